"""Triton's ``tritonserver.Tensor`` and ``MemoryBuffer``: a data type, a shape and
memory someone else owns, handed on through DLPack without a copy.

As in Triton (core ``python/tritonserver/_api/_tensor.py``, ``_memorybuffer.py``):
a tensor holds a reference to the owner of its memory, never the memory itself;
``numpy.from_dlpack(tensor)`` (or torch's, or cupy's) gives an array over that same
memory that keeps the tensor alive; a BYTES tensor is held serialized, each element
as a 4-byte length and its bytes. Exporting goes through the array libraries' own
DLPack producers (numpy for host memory, cupy for device memory, imported only when
a GPU tensor is met), so no DLPack structure is written by hand here.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from trionserve.core import errors


class DataType(enum.IntEnum):
    """TRITONSERVER_DataType, with Triton's values."""

    INVALID = 0
    BOOL = 1
    UINT8 = 2
    UINT16 = 3
    UINT32 = 4
    UINT64 = 5
    INT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    FP16 = 10
    FP32 = 11
    FP64 = 12
    BYTES = 13
    BF16 = 14


class MemoryType(enum.IntEnum):
    """TRITONSERVER_MemoryType, with Triton's values."""

    CPU = 0
    CPU_PINNED = 1
    GPU = 2


class DLDeviceType(enum.IntEnum):
    """DLPack's device types (dlpack.h), under Triton's names."""

    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14
    kDLWebGPU = 15
    kDLHexagon = 16


# DataType -> numpy dtype of one element (BF16: its bits, as the core holds them).
_NUMPY = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.FP16: np.dtype(np.float16),
    DataType.FP32: np.dtype(np.float32),
    DataType.FP64: np.dtype(np.float64),
    DataType.BF16: np.dtype(np.uint16),
}
_FROM_NUMPY = {
    dtype: data_type for data_type, dtype in _NUMPY.items() if data_type != DataType.BF16
}
_STRINGS = {"CPU": MemoryType.CPU, "CPU_PINNED": MemoryType.CPU_PINNED, "GPU": MemoryType.GPU}
_DEVICE_TO_MEMORY = {DLDeviceType.kDLCPU: MemoryType.CPU, DLDeviceType.kDLCUDA: MemoryType.GPU}

DeviceOrMemoryType = tuple[MemoryType, int] | MemoryType | tuple[DLDeviceType, int] | str


def parse_device_or_memory_type(device: Any) -> tuple[MemoryType, int]:
    """``"cpu"``, ``"gpu:1"``, a MemoryType, ``(MemoryType, id)`` or
    ``(DLDeviceType, id)`` as (memory type, memory type id); InvalidArgumentError
    for anything else (Triton's ``_datautils.parse_device_or_memory_type``)."""
    if isinstance(device, MemoryType):
        return device, 0
    if isinstance(device, tuple) and len(device) == 2 and isinstance(device[1], int):
        kind, device_id = device
        if isinstance(kind, MemoryType):
            return kind, device_id
        if isinstance(kind, DLDeviceType) and kind in _DEVICE_TO_MEMORY:
            return _DEVICE_TO_MEMORY[kind], device_id
    if isinstance(device, str):
        kind_name, _, device_id_text = device.partition(":")
        kind = _STRINGS.get(kind_name.upper())
        if kind is not None and (not device_id_text or device_id_text.isdigit()):
            return kind, int(device_id_text or 0)
    raise errors.InvalidArgument(
        f"Invalid memory type {device!r}: expected 'cpu', 'cpu_pinned', 'gpu[:<id>]', "
        "a MemoryType or a (MemoryType, id) pair"
    )


def _cupy() -> ModuleType:
    """cupy, imported when a GPU tensor is first met; UnsupportedError without it."""
    try:
        import cupy
    except ImportError:
        raise errors.Unimplemented(
            "GPU memory needs cupy, which is not installed (the cuda12 or cuda13 extra: "
            "cupy-cuda12x or cupy-cuda13x)"
        ) from None
    return cupy


