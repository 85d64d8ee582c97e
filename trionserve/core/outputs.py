"""Output encoding both inference protocols share: a tensor's bytes on the wire and
the outputs a request asked to receive in shared memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from trionserve.core.bytes_tensor import serialize_bytes_tensor
from trionserve.core.datatypes import WIRE_DTYPE
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest

__all__ = ["output_bytes", "shared_memory_outputs"]

# The wire dtypes as numpy's own instances, which arrays made with numpy's types
# share (WIRE_DTYPE's are equal copies): the identity test of the fast path below.
_BUILTIN = {wire: np.dtype(dtype.str) for wire, dtype in WIRE_DTYPE.items()}


def output_bytes(wire: str, data: np.ndarray) -> bytes | memoryview:
    """An output tensor's raw bytes as both protocols carry them: row-major,
    little-endian, BYTES elements length-prefixed. A contiguous array in its wire
    dtype is not copied (the result is a memoryview of it)."""
    if wire == "BYTES":
        return serialize_bytes_tensor(data)
    if data.dtype is _BUILTIN.get(wire) and data.size and data.flags.c_contiguous:
        # The common case, without making arrays: a byte view of the tensor.
        return data.data.cast("B")
    dtype = WIRE_DTYPE.get(wire)
    if dtype is None:
        raise InvalidArgument(f"invalid datatype '{wire}' for an output")
    if data.dtype != dtype:
        if wire == "BF16" and data.dtype.name == "bfloat16":
            data = data.view(np.uint16)
        else:
            data = data.astype(dtype)
    if data.size == 0:
        return b""
    data = np.ascontiguousarray(data)
    return data.reshape(-1).view(np.uint8).data


def shared_memory_outputs(request: InferenceRequest) -> dict[str, dict[str, Any]]:
    """The parameters of each output the request asked to receive in a shared
    memory region, by output name."""
    if not request.requested_outputs:
        return {}
    return {
        o.name: o.parameters
        for o in request.requested_outputs
        if "shared_memory_region" in o.parameters
    }
