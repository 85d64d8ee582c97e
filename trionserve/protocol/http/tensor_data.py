"""Tensor data of the KServe v2 HTTP/REST protocol, apart from the envelope around it.

Pure functions between an input's data as it travels (the binary tensor extension's
raw bytes, or a JSON ``data`` array) and a numpy array, and from an output's array
back to a JSON ``data`` array; ``codec`` (the infer request and response) and
``generate`` (the generate extension) share them. A binary input is an
``np.frombuffer`` view of the body it came in, never a copy (BYTES excepted).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from trionserve.core.bytes_tensor import read_bytes_elements as _read_bytes_elements
from trionserve.core.datatypes import BY_WIRE, WIRE_DTYPE, DataType
from trionserve.core.errors import InvalidArgument
from trionserve.core.validation import byte_size_mismatch

__all__ = [
    "MAX_JSON_DATA_DEPTH",
    "binary_to_array",
    "flatten",
    "fmt_shape",
    "json_kind",
    "json_output",
    "json_to_array",
]

_INT_WIRES = frozenset(
    d.wire for d in BY_WIRE.values() if d.numpy.kind in "iu" and d.wire != "BF16"
)
_FLOAT_WIRES = frozenset(("FP16", "FP32", "FP64"))


def _bounds(wire: str) -> tuple[int, int]:
    info = np.iinfo(BY_WIRE[wire].numpy)
    return int(info.min), int(info.max)


_BOUNDS = {w: _bounds(w) for w in _INT_WIRES}


def fmt_shape(shape: Any) -> str:
    """A shape as errors print it: ``[2,3]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def json_kind(value: Any) -> str:
    """What a JSON value is, as errors name it (``an array``, ``null``)."""
    if value is None:
        return "null"
    if type(value) is bool:
        return "a boolean"
    if type(value) is int:
        return "an integer"
    if type(value) is float:
        return "a number"
    if type(value) is str:
        return "a string"
    if type(value) is list:
        return "an array"
    if type(value) is dict:
        return "an object"
    return type(value).__name__


def binary_to_array(
    name: str,
    model: str,
    dt: DataType,
    shape: list[int],
    count: int,
    body: bytes | bytearray | memoryview,
    offset: int,
    nbytes: int,
) -> np.ndarray:
    if dt.itemsize == 0:  # BYTES
        what = f"input '{name}' with shape {fmt_shape(shape)}"
        return _read_bytes_elements(body, offset, offset + nbytes, count, what).reshape(shape)
    expected = count * dt.itemsize
    if nbytes != expected:
        raise InvalidArgument(byte_size_mismatch(name, model, expected, nbytes, shape, dt.wire))
    if count == 0:
        return np.empty(shape, dtype=dt.numpy)
    return np.frombuffer(body, dtype=WIRE_DTYPE[dt.wire], count=count, offset=offset).reshape(shape)


def json_to_array(name: str, dt: DataType, shape: list[int], count: int, data: Any) -> np.ndarray:
    wire = dt.wire
    if data is None:
        raise InvalidArgument(
            f"missing data for input '{name}': expected 'data' or a 'binary_data_size' parameter"
        )
    if type(data) is not list:
        raise InvalidArgument(
            f"invalid 'data' for input '{name}': expected an array, got {json_kind(data)}"
        )
    if wire == "BF16":
        raise InvalidArgument(
            f"invalid data for input '{name}': BF16 data must use the binary tensor "
            "extension (binary_data_size), not JSON"
        )
    flat = flatten(data)
    _check_count(name, shape, count, len(flat))
    # One C-level pass over the element types; the Python loops below run only to
    # name the offending element of a request that is already known to be bad.
    types = set(map(type, flat))
    if wire == "BYTES":
        if not types <= _STR_TYPES:
            _bad_element(name, wire, "strings", flat, _STR_TYPES)
        out = np.empty(len(flat), dtype=np.object_)
        out[:] = [item.encode("utf-8") for item in flat]
        return out.reshape(shape)
    if wire == "BOOL":
        if not types <= _BOOL_TYPES:
            _bad_element(name, wire, "true or false", flat, _BOOL_TYPES)
    elif wire in _FLOAT_WIRES:
        if not types <= _NUMBER_TYPES:
            _bad_element(name, wire, "numbers", flat, _NUMBER_TYPES)
    elif not types <= _INT_TYPES:
        _bad_element(name, wire, "integers", flat, _INT_TYPES)
    elif flat:
        # Checked here, not left to numpy: numpy 2 raises OverflowError for an
        # integer its type cannot hold, numpy 1.26 (supported) wraps it around.
        lo, hi = _BOUNDS[wire]
        if min(flat) < lo or max(flat) > hi:
            _out_of_range(name, wire, flat)
    try:
        return np.array(flat, dtype=dt.numpy).reshape(shape)
    except OverflowError:
        _out_of_range(name, wire, flat)
        raise  # pragma: no cover - numpy overflowed on an in-range value


