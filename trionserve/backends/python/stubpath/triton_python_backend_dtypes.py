"""Triton data types as ``triton_python_backend_utils`` converts them, and BYTES tensors.

The TRITONSERVER_DataType codes (``TRITONSERVER_TYPE_*``), their wire names and
numpy types; the conversions python_backend's module offers
(``triton_to_numpy_type``, ``numpy_to_triton_type``, ``triton_string_to_numpy``)
and its BYTES (de)serialization (``serialize_byte_tensor``,
``deserialize_bytes_tensor``). Part of the module model.py imports as
``triton_python_backend_utils``, which re-exports the public names; it holds no
runtime and no state.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

# The stub runs from the trionserve package (also under a model's own
# EXECUTION_ENV_PATH, where only the package is put on sys.path), so the one BYTES
# wire format in trionserve.core (numpy and the standard library only) is here too.
from trionserve.core.bytes_tensor import deserialize_bytes_tensor as _deserialize_bytes
from trionserve.core.bytes_tensor import serialize_bytes_tensor

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
CODE_TO_WIRE = {code: wire for code, wire, _ in _TYPES}
WIRE_TO_CODE = {wire: code for code, wire, _ in _TYPES}
CODE_TO_NUMPY = {code: numpy for code, _, numpy in _TYPES}
# The common answers of numpy_to_triton_type at the cost of a dict look-up: keyed by
# the numpy scalar types and their (native byte order) dtypes.
NUMPY_TO_CODE = {np.object_: 13, np.bytes_: 13, bytes: 13, np.dtype(np.object_): 13}
for _code, _wire, _numpy in reversed(_TYPES):
    if _wire not in ("BF16", "BYTES"):
        NUMPY_TO_CODE[_numpy] = NUMPY_TO_CODE[np.dtype(_numpy)] = _code


def triton_to_numpy_type(data_type: int) -> type | None:
    return CODE_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: DTypeLike) -> int | None:
    try:
        return NUMPY_TO_CODE[data_type]
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


def triton_string_to_numpy(triton_type_string: str) -> type:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | tuple[()] | None:
    """BYTES elements flattened as 4-byte little-endian length + bytes, C order."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    return serialize_bytes_tensor(input_tensor)


def deserialize_bytes_tensor(encoded_tensor: bytes | bytearray | memoryview) -> np.ndarray:
    """The 1-D object array of bytes that serialize_byte_tensor encoded."""
    return _deserialize_bytes(encoded_tensor, None, "the encoded BYTES tensor")
