"""triton_python_backend_utils as trionserve's stub provides it to ``model.py``.

The API of Triton's Python backend module of the same name: tensors, requests,
responses, response senders for decoupled models, BLS (``InferenceRequest.exec``
and ``async_exec``), errors, the logger, the auto-complete ``ModelConfig`` and the
helper functions. Calls that reach the server (BLS, responses sent through a
sender, log lines) go through the stub runtime installed in ``_runtime``.

This module holds what reaches the runtime: requests (BLS included), responses,
response senders and iterators, the logger, custom metrics and the model loading
API. What needs no runtime is in its siblings, whose names it re-exports:
``triton_python_backend_dtypes`` (data types, BYTES tensors),
``triton_python_backend_errors`` (``TritonError``, ``TritonModelException``),
``triton_python_backend_tensor`` (``Tensor``, python_backend's ``PbTensor``) and
``triton_python_backend_config`` (``ModelConfig`` for auto-complete).
"""

from __future__ import annotations

import enum
import json
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

# The module's data types, errors, Tensor and ModelConfig are in sibling modules of
# stubpath/ (each loaded anew with this one for an in-process model): their names
# are this module's too.
from triton_python_backend_config import (  # noqa: F401
    ModelConfig,
    get_input_config_by_name,
    get_output_config_by_name,
    using_decoupled_model_transaction_policy,
)
from triton_python_backend_dtypes import (  # noqa: F401
    TRITON_STRING_TO_NUMPY,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    serialize_bytes_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)
from triton_python_backend_errors import TritonError, TritonModelException
from triton_python_backend_errors import as_text as _text
from triton_python_backend_tensor import Tensor  # noqa: F401

if TYPE_CHECKING:
    import asyncio
    from typing import Self


class _Runtime(Protocol):
    """What this module calls on the stub's runtime (the stub process's, or the
    in-process one). A request's ``key`` is the runtime's own handle for it."""

    model_dir: str

    def is_cancelled(self, key: Any) -> bool: ...
    def send_response(self, key: Any, response: InferenceResponse | None, final: bool) -> None: ...
    def sender_released(self, key: Any) -> None: ...
    def bls(
        self, request: InferenceRequest, decoupled: bool
    ) -> InferenceResponse | ResponseIterator: ...
    def check_can_wait(self) -> None: ...
    def log(self, level: str, message: str) -> None: ...
    def metric(self, action: str, fields: dict[str, Any]) -> Any: ...
    def metric_release(self, action: str, fields: dict[str, Any]) -> None: ...
    def control(self, action: str, fields: dict[str, Any]) -> Any: ...


class _BLSCall(Protocol):
    """A decoupled BLS request in flight, as its ResponseIterator reads it."""

    finished: bool

    def next_response(self) -> InferenceResponse: ...
    def cancel(self) -> None: ...


# Set by the stub process to its runtime (see trionserve.backends.python.stub).
_runtime: _Runtime | None = None


def _live_runtime() -> _Runtime:
    """The runtime a response sender sends through (a sender exists only where
    one is installed)."""
    if _runtime is None:
        raise TritonModelException("responses can only be sent in a stub process")
    return _runtime


TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_GPU = 1
TRITONSERVER_MEMORY_CPU = 2


# -- requests and responses ------------------------------------------------------------


class PreferredMemory:
    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceTrace:
    """A received request's trace (``request.trace()``): a BLS request given it
    (``InferenceRequest(..., trace=request.trace())``) is traced as the child of
    that request's trace, as in python_backend (infer_request.cc). ``_key``: the
    runtime's handle of the request, None when it is not traced; ``_context``:
    the trace context the server set (python_backend src/python_be.cc:292-303
    reads it with TRITONSERVER_InferenceTraceContext)."""

    def __init__(self, key: Any = None, context: str | None = None) -> None:
        self._key = key
        self._context = context

    def get_context(self) -> str | None:
        """The request's trace context as JSON, None without one (python_backend
        src/pb_stub.cc:1759-1765): in trace mode opentelemetry
        ``{"traceparent": "00-<trace id>-<span id>-01"}``, the W3C context of the
        request's span, to hand to a tracer of the model's own (or to a request
        it sends elsewhere); None when the request is not traced or traced in
        mode triton."""
        return self._context or None


# The trace of a received request that is not traced.
_NO_TRACE = InferenceTrace()

# The default of the arguments that must be given (a TypeError names those missing).
_REQUIRED: Any = object()


