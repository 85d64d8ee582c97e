"""Responses of the in-process API: an inference response with its outputs as
:class:`~trionserve.api.Tensor` objects, errors handed to the caller's thread, and
the answer to ``http_request``.

Pure functions and plain data: nothing here touches the event loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, Self

import numpy as np

from trionserve.api._errors import InvalidArgumentError, TritonError
from trionserve.api._tensor import (
    DataType,
    MemoryBuffer,
    MemoryType,
    Tensor,
    parse_device_or_memory_type,
    serialize_bytes,
)
from trionserve.core import errors
from trionserve.core.inference import InferenceRequest as CoreRequest
from trionserve.core.inference import InferenceResponse as CoreResponse
from trionserve.core.inference import Tensor as CoreTensor


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


class ResponseModel(Protocol):
    """The model a response names: an :class:`~trionserve.api.AsyncModel`, or the
    blocking :class:`~trionserve.api.Model` around one."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> int: ...
    def _at_version(self, version: int) -> Self: ...


class _Stopped(enum.Enum):
    STOPPED = "stopped"


# What a response_queue forwarder hands on when responses ended before the final one.
STOPPED: Final = _Stopped.STOPPED
# What a forwarder delivers: each response, then STOPPED if the final one never came.
Forwarded = InferenceResponse | Literal[_Stopped.STOPPED]


class Raised:
    """A request's error, handed from the core's thread to the caller's to raise."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def response_from(
    model: ResponseModel,
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


def error_response(
    model: ResponseModel, request: CoreRequest, error: TritonError
) -> InferenceResponse:
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
