"""What the in-process API shares between its Trio and its blocking faces: options,
errors, requests built from Python values, and responses handed back as numpy.

Pure functions and plain data: nothing here touches the event loop.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trionserve.api._tensor import (
    DataType,
    DLDeviceType,
    MemoryBuffer,
    MemoryType,
    Tensor,
    parse_device_or_memory_type,
    serialize_bytes,
)
from trionserve.core import errors
from trionserve.core.datatypes import from_numpy
from trionserve.core.parameters import check_reserved_key
from trionserve.core.types import InferenceRequest as CoreRequest
from trionserve.core.types import InferenceResponse as CoreResponse
from trionserve.core.types import Tensor as CoreTensor

# Triton's exception names (tritonserver/_c/tritonserver_pybind.cc) for our one
# hierarchy: the core raises these very classes, so nothing is translated.
TritonError = errors.TritonError
InvalidArgumentError = errors.InvalidArgument
NotFoundError = errors.NotFound
UnavailableError = errors.Unavailable
InternalError = errors.InternalError
UnsupportedError = errors.Unimplemented
AlreadyExistsError = errors.AlreadyExists
# Codes Triton's Python package reports as UnknownError; named here.
CancelledError = errors.Cancelled
DeadlineExceededError = errors.DeadlineExceeded
ResourceExhaustedError = errors.ResourceExhausted


class UnknownError(errors.TritonError):
    """Triton's UnknownError (TRITONSERVER_ERROR_UNKNOWN), for code that catches it;
    this server raises the specific error instead."""


class RequestFlag(enum.IntFlag):
    """Triton's TRITONSERVER_RequestFlag: a request's place in its sequence."""

    SEQUENCE_START = 1
    SEQUENCE_END = 2


def route_version(version: int) -> int | None:
    """Triton's -1 ("the version policy decides") as the registry's None."""
    if version == -1:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidArgumentError(
            f"model version must be -1 or a positive integer, got {version!r}"
        )
    return version


# -- requests --------------------------------------------------------------------


@dataclass
class InferenceRequest:
    """An inference request's fields, as Triton's ``tritonserver.InferenceRequest``
    (``Model.create_request()``, or ``Model.infer``'s keywords).

    ``inputs``: name -> :class:`Tensor`, numpy array, object with ``__dlpack__``
    (host memory), or anything numpy turns into an array (str/bytes: BYTES).
    ``flags``: :class:`RequestFlag` for sequences, with ``correlation_id``.
    ``timeout``: in microseconds, as Triton's. ``output_memory_type``: where the
    outputs are handed back ("cpu", "gpu:0", a MemoryType, a (MemoryType, id)
    pair); by default where the model left them (host memory here).
    ``response_queue``: a ``queue.SimpleQueue`` (``infer``) or ``asyncio.Queue``
    (``async_infer``) that every response is also put into as it arrives, whether
    or not the iterator is read.
    """

    model: Any
    request_id: str | None = None
    flags: int = 0
    correlation_id: int | str | None = None
    priority: int = 0
    timeout: int = 0
    inputs: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, str | int | bool | float] = field(default_factory=dict)
    output_memory_type: Any = None
    response_queue: Any = None


def build_request(
    model_name: str,
    model_version: int,
    *,
    inputs: dict[str, Any],
    parameters: dict[str, Any] | None = None,
    request_id: str | None = None,
    flags: int = 0,
    correlation_id: int | str | None = None,
    priority: int = 0,
    timeout: int = 0,
) -> CoreRequest:
    """An inference request from Python values, checked as a frontend checks a
    decoded one (the model's own checks follow in the DataPlane)."""
    if not isinstance(inputs, dict):
        raise InvalidArgumentError(
            f"inputs must be a dict of input name to array, got {type(inputs).__name__}"
        )
    if flags & ~(RequestFlag.SEQUENCE_START | RequestFlag.SEQUENCE_END):
        raise InvalidArgumentError(f"unknown request flags {flags:#x}")
    for what, value in (("priority", priority), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(f"{what} must be a non-negative integer, got {value!r}")
    if correlation_id is not None and (
        isinstance(correlation_id, bool)
        or not isinstance(correlation_id, (int, str))
        or (isinstance(correlation_id, int) and correlation_id < 0)
    ):
        raise InvalidArgumentError(
            f"correlation_id must be a non-negative integer or a string, got {correlation_id!r}"
        )
    return CoreRequest(
        model_name,
        route_version(model_version),
        id=request_id or "",
        inputs={name: input_tensor(name, value) for name, value in inputs.items()},
        parameters=_parameters(parameters),
        priority=priority,
        timeout_us=timeout,
        sequence_id=correlation_id if correlation_id is not None else 0,
        sequence_start=bool(flags & RequestFlag.SEQUENCE_START),
        sequence_end=bool(flags & RequestFlag.SEQUENCE_END),
    )


def _parameters(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """Request parameters: the value types Triton's request takes (string, int,
    float, bool), no reserved ``triton_`` key."""
    if parameters is None:
        return {}
    checked = {}
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise InvalidArgumentError(f"parameter names are strings, got {key!r}")
        check_reserved_key(key)
        if not isinstance(value, (str, int, float, bool)):
            raise InvalidArgumentError(
                f"parameter '{key}': expected a string, integer, float or boolean, "
                f"got {type(value).__name__}"
            )
        checked[key] = value
    return checked


def input_tensor(name: str, value: Any) -> CoreTensor:
    """One input from a :class:`Tensor`, a numpy array, an object with
    ``__dlpack__`` (read on the host), or anything numpy makes an array of; str
    and bytes arrays are BYTES."""
    if isinstance(value, CoreTensor):
        return value
    if isinstance(value, Tensor):
        return _from_api_tensor(name, value)
    if isinstance(value, np.ndarray):
        array = value
    elif _on_gpu(value):  # copied to the host through cupy
        return _from_api_tensor(name, Tensor.from_dlpack(value))
    elif hasattr(value, "__dlpack__"):
        try:
            array = np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"input '{name}': cannot read it as a host array through DLPack ({exc}); "
                "this server takes inputs in CPU memory: copy it to the host first"
            ) from None
    else:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"input '{name}': not an array: {exc}") from None
    if array.dtype.kind in ("S", "U", "O"):
        return CoreTensor(name, "BYTES", _bytes_elements(name, array))
    try:
        datatype = from_numpy(array.dtype.newbyteorder("="))
    except errors.InvalidArgument:
        raise InvalidArgumentError(
            f"input '{name}': numpy dtype {array.dtype} has no Triton datatype"
        ) from None
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return CoreTensor(name, datatype.wire, np.ascontiguousarray(array))


def _on_gpu(value: Any) -> bool:
    device = getattr(value, "__dlpack_device__", None)
    return device is not None and int(device()[0]) == DLDeviceType.kDLCUDA


def _from_api_tensor(name: str, tensor: Tensor) -> CoreTensor:
    """An input given as a Tensor, on the host (device memory is copied there:
    the backends here take host tensors); a view of its memory otherwise."""
    try:
        host = tensor.to_host()
        if host.data_type == DataType.BYTES:
            return CoreTensor(name, "BYTES", host.to_bytes_array())
        array = np.asarray(host)
    except errors.TritonError as exc:
        raise InvalidArgumentError(f"input '{name}': {exc}") from None
    return CoreTensor(name, host.data_type.name, array)


def _bytes_elements(name: str, array: np.ndarray) -> np.ndarray:
    """A BYTES tensor as the server holds it: an object array of ``bytes``."""
    flat = array.reshape(-1).tolist()
    elements = np.empty(len(flat), dtype=object)
    for index, item in enumerate(flat):
        if isinstance(item, bytes):
            elements[index] = item
        elif isinstance(item, str):
            elements[index] = item.encode("utf-8")
        else:
            raise InvalidArgumentError(
                f"input '{name}': a BYTES tensor holds bytes or str, element {index} is "
                f"{type(item).__name__}"
            )
    return elements.reshape(array.shape)


# -- responses -------------------------------------------------------------------


@dataclass
class InferenceResponse:
    """One response, as Triton's ``tritonserver.InferenceResponse``, its outputs as
    :class:`Tensor` objects (``numpy.from_dlpack(tensor)`` reads one without a
    copy; ``to_bytes_array()`` / ``to_string_array()`` a BYTES one).

    ``final`` is true on the last response of its request; a decoupled model that
    ends a request without a last response yields one empty final response.
    ``error`` is set only when the request was made with ``raise_on_error=False``.
    """

    model: Any  # the Model (or AsyncModel) at the version that answered
    request_id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Tensor] = field(default_factory=dict)
    error: TritonError | None = None
    classification_label: str | None = None
    final: bool = False


# What a response_queue forwarder hands on when responses ended before the final one.
STOPPED: Any = object()


class Raised:
    """A request's error, handed from the core's thread to the caller's to raise."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def response_from(
    model,
    request: CoreRequest,
    response: CoreResponse | None,
    final: bool,
    output_memory_type: Any = None,
) -> InferenceResponse:
    if response is None:
        return InferenceResponse(model, request.id or None, final=final)
    version = int(response.model_version) if str(response.model_version).isdigit() else -1
    outputs = {tensor.name: output_tensor(tensor) for tensor in response.outputs}
    if output_memory_type is not None:
        try:
            outputs = {name: t.to_device(output_memory_type) for name, t in outputs.items()}
        except errors.TritonError as exc:
            # Triton's message (_api/_response.py _from_tritonserver_inference_response)
            raise InvalidArgumentError(
                f"Memory type {output_memory_type} not supported: {exc}"
            ) from None
    return InferenceResponse(
        model._at_version(version),
        response.id or request.id or None,
        dict(response.parameters),
        outputs,
        final=final,
    )


def check_output_memory_type(output_memory_type: Any) -> None:
    """Refuse an ``output_memory_type`` that names no memory type, before the
    request is sent."""
    if output_memory_type is not None:
        try:
            parse_device_or_memory_type(output_memory_type)
        except errors.InvalidArgument as exc:
            raise InvalidArgumentError(
                f"Memory type {output_memory_type} not supported: {exc}"
            ) from None


def output_tensor(tensor: CoreTensor) -> Tensor:
    """An output as a Tensor over the backend's own array (BYTES: serialized as
    Triton holds them; BF16: its bits)."""
    data = tensor.data
    if not isinstance(data, np.ndarray):
        return Tensor.from_dlpack(data)
    if tensor.datatype == "BYTES" or data.dtype == object:
        serialized = serialize_bytes(data)
        buffer = MemoryBuffer(
            serialized.ctypes.data, MemoryType.CPU, 0, serialized.nbytes, serialized
        )
        return Tensor(DataType.BYTES, list(data.shape), buffer)
    if not data.flags.writeable:
        data = data.copy()  # the caller's to change, as Triton's output memory is
    elif not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    buffer = MemoryBuffer(data.ctypes.data, MemoryType.CPU, 0, data.nbytes, data)
    return Tensor(DataType[tensor.datatype], list(data.shape), buffer)


def error_response(model, request: CoreRequest, error: TritonError) -> InferenceResponse:
    return InferenceResponse(model, request.id or None, error=error, final=True)


@dataclass
class HttpResponse:
    """The answer to :meth:`Server.http_request`: what the HTTP frontend would
    have written on a socket. A streamed answer (``generate_stream``'s
    server-sent events) has ``stream``, an iterator of body chunks (async in the
    Trio API; close it to end the request early), and an empty ``body``."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    stream: Any = None

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)


