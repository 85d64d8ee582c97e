"""triton_python_backend_utils as trionserve's stub provides it to ``model.py``.

The API of Triton's Python backend module of the same name: tensors, requests,
responses, response senders for decoupled models, BLS (``InferenceRequest.exec``
and ``async_exec``), errors, the logger, the auto-complete ``ModelConfig`` and the
helper functions. Calls that reach the server (BLS, responses sent through a
sender, log lines) go through the stub runtime installed in ``_runtime``.
"""

from __future__ import annotations

import enum
import json
import sys
import threading

import numpy as np

# The stub runs from the trionserve package (also under a model's own
# EXECUTION_ENV_PATH, where only the package is put on sys.path), so the one BYTES
# wire format in trionserve.core (numpy and the standard library only) is here too.
from trionserve.core.bytes_tensor import deserialize_bytes_tensor as _deserialize_bytes
from trionserve.core.bytes_tensor import serialize_bytes_tensor

# Set by the stub process to its runtime (see trionserve.backends.python.stub).
_runtime = None

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_GPU = 1
TRITONSERVER_MEMORY_CPU = 2

TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

# TRITONSERVER_DataType codes, their wire names and numpy types.
_TYPES = [
    (1, "BOOL", np.bool_),
    (2, "UINT8", np.uint8),
    (3, "UINT16", np.uint16),
    (4, "UINT32", np.uint32),
    (5, "UINT64", np.uint64),
    (6, "INT8", np.int8),
    (7, "INT16", np.int16),
    (8, "INT32", np.int32),
    (9, "INT64", np.int64),
    (10, "FP16", np.float16),
    (11, "FP32", np.float32),
    (12, "FP64", np.float64),
    (13, "BYTES", np.object_),
    (14, "BF16", np.uint16),
]
_CODE_TO_WIRE = {code: wire for code, wire, _ in _TYPES}
_WIRE_TO_CODE = {wire: code for code, wire, _ in _TYPES}
_CODE_TO_NUMPY = {code: numpy for code, _, numpy in _TYPES}
# The common answers of numpy_to_triton_type at the cost of a dict look-up: keyed by
# the numpy scalar types and their (native byte order) dtypes.
_NUMPY_TO_CODE = {np.object_: 13, np.bytes_: 13, bytes: 13, np.dtype(np.object_): 13}
for _code, _wire, _numpy in reversed(_TYPES):
    if _wire not in ("BF16", "BYTES"):
        _NUMPY_TO_CODE[_numpy] = _NUMPY_TO_CODE[np.dtype(_numpy)] = _code


def triton_to_numpy_type(data_type):
    return _CODE_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type):
    try:
        return _NUMPY_TO_CODE[data_type]
    except (KeyError, TypeError):
        pass
    if data_type in (np.object_, np.bytes_) or data_type is bytes:
        return 13
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind in ("O", "S", "U"):
        return 13
    for code, wire, numpy in _TYPES:
        if wire != "BF16" and dtype == np.dtype(numpy):
            return code
    return None


def triton_string_to_numpy(triton_type_string):
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor):
    """BYTES elements flattened as 4-byte little-endian length + bytes, C order."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    return serialize_bytes_tensor(input_tensor)


def deserialize_bytes_tensor(encoded_tensor):
    """The 1-D object array of bytes that serialize_byte_tensor encoded."""
    return _deserialize_bytes(encoded_tensor, None, "the encoded BYTES tensor")


# -- errors -------------------------------------------------------------------------


class TritonError(Exception):
    """An error for one response; ``code`` is one of the class constants."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message, code=INTERNAL):
        if message is None:
            raise TypeError("TritonError needs a message")
        super().__init__(message)
        self._message = str(message)
        self._code = int(code)

    def message(self):
        return self._message

    def code(self):
        return self._code

    def __str__(self):
        return self._message


class TritonModelException(Exception):
    """Raised by models (and by this module) to fail initialize, execute or finalize."""

    def __init__(self, msg=None):
        super().__init__(msg)
        self._msg = msg

    def message(self):
        return self._msg

    def __str__(self):
        return "" if self._msg is None else str(self._msg)


