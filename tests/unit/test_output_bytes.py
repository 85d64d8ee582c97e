"""An output tensor's bytes on the wire (core/outputs.py): a view of the tensor
where it is contiguous in its wire type, a copy in that type otherwise."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from trionserve.core.datatypes import WIRE_DTYPE
from trionserve.core.outputs import output_bytes


@pytest.mark.parametrize("wire", sorted(set(WIRE_DTYPE) - {"BF16"}))
def test_a_contiguous_tensor_is_a_byte_view_of_itself(wire):
    # Made as a backend makes them: with numpy's own types, a batch's row.
    data = np.arange(24).reshape(6, 4).astype(WIRE_DTYPE[wire].type)[2:5]
    chunk = output_bytes(wire, data)
    assert isinstance(chunk, memoryview) and chunk.format == "B" and chunk.ndim == 1
    assert bytes(chunk) == data.tobytes() and len(chunk) == data.nbytes
    data[0, 0] = 1  # a view: written, it changes
    assert bytes(chunk) == data.tobytes()


@pytest.mark.parametrize(
    "data",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # strided
        np.arange(12, dtype=np.float32).reshape(3, 4).T,  # Fortran order
        np.arange(6, dtype=">f4"),  # big-endian
        np.arange(6, dtype=np.float64),  # another type than the wire's
    ],
    ids=["strided", "fortran", "big-endian", "float64"],
)
def test_other_tensors_are_copied_row_major_in_the_wire_type(data):
    assert bytes(output_bytes("FP32", data)) == np.ascontiguousarray(data, "<f4").tobytes()


def test_empty_and_bf16_tensors():
    assert output_bytes("FP32", np.zeros((0, 3), np.float32)) == b""
    bf16 = np.arange(4).astype(ml_dtypes.bfloat16)
    assert bytes(output_bytes("BF16", bf16)) == bf16.view(np.uint16).tobytes()


def test_a_backend_made_tensor_takes_no_numpy_call(monkeypatch):
    """The common case (a contiguous row of a batch in the wire type) is a byte
    view made without numpy's array calls, which cost the event loop at c=8."""

    def called(*args, **kwargs):
        raise AssertionError("numpy was asked to make an array")

    batch = np.random.default_rng(0).random((4, 1000), dtype=np.float32)
    monkeypatch.setattr(np, "ascontiguousarray", called)
    chunk = output_bytes("FP32", batch[1:2])
    assert bytes(chunk) == batch[1].tobytes()
