"""What Triton's test backends share here: the backend, the loaded model and an
instance that runs on the event loop.

A reference backend has no model file: its model is its ``config.pbtxt``, checked
when it loads (each backend's ``ValidateModelConfig``). Its instances are
:class:`~trionserve.backends.base.AsyncBackendInstance` objects: ``execute``
computes on the Trio thread (a copy or a sum), a configured delay is a Trio sleep,
and a decoupled backend's responses come from tasks in the instance's own nursery,
which its executor supervises, so an unload cancels them and every request they
hold still gets its one final outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import structlog
import trio

from trionserve.backends.base import Backend, ExecuteResult, InstanceSpec, ModelContext
from trionserve.core.errors import InvalidArgument, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.observability.logging import verbose

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelInput, ModelOutput

log = structlog.get_logger("trionserve.backends.reference")


def parameter(config: ModelConfig, key: str) -> str | None:
    """A ``parameters { key: ... value: { string_value: ... } }`` entry, if set."""
    if key in config.parameters:
        return str(config.parameters[key].string_value)
    return None


def int_parameter(config: ModelConfig, key: str, default: int = 0) -> int:
    """An integer parameter (Triton's backends read them with std::stoi)."""
    value = parameter(config, key)
    if value is None:
        return default
    try:
        return int(value.strip())
    except ValueError:
        raise InvalidArgument(
            f"model '{config.name}': parameter '{key}' must be an integer, got '{value}'"
        ) from None


def config_dims(tensor: ModelInput | ModelOutput) -> list[int]:
    """A config tensor's shape as its backend sees it: ``reshape`` if it has one."""
    if tensor.HasField("reshape"):
        return list(tensor.reshape.shape)
    return list(tensor.dims)


def shape_string(shape: Iterable[int]) -> str:
    """A shape as Triton's backend utilities write it (ShapeToString): ``[1,5]``."""
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def byte_size(tensor: Tensor) -> int:
    """The bytes a tensor holds as Triton hands it to a backend: BYTES elements
    each with their 4-byte length."""
    data = tensor.data
    if data.dtype != np.object_:
        return int(data.nbytes)
    total = 0
    for item in data.reshape(-1).tolist():
        total += 4 + (len(item) if isinstance(item, (bytes, bytearray)) else len(str(item)))
    return total


def vlog(message: str) -> None:
    """A TRITONSERVER_LOG_VERBOSE line (only built when --log-verbose is on)."""
    if verbose():
        log.debug(message)


def requested(request: InferenceRequest, name: str) -> bool:
    """Whether the request asked for output ``name`` (no list: every output)."""
    outputs = request.requested_outputs
    return outputs is None or any(o.name == name for o in outputs)


def requested_names(request: InferenceRequest, model_outputs: list[str]) -> list[str]:
    """The outputs a request asked for, in its order (no list: the model's)."""
    if request.requested_outputs is None:
        return list(model_outputs)
    return [o.name for o in request.requested_outputs]


class ReferenceInstance:
    """One instance of a reference backend: an AsyncBackendInstance whose
    ``execute_async`` runs on the Trio thread. Subclasses implement ``execute``
    (or ``execute_async`` for delays and decoupled responses)."""

    def __init__(self, context: ModelContext, spec: InstanceSpec) -> None:
        self.context = context
        self.spec = spec
        self.version = str(context.version)
        # A model that is not decoupled has one response per request: a backend
        # that sends more (repeat, square) has its first delivered as the final one
        # and the rest ignored (qa/L0_grpc_state_cleanup
        # test_non_decoupled_streaming_multi_response: "should return the first
        # response").
        self.decoupled = bool(context.config.model_transaction_policy.decoupled)
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery that decoupled responses are sent from."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        raise NotImplementedError

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult | None:
        return self.execute(requests)

    def respond_later(
        self, request: InferenceRequest, responder: Callable[[], Awaitable[object]]
    ) -> None:
        """Send a decoupled request's responses from a task of this instance (the
        thread Triton's decoupled backends detach); if the task ends without the
        final outcome (an unload cancelled it), the request is told so."""
        assert self._nursery is not None, "instance not running"

        async def task() -> None:
            try:
                await responder()
            finally:
                if not request.done:
                    request.fail(
                        Unavailable(
                            f"model instance '{self.spec.name}' stopped before it "
                            "finished sending its responses"
                        )
                    )

        self._nursery.start_soon(task)

    def response(
        self, request: InferenceRequest, outputs: list[Tensor], parameters: dict | None = None
    ) -> InferenceResponse:
        return InferenceResponse(
            request.model_name, self.version, request.id, outputs, parameters or {}
        )

    def close(self) -> None:
        return None


class ReferenceModel:
    """A loaded reference model: its checked config makes instances."""

    def __init__(
        self,
        make_instance: Callable[[InstanceSpec], ReferenceInstance],
        on_unload: Callable[[], None] | None = None,
    ) -> None:
        self._make_instance = make_instance
        self._on_unload = on_unload

    def create_instance(self, spec: InstanceSpec) -> ReferenceInstance:
        return self._make_instance(spec)

    def unload(self) -> None:
        if self._on_unload is not None:
            self._on_unload()


class ReferenceBackend(Backend):
    """A backend whose models are their config: no model file, no auto-complete
    (none of Triton's test backends fills a config), CPU instances only (they
    compute on the host; Triton's copy inputs to wherever outputs are asked)."""

    name = "reference"

    def default_model_filename(self) -> str:
        return ""

    def auto_complete_config(
        self, config: ModelConfig, model_path: Path, max_batch_size_set: bool
    ) -> None:
        return None

    def can_use_gpu(self) -> bool:
        return False

    def configure(self, settings: Mapping[str, str]) -> None:
        return None

    def load(self, context: ModelContext) -> ReferenceModel:
        raise NotImplementedError


def refuse(config: ModelConfig, condition: bool, message: str) -> None:
    """RETURN_ERROR_IF_FALSE(condition, TRITONSERVER_ERROR_INVALID_ARG, message)."""
    if not condition:
        raise InvalidArgument(message)


def error_for(request: InferenceRequest, error: TritonError) -> TritonError:
    """An error for one request, logged as Triton's backends log theirs."""
    log.error(f"request '{request.id}': {error.message}, error response sent")
    return error
