"""``triton_python_backend_utils.Tensor``: python_backend's ``PbTensor``.

A named tensor as a model sees it: a numpy array in CPU memory, or a DLPack object
on a GPU (``from_dlpack``, ``to_dlpack``, ``__dlpack__``), with Triton's data type
kept as it arrived (BF16, BYTES). Part of the module model.py imports as
``triton_python_backend_utils``, which re-exports ``Tensor``; it holds no runtime
and no state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from triton_python_backend_dtypes import (
    CODE_TO_WIRE,
    NUMPY_TO_CODE,
    WIRE_TO_CODE,
    numpy_to_triton_type,
)
from triton_python_backend_errors import TritonModelException, as_text

if TYPE_CHECKING:
    from typing import Self

    from numpy.typing import ArrayLike
    from typing_extensions import CapsuleType


class Tensor:
    """A named tensor: a numpy array in CPU memory, or a DLPack object on a GPU."""

    _name: str
    _datatype: str  # the wire name: FP32, BYTES, BF16, ...
    _array: np.ndarray | None  # None: on a device
    # What holds a device tensor's memory: a DLPack producer (torch, cupy, ...).
    _device_object: Any

    def __init__(self, name: str | bytes, numpy_array: ArrayLike, *_legacy: object) -> None:
        name = name if type(name) is str else as_text(name, "Tensor name")
        if numpy_array is None:
            raise TypeError("Tensor() takes a numpy array, not None")
        array = numpy_array if type(numpy_array) is np.ndarray else np.asarray(numpy_array)
        code = NUMPY_TO_CODE.get(array.dtype)
        if code is not None and code != 13:  # the common case: a numeric array
            self._name = name
            self._array = array
            self._device_object = None
            self._datatype = CODE_TO_WIRE[code]
            return
        if array.dtype.kind in ("U", "S"):
            # Triton asks for np.object_; bytes and str elements mean the same here.
            array = array.astype(np.object_)
        if array.dtype.kind == "V":
            raise TritonModelException(
                "Tensor dtype used for numpy_array is not supported by Python "
                "backend. Please use np.object_ instead."
            )
        code = numpy_to_triton_type(array.dtype)
        if code is None:
            raise TritonModelException(f"numpy dtype {array.dtype} has no Triton data type")
        self._name = name
        self._array = array
        self._device_object = None
        self._datatype = CODE_TO_WIRE[code]

    @classmethod
    def _wrap(cls, name: str, datatype: str, array: np.ndarray | None) -> Self:
        """A tensor that keeps the wire datatype it arrived with (BF16, BYTES)."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array
        tensor._device_object = None
        tensor._datatype = datatype
        return tensor

    def name(self) -> str:
        return self._name

    def triton_dtype(self) -> int:
        return WIRE_TO_CODE[self._datatype]

    def shape(self) -> list[int]:
        source = self._array if self._array is not None else self._device_object
        return [int(d) for d in source.shape]

    def is_cpu(self) -> bool:
        return self._device_object is None

    def as_numpy(self) -> np.ndarray:
        if self._array is None:
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")
        return self._array

    def to_dlpack(self) -> object:
        return self.__dlpack__()

    def __dlpack__(self, stream: object = None) -> object:
        if self._device_object is not None:
            if stream is None:
                return self._device_object.__dlpack__()
            return self._device_object.__dlpack__(stream=stream)
        assert self._array is not None  # in CPU memory
        if self._array.dtype == np.object_:
            raise TritonModelException("BYTES tensors cannot be exported with DLPack")
        return self._array.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        if self._device_object is not None:
            return self._device_object.__dlpack_device__()
        return (1, 0)  # kDLCPU

    @staticmethod
    def from_dlpack(name: str, dlpack_object: Any) -> Tensor:
        """A tensor from a DLPack capsule or an object with ``__dlpack__``."""
        # pb_tensor.cc PbTensor::FromDLPack's checks and words.
        if name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")
        if dlpack_object is None:
            raise TritonModelException(
                "Provided tensor is not supported. Tensor must be a DLPack capsule or "
                "have `__dlpack__` and `__dlpack_device__` attributes"
            )
        source = dlpack_object
        if not hasattr(source, "__dlpack__"):
            try:  # a capsule of CPU memory: numpy takes it without copying
                array = np.from_dlpack(_CpuCapsule(source))
                return Tensor._wrap(name, CODE_TO_WIRE[numpy_to_triton_type(array.dtype)], array)
            except (BufferError, RuntimeError, TypeError):
                source = _device_capsule_owner(source)
        device_type = source.__dlpack_device__()[0]
        if device_type in (1, 3):  # kDLCPU, kDLCUDAHost
            array = np.from_dlpack(source)
            return Tensor._wrap(name, CODE_TO_WIRE[numpy_to_triton_type(array.dtype)], array)
        tensor = Tensor._wrap(name, _device_datatype(source), None)
        tensor._device_object = source
        return tensor

    def _host_array(self) -> np.ndarray:
        """The data in CPU memory, for sending to the server."""
        if self._array is not None:
            return self._array
        source = self._device_object
        if hasattr(source, "cpu"):  # torch
            return source.cpu().numpy()
        if hasattr(source, "get"):  # cupy
            return source.get()
        return np.from_dlpack(source, device="cpu", copy=True)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self._datatype}, shape={self.shape()})"


class _CpuCapsule:
    """A raw DLPack capsule presented to numpy as CPU memory (numpy checks it)."""

    def __init__(self, capsule: CapsuleType) -> None:
        self._capsule = capsule

    def __dlpack__(self, *, stream: None = None, **_: object) -> CapsuleType:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def _device_capsule_owner(capsule: object) -> Any:
    """A raw DLPack capsule of device memory, imported through torch."""
    try:
        import torch.utils.dlpack
    except ImportError:
        raise TritonModelException(
            "a DLPack capsule of GPU memory needs torch to be imported"
        ) from None
    return torch.utils.dlpack.from_dlpack(capsule)


def _device_datatype(source: object) -> str:
    dtype = getattr(source, "dtype", None)
    name = str(dtype).replace("torch.", "")
    if name == "bfloat16":
        return "BF16"
    code = numpy_to_triton_type(np.dtype(name)) if name else None
    if code is None:
        raise TritonModelException(f"unsupported DLPack tensor dtype {dtype}")
    return CODE_TO_WIRE[code]
