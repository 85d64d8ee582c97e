"""DataPlane: the one path from a decoded request to its response, for every frontend.

Frontends decode, call the DataPlane, and encode; everything between — routing,
validation, scheduling, waiting for the outcome, cancellation — happens here once.
"""

from __future__ import annotations

import weakref

import structlog
import trio

from trionserve import __version__
from trionserve.actors.model import ModelVersion
from trionserve.actors.registry import ModelRegistry
from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import InvalidArgument, NotFound, TritonError, Unavailable
from trionserve.core.classification import classify, read_labels
from trionserve.core.shared_memory import SystemSharedMemory
from trionserve.core.types import InferenceRequest, InferenceResponse
from trionserve.core.validation import validate_request

log = structlog.get_logger(__name__)

EXTENSIONS = [
    "classification",
    "binary_tensor_data",
    "parameters",
    "model_configuration",
    "model_repository",
]


class DataPlane:
    """Serves health, metadata, configuration, repository and inference calls.

    It owns no tasks: each call runs in the caller's task, so a client that goes
    away cancels exactly its own work. A cancelled request is flagged so that the
    scheduler drops it if it has not started, and its result is discarded if it has.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        control_mode: ControlMode,
        server_id: str = "trionserve",
        *,
        allow_client_shm: bool = False,
    ) -> None:
        self.registry = registry
        self.control_mode = control_mode
        self.server_id = server_id
        # Client shared memory is opt-in, as in Triton (--allow-client-shm).
        self.shared_memory = SystemSharedMemory() if allow_client_shm else None
        # Label files of the classification extension, read once per model version.
        self._label_cache: weakref.WeakKeyDictionary[ModelVersion, dict] = (
            weakref.WeakKeyDictionary()
        )
        self.started = False
        self.stopping = False

    # -- health and metadata --------------------------------------------------

    def live(self) -> bool:
        return not self.stopping

    def ready(self) -> bool:
        return self.started and not self.stopping and self.registry.all_ready()

    def server_metadata(self) -> dict:
        extensions = list(EXTENSIONS)
        if self.shared_memory is not None:
            extensions.append("system_shared_memory")
        return {"name": self.server_id, "version": __version__, "extensions": extensions}

    def client_shared_memory(self) -> SystemSharedMemory:
        """The registered regions, or the error saying client shared memory is off."""
        if self.shared_memory is None:
            raise Unavailable(
                "client shared memory is disabled; start the server with "
                "--allow-client-shm=true to register shared memory regions"
            )
        return self.shared_memory

    def model_ready(self, name: str, version: int | None) -> bool:
        try:
            self.registry.route(name, version)
        except TritonError:
            return False
        return True

    def model(self, name: str, version: int | None) -> ModelVersion:
        return self.registry.route(name, version)

    def model_metadata(self, name: str, version: int | None) -> dict:
        model = self.registry.route(name, version)
        signature = model.signature
        ready_versions = self.registry.entries()[name].versions
        return {
            "name": name,
            "versions": [str(v) for v in sorted(ready_versions)],
            "platform": model.config.platform or model.config.backend,
            "inputs": [
                {"name": s.name, "datatype": s.datatype, "shape": signature.full_shape(s)}
                for s in signature.inputs.values()
            ],
            "outputs": [
                {"name": s.name, "datatype": s.datatype, "shape": signature.full_shape(s)}
                for s in signature.outputs.values()
            ],
        }

    def model_config(self, name: str, version: int | None):
        return self.registry.route(name, version).config

    # -- repository -------------------------------------------------------------

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        known = {row["name"] for row in self.registry.index()}
        rows = self.registry.index()
        # Models present in the repository but never loaded are listed too.
        for name in sorted(set(self.registry.repository.scan()) - known):
            rows.append({"name": name})
        if ready_only:
            rows = [r for r in rows if r.get("state") == "READY"]
        return sorted(rows, key=lambda r: (r["name"], r.get("version", "")))

    async def load_model(self, name: str, config_override: str | None = None) -> None:
        if self.control_mode is not ControlMode.EXPLICIT:
            raise Unavailable(
                f"explicit model load / unload is not allowed if polling is enabled"
                if self.control_mode is ControlMode.POLL
                else "explicit model load / unload is not allowed in model control "
                "mode NONE; start the server with --model-control-mode=explicit"
            )
        await self.registry.load(name, config_override)

    async def unload_model(self, name: str) -> None:
        if self.control_mode is not ControlMode.EXPLICIT:
            await self.load_model(name)  # raises the mode error
        await self.registry.unload(name)

    # -- inference ---------------------------------------------------------------

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Route, validate, queue and await one request's single outcome."""
        model = self.registry.route(request.model_name, request.model_version)
        validate_request(request, model.signature)
        model.begin_request()
        try:
            await model.infer(request)
            response = await request.wait()
        except trio.Cancelled:
            request.cancelled = True
            raise
        finally:
            model.end_request()
        if request.requested_outputs is not None:
            for output in request.requested_outputs:
                if output.parameters.get("classification"):
                    await self._classify(model, request, response)
                    break
        return response

    async def _classify(
        self, model: ModelVersion, request: InferenceRequest, response: InferenceResponse
    ) -> None:
        """Apply the classification extension to the outputs that asked for it."""
        wanted = {
            o.name: int(o.parameters["classification"])
            for o in request.requested_outputs or ()
            if o.parameters.get("classification")
        }
        batched = model.signature.max_batch_size > 0
        for index, tensor in enumerate(response.outputs):
            k = wanted.get(tensor.name)
            if k:
                labels = await self._labels(model, tensor.name)
                response.outputs[index] = classify(tensor, k, labels, batched)

    async def _labels(self, model: ModelVersion, output: str) -> list[str] | None:
        cache = self._label_cache.setdefault(model, {})
        if output not in cache:
            filename = next(
                (o.label_filename for o in model.config.output if o.name == output), ""
            )
            cache[output] = (
                await trio.to_thread.run_sync(read_labels, model.model_dir / filename)
                if filename
                else None
            )
        return cache[output]

