"""Inference requests of the in-process API: ``tritonserver.InferenceRequest``'s
fields, and the core request built from Python values (numpy arrays, DLPack
objects, :class:`~trionserve.api.Tensor`, str/bytes).

Pure functions and plain data: nothing here touches the event loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trionserve.api._errors import InvalidArgumentError
from trionserve.api._models import route_version
from trionserve.api._tensor import DataType, DLDeviceType, Tensor
from trionserve.core import errors
from trionserve.core.datatypes import from_numpy
from trionserve.core.inference import InferenceRequest as CoreRequest
from trionserve.core.inference import Tensor as CoreTensor
from trionserve.core.parameters import check_reserved_key


class RequestFlag(enum.IntFlag):
    """Triton's TRITONSERVER_RequestFlag: a request's place in its sequence."""

    SEQUENCE_START = 1
    SEQUENCE_END = 2


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