def _parameters_json(parameters: object) -> str:
    """Request or response parameters as JSON; errors in python_backend's words
    (src/pb_stub.cc: PyDefaultArgumentToMutableType, PyParametersToJSON)."""
    if parameters is None:
        return "{}"
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect dict, got {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key)}"
            )
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}"
            )
    return json.dumps(parameters)


class InferenceRequest:
    """A request: one the model received, or a BLS request it builds and executes."""

    def __init__(
        self,
        request_id: str | bytes = "",
        correlation_id: int | str | bytes = 0,
        inputs: Iterable[Tensor] = _REQUIRED,
        requested_output_names: Iterable[str | bytes] = _REQUIRED,
        model_name: str | bytes = _REQUIRED,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
        parameters: Mapping[str, bool | int | str] | None = None,
    ) -> None:
        missing = [
            name
            for name, value in (
                ("inputs", inputs),
                ("requested_output_names", requested_output_names),
                ("model_name", model_name),
            )
            if value is _REQUIRED
        ]
        if missing:
            raise TypeError(f"InferenceRequest() missing required argument(s): {missing}")
        if isinstance(correlation_id, (bytes, bytearray)):
            correlation_id = _text(correlation_id, "correlation_id")
        if not isinstance(correlation_id, (int, str)):
            raise TypeError("correlation_id must be an integer or a string")
        for tensor in inputs:
            if not isinstance(tensor, Tensor):
                raise TritonModelException("inputs must be a list of pb_utils.Tensor")
        self._request_id = _text(request_id, "request_id")
        self._correlation_id = correlation_id
        self._inputs = list(inputs)
        self._requested_output_names = [
            _text(name, "requested_output_names") for name in requested_output_names
        ]
        self._model_name = _text(model_name, "model_name")
        self._model_version = int(model_version)
        self._flags = int(flags)
        self._timeout = int(timeout)
        self._parameters = _parameters_json(parameters)
        self._preferred_memory = preferred_memory
        self._trace = trace or InferenceTrace()
        self._key: Any = None  # the runtime's handle, for requests the model received
        self._sender: InferenceResponseSender | None = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    @classmethod
    def _received(
        cls,
        key: Any,
        request_id: str,
        correlation_id: int | str,
        inputs: list[Tensor],
        output_names: list[str],
        model_name: str,
        flags: int,
        parameters: str,
        sender: InferenceResponseSender,
        trace: InferenceTrace | None = None,
    ) -> Self:
        """A request the model receives, from values the server already checked."""
        request = cls.__new__(cls)
        request._request_id = request_id
        request._correlation_id = correlation_id
        request._inputs = inputs
        request._requested_output_names = output_names
        request._model_name = model_name
        request._model_version = -1
        request._flags = flags
        request._timeout = 0
        request._parameters = parameters
        request._preferred_memory = None
        request._trace = trace or _NO_TRACE
        request._key = key
        request._sender = sender
        request._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return request

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = int(flags)

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return self._parameters

    def trace(self) -> InferenceTrace:
        return self._trace

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "a response sender exists only for requests the model received"
            )
        return self._sender

    def is_cancelled(self) -> bool:
        return self._key is not None and _runtime is not None and _runtime.is_cancelled(self._key)

    def set_release_flags(self, flags: int) -> None:
        """TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: once execute returns, the request
        goes back to its model's queue and is executed again (a model with
        ``sequence_batching { iterative_sequence: true }``)."""
        self._release_flags = int(flags)

    def exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """Run this request on another model and wait: a response, or an iterator
        of responses with ``decoupled=True``."""
        if _runtime is None:
            raise TritonModelException("BLS requests can only be executed in a stub process")
        return _runtime.bls(self, bool(decoupled))

    def async_exec(
        self, decoupled: bool = False
    ) -> asyncio.Future[InferenceResponse | ResponseIterator]:
        """Like :meth:`exec`, as an awaitable for ``async def execute``."""
        import asyncio

        loop = asyncio.get_running_loop()
        if _runtime is not None:
            _runtime.check_can_wait()  # this thread's asyncio loop waits for it
        return loop.run_in_executor(None, self.exec, decoupled)


