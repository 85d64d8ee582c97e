"""The interface between the runtime and a model framework (Triton's backend API,
``TRITONBACKEND_*``; a :class:`Backend` is core's ``TritonBackend``).

A :class:`Backend` knows one kind of model file. The registry asks it to auto-complete
a configuration and to load a version directory into a :class:`LoadedModel`; the
loaded model creates one :class:`BackendInstance` per configured instance. Every
method here is blocking and is called from a worker thread, never on the Trio loop,
except those of :class:`AsyncBackendInstance` (instances whose work happens in
another process), which its executor calls on the Trio thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import trio

from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.custom_metrics import CustomMetrics

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.observability.statistics import ComputeTimes


class InferenceService(Protocol):
    """What a backend may call back into: the server's one inference path.

    Called on the Trio thread; the DataPlane implements it. ``infer`` routes,
    validates, queues and awaits a request with one response; ``infer_stream``
    does the same for a decoupled model, awaiting ``deliver(response, final)``
    for each of its responses. ``queued`` is set once the model's scheduler holds
    the request: an error raised before it is one of issuing the request.
    """

    async def infer(
        self, request: InferenceRequest, *, queued: trio.Event | None = None
    ) -> InferenceResponse: ...

    async def infer_stream(
        self,
        request: InferenceRequest,
        deliver: Callable[[InferenceResponse | None, bool], Awaitable[None]],
        *,
        queued: trio.Event | None = None,
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What a backend needs to load one version of one model."""

    name: str
    version: int
    config: ModelConfig
    model_dir: Path  # <repository>/<model>
    version_dir: Path  # <repository>/<model>/<version>
    # The server's inference path, for models that call other models (BLS).
    inference: InferenceService | None = None
    # The server's custom metrics, where the model defines its metric families
    # (pb_utils.MetricFamily, the identity backend's counter); a context made
    # outside a server has a registry of its own, which nothing exposes.
    metrics: CustomMetrics = field(default_factory=CustomMetrics)

    @property
    def repository(self) -> Path:
        return self.model_dir.parent


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One model instance: Triton's name for it, its kind and its device."""

    name: str  # e.g. "simple_0_0"
    group: str  # e.g. "simple_0"
    kind: str  # "KIND_CPU", "KIND_GPU", "KIND_MODEL"
    device_id: int  # GPU index for KIND_GPU; 0 otherwise


ExecuteResult = list["InferenceResponse | TritonError"]
# The next queued batch to post behind the one an instance runs, with what to call
# with its results and when it started; None when none is queued (see
# PipelinedAsyncBackendInstance).
Ahead = Callable[
    [], "tuple[list[InferenceRequest], Callable[[ExecuteResult | None, float], None]] | None"
]


class BackendInstance(Protocol):
    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        """Run one batch; return one response or error per request, in order."""

    def close(self) -> None:
        """Release the instance's resources."""


@runtime_checkable
class TimedBackendInstance(BackendInstance, Protocol):
    """An in-process instance that reports how its batches' time divides: it sets
    ``compute_times`` at the end of each ``execute`` (Triton's compute_input /
    compute_infer / compute_output). The executor checks for it once."""

    compute_times: ComputeTimes | None


@runtime_checkable
class InlineBackendInstance(TimedBackendInstance, Protocol):
    """A timed instance that may be cheap enough to run on the event loop: a batch
    whose previous run took at most ``inline_budget_ns`` runs there instead of in
    a worker thread (0: always a thread)."""

    inline_budget_ns: int


@runtime_checkable
class AsyncBackendInstance(Protocol):
    """An instance whose work happens outside the server process (a stub process).

    Its executor starts ``run`` as a child task for the instance's lifetime (it
    reads the process's messages and restarts it; raising from it ends the model)
    and awaits ``execute_async`` on the Trio thread instead of calling ``execute``
    in a worker thread. ``execute_async`` returns one response or error per
    request, or None when it answers the requests itself as their responses
    arrive (decoupled models). ``close`` stays blocking, called after ``run``.
    """

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None: ...

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult | None: ...

    def close(self) -> None: ...


