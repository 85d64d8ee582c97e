"""The BYTES tensor wire format: each element a 4-byte little-endian length, then its bytes.

Triton's binary tensor data extension, gRPC ``raw_input_contents`` /
``raw_output_contents`` and shared-memory regions all carry BYTES tensors this
way; every frontend reads and writes them here.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from trionserve.core.errors import InvalidArgument

__all__ = ["serialize_bytes_tensor", "deserialize_bytes_tensor", "read_bytes_elements"]

_U32 = struct.Struct("<I")


def serialize_bytes_tensor(array: np.ndarray) -> bytes:
    """Serialize a BYTES tensor: each element, in row-major order, as a 4-byte
    little-endian length followed by its bytes. ``str`` elements are UTF-8 encoded."""
    items = np.asarray(array).reshape(-1).tolist()
    pack = _U32.pack
    parts: list[bytes] = []
    append = parts.append
    for item in items:
        if type(item) is not bytes:
            item = _element_bytes(item)
        append(pack(len(item)))
        append(item)
    return b"".join(parts)


def _element_bytes(item: Any) -> bytes:
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    # Same leniency as tritonclient: anything else goes by its string form.
    return str(item).encode("utf-8")


def deserialize_bytes_tensor(
    buffer: bytes | bytearray | memoryview, count: int | None, what: str
) -> np.ndarray:
    """Parse length-prefixed BYTES elements into a 1-D object array of ``bytes``.

    ``count`` is the number of elements the shape promises (None: as many as the
    buffer holds); ``what`` names the tensor in error messages, e.g. "input 'X'".
    """
    if not isinstance(buffer, bytes):
        buffer = memoryview(buffer).cast("B")
    return read_bytes_elements(buffer, 0, len(buffer), count, what)


def read_bytes_elements(
    buf: bytes | bytearray | memoryview, start: int, end: int, count: int | None, what: str
) -> np.ndarray:
    """The BYTES elements in ``buf[start:end]``, as :func:`deserialize_bytes_tensor`."""
    items: list[bytes] = []
    append = items.append
    unpack = _U32.unpack_from
    offset = start
    while offset < end:
        if end - offset < 4:
            raise InvalidArgument(
                f"malformed BYTES data for {what}: element {len(items)} needs a 4-byte "
                f"length prefix, got {end - offset} bytes"
            )
        (length,) = unpack(buf, offset)
        offset += 4
        stop = offset + length
        if stop > end:
            raise InvalidArgument(
                f"malformed BYTES data for {what}: element {len(items)} has length "
                f"{length}, got only {end - offset} bytes"
            )
        append(bytes(buf[offset:stop]))
        offset = stop
    if count is not None and len(items) != count:
        raise InvalidArgument(
            f"unexpected number of BYTES elements for {what}: expected {count}, got {len(items)}"
        )
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out