class InferenceResponse:
    """Output tensors, or an error, for one request."""

    def __init__(
        self,
        output_tensors: list[Tensor] = _REQUIRED,
        error: TritonError | str | None = None,
        parameters: Mapping[str, bool | int | str] | None = None,
    ) -> None:
        if output_tensors is _REQUIRED:
            output_tensors = []
        elif output_tensors is None:
            raise TypeError("InferenceResponse() takes a list of output tensors, not None")
        if not isinstance(output_tensors, list):
            raise TritonModelException('"output_tensors" must be a list.')
        for tensor in output_tensors:
            if not isinstance(tensor, Tensor):
                raise TritonModelException("output_tensors must hold pb_utils.Tensor objects")
        if error is not None and not isinstance(error, TritonError):
            error = TritonError(str(error))
        self._output_tensors = output_tensors
        self._error = error
        self._parameters = _parameters_json(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceResponseSender:
    """Sends a request's responses at any time, from any thread.

    As Triton's ResponseSender: a decoupled model sends any number of responses
    and then the final flag; a model that is not decoupled sends exactly one
    response (the final flag with it or after it). Breaking that rule raises
    Triton's error in the model; a final flag sent before any response also ends
    the request with that error, so its client is answered.
    """

    def __init__(self, key: Any, decoupled: bool = True) -> None:
        self._key = key
        self._decoupled = decoupled
        self._lock = threading.Lock()
        self._sent = 0
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException("send() takes a pb_utils.InferenceResponse")
        with self._lock:
            if not self._decoupled:
                if response is not None and self._sent > 0:
                    raise TritonModelException(
                        "Unable to send response. Non-decoupled model cannot send more "
                        "than one response."
                    )
                if response is None and self._sent == 0 and not self._closed:
                    message = (
                        "Unable to send response. Non-decoupled model cannot send "
                        "complete final before sending a response."
                    )
                    self._closed = True
                    _live_runtime().send_response(
                        self._key, InferenceResponse(error=TritonError(message)), True
                    )
                    raise TritonModelException(message)
            if self._closed:
                raise TritonModelException(
                    "Unable to send response. Response sender has been closed."
                )
            if final:
                self._closed = True
            self._sent += 1
            # Sent under the lock: one request's messages keep their order.
            _live_runtime().send_response(self._key, response, final)

    def is_cancelled(self) -> bool:
        return _runtime is not None and _runtime.is_cancelled(self._key)

    def __del__(self) -> None:
        # The model let go of the request's sender: if it was not answered, nothing
        # can answer it any more, so the stub ends it (with an error).
        if _runtime is not None:
            _runtime.sender_released(self._key)

    def _close(self) -> None:
        with self._lock:
            self._closed = True

    def _end_with_error(self, message: str) -> bool:
        """Close the sender, ending its request with ``message`` if still open."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            _live_runtime().send_response(
                self._key, InferenceResponse(error=TritonError(message)), True
            )
            return True


class ResponseIterator:
    """The responses of a decoupled BLS request, as they arrive.

    As python_backend's (pb_response_iterator.cc): the responses are kept, and
    once the last one came, iterating again starts from the first.
    """

    def __init__(self, call: _BLSCall) -> None:
        self._call = call
        self._responses: list[InferenceResponse] = []
        self._index = 0
        self._finished = False

    def __iter__(self) -> Self:
        if self._finished and self._index >= len(self._responses):
            self._index = 0
        return self

    def __next__(self) -> InferenceResponse:
        if self._finished:
            if self._index >= len(self._responses):
                raise StopIteration
            self._index += 1
            return self._responses[self._index - 1]
        response = self._call.next_response()
        self._responses.append(response)
        if self._call.finished:
            self._finished = True
            self._index = len(self._responses)
        return response

    def cancel(self) -> None:
        self._call.cancel()


# -- logging -------------------------------------------------------------------------


class LogLevel(enum.Enum):
    """Logger levels (pb_stub.cc: the ``Logger.LogLevel`` enum, its values also
    ``Logger.INFO`` and so on)."""

    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    VERBOSE = "VERBOSE"


# Logger's level type (inside Logger, ``LogLevel`` is the class attribute).
_Level = LogLevel


class Logger:
    """Log lines that appear in the server's log, tagged with the model instance."""

    LogLevel = LogLevel
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str | bytes, level: _Level = LogLevel.INFO) -> None:
        # Argument types as pybind11 checks them: a TypeError otherwise.
        if not isinstance(level, LogLevel):
            raise TypeError(f"log level must be a pb_utils.Logger level, not {level!r}")
        if isinstance(message, (bytes, bytearray)):
            message = bytes(message).decode("utf-8", "replace")
        if not isinstance(message, str):
            raise TypeError(f"log message must be a str, not {type(message).__name__}")
        if _runtime is None:
            print(f"[{level.value}] {message}", file=sys.stderr, flush=True)
        else:
            _runtime.log(level.value, message)

    @staticmethod
    def log_info(message: str | bytes) -> None:
        Logger.log(message, Logger.INFO)

    @staticmethod
    def log_warn(message: str | bytes) -> None:
        Logger.log(message, Logger.WARNING)

    @staticmethod
    def log_error(message: str | bytes) -> None:
        Logger.log(message, Logger.ERROR)

    @staticmethod
    def log_verbose(message: str | bytes) -> None:
        Logger.log(message, Logger.VERBOSE)


