"""Triton datatypes: config names (TYPE_FP32), wire names (FP32) and numpy dtypes.

BYTES tensors are numpy object arrays whose elements are ``bytes``. BF16 has no numpy
dtype, so BF16 tensors travel as ``uint16`` arrays holding the raw bits; the wire
datatype of a :class:`~trionserve.core.inference.Tensor` tells them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trionserve.core.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class DataType:
    wire: str  # name on the v2 protocol: "FP32"
    config: str  # name in config.pbtxt: "TYPE_FP32"
    numpy: np.dtype  # element type of arrays of this datatype
    itemsize: int  # bytes per element on the wire; 0 for variable-size BYTES


def _dt(wire: str, config: str, np_type: str | type) -> DataType:
    dtype = np.dtype(np_type)
    return DataType(wire, config, dtype, 0 if dtype == np.object_ else dtype.itemsize)


ALL_DATATYPES: tuple[DataType, ...] = (
    _dt("BOOL", "TYPE_BOOL", np.bool_),
    _dt("UINT8", "TYPE_UINT8", np.uint8),
    _dt("UINT16", "TYPE_UINT16", np.uint16),
    _dt("UINT32", "TYPE_UINT32", np.uint32),
    _dt("UINT64", "TYPE_UINT64", np.uint64),
    _dt("INT8", "TYPE_INT8", np.int8),
    _dt("INT16", "TYPE_INT16", np.int16),
    _dt("INT32", "TYPE_INT32", np.int32),
    _dt("INT64", "TYPE_INT64", np.int64),
    _dt("FP16", "TYPE_FP16", np.float16),
    _dt("FP32", "TYPE_FP32", np.float32),
    _dt("FP64", "TYPE_FP64", np.float64),
    _dt("BYTES", "TYPE_STRING", np.object_),
    _dt("BF16", "TYPE_BF16", np.uint16),
)

BY_WIRE: dict[str, DataType] = {d.wire: d for d in ALL_DATATYPES}
BY_CONFIG: dict[str, DataType] = {d.config: d for d in ALL_DATATYPES}
# Fixed-size wire datatype -> its numpy dtype on the wire: tensors travel
# little-endian (on a little-endian host these equal the native dtypes).
WIRE_DTYPE: dict[str, np.dtype] = {
    d.wire: d.numpy.newbyteorder("<") for d in ALL_DATATYPES if d.itemsize
}
# numpy -> wire name; uint16 maps to UINT16 (BF16 is never inferred from numpy).
_BY_NUMPY: dict[np.dtype, DataType] = {d.numpy: d for d in ALL_DATATYPES if d.wire != "BF16"}


def from_wire(name: str) -> DataType:
    try:
        return BY_WIRE[name]
    except KeyError:
        raise InvalidArgument(f"invalid datatype '{name}'") from None


def from_config(name: str) -> DataType:
    try:
        return BY_CONFIG[name]
    except KeyError:
        raise InvalidArgument(f"invalid data_type '{name}'") from None


def from_numpy(dtype: np.dtype) -> DataType:
    """The datatype for a numpy dtype; str/bytes arrays map to BYTES."""
    dtype = np.dtype(dtype)
    if dtype.kind in ("S", "U", "O"):
        return BY_WIRE["BYTES"]
    try:
        return _BY_NUMPY[dtype]
    except KeyError:
        raise InvalidArgument(f"numpy dtype {dtype} has no Triton datatype") from None