def _out_of_range(name: str, wire: str, flat: list) -> None:
    if wire in _FLOAT_WIRES:
        for i, item in enumerate(flat):
            try:
                float(item)
            except OverflowError:
                raise InvalidArgument(
                    f"value out of range for input '{name}': element {i} is {item}, "
                    f"too large for {wire}"
                ) from None
        return
    lo, hi = _BOUNDS[wire]
    for i, item in enumerate(flat):
        if not lo <= item <= hi:
            raise InvalidArgument(
                f"value out of range for input '{name}': element {i} is {item}, "
                f"expected {wire} in [{lo}, {hi}]"
            )


_STR_TYPES = frozenset((str,))
_BOOL_TYPES = frozenset((bool,))
_INT_TYPES = frozenset((int,))
_NUMBER_TYPES = frozenset((int, float))


# Triton's cap on the nesting of an input's JSON 'data' (src/common.h
# HTTP_MAX_JSON_NESTING_DEPTH; src/http_server.cc ReadDataFromJsonHelper and
# JsonBytesArrayByteSize refuse a value at this depth or deeper).
MAX_JSON_DATA_DEPTH = 100


def flatten(data: list) -> list:
    """The elements of nested lists in order; InvalidArgument with Triton's words
    for a value nested ``MAX_JSON_DATA_DEPTH`` levels deep or deeper."""
    if list not in set(map(type, data)):
        return data
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if type(item) is list:
                # ``item`` is len(stack) levels deep, its elements one more.
                if item and len(stack) >= MAX_JSON_DATA_DEPTH - 1:
                    raise InvalidArgument(
                        f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DATA_DEPTH})"
                    )
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _check_count(name: str, shape: list[int], expected: int, got: int) -> None:
    if got != expected:
        raise InvalidArgument(
            f"unexpected number of elements for input '{name}': expected {expected} "
            f"for shape {fmt_shape(shape)}, got {got}"
        )


def _bad_element(name: str, wire: str, expected: str, flat: list, allowed: frozenset) -> None:
    for index, item in enumerate(flat):
        if type(item) not in allowed:
            raise InvalidArgument(
                f"invalid data for input '{name}': {wire} data must be {expected}, "
                f"got {json.dumps(item)} at element {index}"
            )


def json_output(wire: str, data: np.ndarray, name: str | None = None) -> list:
    """An output's elements as JSON values. BYTES elements are text: for an infer
    response (``name`` given) an element that is not UTF-8 is refused, naming the
    output, since JSON cannot carry it (Triton writes such bytes into the JSON
    unescaped, src/http_server.cc WriteDataToJson, which no JSON parser accepts:
    tritonclient raises "Failed to encode using UTF-8. Please use
    binary_data=True"); elsewhere (the generate extension) it is decoded with
    replacement characters."""
    flat = data.reshape(-1)
    if wire == "BYTES":
        if name is None:
            return [
                x.decode("utf-8", errors="replace") if isinstance(x, (bytes, bytearray)) else str(x)
                for x in flat.tolist()
            ]
        values = []
        for index, x in enumerate(flat.tolist()):
            if not isinstance(x, (bytes, bytearray)):
                values.append(str(x))
                continue
            try:
                values.append(x.decode("utf-8"))
            except UnicodeDecodeError:
                raise InvalidArgument(
                    f"output '{name}' holds BYTES that are not UTF-8 text (element {index}), "
                    "which a JSON response cannot carry; request it with binary_data: true"
                ) from None
        return values
    if wire == "BF16":
        if data.dtype.name == "bfloat16":
            return flat.astype(np.float32).tolist()
        # BF16 travels as its uint16 bits: the high half of a float32.
        return (flat.astype(np.uint32) << 16).view(np.float32).tolist()
    if wire == "BOOL" and data.dtype != np.bool_:
        flat = flat.astype(np.bool_)
    return flat.tolist()