@dataclass
class MemoryBuffer:
    """Memory a tensor's data lies in; ``owner`` keeps it allocated (Triton's
    ``MemoryBuffer``: this object never frees it)."""

    data_ptr: int
    memory_type: MemoryType
    memory_type_id: int
    size: int
    owner: Any

    @staticmethod
    def from_dlpack(owner: Any) -> MemoryBuffer:
        """The memory of ``owner`` (an object with ``__dlpack__``), which it keeps."""
        if not hasattr(owner, "__dlpack__"):
            raise errors.InvalidArgument("Object does not support DLpack protocol")
        return _described(owner)[2]


@dataclass
class Tensor:
    """A tensor as Triton's ``tritonserver.Tensor``: ``data_type``, ``shape`` and
    the ``memory_buffer`` its data lies in. Inputs may be given as tensors;
    outputs come back as tensors: read them with ``numpy.from_dlpack(tensor)``
    (no copy), ``to_bytes_array()`` / ``to_string_array()`` for BYTES, or
    ``cupy.from_dlpack`` / ``torch.from_dlpack``."""

    data_type: DataType
    shape: Sequence[int]
    memory_buffer: MemoryBuffer

    @property
    def data_ptr(self) -> int:
        return self.memory_buffer.data_ptr

    @property
    def memory_type(self) -> MemoryType:
        return self.memory_buffer.memory_type

    @property
    def memory_type_id(self) -> int:
        return self.memory_buffer.memory_type_id

    @property
    def size(self) -> int:
        """The size of the data in bytes."""
        return self.memory_buffer.size

    # -- DLPack ----------------------------------------------------------------

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        """A DLPack capsule over this tensor's memory (no copy); the array made
        from it keeps this tensor, and so its memory's owner, alive."""
        return self._view(stream).__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        if self.memory_type == MemoryType.GPU:
            return DLDeviceType.kDLCUDA, self.memory_type_id
        return DLDeviceType.kDLCPU, self.memory_type_id

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """``numpy.asarray(tensor)``: a host array over the same memory (a copy for
        device memory; BYTES as an object array of ``bytes``)."""
        if self.data_type == DataType.BYTES:
            array = self.to_bytes_array()
        elif self.memory_type == MemoryType.GPU:
            array = _cupy().asnumpy(self._view(None))
        else:
            array = self._view(None)
        if dtype is not None and array.dtype != dtype:
            return array.astype(dtype)
        return array.copy() if copy else array

    def _view(self, stream: Any) -> Any:
        """An array of the tensor's type and shape over its memory, holding a
        reference to the tensor (numpy for host memory, cupy for device)."""
        dtype = _NUMPY.get(self.data_type)
        if dtype is None:  # BYTES: DLPack has no such type (Triton refuses it too)
            raise errors.InvalidArgument(
                f"a {self.data_type.name} tensor cannot be exported through DLPack; "
                "read it with to_bytes_array() or to_string_array()"
            )
        if self.data_type == DataType.BF16:
            raise errors.Unimplemented(
                "BF16 tensors cannot be exported through DLPack by this server (numpy has "
                "no bfloat16); read the bits with numpy.asarray(tensor)"
            )
        # From a list: tuple() of a generator over-allocates and shrinks, which
        # leaves one spare tuple on the interpreter's free list per export.
        shape = tuple([int(d) for d in self.shape])
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > self.size:
            raise errors.InvalidArgument(
                f"tensor shape {list(shape)} of {self.data_type.name} needs "
                f"{count * dtype.itemsize} bytes, its memory buffer has {self.size}"
            )
        if self.memory_type == MemoryType.GPU:
            if stream not in (None, 0, 1, 2) and not isinstance(stream, int):
                raise errors.Unimplemented(f"DLPack stream {stream!r} not supported")
            cupy = _cupy()
            memory = cupy.cuda.UnownedMemory(self.data_ptr, self.size, self, self.memory_type_id)
            with cupy.cuda.Device(self.memory_type_id):
                return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))
        if stream not in (None, 0):  # host memory has no stream (DLPack's rule)
            raise errors.Unimplemented(
                f"DLPack stream synchronization on memory type {self.memory_type.name} "
                f"and stream {stream!r} not supported"
            )
        return np.asarray(_HostMemory(self, dtype, shape))

    # -- BYTES -----------------------------------------------------------------

    def to_bytes_array(self) -> np.ndarray:
        """A BYTES tensor as a numpy object array of ``bytes`` (copied to the host
        first if it is not there)."""
        if self.data_type != DataType.BYTES:
            raise errors.InvalidArgument(
                f"Tensor has data type {self.data_type.name} not {DataType.BYTES.name}"
            )
        raw = self._raw_host_bytes()
        elements = np.empty(len(_offsets := _element_spans(raw)), dtype=object)
        for index, (start, end) in enumerate(_offsets):
            elements[index] = bytes(raw[start:end])
        return elements.reshape(tuple(self.shape))

    def to_string_array(self) -> np.ndarray:
        """A BYTES tensor as a numpy array of ``str``, each element decoded as
        UTF-8 (Triton's ``astype(str)`` takes ASCII only)."""
        elements = self.to_bytes_array()
        decoded = [item.decode("utf-8", errors="replace") for item in elements.reshape(-1)]
        return np.array(decoded, dtype=str).reshape(elements.shape)

    def _raw_host_bytes(self) -> memoryview:
        raw = Tensor(DataType.UINT8, [self.size], self.memory_buffer)
        if self.memory_type == MemoryType.GPU:
            return memoryview(_cupy().asnumpy(raw._view(None)))
        return memoryview(raw._view(None))

    @staticmethod
    def from_string_array(string_array: Sequence[str] | np.ndarray) -> Tensor:
        return Tensor.from_bytes_array(string_array)

    @staticmethod
    def from_bytes_array(bytes_array: Sequence[str | bytes] | np.ndarray) -> Tensor:
        """A BYTES tensor from a list or array of ``str`` / ``bytes`` (serialized
        into new host memory)."""
        tensor = Tensor._from_object(bytes_array)
        if tensor.data_type != DataType.BYTES:
            raise errors.InvalidArgument(
                f"Unsupported conversion from {bytes_array!r} to Triton BYTES Tensor. "
                f"Got {tensor.data_type.name}"
            )
        return tensor

    # -- construction ------------------------------------------------------------

    @staticmethod
    def from_dlpack(obj: Any) -> Tensor:
        """A tensor over the memory of ``obj`` (numpy, torch, cupy, ... anything
        with ``__dlpack__``), without a copy; it keeps ``obj`` alive."""
        data_type, shape, buffer = _described(obj)
        return Tensor(data_type, shape, buffer)

    @staticmethod
    def _from_object(obj: Any) -> Tensor:
        """A tensor from a Tensor, a numpy array or scalar (str / bytes / object
        arrays serialized as BYTES), a list, or an object with ``__dlpack__``."""
        if isinstance(obj, Tensor):
            return obj
        if isinstance(obj, (np.ndarray, np.generic)):
            return _from_numpy(np.asarray(obj))
        if isinstance(obj, (list, tuple)):
            try:
                array = np.array(obj)
            except (TypeError, ValueError) as exc:
                raise errors.InvalidArgument(
                    f"Conversion from {obj!r} to tensor not supported: {exc}"
                ) from None
            return _from_numpy(array)
        if hasattr(obj, "__dlpack__"):
            return Tensor.from_dlpack(obj)
        raise errors.InvalidArgument(
            f"Input type {type(obj).__name__} not supported. Must be a Tensor, numpy "
            "array, list, or a type that supports __dlpack__"
        )

    # -- devices -----------------------------------------------------------------

    def to_host(self) -> Tensor:
        return self.to_device("cpu")

    def to_device(self, device: DeviceOrMemoryType) -> Tensor:
        """This tensor in ``device``'s memory: itself if it is there already (host
        memory counts as pinned host memory), else a copy (through cupy)."""
        memory_type, memory_type_id = parse_device_or_memory_type(device)
        here = self.memory_type
        if memory_type == MemoryType.CPU_PINNED:
            memory_type = MemoryType.CPU  # no pinned pool here: host memory it is
        if here in (MemoryType.CPU, MemoryType.CPU_PINNED) and memory_type == MemoryType.CPU:
            return self
        if here == memory_type and self.memory_type_id == memory_type_id:
            return self
        cupy = _cupy()
        raw = Tensor(DataType.UINT8, [self.size], self.memory_buffer)._view(None)
        if memory_type == MemoryType.CPU:
            moved = Tensor.from_dlpack(cupy.asnumpy(raw))
        else:
            with cupy.cuda.Device(memory_type_id):
                moved = Tensor.from_dlpack(cupy.asarray(raw))
        return Tensor(self.data_type, list(self.shape), moved.memory_buffer)