@runtime_checkable
class DirectAsyncBackendInstance(AsyncBackendInstance, Protocol):
    """An async instance whose ``execute_async`` may be awaited by the task that
    submitted the request (a Python model's stub): while ``runs_direct()`` says
    so (the instance is idle and can start a call without waiting for anything
    but its answer), its executor offers itself to the scheduler, and the
    submitting task runs the batch and waits for the answer itself; one task
    step and one hop each way fewer than through the executor's task."""

    def runs_direct(self) -> bool: ...

    async def wait_idle(self) -> None:
        """Return once no batch is in flight (one whose awaiting task was
        cancelled has been answered by the process)."""


@runtime_checkable
class PipelinedAsyncBackendInstance(DirectAsyncBackendInstance, Protocol):
    """A direct async instance that takes the next batch while it runs one (a
    stub's lane has two slots each way, as python_backend's message queue holds
    more than one message): while its executor's task awaits a batch, it posts
    the next queued one from ``ahead`` behind it, so that a busy stub finds
    work waiting instead of sleeping until the server looks again. Such a batch
    is answered through its callback; ``settle`` awaits those still in flight
    (posting more meanwhile)."""

    async def execute_ahead(
        self, requests: list[InferenceRequest], ahead: Ahead
    ) -> ExecuteResult | None: ...

    async def settle(self, ahead: Ahead) -> None: ...


@runtime_checkable
class InlineAsyncBackendInstance(AsyncBackendInstance, Protocol):
    """An async instance that runs some batches on the event loop without
    awaiting anything (an in-process Python model with ``INPROCESS_EXECUTE_ON``
    ``event_loop``): while ``runs_inline()`` says so, its executor lets the
    scheduler hand it a batch straight over (``execute_inline``: what
    ``execute_async`` would do, without a task switch), as it does for an
    :class:`InlineBackendInstance`. ``inline`` says whether it ever does (its
    configuration asks for it)."""

    inline: bool

    def runs_inline(self) -> bool: ...

    def execute_inline(self, requests: list[InferenceRequest]) -> ExecuteResult | None: ...


@runtime_checkable
class ReadinessCheckedInstance(Protocol):
    """An instance that can stop being ready while its model stays loaded (a
    stub process that died, a model.py whose ``is_ready()`` says no): Triton's
    ``TRITONBACKEND_ModelInstanceReady``. ``check_ready`` raises the TritonError
    saying why it is not ready."""

    async def check_ready(self) -> None: ...


class LoadedModel(Protocol):
    def create_instance(self, spec: InstanceSpec) -> BackendInstance | AsyncBackendInstance: ...

    def unload(self) -> None: ...


class Backend(Protocol):
    name: str

    def default_model_filename(self) -> str: ...

    def auto_complete_config(
        self, config: ModelConfig, model_path: Path, max_batch_size_set: bool
    ) -> None:
        """Fill inputs, outputs and max_batch_size that the model file can tell.

        ``max_batch_size_set`` says whether config.pbtxt named max_batch_size (proto3
        cannot tell an explicit 0 from an absent field).
        """

    def load(self, context: ModelContext) -> LoadedModel: ...

    def auto_complete_source(self, version_dir: Path, filename: str) -> Path:
        """The file auto-completion reads for a model of this backend: the
        version's model file, unless the backend serves every model from one file
        of its own (a Python-based backend's ``model.py``)."""
        return version_dir / filename

    def configure(self, settings: Mapping[str, str]) -> None:
        """Take the server's checked ``--backend-config`` settings for this backend,
        before any other call (the ``BackendManager`` that made it calls this, as
        Triton hands a backend its configuration when it loads). Backends that read
        none keep this default."""
        return None

    def can_use_gpu(self) -> bool:
        """Whether this backend, as installed, can run an instance on a GPU:
        KIND_AUTO becomes KIND_GPU only when it can (Triton's rule for backends
        built without GPU support). Backends subclass this protocol to inherit
        this default (they can)."""
        return True