# -- tensors ------------------------------------------------------------------------


class Tensor:
    """A named tensor: a numpy array in CPU memory, or a DLPack object on a GPU."""

    def __init__(self, name, numpy_array, *_legacy):
        name = name if type(name) is str else _text(name, "Tensor name")
        if numpy_array is None:
            raise TypeError("Tensor() takes a numpy array, not None")
        array = numpy_array if type(numpy_array) is np.ndarray else np.asarray(numpy_array)
        code = _NUMPY_TO_CODE.get(array.dtype)
        if code is not None and code != 13:  # the common case: a numeric array
            self._name = name
            self._array = array
            self._device_object = None
            self._datatype = _CODE_TO_WIRE[code]
            return
        if array.dtype.kind in ("U", "S"):
            # Triton asks for np.object_; bytes and str elements mean the same here.
            array = array.astype(np.object_)
        if array.dtype.kind == "V":
            raise TritonModelException(
                "Tensor dtype used for numpy_array is not supported by Python "
                "backend. Please use np.object_ instead."
            )
        code = numpy_to_triton_type(array.dtype)
        if code is None:
            raise TritonModelException(f"numpy dtype {array.dtype} has no Triton data type")
        self._name = name
        self._array = array
        self._device_object = None
        self._datatype = _CODE_TO_WIRE[code]

    @classmethod
    def _wrap(cls, name, datatype, array):
        """A tensor that keeps the wire datatype it arrived with (BF16, BYTES)."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array
        tensor._device_object = None
        tensor._datatype = datatype
        return tensor

    def name(self):
        return self._name

    def triton_dtype(self):
        return _WIRE_TO_CODE[self._datatype]

    def shape(self):
        source = self._array if self._device_object is None else self._device_object
        return [int(d) for d in source.shape]

    def is_cpu(self):
        return self._device_object is None

    def as_numpy(self):
        if self._device_object is not None:
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")
        return self._array

    def to_dlpack(self):
        return self.__dlpack__()

    def __dlpack__(self, stream=None):
        if self._device_object is not None:
            if stream is None:
                return self._device_object.__dlpack__()
            return self._device_object.__dlpack__(stream=stream)
        if self._array.dtype == np.object_:
            raise TritonModelException("BYTES tensors cannot be exported with DLPack")
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        if self._device_object is not None:
            return self._device_object.__dlpack_device__()
        return (1, 0)  # kDLCPU

    @staticmethod
    def from_dlpack(name, dlpack_object):
        """A tensor from a DLPack capsule or an object with ``__dlpack__``."""
        # pb_tensor.cc PbTensor::FromDLPack's checks and words.
        if name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")
        if dlpack_object is None:
            raise TritonModelException(
                "Provided tensor is not supported. Tensor must be a DLPack capsule or "
                "have `__dlpack__` and `__dlpack_device__` attributes"
            )
        source = dlpack_object
        if not hasattr(source, "__dlpack__"):
            try:  # a capsule of CPU memory: numpy takes it without copying
                array = np.from_dlpack(_CpuCapsule(source))
                return Tensor._wrap(name, _CODE_TO_WIRE[numpy_to_triton_type(array.dtype)], array)
            except (BufferError, RuntimeError, TypeError):
                source = _device_capsule_owner(source)
        device_type = source.__dlpack_device__()[0]
        if device_type in (1, 3):  # kDLCPU, kDLCUDAHost
            array = np.from_dlpack(source)
            return Tensor._wrap(name, _CODE_TO_WIRE[numpy_to_triton_type(array.dtype)], array)
        tensor = Tensor._wrap(name, _device_datatype(source), None)
        tensor._device_object = source
        return tensor

    def _host_array(self):
        """The data in CPU memory, for sending to the server."""
        if self._device_object is None:
            return self._array
        source = self._device_object
        if hasattr(source, "cpu"):  # torch
            return source.cpu().numpy()
        if hasattr(source, "get"):  # cupy
            return source.get()
        return np.from_dlpack(source, device="cpu", copy=True)

    def __repr__(self):
        return f"Tensor({self._name!r}, {self._datatype}, shape={self.shape()})"


class _CpuCapsule:
    """A raw DLPack capsule presented to numpy as CPU memory (numpy checks it)."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None, **_):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)