# -- model configuration -------------------------------------------------------------------


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_model_dir() -> str:
    """The directory model.py was loaded from (its version directory)."""
    if _runtime is None:
        raise TritonModelException("get_model_dir() is only available in a stub process")
    return _runtime.model_dir


def _unsupported(feature: str) -> Callable[..., NoReturn]:
    def call(*_args: object, **_kwargs: object) -> NoReturn:
        raise TritonModelException(f"{feature} is not supported by trionserve yet")

    call.__name__ = feature
    return call


def _control(action: str, **fields: object) -> Any:
    if _runtime is None:
        raise TritonModelException("the model loading API is only available in a stub process")
    return _runtime.control(action, fields)


def load_model(
    model_name: str | bytes,
    config: str | bytes = "",
    files: Mapping[str | bytes, bytes] | None = None,
) -> None:
    """Load or reload ``model_name`` (the server must be in EXPLICIT mode).

    ``config`` is a model configuration as JSON; ``files`` maps
    ``"file:<version>/<name>"`` to the file's bytes, as in the load API.
    """
    files = {_text(key, "files key"): value for key, value in dict(files or {}).items()}
    _control(
        "load",
        name=_text(model_name, "model_name"),
        config=_text(config, "config"),
        files=files,
    )


def unload_model(model_name: str | bytes, unload_dependents: bool = False) -> None:
    """Unload ``model_name`` (the server must be in EXPLICIT mode)."""
    _control(
        "unload", name=_text(model_name, "model_name"), unload_dependents=bool(unload_dependents)
    )


def is_model_ready(model_name: str | bytes, model_version: str | bytes | int = "") -> bool:
    """Whether ``model_name`` (that version, or any) is ready to serve."""
    if isinstance(model_version, (bytes, bytearray)):
        model_version = _text(model_version, "model_version")
    return _control("ready", name=_text(model_name, "model_name"), version=str(model_version))


def _metric_call(action: str, **fields: object) -> Any:
    """One custom-metric operation, answered by the server (raises its error)."""
    if _runtime is None:
        raise TritonModelException("custom metrics are only available in a stub process")
    return _runtime.metric(action, fields)


class MetricFamily:
    """A family of custom metrics, exposed on the server's metrics endpoint.

    A name already in use gives that family when the kind matches, and raises
    when it does not. The family lives while this object (or another with the
    same name) does.
    """

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __init__(self, name: str, description: str, kind: int) -> None:
        self._id: int | None = None
        self._name = name
        self._kind = kind
        self._id = _metric_call("family_create", name=name, description=description, kind=kind)

    def Metric(  # noqa: N802 - Triton's name
        self, labels: Mapping[str, str] | None = None, buckets: Iterable[float] | None = None
    ) -> Metric:
        """The metric of this family with these labels (created when new)."""
        return Metric(self, labels, buckets)

    def __del__(self) -> None:
        if self._id is not None and _runtime is not None:
            _runtime.metric_release("family_delete", {"family": self._id})


class Metric:
    """One metric (one set of labels) of a :class:`MetricFamily`."""

    def __init__(
        self,
        family: MetricFamily,
        labels: Mapping[str, str] | None = None,
        buckets: Iterable[float] | None = None,
    ) -> None:
        self._key: list[list[str]] | None = None
        self._family = family._id
        bounds = [float(b) for b in buckets] if buckets is not None else None
        self._key = _metric_call(
            "metric_create", family=family._id, labels=labels or {}, buckets=bounds
        )

    def _update(self, action: str, value: float = 0.0) -> Any:
        return _metric_call(action, family=self._family, labels=self._key, value=value)

    def increment(self, value: float) -> None:
        self._update("increment", value)

    def set(self, value: float) -> None:
        self._update("set", value)

    def observe(self, value: float) -> None:
        self._update("observe", value)

    def value(self) -> float:
        return self._update("value")

    def __del__(self) -> None:
        if self._key is not None and _runtime is not None:
            _runtime.metric_release("metric_delete", {"family": self._family, "labels": self._key})
