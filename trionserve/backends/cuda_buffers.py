"""Device buffers and CUDA streams through cupy, or torch when cupy is missing.

Backends that drive CUDA themselves (TensorRT) need device memory they can hand to
the framework as a raw address, a stream handle, and copies to and from numpy.
cupy is preferred: it copies from read-only host memory (a request body) directly.
Both libraries are imported lazily, on first use.
"""

from __future__ import annotations

import numpy as np


class CupyBuffers:
    def __init__(self, cupy) -> None:
        self._cp = cupy

    def device(self, index: int):
        """Context manager making GPU ``index`` current in this thread."""
        return self._cp.cuda.Device(index)

    def stream(self):
        """A new stream and its raw handle."""
        stream = self._cp.cuda.Stream(non_blocking=True)
        return stream, stream.ptr

    def to_device(self, array: np.ndarray, stream):
        """A device copy of ``array`` (enqueued on ``stream``) and its address."""
        buffer = self._cp.empty(array.shape, array.dtype)
        buffer.set(array, stream=stream)
        return buffer, buffer.data.ptr

    def empty(self, shape, dtype):
        buffer = self._cp.empty(tuple(shape), dtype)
        return buffer, buffer.data.ptr

    def to_host(self, buffer, stream) -> np.ndarray:
        """The buffer's contents once ``stream`` has produced them."""
        return buffer.get(stream=stream)

    def synchronize(self, stream) -> None:
        stream.synchronize()


class TorchBuffers:
    def __init__(self, torch) -> None:
        self._torch = torch

    def device(self, index: int):
        return self._torch.cuda.device(index)

    def stream(self):
        stream = self._torch.cuda.Stream()
        return stream, stream.cuda_stream

    def to_device(self, array: np.ndarray, stream):
        torch = self._torch
        if not array.flags.writeable:
            # torch cannot wrap read-only memory; this host copy is the price of
            # the torch fallback (cupy copies straight from the request body).
            array = array.copy()
        with torch.cuda.stream(stream):
            tensor = torch.from_numpy(array).to("cuda", non_blocking=True)
        return tensor, tensor.data_ptr()

    def empty(self, shape, dtype):
        torch = self._torch
        torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        tensor = torch.empty(tuple(shape), dtype=torch_dtype, device="cuda")
        return tensor, tensor.data_ptr()

    def to_host(self, tensor, stream) -> np.ndarray:
        stream.synchronize()
        return tensor.cpu().numpy()

    def synchronize(self, stream) -> None:
        stream.synchronize()


def device_buffers() -> CupyBuffers | TorchBuffers:
    """cupy's buffers when cupy is installed, else torch's."""
    try:
        import cupy
    except ImportError:
        import torch

        return TorchBuffers(torch)
    return CupyBuffers(cupy)