# -- models ----------------------------------------------------------------------


def load_arguments(
    parameters: dict[str, Any] | None, config: str | dict | None, files: dict[str, bytes] | None
) -> tuple[str | None, dict[str, bytes]]:
    """``load``'s override: Triton's ``parameters`` ({"config": JSON, "file:<path>":
    bytes}), or the ``config`` and ``files`` keywords."""
    parameters = dict(parameters or {})
    if config is not None:
        parameters["config"] = config
    for path, content in (files or {}).items():
        key = path if path.startswith("file:") else f"file:{path}"
        parameters[key] = content
    config_text = parameters.pop("config", None)
    if isinstance(config_text, dict):
        config_text = json.dumps(config_text)
    elif config_text is not None and not isinstance(config_text, str):
        raise InvalidArgumentError("load parameter 'config' must be a JSON string or a dict")
    contents: dict[str, bytes] = {}
    for key, value in parameters.items():
        if not key.startswith("file:"):
            raise InvalidArgumentError(
                f"unknown load parameter '{key}': expected 'config' or 'file:<version>/<name>'"
            )
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"load parameter '{key}' must be bytes")
        contents[key] = bytes(value)
    return config_text, contents


class ModelDictionary(dict):
    """``models()``: (name, version) -> Model, as Triton's ModelDictionary; a bare
    name gives the model at version -1."""

    def __init__(self, make_model, rows: list[dict]) -> None:
        super().__init__()
        self._make_model = make_model
        for row in rows:
            version = row.get("version", "")
            number = int(version) if str(version).isdigit() else -1
            model = make_model(row["name"], number, row.get("state"), row.get("reason"))
            self[(row["name"], number)] = model
        self._names = {name for name, _ in self}

    def __getitem__(self, key):
        if isinstance(key, tuple):
            try:
                return dict.__getitem__(self, key)
            except KeyError:
                raise KeyError(f"Unknown Model: {key}") from None
        if key in self._names:
            return self._make_model(key, -1, None, None)
        raise KeyError(f"Unknown Model: {key}")


def describe_model(name: str, version: int, state: str | None) -> str:
    return repr({"name": name, "version": version, "state": state})
