"""DataPlane: the one path from a decoded request to its response, for every frontend.

Frontends decode, call the DataPlane, and encode; everything between — routing,
validation, scheduling, waiting for the outcome, cancellation — happens here once
(the inference calls in :mod:`trionserve.inference_path`, a base of DataPlane;
health, metadata, the repository, statistics and trace settings here).
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from trionserve import __version__
from trionserve.actors.model import ModelVersion
from trionserve.actors.registry import ModelRegistry
from trionserve.actors.watcher import ControlMode
from trionserve.core.client_budget import ClientBudget
from trionserve.core.cuda_shared_memory import CudaSharedMemory, SharedMemoryResolver
from trionserve.core.errors import (
    AlreadyExists,
    InvalidArgument,
    TritonError,
    Unavailable,
    Unimplemented,
)
from trionserve.core.inference import (
    DEFAULT_UNDELIVERED_RESPONSE_BYTES,
    InferenceRequest,
    InferenceResponse,
)
from trionserve.core.response_cache import ResponseCache
from trionserve.core.shared_memory import RequestRegions, SystemSharedMemory
from trionserve.drain import Drain
from trionserve.inference_path import Deliver, InferencePath
from trionserve.observability.statistics import (
    select_statistics,
    statistics_json,
)
from trionserve.observability.trace.manager import TraceManager
from trionserve.repository.repository import ModelId, duplicate_reason

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

log = structlog.get_logger(__name__)

# Statistics of a model name and version (None: all), in the HTTP JSON shape.
StatisticsSource = Callable[[str | None, int | None], Awaitable[dict]]

# Triton's names and order (core src/server.cc, InferenceServer's constructor); the
# shared-memory ones are added where usable (see server_metadata); "generate" is ours.
EXTENSIONS = [
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "cuda_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
    "generate",
]


class DataPlane(InferencePath):
    """Serves health, metadata, configuration, repository and inference calls.

    It owns no tasks: each call runs in the caller's task, so a client that goes
    away cancels exactly its own work. A cancelled request is flagged so that the
    scheduler drops it if it has not started, and its result is discarded if it has.

    The drain before shutdown is its :class:`~trionserve.drain.Drain` (``drain``):
    every admitted request is counted there, and ``_admit`` asks it what a draining
    server still takes.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        control_mode: ControlMode,
        server_id: str = "triton",
        *,
        allow_client_shm: bool = False,
        tracing: TraceManager | None = None,
        first_response_histogram: bool = False,
        response_cache: ResponseCache | None = None,
        strict_readiness: bool = True,
        undelivered_response_limit: int = DEFAULT_UNDELIVERED_RESPONSE_BYTES,
        budget: ClientBudget | None = None,
    ) -> None:
        self.registry = registry
        # --client-buffer-limit: the bytes held for clients, every listener's
        # together; a new request is refused at it (see core/client_budget.py).
        self.budget = budget if budget is not None else ClientBudget()
        # --strict-readiness: ready needs every model ready (true), or only a
        # started server that is not draining (false).
        self.strict_readiness = strict_readiness
        # --max-undelivered-response-bytes, given to every request it admits.
        self.undelivered_response_limit = undelivered_response_limit
        self.control_mode = control_mode
        self.server_id = server_id
        # Where the statistics extension reads from, when not this server alone.
        self.statistics_source: StatisticsSource | None = None
        # Client shared memory is opt-in, as in Triton (--allow-client-shm).
        self.shared_memory: SystemSharedMemory | None = None
        self.cuda_shared_memory: CudaSharedMemory | None = None
        # What the codecs look request regions up in (system or CUDA, one namespace).
        self.shm_resolver: SharedMemoryResolver | None = None
        if allow_client_shm:
            self.shared_memory = SystemSharedMemory()
            self.cuda_shared_memory = CudaSharedMemory(self.shared_memory)
            self.shm_resolver = SharedMemoryResolver(self.shared_memory, self.cuda_shared_memory)
        # Label files of the classification extension, read once per model version.
        self._label_cache: weakref.WeakKeyDictionary[ModelVersion, dict] = (
            weakref.WeakKeyDictionary()
        )
        # Responses of models with response_cache enabled (--cache-config).
        self.response_cache = response_cache
        # Request tracing; ``tracing.active`` is all an untraced request pays.
        self.tracing = tracing if tracing is not None else TraceManager()
        # nv_inference_first_response_histogram_ms is kept only when asked for.
        self._first_response = first_response_histogram
        self.started = False
        # The drain before shutdown: in-flight requests, open sequences, refusals.
        self.drain = Drain()
        # Models call other models (BLS, ensemble steps) through this view.
        registry.lifecycle.inference = _ModelCalls(self)

    # -- health and metadata --------------------------------------------------

    def live(self) -> bool:
        # Live until the process exits, draining included: a liveness probe must
        # never restart a server that is finishing its work.
        return True

    def ready(self) -> bool:
        if not self.started or self.drain.draining:
            return False
        return self.registry.all_ready() if self.strict_readiness else True

    async def server_is_ready(self) -> bool:
        """The readiness API: with strict readiness, every version being served
        must also be ready now (core server.cc InferenceServer::IsReady asks each
        READY model's instances, e.g. a Python model whose stub died)."""
        if not self.ready():
            return False
        if self.strict_readiness:
            for model in self.registry.serving():
                try:
                    await model.check_ready()
                except TritonError as exc:
                    log.debug(
                        f"Model '{model.name}' version {model.version} is in READY "
                        "lifecycle state but failed runtime readiness check during "
                        f"server readiness evaluation: {exc.message}"
                    )
                    return False
        return True

    def server_metadata(self) -> dict:
        """Name, version and extensions. Both shared-memory extensions are always
        listed, as Triton's core lists them (``src/server.cc``); a registration the
        server does not allow is refused instead (``client_shared_memory``)."""
        return {"name": self.server_id, "version": __version__, "extensions": list(EXTENSIONS)}

    def client_shared_memory(self) -> SystemSharedMemory:
        """The registered regions, or Triton's error saying client shared memory is
        off (UNSUPPORTED: HTTP 501, gRPC UNIMPLEMENTED; ``kClientShmDisabledErrorStr``
        in its ``src/common.h``)."""
        if self.shared_memory is None:
            raise Unimplemented(
                "Client shared memory is disabled. Start the server with "
                "'--allow-client-shm=true' to enable."
            )
        return self.shared_memory

    def request_regions(self) -> RequestRegions | None:
        """One request's shared memory (None when client shared memory is off): the
        regions it names stay registered until it is answered and ``release``d."""
        return None if self.shm_resolver is None else RequestRegions(self.shm_resolver)

    def client_system_shared_memory(self, name: str) -> SystemSharedMemory:
        """The system registry, refusing a ``name`` already used by a CUDA region."""
        shared_memory = self.client_shared_memory()
        if self.cuda_shared_memory is not None and name in self.cuda_shared_memory:
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        return shared_memory

    def client_cuda_shared_memory(self) -> CudaSharedMemory:
        """The CUDA registry, or the error saying client shared memory is off."""
        self.client_shared_memory()  # raises when client shared memory is off
        assert self.cuda_shared_memory is not None  # made with the system registry
        return self.cuda_shared_memory

    def model_ready(self, name: str, version: int | None) -> bool:
        try:
            self.registry.route(name, version)
        except TritonError:
            return False
        return True

    async def model_is_ready(self, name: str, version: int | None) -> bool:
        """The model readiness API: READY, and each of its instances ready now
        (core server.cc InferenceServer::ModelIsReady, which logs why not)."""
        try:
            model = self.registry.route(name, version)
        except TritonError:
            return False
        try:
            await model.check_ready()
        except TritonError as exc:
            log.debug(f"Model '{name}' version {model.version} is not ready: {exc.message}")
            return False
        return True

    def model(self, name: str, version: int | None, namespace: str | None = None) -> ModelVersion:
        return self.registry.route(name, version, namespace)

    async def load_on_demand(self, name: str, version: int | None) -> None:
        """With ``--model-load-on-demand``, load a model its metadata or
        configuration is asked of (perf_analyzer and tritonclient's examples ask
        before their first request): the answer is the loaded model's, as Triton
        gives it. Does nothing otherwise, or while draining."""
        residency = self.registry.residency
        if residency is not None and residency.options.load_on_demand and not self.drain.draining:
            await residency.wait_model(name, version)

    def model_metadata(self, name: str, version: int | None) -> dict:
        model = self.registry.route(name, version)
        signature = model.signature
        ready_versions = self.registry.entries()[ModelId(model.namespace, name)].versions
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

    def model_config(self, name: str, version: int | None) -> ModelConfig:
        return self.registry.route(name, version).config

    # -- repository -------------------------------------------------------------

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        """Every model in the repositories or known to the registry, as Triton lists it.

        Models loaded (or once tried) list each version with state and reason; a
        model never loaded lists only its name; a name found in several
        repositories is UNAVAILABLE with that reason unless a version is serving.
        With namespacing each repository's model is listed on its own rows, by
        namespace and then name, the namespace itself not shown (core
        ``model_repository_manager.cc``, ``RepositoryIndex``).
        """
        scan = self.registry.repository.scan()
        listed: dict[ModelId, list[dict]] = {}
        for entry in self.registry.entries().values():
            rows = entry.index_rows()
            if rows:
                listed[entry.model_id] = rows
        for model_id in scan:
            listed.setdefault(model_id, [{"name": model_id.name}])
        for name, dirs in scan.duplicates.items():
            model_id = ModelId("", name)
            if not any(row.get("state") == "READY" for row in listed.get(model_id, ())):
                reason = duplicate_reason(name, dirs)
                listed[model_id] = [
                    {"name": name, "version": "", "state": "UNAVAILABLE", "reason": reason}
                ]
        rows = [
            row
            for model_id in sorted(listed, key=ModelId.order)
            for row in sorted(listed[model_id], key=_index_order)
        ]
        if ready_only:
            rows = [r for r in rows if r.get("state") == "READY"]
        return rows

    def _check_model_control(self) -> None:
        if self.control_mode is ControlMode.POLL:
            raise Unavailable(
                "explicit model load / unload is not allowed if polling is enabled: in "
                "model control mode POLL the server follows the model repository; "
                "change the repository, or start the server with "
                "--model-control-mode=explicit"
            )
        if self.control_mode is not ControlMode.EXPLICIT:
            # Triton's words in NONE mode too (core model_repository_manager.cc
            # LoadUnloadModel: model control is disabled in both), then ours.
            raise Unavailable(
                "explicit model load / unload is not allowed if polling is enabled: in "
                "model control mode NONE the server loads the repository's models at "
                "start; start the server with --model-control-mode=explicit"
            )

    async def load_model(
        self,
        name: str,
        config_override: str | None = None,
        files: dict[str, bytes] | None = None,
    ) -> None:
        """Load or reload a model (EXPLICIT mode only).

        ``config_override`` is the model configuration as JSON; ``files`` maps
        ``file:<version>/<filename>`` to file contents and, with the
        configuration, replaces the model directory.
        """
        self._check_model_control()
        await self.registry.load(name, config_override, files=files or None)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload a model (EXPLICIT mode only); in-flight requests finish first."""
        self._check_model_control()
        await self.registry.unload(name, unload_dependents=unload_dependents)

    # -- statistics ----------------------------------------------------------------

    async def model_statistics(self, name: str | None, version: int | None) -> dict:
        """Triton's statistics extension, in its HTTP JSON shape (``model_stats``).

        What this server counted; as a worker of ``--workers``, what every worker
        counted together (``statistics_source``, set by the worker: a client's
        connection lands on one worker, and a load generator reading the
        statistics on another connection must see its requests counted).
        Unknown models and versions raise here, from this server's registry, the
        same errors with or without workers."""
        if self.statistics_source is None:
            return statistics_json(self.registry, name, version)
        select_statistics(self.registry, name, version)  # raises for what is unknown here
        return await self.statistics_source(name, version)

    # -- trace settings -------------------------------------------------------------

    def trace_settings(
        self, model_name: str | None, changes: dict[str, list[str] | None] | None = None
    ) -> dict:
        """The trace extension: apply ``changes`` (if any) for a model or globally,
        then return the settings in force there."""
        if model_name:
            try:
                self.registry.route(model_name, None)
            except TritonError:
                raise InvalidArgument(f"Request for unknown model : {model_name}") from None
        if changes is not None:
            self.tracing.update(model_name or "", changes)
        return self.tracing.settings(model_name or "")


class _ModelCalls:
    """The DataPlane as models see it (BLS calls and model control, ensemble steps).

    Their inference requests belong to a request the server already took, so a
    drain never refuses them. This is all a model may call: each method is wired
    to the DataPlane explicitly.
    """

    __slots__ = ("_dataplane",)

    def __init__(self, dataplane: DataPlane) -> None:
        self._dataplane = dataplane

    async def infer(self, request: InferenceRequest, **options: Any) -> InferenceResponse:
        return await self._dataplane.infer(request, internal=True, **options)

    async def infer_stream(
        self, request: InferenceRequest, deliver: Deliver, **options: Any
    ) -> None:
        await self._dataplane.infer_stream(request, deliver, internal=True, **options)

    def model(self, name: str, version: int | None, namespace: str | None = None) -> ModelVersion:
        """The READY version a step routes to (ensembles check their steps with it)."""
        return self._dataplane.model(name, version, namespace)

    # The model loading API of Python models (pb_utils.load_model & co).

    def model_ready(self, name: str, version: int | None) -> bool:
        return self._dataplane.model_ready(name, version)

    async def load_model(
        self,
        name: str,
        config_override: str | None = None,
        files: dict[str, bytes] | None = None,
    ) -> None:
        await self._dataplane.load_model(name, config_override, files)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self._dataplane.unload_model(name, unload_dependents)


def _index_order(row: dict) -> tuple:
    """Repository index order: by name, then numerically by version."""
    version = row.get("version", "")
    return (row["name"], int(version) if version.isdigit() else -1)