class _HostMemory:
    """What numpy makes a host array of: a tensor's memory, typed and shaped. The
    array keeps this object, and this object the tensor."""

    __slots__ = ("__array_interface__", "_tensor")

    def __init__(self, tensor: Tensor, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self._tensor = tensor
        readonly = getattr(tensor.memory_buffer.owner, "flags", None)
        readonly = readonly is not None and not getattr(readonly, "writeable", True)
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": dtype.str,
            "data": (tensor.data_ptr, readonly),
        }


def _element_spans(raw: memoryview) -> list[tuple[int, int]]:
    """(start, end) of each element of a serialized BYTES tensor."""
    spans = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise errors.InvalidArgument("malformed BYTES tensor: a length is cut short")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise errors.InvalidArgument("malformed BYTES tensor: an element is cut short")
        spans.append((offset, offset + length))
        offset += length
    return spans


def serialize_bytes(elements: np.ndarray) -> np.ndarray:
    """Triton's BYTES serialization of an array of str / bytes: each element as its
    little-endian 4-byte length and its bytes (UTF-8 for str)."""
    parts = []
    for item in elements.reshape(-1).tolist():
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray, memoryview)):
            item = str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(item)))
        parts.append(bytes(item))
    return np.frombuffer(b"".join(parts), dtype=np.uint8).copy()


