"""trionserve.api.Tensor: Triton's tensor, handed on through DLPack without a copy
and without keeping memory alive longer than its users."""

from __future__ import annotations

import gc
import struct
import sys
import tracemalloc
import weakref

import numpy as np
import pytest

from trionserve import api

try:
    import cupy
except ImportError:
    cupy = None


def test_numpy_from_dlpack_shares_the_owners_memory():
    owner = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor = api.Tensor.from_dlpack(owner)
    assert tensor.data_type == api.DataType.FP32
    assert list(tensor.shape) == [3, 4]
    assert tensor.memory_type == api.MemoryType.CPU and tensor.memory_type_id == 0
    assert tensor.size == owner.nbytes and tensor.data_ptr == owner.ctypes.data
    assert tensor.__dlpack_device__() == (api.DLDeviceType.kDLCPU, 0)
    array = np.from_dlpack(tensor)
    assert array.ctypes.data == owner.ctypes.data
    array[0, 0] = 42.0
    assert owner[0, 0] == 42.0


def test_references_are_the_ones_triton_takes():
    """The tensor holds its owner once; an array made from it holds the tensor
    once; when they are gone the owner is freed (Triton's test_reference_counts)."""
    owner = np.ones(1 << 16)
    owner_ref = weakref.ref(owner)
    assert sys.getrefcount(owner) - 1 == 1
    tensor = api.Tensor.from_dlpack(owner)
    assert sys.getrefcount(owner) - 1 == 2
    del owner
    array = np.from_dlpack(tensor)
    assert sys.getrefcount(tensor) - 1 == 2
    # A changed shape reaches the next export, not the arrays already made.
    tensor.shape = [2, 1 << 15]
    reshaped = np.from_dlpack(tensor)
    assert array.shape == (1 << 16,) and reshaped.shape == (2, 1 << 15)
    del tensor
    assert owner_ref() is not None  # the arrays keep it
    del array, reshaped
    assert owner_ref() is None


def test_repeated_exports_leave_nothing_behind():
    """200 tensors over 8 MiB arrays each, read through DLPack: traced memory grows
    by far less than one array, and no Tensor object is left."""
    gc.collect()
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    for _ in range(200):
        owner = np.ones(1 << 20)  # 8 MiB
        tensor = api.Tensor.from_dlpack(owner)
        array = np.from_dlpack(tensor)
        assert array[-1] == 1.0
        del owner, tensor, array
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    gc.collect()
    assert after - before < 1 << 20
    assert not [o for o in gc.get_objects() if isinstance(o, api.Tensor)]


def test_bytes_tensors_are_serialized_as_tritons():
    tensor = api.Tensor.from_string_array([["hé", "x"], ["", "yz"]])
    assert tensor.data_type == api.DataType.BYTES and list(tensor.shape) == [2, 2]
    raw = bytes(np.from_dlpack(api.Tensor(api.DataType.UINT8, [tensor.size], tensor.memory_buffer)))
    assert raw == b"".join(struct.pack("<I", len(v)) + v for v in (b"h\xc3\xa9", b"x", b"", b"yz"))
    assert tensor.to_string_array().tolist() == [["hé", "x"], ["", "yz"]]
    assert tensor.to_bytes_array().tolist() == [[b"h\xc3\xa9", b"x"], [b"", b"yz"]]
    nul = api.Tensor.from_bytes_array(np.array([b"a\x00b"], dtype=object))
    assert nul.to_bytes_array().tolist() == [b"a\x00b"]


def test_bytes_tensor_is_not_exported_through_dlpack():
    tensor = api.Tensor.from_string_array(["x"])
    with pytest.raises(api.InvalidArgumentError, match="to_bytes_array"):
        np.from_dlpack(tensor)
    with pytest.raises(api.InvalidArgumentError, match="not BYTES"):
        api.Tensor.from_dlpack(np.zeros(2)).to_bytes_array()
    with pytest.raises(api.InvalidArgumentError, match="BYTES"):
        api.Tensor.from_bytes_array(np.zeros(2))


def test_what_cannot_become_a_tensor_is_refused():
    with pytest.raises(api.InvalidArgumentError, match="contiguous"):
        api.Tensor.from_dlpack(np.zeros((4, 4))[:, ::2])
    with pytest.raises(api.InvalidArgumentError, match="DLPack"):
        api.Tensor.from_dlpack(object())
    with pytest.raises(api.InvalidArgumentError, match="not supported"):
        api.Tensor._from_object({"a": 1})


def test_devices_are_parsed_as_tritons():
    tensor = api.Tensor.from_dlpack(np.zeros(3, np.int32))
    assert tensor.to_device("cpu") is tensor
    assert tensor.to_device(api.MemoryType.CPU_PINNED) is tensor
    assert tensor.to_device((api.DLDeviceType.kDLCPU, 0)) is tensor
    assert tensor.to_host() is tensor
    with pytest.raises(api.InvalidArgumentError, match="unsupported"):
        tensor.to_device("unsupported")


@pytest.mark.skipif(cupy is not None, reason="checks the error when cupy is absent")
def test_gpu_memory_without_cupy_says_so():
    tensor = api.Tensor.from_dlpack(np.zeros(3, np.int32))
    with pytest.raises(api.UnsupportedError, match="cupy"):
        tensor.to_device("gpu:0")


def test_torch_reads_and_gives_tensors_without_a_copy():
    torch = pytest.importorskip("torch")
    owner = np.arange(6, dtype=np.int64)
    from_torch = torch.from_dlpack(api.Tensor.from_dlpack(owner))
    assert from_torch.data_ptr() == owner.ctypes.data
    source = torch.arange(4, dtype=torch.float32)
    tensor = api.Tensor.from_dlpack(source)
    assert tensor.data_type == api.DataType.FP32 and tensor.data_ptr == source.data_ptr()
    assert tensor.memory_buffer.owner is source
    np.testing.assert_array_equal(np.from_dlpack(tensor), [0, 1, 2, 3])
