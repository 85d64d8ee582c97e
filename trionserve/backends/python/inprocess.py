"""In-process Python models: ``model.py`` on a thread of the server, no stub process.

Chosen per model with ``parameters { key: "EXECUTION_MODE" value: { string_value:
"in_process" } }``. Each instance gets one thread of its own (an
:class:`~trionserve.actors.instance_thread.InstanceThread`) that imports
``model.py``, runs ``initialize``, every ``execute`` and ``finalize``, one after
the other, so a model keeps the thread affinity it has in a stub (thread-local
state, a CUDA device set in ``initialize``). Requests reach the model as
``pb_utils.InferenceRequest`` objects that wrap the server's tensors, with no copy
and no message; what it returns, or sends through a response sender from any
thread, becomes the server's response on the Trio thread (``run_sync_soon``).

The model sees the same ``triton_python_backend_utils`` API as in a stub: the
module is the stub's own, loaded once per instance with an
:class:`InProcessRuntime` behind it, so two models (or two instances) share no
module globals, as two stub processes would not. BLS calls, custom metrics, the
model loading API and log lines go to the server's objects directly.

What is lost against a stub: a crash (``os._exit``, a segfault in an extension) or
a leak in model.py is the server's; the GIL is shared with the frontends; there is
no per-model Python environment (EXECUTION_ENV_PATH is refused) and no execute
timeout or restart (a thread cannot be killed).
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
import queue
import sys
import threading
import types
from pathlib import Path
from typing import Any

import structlog
import trio

from trionserve.actors.instance_thread import InstanceThread, Job
from trionserve.backends.base import ExecuteResult, InstanceSpec, ModelContext
from trionserve.backends.python.bls import Outcome, run_bls
from trionserve.backends.python.control import ModelControl
from trionserve.backends.python.messages import called_request, code_of, error_from_code
from trionserve.backends.python.process import log_stub_line, new_metrics_owner
from trionserve.backends.python.settings import StubSettings
from trionserve.backends.python.stub import STUBPATH, ModelRuntime, describe_exception
from trionserve.core.errors import (
    Cancelled,
    InternalError,
    InvalidArgument,
    TritonError,
    Unavailable,
)
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.observability.custom_metrics import CUSTOM_METRICS

log = structlog.get_logger(__name__)

PB_MODULE = "triton_python_backend_utils"
C_MODULE = "c_python_backend_utils"
# How long a readiness check waits for the model's is_ready() (as a stub's).
READINESS_TIMEOUT_SECONDS = 5.0
_FLAG_SEQUENCE_START, _FLAG_SEQUENCE_END = 1, 2
# An execute's entry for a request released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE.
_RESCHEDULED = object()


# -- one module namespace per instance ---------------------------------------------------

# Model imports change sys.modules and sys.path for a moment: one at a time.
_IMPORT_LOCK = threading.Lock()
_PACKAGES = itertools.count(1)
# The pb_utils modules (by name) of the model whose code runs on this thread.
_bound = threading.local()


class _LateImport(types.ModuleType):
    """``sys.modules['triton_python_backend_utils']`` outside model imports: an
    ``import`` inside a function gets the module of the model whose thread runs it."""

    def __getattr__(self, name: str) -> Any:
        module = getattr(_bound, "modules", {}).get(self.__name__)
        if module is None:
            raise AttributeError(
                f"{self.__name__}.{name}: this thread runs no in-process model; import "
                f"{self.__name__} at the top of model.py, where every model gets its own"
            )
        return getattr(module, name)


def _module_from_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ModelNamespace:
    """One instance's import of model.py, with its own pb_utils modules.

    model.py is imported as ``<package>.model``, the package being a fresh one
    whose directory is the version directory (Triton imports ``<version>.model``),
    so relative imports work and two models' ``1.model`` never meet. While it is
    imported, ``triton_python_backend_utils`` and ``c_python_backend_utils`` in
    ``sys.modules`` are this instance's, and the version and model directories
    are on ``sys.path`` (as a stub puts them); afterwards the modules imported
    from those directories are taken out of ``sys.modules`` again, so another
    model's ``import utils`` finds its own.
    """

    def __init__(self, model_file: Path, runtime: Any) -> None:
        version_dir = model_file.parent
        self.package = f"_trionserve_model_{next(_PACKAGES)}"
        with _IMPORT_LOCK:
            saved = {name: sys.modules.get(name) for name in (PB_MODULE, C_MODULE)}
            path = list(sys.path)
            before = set(sys.modules)
            try:
                self.pb = _module_from_file(PB_MODULE, STUBPATH / f"{PB_MODULE}.py")
                setattr(self.pb, "_runtime", runtime)  # noqa: B010 - the module's hook
                sys.modules[PB_MODULE] = self.pb
                self.c_pb = _module_from_file(C_MODULE, STUBPATH / f"{C_MODULE}.py")
                sys.modules[C_MODULE] = self.c_pb
                package = types.ModuleType(self.package)
                package.__path__ = [str(version_dir)]
                sys.modules[self.package] = package
                sys.path.extend([str(version_dir), str(version_dir.parent)])
                self.module = importlib.import_module(f"{self.package}.{model_file.stem}")
            except BaseException:
                self.close()
                raise
            finally:
                sys.path[:] = path
                for name, module in saved.items():
                    sys.modules[name] = module if module is not None else _LateImport(name)
                self._forget_local_modules(before, version_dir.parent)

    def _forget_local_modules(self, before: set[str], model_dir: Path) -> None:
        """Take out of sys.modules what was imported from the model's directory
        under a plain name (its helpers): the model keeps them, others do not see
        them."""
        root = model_dir.resolve()
        for name in set(sys.modules) - before:
            if name == self.package or name.startswith(self.package + "."):
                continue
            origin = getattr(sys.modules[name], "__file__", None)
            if origin and Path(origin).resolve().is_relative_to(root):
                del sys.modules[name]

    def bind(self) -> None:
        """Late imports of the pb_utils modules on this thread get this model's."""
        _bound.modules = {PB_MODULE: self.pb, C_MODULE: self.c_pb}

    def close(self) -> None:
        """Forget the model's package (its module stays with whoever holds it)."""
        for name in [
            n for n in sys.modules if n == self.package or n.startswith(self.package + ".")
        ]:
            sys.modules.pop(name, None)