def _from_numpy(array: np.ndarray) -> Tensor:
    """A tensor over a numpy array's memory (BYTES: serialized into new memory)."""
    if array.dtype.kind in ("S", "U", "O"):
        serialized = serialize_bytes(array)
        buffer = MemoryBuffer(
            serialized.ctypes.data, MemoryType.CPU, 0, serialized.nbytes, serialized
        )
        return Tensor(DataType.BYTES, list(array.shape), buffer)
    if not array.flags.c_contiguous or not array.dtype.isnative:
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    data_type = _FROM_NUMPY.get(array.dtype)
    if data_type is None:
        raise errors.InvalidArgument(f"numpy dtype {array.dtype} has no Triton data type")
    buffer = MemoryBuffer(array.ctypes.data, MemoryType.CPU, 0, array.nbytes, array)
    return Tensor(data_type, list(array.shape), buffer)


# DLPack (type code, bits) -> DataType (dlpack.h kDLInt 0, kDLUInt 1, kDLFloat 2,
# kDLBfloat 4, kDLBool 6).
def _described(obj: Any) -> tuple[DataType, list[int], MemoryBuffer]:
    """Data type, shape and memory of an object with ``__dlpack__``; the memory
    buffer's owner is ``obj`` itself."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise errors.InvalidArgument("Only contiguous memory is supported")
        data_type = _FROM_NUMPY.get(obj.dtype)
        if data_type is None or not obj.dtype.isnative:
            raise errors.InvalidArgument(
                f"numpy dtype {obj.dtype} has no Triton data type through DLPack"
            )
        buffer = MemoryBuffer(obj.ctypes.data, MemoryType.CPU, 0, obj.nbytes, obj)
        return data_type, list(obj.shape), buffer
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise errors.InvalidArgument(
            f"{type(obj).__name__} does not support the DLPack protocol "
            "(__dlpack__ and __dlpack_device__)"
        )
    device_type, device_id = obj.__dlpack_device__()
    if int(device_type) in (DLDeviceType.kDLCPU, DLDeviceType.kDLCUDAHost):
        try:
            view = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"cannot read it through DLPack: {exc}") from None
        memory_type = MemoryType.CPU
        data_ptr = view.ctypes.data
    elif int(device_type) == DLDeviceType.kDLCUDA:
        view = _cupy().from_dlpack(obj)
        memory_type = MemoryType.GPU
        data_ptr = view.data.ptr
    else:
        raise errors.Unimplemented(
            f"DLPack device type {device_type} is not supported (host or CUDA memory only)"
        )
    if not view.flags.c_contiguous:
        raise errors.InvalidArgument("Only contiguous memory is supported")
    data_type = _FROM_NUMPY.get(np.dtype(view.dtype))
    if data_type is None:
        raise errors.InvalidArgument(f"data type {view.dtype} has no Triton data type")
    buffer = MemoryBuffer(int(data_ptr), memory_type, int(device_id), int(view.nbytes), obj)
    return data_type, list(view.shape), buffer