def _device_capsule_owner(capsule):
    """A raw DLPack capsule of device memory, imported through torch."""
    try:
        import torch.utils.dlpack
    except ImportError:
        raise TritonModelException(
            "a DLPack capsule of GPU memory needs torch to be imported"
        ) from None
    return torch.utils.dlpack.from_dlpack(capsule)


def _device_datatype(source):
    dtype = getattr(source, "dtype", None)
    name = str(dtype).replace("torch.", "")
    if name == "bfloat16":
        return "BF16"
    code = numpy_to_triton_type(np.dtype(name)) if name else None
    if code is None:
        raise TritonModelException(f"unsupported DLPack tensor dtype {dtype}")
    return _CODE_TO_WIRE[code]


# -- requests and responses ------------------------------------------------------------


class PreferredMemory:
    def __init__(self, preferred_memory_type, preferred_device_id=0):
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceTrace:
    def get_context(self):
        return None


# The trace of every received request: trionserve gives models no trace context.
_NO_TRACE = InferenceTrace()

_REQUIRED = object()


def _text(value, what):
    """A string argument as Triton's C++ side takes it: ``str``, or ``bytes`` as UTF-8
    (a name read from a BYTES tensor is ``bytes``)."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise TritonModelException(f"{what} must be valid UTF-8, got {value!r}") from None
    # A wrong type is a TypeError, as pybind11 raises it for python_backend's API.
    raise TypeError(f"{what} must be a str or bytes, not {type(value).__name__}")


def _parameters_json(parameters):
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
        request_id="",
        correlation_id=0,
        inputs=_REQUIRED,
        requested_output_names=_REQUIRED,
        model_name=_REQUIRED,
        model_version=-1,
        flags=0,
        timeout=0,
        preferred_memory=None,
        trace=None,
        parameters=None,
    ):
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
        self._key = None  # set for requests the model received
        self._sender = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    @classmethod
    def _received(
        cls,
        key,
        request_id,
        correlation_id,
        inputs,
        output_names,
        model_name,
        flags,
        parameters,
        sender,
    ):
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
        request._trace = _NO_TRACE
        request._key = key
        request._sender = sender
        request._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return request

    def inputs(self):
        return self._inputs

    def request_id(self):
        return self._request_id

    def correlation_id(self):
        return self._correlation_id

    def flags(self):
        return self._flags

    def set_flags(self, flags):
        self._flags = int(flags)

    def timeout(self):
        return self._timeout

    def parameters(self):
        return self._parameters

    def trace(self):
        return self._trace

    def model_name(self):
        return self._model_name

    def model_version(self):
        return self._model_version

    def requested_output_names(self):
        return self._requested_output_names

    def get_response_sender(self):
        if self._sender is None:
            raise TritonModelException(
                "a response sender exists only for requests the model received"
            )
        return self._sender

    def is_cancelled(self):
        return self._key is not None and _runtime is not None and _runtime.is_cancelled(self._key)

    def set_release_flags(self, flags):
        """TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: once execute returns, the request
        goes back to its model's queue and is executed again (a model with
        ``sequence_batching { iterative_sequence: true }``)."""
        self._release_flags = int(flags)

    def exec(self, decoupled=False):
        """Run this request on another model and wait: a response, or an iterator
        of responses with ``decoupled=True``."""
        if _runtime is None:
            raise TritonModelException("BLS requests can only be executed in a stub process")
        return _runtime.bls(self, bool(decoupled))

    def async_exec(self, decoupled=False):
        """Like :meth:`exec`, as an awaitable for ``async def execute``."""
        import asyncio

        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.exec, decoupled)


class InferenceResponse:
    """Output tensors, or an error, for one request."""

    def __init__(self, output_tensors=_REQUIRED, error=None, parameters=None):
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

    def output_tensors(self):
        return self._output_tensors

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def parameters(self):
        return self._parameters


class InferenceResponseSender:
    """Sends a request's responses at any time, from any thread.

    As Triton's ResponseSender: a decoupled model sends any number of responses
    and then the final flag; a model that is not decoupled sends exactly one
    response (the final flag with it or after it). Breaking that rule raises
    Triton's error in the model; a final flag sent before any response also ends
    the request with that error, so its client is answered.
    """

    def __init__(self, key, decoupled=True):
        self._key = key
        self._decoupled = decoupled
        self._lock = threading.Lock()
        self._sent = 0
        self._closed = False

    def send(self, response=None, flags=0):
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
                    _runtime.send_response(
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
            _runtime.send_response(self._key, response, final)

    def is_cancelled(self):
        return _runtime is not None and _runtime.is_cancelled(self._key)

    def __del__(self):
        # The model let go of the request's sender: if it was not answered, nothing
        # can answer it any more, so the stub ends it (with an error).
        if _runtime is not None:
            _runtime.sender_released(self._key)

    def _close(self):
        with self._lock:
            self._closed = True

    def _end_with_error(self, message):
        """Close the sender, ending its request with ``message`` if still open."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            _runtime.send_response(self._key, InferenceResponse(error=TritonError(message)), True)
            return True