def auto_complete_in_process(config_json: str, model_file: Path, model_name: str) -> str:
    """The model class's ``auto_complete_config`` run in the server: the completed
    configuration as JSON (a stub's auto-complete, without the stub)."""
    namespace = ModelNamespace(model_file, None)
    try:
        pb = namespace.pb
        config = pb.ModelConfig(config_json)
        model_class = namespace.module.TritonPythonModel
        if hasattr(model_class, "auto_complete_config"):
            config = model_class.auto_complete_config(config)
            if not isinstance(config, pb.ModelConfig):
                raise TypeError(
                    f"auto_complete_config function in model '{model_name}' "
                    "must return a valid pb.ModelConfig object."
                )
        return json.dumps(config.as_dict())
    finally:
        namespace.close()


# -- the model's side: pb_utils calls, on the model's threads ----------------------------


class _BLSCall:
    """A BLS request in flight: the Trio thread puts its outcomes, the model's
    thread takes them (the stub's ``_BLSCall``, without messages)."""

    def __init__(self, runtime: InProcessRuntime, request: InferenceRequest) -> None:
        self.runtime = runtime
        self.request = request
        self.outcomes: queue.SimpleQueue[tuple[Outcome, bool]] = queue.SimpleQueue()
        self.ended = False  # the final outcome was put (Trio thread)
        self.finished = False  # the model took the final outcome
        self._first: tuple[Outcome, bool] | None = None

    def put(self, outcome: Outcome, final: bool) -> None:
        if not self.ended:
            self.ended = final
            self.outcomes.put((outcome, final))

    def wait_first(self) -> None:
        self._first = self.outcomes.get()

    def next_response(self):
        if self.finished:
            raise StopIteration
        if self._first is not None:
            (outcome, final), self._first = self._first, None
        else:
            outcome, final = self.outcomes.get()
        if final:
            self.finished = True
        return self.runtime.pb_response(outcome)

    def cancel(self) -> None:
        if not self.finished:
            self.runtime.post(_cancel, self.request)


