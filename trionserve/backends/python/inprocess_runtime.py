"""The model's side of an in-process Python model: what ``pb_utils`` calls, on its threads.

:class:`InProcessRuntime` is the runtime behind one in-process instance's
``triton_python_backend_utils`` (the counterpart of the stub's ``StubRuntime``,
python_backend's ``Stub``): on the instance's thread it imports model.py (into a
:class:`~trionserve.backends.python.model_namespace.ModelNamespace`) and runs
``initialize``, ``execute`` and ``finalize``; from any of the model's threads it
takes responses sent through response senders, BLS calls, custom metrics, model
loading API calls and log lines, and posts what the server must do to the Trio
thread through the instance (:class:`~trionserve.backends.python.inprocess.InProcessInstance`).
"""

from __future__ import annotations

import inspect
import json
import queue
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVarTuple, cast

import structlog
import trio

from trionserve.backends.python.bls import Outcome
from trionserve.backends.python.messages import called_request, code_of, error_from_code
from trionserve.backends.python.model_namespace import ModelNamespace, unbind
from trionserve.backends.python.process import log_stub_line
from trionserve.backends.python.runtime import ModelRuntime, describe_exception
from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor

if TYPE_CHECKING:
    import asyncio

    from trionserve.backends.python.inprocess import InProcessInstance
    from trionserve.backends.python.stubpath import triton_python_backend_utils as pb_utils
    from trionserve.observability.trace.trace_file import Trace

log = structlog.get_logger(__name__)

Args = TypeVarTuple("Args")

_FLAG_SEQUENCE_START, _FLAG_SEQUENCE_END = 1, 2
# An execute's entry for a request released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE.
RESCHEDULED = object()