class ResponseIterator:
    """The responses of a decoupled BLS request, as they arrive.

    As python_backend's (pb_response_iterator.cc): the responses are kept, and
    once the last one came, iterating again starts from the first.
    """

    def __init__(self, call):
        self._call = call
        self._responses = []
        self._index = 0
        self._finished = False

    def __iter__(self):
        if self._finished and self._index >= len(self._responses):
            self._index = 0
        return self

    def __next__(self):
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

    def cancel(self):
        self._call.cancel()


# -- logging -------------------------------------------------------------------------


class LogLevel(enum.Enum):
    """Logger levels (pb_stub.cc: the ``Logger.LogLevel`` enum, its values also
    ``Logger.INFO`` and so on)."""

    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    VERBOSE = "VERBOSE"


class Logger:
    """Log lines that appear in the server's log, tagged with the model instance."""

    LogLevel = LogLevel
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message, level=LogLevel.INFO):
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
    def log_info(message):
        Logger.log(message, Logger.INFO)

    @staticmethod
    def log_warn(message):
        Logger.log(message, Logger.WARNING)

    @staticmethod
    def log_error(message):
        Logger.log(message, Logger.ERROR)

    @staticmethod
    def log_verbose(message):
        Logger.log(message, Logger.VERBOSE)


# -- model configuration -------------------------------------------------------------------


def get_input_tensor_by_name(inference_request, name):
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response, name):
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config, name):
    for entry in model_config.get("input", []):
        if entry["name"] == name:
            return entry
    return None


def get_output_config_by_name(model_config, name):
    for entry in model_config.get("output", []):
        if entry["name"] == name:
            return entry
    return None


def using_decoupled_model_transaction_policy(model_config):
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def get_model_dir():
    """The directory model.py was loaded from (its version directory)."""
    if _runtime is None:
        raise TritonModelException("get_model_dir() is only available in a stub process")
    return _runtime.model_dir


def _unsupported(feature):
    def call(*_args, **_kwargs):
        raise TritonModelException(f"{feature} is not supported by trionserve yet")

    call.__name__ = feature
    return call


def _control(action, **fields):
    if _runtime is None:
        raise TritonModelException("the model loading API is only available in a stub process")
    return _runtime.control(action, fields)


def load_model(model_name, config="", files=None):
    """Load or reload ``model_name`` (the server must be in EXPLICIT mode).

    ``config`` is a model configuration as JSON; ``files`` maps
    ``"file:<version>/<name>"`` to the file's bytes, as in the load API.
    """
    files = {_text(key, "files key"): value for key, value in dict(files or {}).items()}
    _control(
        "load", name=_text(model_name, "model_name"), config=_text(config, "config"), files=files
    )


def unload_model(model_name, unload_dependents=False):
    """Unload ``model_name`` (the server must be in EXPLICIT mode)."""
    _control(
        "unload", name=_text(model_name, "model_name"), unload_dependents=bool(unload_dependents)
    )