def _cancel(request: InferenceRequest) -> None:
    request.cancelled = True


class InProcessRuntime(ModelRuntime):
    """What ``pb_utils`` calls for one in-process instance (the stub's
    ``StubRuntime`` counterpart), and the model's ``execute`` on its thread."""

    arena = None  # no shared memory: c_python_backend_utils reports 0 bytes free

    def __init__(self, instance: InProcessInstance, model_file: Path, model_dir: str) -> None:
        self._instance = instance
        self._model_file = model_file
        self.model_dir = model_dir
        self.instance_name = instance.spec.name
        self.model_name = instance.model_name
        self.decoupled = instance.decoupled
        self.label = instance.label
        self._loop = None
        self._serving = False
        self._finalizing = False
        # Requests still to be answered through their response senders.
        self._unanswered: set[InferenceRequest] = set()
        self.namespace: ModelNamespace | None = None
        self.pb: Any = None
        self.model: Any = None

    # -- on the instance's thread --------------------------------------------------

    def load(self, args: dict) -> bool:
        """Import model.py and run ``initialize(args)``; whether it has ``is_ready``."""
        self.namespace = ModelNamespace(self._model_file, self)
        self.pb = self.namespace.pb
        self.namespace.bind()
        self.model = self.namespace.module.TritonPythonModel()
        initialize = getattr(self.model, "initialize", None)
        if initialize is not None:
            initialize(args)
        self._serving = True
        return hasattr(self.model, "is_ready")

    def execute(self, requests: list[InferenceRequest]) -> list:
        """The model's execute: one entry per request, a response or an error, or
        None where a response sender answers it, or ``_RESCHEDULED``. Raises
        :class:`ExecuteFailed` with Triton's wording when execute raised."""
        pb = self.pb
        received = [self._received(request) for request in requests]
        outcomes: list = [None] * len(requests)
        try:
            result = self.model.execute(received)
            if type(result) is not list and inspect.isawaitable(result):
                if self.decoupled:
                    # As Triton: not awaited; its requests end as it sends.
                    self._run_in_background(result, received)
                    result = None
                else:
                    result = self._run_coroutine(result).result()
            if result is not None:
                if self.decoupled:
                    raise pb.TritonModelException(
                        f"Python model '{self.instance_name}' is using the decoupled mode "
                        "and the execute function must return None."
                    )
                self._check_rescheduled(received, result)
                self.check_returned(received, result)
                for index, (request, response) in enumerate(zip(received, result)):
                    if response is not None:
                        outcomes[index] = self.outcome(request._key, response)
                        request._sender._close()
                        self._unanswered.discard(request._key)
            for index, request in enumerate(received):
                if request._release_flags & pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                    request._sender._close()
                    self._unanswered.discard(request._key)
                    outcomes[index] = _RESCHEDULED
        except BaseException as exc:
            # As Triton: the requests end with the error, their senders close.
            for request in received:
                request._sender._close()
                self._unanswered.discard(request._key)
            raise ExecuteFailed(self.execute_error(exc)) from exc
        return outcomes

    def _received(self, request: InferenceRequest):
        """The model's view of a request: its tensors as they are (no copy)."""
        pb = self.pb
        wrap = pb.Tensor._wrap
        inputs = [
            wrap(name, tensor.datatype, tensor.data) for name, tensor in request.inputs.items()
        ]
        flags = (_FLAG_SEQUENCE_START if request.sequence_start else 0) | (
            _FLAG_SEQUENCE_END if request.sequence_end else 0
        )
        requested = request.requested_outputs
        outputs = (
            list(self._instance.output_names) if requested is None else [o.name for o in requested]
        )
        parameters = json.dumps(request.parameters, default=str) if request.parameters else "{}"
        self._unanswered.add(request)
        return pb.InferenceRequest._received(
            request,
            request.id,
            request.sequence_id,
            inputs,
            outputs,
            self.model_name,
            flags,
            parameters,
            pb.InferenceResponseSender(request, self.decoupled),
        )

    def outcome(self, request: InferenceRequest, response) -> InferenceResponse | TritonError:
        """A model's ``pb_utils.InferenceResponse`` as the server's response: the
        outputs the request asked for, as they are (no copy)."""
        error = response.error()
        if error is not None:
            return error_from_code(error.code(), error.message())
        tensors = response.output_tensors()
        requested = request.requested_outputs
        if requested is not None:
            by_name = {tensor._name: tensor for tensor in tensors}
            tensors = [by_name[o.name] for o in requested if o.name in by_name]
        outputs = [Tensor(t._name, t._datatype, t._host_array()) for t in tensors]
        text = response.parameters()
        parameters = json.loads(text) if text != "{}" else {}
        return InferenceResponse(
            request.model_name, self._instance.model_version, request.id, outputs, parameters
        )

    def finalize(self) -> None:
        self._finalizing = True
        finalize = getattr(self.model, "finalize", None)
        try:
            if finalize is not None:
                finalize()
        except BaseException as exc:
            log.warning("finalize raised", source=self.label, error=describe_exception(exc))
        finally:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
            _bound.modules = {}

    def close(self) -> None:
        """Nothing here: :meth:`InProcessInstance.close` runs ``finalize``."""

    def _run_loop(self, loop) -> None:
        if self.namespace is not None:
            self.namespace.bind()
        try:
            loop.run_forever()
        finally:
            loop.close()

    # -- called from pb_utils, on any thread ---------------------------------------

    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the Trio thread, in the order posted."""
        self._instance.post(fn, *args)

    def send_response(self, key: InferenceRequest, response, final: bool) -> None:
        if final:
            self._unanswered.discard(key)
        outcome = None if response is None else self.outcome(key, response)
        self.post(self._instance.deliver_sent, key, outcome, final)

    def is_cancelled(self, key: InferenceRequest) -> bool:
        # Answered already (a failure, or its final response): the model should stop.
        return key.cancelled or key.done

    def sender_released(self, key: InferenceRequest) -> None:
        """A request's sender is gone (garbage): nothing can answer it any more."""
        if key in self._unanswered:
            self._unanswered.discard(key)
            self.post(self._instance.released, key)

    def log(self, level: str, message: str) -> None:
        log_stub_line(self.label, level, message)

    def metric(self, action: str, fields: dict):
        reply = CUSTOM_METRICS.handle(
            self._instance.metrics_owner, {"op": "metric", "action": action, "call": 0, **fields}
        )
        assert reply is not None
        if reply["error"] is not None:
            raise self.pb.TritonModelException(reply["error"])
        return reply["result"]

    def metric_release(self, action: str, fields: dict) -> None:
        CUSTOM_METRICS.handle(
            self._instance.metrics_owner, {"op": "metric", "action": action, "call": None, **fields}
        )

    def control(self, action: str, fields: dict):
        message = {"op": "control", "action": action, "call": 0, **fields}
        try:
            reply = trio.from_thread.run(
                self._instance.control.handle, message, trio_token=self._instance.token
            )
        except trio.RunFinishedError:
            raise self.pb.TritonModelException(
                "the model loading API is not available: the server has stopped"
            ) from None
        if reply["error"] is not None:
            raise self.pb.TritonModelException(reply["error"])
        return reply["result"]

    def bls(self, request, decoupled: bool):
        pb = self.pb
        if not self._serving or self._finalizing:
            # python_backend's words (infer_request.cc InferRequest::Exec).
            raise pb.TritonModelException("BLS is only supported during the 'execute' function.")
        inputs = {
            t.name(): Tensor(t.name(), t._datatype, t._host_array()) for t in request.inputs()
        }
        called = called_request(
            request.model_name(),
            request.model_version(),
            request.request_id(),
            request.correlation_id(),
            request.flags(),
            request.timeout(),
            request.parameters(),
            inputs,
            list(request.requested_output_names()),
        )
        call = _BLSCall(self, called)
        try:
            self.post(self._instance.start_bls, call, decoupled, request.model_name())
        except trio.RunFinishedError:
            raise pb.TritonModelException("BLS is not available: the server has stopped") from None
        if decoupled:
            call.wait_first()
            return pb.ResponseIterator(call)
        return call.next_response()

    def pb_response(self, outcome: Outcome):
        """A BLS outcome as the model sees it (None: the empty final response)."""
        pb = self.pb
        if outcome is None:
            return pb.InferenceResponse([])
        if isinstance(outcome, TritonError):
            return pb.InferenceResponse([], pb.TritonError(outcome.message, code_of(outcome)))
        wrap = pb.Tensor._wrap
        response = pb.InferenceResponse([wrap(t.name, t.datatype, t.data) for t in outcome.outputs])
        if outcome.parameters:
            response._parameters = json.dumps(outcome.parameters, default=str)
        return response

    def is_ready(self) -> bool:
        """The model's ``is_ready()`` (a coroutine is run to its end)."""
        result = self.model.is_ready()
        if inspect.iscoroutine(result):
            result = self._run_coroutine(result).result()
        if not isinstance(result, bool):
            raise TypeError("is_ready() must return a boolean value")
        return result