class BLSCall:
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

    def next_response(self) -> pb_utils.InferenceResponse:
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
        self._on_event_loop = False  # execute runs on the event loop's thread now
        self._loop_thread = 0  # that thread's ident
        # What execute posted from the event loop's thread: run as it returns.
        self._deferred: list[tuple[Any, tuple]] = []
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
        None where a response sender answers it, or ``RESCHEDULED``. Raises
        :class:`ExecuteFailed` with Triton's wording when execute raised."""
        pb = self.pb
        received = [self._received(request) for request in requests]
        outcomes: list = [None] * len(requests)
        try:
            result = self.call_execute(received)
            if result is not None:
                self.check_returned(received, result)
                for index, (request, response) in enumerate(zip(received, result)):
                    if response is not None:
                        outcomes[index] = self.outcome(request._key, response)
                        request.get_response_sender()._close()
                        self._unanswered.discard(request._key)
            for index, request in enumerate(received):
                if request._release_flags & pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                    request.get_response_sender()._close()
                    self._unanswered.discard(request._key)
                    outcomes[index] = RESCHEDULED
        except BaseException as exc:
            # As Triton: the requests end with the error, their senders close.
            for request in received:
                request.get_response_sender()._close()
                self._unanswered.discard(request._key)
            raise ExecuteFailed(self.execute_error(exc)) from exc
        return outcomes

    def execute_on_loop(self, requests: list[InferenceRequest]) -> list:
        """:meth:`execute` on the event loop's thread (INPROCESS_EXECUTE_ON
        'event_loop'): late pb_utils imports get this model's modules, what
        would wait for the loop is refused (:meth:`check_can_wait`), and what
        execute posts from this thread (responses sent, senders let go) runs as
        it returns, in order, before its results are looked at, as the
        instance's thread posts them before its job is done."""
        assert self.namespace is not None
        self.namespace.bind()
        self._loop_thread = threading.get_ident()
        self._on_event_loop = True
        try:
            return self.execute(requests)
        finally:
            self._on_event_loop = False
            deferred, self._deferred = self._deferred, []
            for fn, args in deferred:
                fn(*args)

    def _await_result(self, coroutine: Awaitable[object]) -> object:
        if self._on_event_loop:
            close = getattr(coroutine, "close", None)
            if close is not None:
                close()  # never awaited: no warning about it
            raise self.pb.TritonModelException(
                f"{self.label}: execute returned an awaitable, which parameter "
                "INPROCESS_EXECUTE_ON 'event_loop' cannot wait for; use 'instance_thread'"
            )
        return super()._await_result(coroutine)

    def _on_loop(self) -> bool:
        """Whether this is the event loop's thread."""
        try:
            return trio.lowlevel.current_trio_token() is self._instance.token
        except RuntimeError:
            return False  # not a Trio thread

    def check_can_wait(self) -> None:
        """Refuse a call that would make the event loop's thread wait for itself:
        one from the model's execute running there (a BLS ``exec()``, an
        ``async_exec()`` on an asyncio loop of that thread, the model loading API)."""
        try:
            on_loop = trio.lowlevel.current_trio_token() is self._instance.token
        except RuntimeError:
            return  # not a Trio thread
        if on_loop:
            raise self.pb.TritonModelException(
                f"{self.label}: a BLS or model loading call cannot wait on the event "
                "loop's thread, where this model's execute runs (parameter "
                "INPROCESS_EXECUTE_ON 'event_loop'); use 'instance_thread' for a model "
                "that calls other models"
            )

    def _received(self, request: InferenceRequest) -> pb_utils.InferenceRequest:
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
        trace = cast("Trace | None", request.trace)
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
            None if trace is None else pb.InferenceTrace(request, trace.context),
        )

    def outcome(
        self, request: InferenceRequest, response: pb_utils.InferenceResponse
    ) -> InferenceResponse | TritonError:
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
            unbind()

    def close(self) -> None:
        """Nothing here: :meth:`InProcessInstance.close` runs ``finalize``."""

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.namespace is not None:
            self.namespace.bind()
        try:
            loop.run_forever()
        finally:
            loop.close()

    # -- called from pb_utils, on any thread ---------------------------------------

    def post(self, fn: Callable[[*Args], object], *args: *Args) -> None:
        """Run ``fn(*args)`` on the Trio thread, in the order posted."""
        if self._on_event_loop and threading.get_ident() == self._loop_thread:
            self._deferred.append((fn, args))
            return
        self._instance.post(fn, *args)

    def send_response(
        self, key: InferenceRequest, response: pb_utils.InferenceResponse | None, final: bool
    ) -> None:
        if final:
            self._unanswered.discard(key)
        budget = key.budget
        if budget is not None and budget.full and response is not None and not self._on_loop():
            # The server's budget of bytes held for clients is full: the model's
            # thread waits for room (never the event loop's), or until the
            # request is cancelled (its client gone, or evicted by the budget).
            budget.wait_for_room_blocking(lambda: key.cancelled or key.done)
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

    def metric(self, action: str, fields: dict[str, Any]) -> Any:
        reply = self._instance.metrics.handle(
            self._instance.metrics_owner, {"op": "metric", "action": action, "call": 0, **fields}
        )
        assert reply is not None
        if reply["error"] is not None:
            raise self.pb.TritonModelException(reply["error"])
        return reply["result"]

    def metric_release(self, action: str, fields: dict) -> None:
        self._instance.metrics.handle(
            self._instance.metrics_owner, {"op": "metric", "action": action, "call": None, **fields}
        )

    def control(self, action: str, fields: dict[str, Any]) -> Any:
        self.check_can_wait()
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

    def bls(
        self, request: pb_utils.InferenceRequest, decoupled: bool
    ) -> pb_utils.InferenceResponse | pb_utils.ResponseIterator:
        pb = self.pb
        if not self._serving or self._finalizing:
            # python_backend's words (infer_request.cc InferRequest::Exec).
            raise pb.TritonModelException("BLS is only supported during the 'execute' function.")
        self.check_can_wait()
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
        parent = request.trace()._key  # the received request, if traced: a child trace
        if parent is not None:
            called.trace_context = parent.trace
        call = BLSCall(self, called)
        try:
            self.post(self._instance.start_bls, call, decoupled, request.model_name())
        except trio.RunFinishedError:
            raise pb.TritonModelException("BLS is not available: the server has stopped") from None
        if decoupled:
            call.wait_first()
            return pb.ResponseIterator(call)
        return call.next_response()

    def pb_response(self, outcome: Outcome) -> pb_utils.InferenceResponse:
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
