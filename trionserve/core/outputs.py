"""Output encoding both inference protocols share: a tensor's bytes on the wire and
the outputs a request asked to receive in shared memory."""

from __future__ import annotations

from typing import Any, Self

import numpy as np

from trionserve.core.bytes_tensor import serialize_bytes_tensor
from trionserve.core.datatypes import WIRE_DTYPE
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse

__all__ = ["Described", "output_bytes", "shared_memory_outputs"]

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


class Described:
    """An answer written whole, kept by its connection to write the next one
    described the same: the same model, version and id, each output's name,
    datatype, shape, dtype and strides, no requested outputs, no parameters.
    Both protocols encode such a response as the same bytes around the outputs'
    own (``heads``: the bytes before each output's, ``size`` the whole
    answer's), so the next one is those bytes and the outputs' arrays, not
    encoded again: the instance's thread writes it right after the model's run,
    when each Python step costs about 1 µs with its caches evicted (issue 39's
    twelfth round)."""

    __slots__ = ("heads", "id", "model", "outputs", "size", "version")

    def __init__(
        self, request: InferenceRequest, response: InferenceResponse, heads: list, size: int
    ) -> None:
        self.model = response.model_name
        self.version = response.model_version
        self.id = response.id or request.id
        self.outputs = [
            (t.name, t.datatype, t.data.shape, t.data.dtype, t.data.strides)
            for t in response.outputs
        ]
        self.heads = heads
        self.size = size

    @classmethod
    def of(
        cls, request: InferenceRequest, response: InferenceResponse, before: list, chunks: list
    ) -> Self | None:
        """The answer ``before`` (bytes before the first output's) then ``chunks``,
        an encoder's (each output's own bytes, one view of its array, after the
        bytes that precede it, if any), kept; None where it is not that."""
        if request.requested_outputs is not None or response.parameters:
            return None
        heads: list[bytes] = []
        size = 0
        index = 0
        for tensor in response.outputs:
            head = b"".join(before)
            before = []
            data = tensor.data
            while index < len(chunks):
                chunk = chunks[index]
                index += 1
                if isinstance(chunk, memoryview) and chunk.obj is data:
                    break
                if not isinstance(chunk, bytes):
                    return None
                head += chunk
            else:
                return None
            if not isinstance(data, np.ndarray) or chunk.nbytes != data.nbytes or not data.nbytes:
                return None
            heads.append(head)
            size += len(head) + data.nbytes
        if index != len(chunks) or before or not heads:
            return None
        return cls(request, response, heads, size)

    def pieces(self, request: InferenceRequest, response: InferenceResponse) -> list | None:
        """The answer to ``request`` as the kept bytes and the outputs' arrays, if
        ``response`` is described as the kept one; else None."""
        outputs = response.outputs
        if (
            request.requested_outputs is not None
            or response.parameters
            or response.model_name != self.model
            or response.model_version != self.version
            or (response.id or request.id) != self.id
            or len(outputs) != len(self.outputs)
        ):
            return None
        pieces: list = []
        for tensor, head, (name, datatype, shape, dtype, strides) in zip(
            outputs, self.heads, self.outputs
        ):
            data = tensor.data
            if (
                tensor.name != name
                or tensor.datatype != datatype
                or data.shape != shape
                or data.dtype is not dtype
                or data.strides != strides
            ):
                return None
            pieces.append(head)
            pieces.append(data)
        return pieces