def is_model_ready(model_name, model_version=""):
    """Whether ``model_name`` (that version, or any) is ready to serve."""
    if isinstance(model_version, (bytes, bytearray)):
        model_version = _text(model_version, "model_version")
    return _control("ready", name=_text(model_name, "model_name"), version=str(model_version))


def _metric_call(action, **fields):
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

    def __init__(self, name, description, kind):
        self._id = None
        self._name = name
        self._kind = kind
        self._id = _metric_call("family_create", name=name, description=description, kind=kind)

    def Metric(self, labels=None, buckets=None):  # noqa: N802 - Triton's name
        """The metric of this family with these labels (created when new)."""
        return Metric(self, labels, buckets)

    def __del__(self):
        if self._id is not None and _runtime is not None:
            _runtime.metric_release("family_delete", {"family": self._id})


class Metric:
    """One metric (one set of labels) of a :class:`MetricFamily`."""

    def __init__(self, family, labels=None, buckets=None):
        self._key = None
        self._family = family._id
        if buckets is not None:
            buckets = [float(b) for b in buckets]
        self._key = _metric_call(
            "metric_create", family=family._id, labels=labels or {}, buckets=buckets
        )

    def _update(self, action, value=0.0):
        return _metric_call(action, family=self._family, labels=self._key, value=value)

    def increment(self, value):
        self._update("increment", value)

    def set(self, value):
        self._update("set", value)

    def observe(self, value):
        self._update("observe", value)

    def value(self):
        return self._update("value")

    def __del__(self):
        if self._key is not None and _runtime is not None:
            _runtime.metric_release("metric_delete", {"family": self._family, "labels": self._key})


class ModelConfig:
    """The configuration ``auto_complete_config`` may complete.

    Only max_batch_size, inputs, outputs, dynamic batching and the transaction
    policy can be set; a value that contradicts config.pbtxt raises ValueError.
    """

    _INPUT_PROPERTIES = ("name", "data_type", "dims", "optional")
    _OUTPUT_PROPERTIES = ("name", "data_type", "dims")

    def __init__(self, model_config):
        self._model_config = json.loads(model_config)
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self):
        return self._model_config

    @property
    def _name(self):
        return self._model_config.get("name", "")

    def set_max_batch_size(self, max_batch_size):
        current = self._model_config.get("max_batch_size", 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in "
                f"auto-complete-config function for model '{self._name}' specified "
                f"max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self):
        for other in ("sequence_batching", "ensemble_scheduling"):
            if self._model_config.get(other):
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name}' tries to "
                    "set scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input):
        self._add("input", input, self._INPUT_PROPERTIES)

    def add_output(self, output):
        self._add("output", output, self._OUTPUT_PROPERTIES)

    def _add(self, kind, tensor, allowed):
        label = f"{kind} '{tensor.get('name', '')}'"
        where = f"in auto-complete-config function for model '{self._name}'"
        extra = [key for key in tensor if key not in allowed]
        if extra:
            raise ValueError(
                f"{label} {where} contains property other than "
                f"{', '.join(repr(a) for a in allowed)}: {extra}"
            )
        for key in allowed[:3]:
            if key not in tensor:
                raise ValueError(f"{label} {where} is missing '{key}' property.")
        for current in self._model_config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            current_type = current.get("data_type", "TYPE_INVALID")
            if current_type not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(
                    f"unable to load model '{self._name}', configuration expects "
                    f"datatype {current_type} for {kind} '{tensor['name']}', model "
                    f"provides {tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model "
                    f"expects dims {list(tensor['dims'])} but the model configuration "
                    f"specifies dims {list(current['dims'])}"
                )
            if (
                "optional" in tensor
                and "optional" in current
                and bool(current["optional"]) != bool(tensor["optional"])
            ):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model "
                    f"expects optional {tensor['optional']} but the model "
                    f"configuration specifies optional {current['optional']}"
                )
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict):
        extra = [key for key in transaction_policy_dict if key != "decoupled"]
        if extra:
            raise ValueError(
                "model transaction property in auto-complete-config function for model "
                f"'{self._name}' contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config for "
                    f"model '{self._name}', which is already set to "
                    f"'{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted
