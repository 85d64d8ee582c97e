"""Tensors a model's configuration names by file: implicit-state ``initial_state``
data (``<model>/initial_state/``) and warmup samples (``<model>/warmup/``).

Triton's format: the raw bytes of the tensor in row-major order, or for BYTES
each element as a 4-byte little-endian length followed by its bytes. The file
must lie inside its folder of the model directory.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from trionserve.core.datatypes import DataType
from trionserve.core.errors import InvalidArgument


def read_model_file(model_dir: Path, folder: str, filename: str, where: str) -> bytes:
    """The contents of ``<model_dir>/<folder>/<filename>``; never outside the folder."""
    base = (model_dir / folder).resolve()
    path = (base / filename).resolve()
    if base not in path.parents:
        raise InvalidArgument(
            f"{where}: data file '{filename}' must name a file in the model's {folder}/ directory"
        )
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(
            f"{where}: cannot read {folder}/{filename}: {exc.strerror or exc}"
        ) from None


def tensor_from_bytes(
    datatype: DataType, data: bytes, shape: tuple[int, ...], where: str
) -> np.ndarray:
    """A tensor of ``shape`` from a data file's contents (extra bytes are ignored)."""
    count = math.prod(shape)
    if datatype.wire == "BYTES":
        items: list[bytes] = []
        offset = 0
        while len(items) < count:
            if offset + 4 > len(data):
                raise InvalidArgument(
                    f"{where}: the data file holds {len(items)} BYTES elements, the shape "
                    f"{list(shape)} needs {count}"
                )
            size = int.from_bytes(data[offset : offset + 4], "little")
            items.append(data[offset + 4 : offset + 4 + size])
            offset += 4 + size
        array = np.empty(count, dtype=object)
        array[:] = items
        return array.reshape(shape)
    needed = count * datatype.itemsize
    if len(data) < needed:
        raise InvalidArgument(
            f"{where}: the shape {list(shape)} of {datatype.wire} expects {needed} bytes, "
            f"the data file has {len(data)}"
        )
    return np.frombuffer(data[:needed], dtype=datatype.numpy).reshape(shape).copy()


def zeros(shape: tuple[int, ...], datatype: DataType) -> np.ndarray:
    """Zeros of ``datatype``; empty strings for BYTES."""
    if datatype.wire == "BYTES":
        array = np.empty(shape, dtype=object)
        array.fill(b"")
        return array
    return np.zeros(shape, dtype=datatype.numpy)