class ExecuteFailed(Exception):
    """The model's execute raised; the message is Triton's wording of it."""


# -- the server's side: on the Trio thread ------------------------------------------------


class InProcessInstance:
    """One in-process instance: an async backend instance (see
    ``AsyncBackendInstance``) whose ``execute_async`` hands the batch to the
    instance's thread and awaits it, and whose ``run`` holds the nursery of the
    model's BLS calls.

    Guarantees, as a stub-backed instance's: every request handed to
    ``execute_async`` gets one final outcome — the model's response(s), its
    error, or Triton's error for a response sender let go unanswered; a
    decoupled model's responses reach their request in the order it sent them.
    """

    def __init__(
        self,
        context: ModelContext,
        spec: InstanceSpec,
        settings: StubSettings,
        model_file: Path,
        config_json: str,
    ) -> None:
        config = context.config
        self.spec = spec
        self.model_name = context.name
        self.model_version = str(context.version)
        self.label = f"model '{context.name}' instance '{spec.name}'"
        self.decoupled = config.model_transaction_policy.decoupled
        self._reschedulable = config.sequence_batching.iterative_sequence
        self.output_names = [o.name for o in config.output]
        self._settings = settings
        self._inference = context.inference
        self.control = ModelControl(context.inference, context.name)
        self.metrics_owner = new_metrics_owner()
        self._nursery: trio.Nursery | None = None
        self._has_is_ready = False
        self.token = trio.from_thread.run_sync(trio.lowlevel.current_trio_token)
        self._runtime = InProcessRuntime(self, model_file, str(context.version_dir))
        self._thread = InstanceThread(spec.name, self._runtime)
        self._thread.start(self.token)
        args = {
            "model_config": config_json,
            "model_instance_kind": spec.kind.removeprefix("KIND_"),
            "model_instance_name": spec.name,
            "model_instance_device_id": str(spec.device_id),
            "model_repository": str(context.model_dir),
            "model_version": str(context.version),
            "model_name": context.name,
        }
        try:
            self._has_is_ready = self._thread.call(lambda: self._runtime.load(args))
        except BaseException as exc:
            self._stop_thread()
            if isinstance(exc, Exception):
                raise Unavailable(
                    f"{self.label}: initialize failed: {describe_exception(exc)}"
                ) from None
            raise

    # -- the actor -----------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult | None:
        job = Job(requests)
        self._thread.submit(job)
        await self._thread.wait(job)
        for request in job.cancelled:  # cancelled while waiting for the thread
            request.fail(
                Cancelled(
                    f"request '{request.id}' for model '{request.model_name}' was "
                    "cancelled before it executed"
                )
            )
        if job.error is not None:
            if not isinstance(job.error, ExecuteFailed):
                raise job.error
            # Logged as Triton's stub logs it (pb_stub.cc ProcessRequests).
            log.error("execute raised", source=self.label, error=str(job.error))
            error = InternalError(str(job.error))
            if self.decoupled or job.cancelled:
                for request in job.requests:
                    request.fail(error)
                return None
            return [error] * len(job.requests)
        assert job.results is not None
        outcomes: list[InferenceResponse | TritonError | None] = []
        for request, result in zip(job.requests, job.results):
            outcomes.append(self._reschedule(request) if result is _RESCHEDULED else result)
        if job.cancelled or any(outcome is None for outcome in outcomes):
            for request, outcome in zip(job.requests, outcomes):
                if outcome is not None:
                    _deliver(request, outcome)
            return None
        return outcomes  # type: ignore[return-value]  # no None in it

    def _reschedule(self, request: InferenceRequest) -> TritonError | None:
        """Released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE (see the stub-backed
        instance's ``_reschedule``)."""
        if not self._reschedulable:
            return InvalidArgument(
                "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while "
                "the model is not configured to handle such a flag."
            )
        request.rescheduled = True
        return None

    async def check_ready(self) -> None:
        """The model's ``is_ready()``, within 5 s (as a stub-backed instance)."""
        if not self._has_is_ready:
            return
        with trio.move_on_after(READINESS_TIMEOUT_SECONDS):
            try:
                ready = await trio.to_thread.run_sync(
                    self._runtime.is_ready, abandon_on_cancel=True
                )
            except Exception as exc:
                raise InternalError(describe_exception(exc)) from None
            if not ready:
                raise Unavailable(
                    f"Model '{self.spec.name}' is not ready (user-defined check failed)."
                )
            return
        raise Unavailable("Timed out waiting for user-defined is_ready() response")

    # -- what the model's threads post ---------------------------------------------------

    def post(self, fn, *args) -> None:
        self.token.run_sync_soon(fn, *args)

    def deliver_sent(
        self,
        request: InferenceRequest,
        outcome: InferenceResponse | TritonError | None,
        final: bool,
    ) -> None:
        """A response (or the final flag) the model sent through a response sender."""
        if outcome is not None:
            # A model that is not decoupled has one response (its sender refuses a
            # second), so it is the final outcome whatever the flag.
            _deliver(request, outcome, final or not self.decoupled)
        elif final:
            if self.decoupled:
                request.send(None, final=True)
            else:
                request.fail(
                    InternalError(
                        "Unable to send response. Non-decoupled model cannot send complete "
                        "final before sending a response."
                    )
                )

    def released(self, request: InferenceRequest) -> None:
        if not request.done:
            request.fail(
                InternalError(
                    "the model released the request without sending its final response "
                    "(a response returned from execute, or one sent with "
                    "TRITONSERVER_RESPONSE_COMPLETE_FINAL)"
                )
            )

    def start_bls(self, call: _BLSCall, decoupled: bool, model_name: str) -> None:
        nursery = self._nursery
        try:
            if nursery is None:
                raise RuntimeError("no nursery")
            nursery.start_soon(self._bls, call, decoupled, model_name)
        except RuntimeError:
            call.put(Unavailable(f"{self.label}: the model instance is stopping"), True)

    async def _bls(self, call: _BLSCall, decoupled: bool, model_name: str) -> None:
        async def reply(outcome: Outcome, final: bool) -> None:
            call.put(outcome, final)

        try:
            await run_bls(
                self._inference,
                lambda: call.request,
                decoupled=decoupled,
                timeout_us=call.request.timeout_us,
                model_name=model_name,
                label=self.label,
                reply=reply,
            )
        finally:
            # Cut short (the instance stops): the model's iterator still ends.
            call.put(Unavailable(f"{self.label}: the model instance was stopped"), True)

    # -- shutdown ---------------------------------------------------------------------

    def close(self) -> None:
        """Finalize the model on its thread, then end the thread (blocking)."""
        try:
            self._thread.call(self._runtime.finalize, timeout=self._settings.stub_timeout)
        except TimeoutError:
            log.warning(
                "finalize failed",
                source=self.label,
                error=(
                    f"the model did not finish its batches and finalize within "
                    f"{self._settings.stub_timeout:g}s (stub-timeout-seconds); its thread "
                    "is left behind"
                ),
            )
        self._stop_thread()

    def _stop_thread(self) -> None:
        self._thread.stop()
        CUSTOM_METRICS.release(self.metrics_owner)
        namespace = self._runtime.namespace
        if namespace is not None:
            namespace.close()


def _deliver(request: InferenceRequest, outcome, final: bool = True) -> None:
    if isinstance(outcome, TritonError):
        request.fail(outcome)
    else:
        request.send(outcome, final=final)
