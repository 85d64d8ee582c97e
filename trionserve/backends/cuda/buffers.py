"""Device buffers and CUDA streams through cupy, or torch when cupy is missing.

Backends that drive CUDA themselves (TensorRT) need device memory they can hand to
the framework as a raw address, a stream handle, copies to and from numpy, and CUDA
graphs captured from the work put on a stream. cupy is preferred: it copies from
read-only host memory (a request body) directly. Both libraries are imported
lazily, on first use.
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

    def upload(self, buffer, array: np.ndarray, stream) -> None:
        """Copy ``array`` into ``buffer`` (a device buffer of its shape, or a view
        of one: its leading rows), enqueued on ``stream``."""
        buffer.set(array, stream=stream)

    def to_host(self, buffer, stream) -> np.ndarray:
        """The buffer's contents once ``stream`` has produced them."""
        return buffer.get(stream=stream)

    def synchronize(self, stream) -> None:
        stream.synchronize()

    def capture(self, stream, enqueue):
        """A CUDA graph of the work ``enqueue()`` puts on ``stream``, captured in
        thread-local mode (other threads' CUDA calls neither fail nor break it);
        raises when the capture fails, with the stream out of capture mode."""
        runtime = self._cp.cuda.runtime
        stream.begin_capture(mode=getattr(runtime, "streamCaptureModeThreadLocal", 1))
        try:
            enqueue()
        except BaseException:
            try:
                stream.end_capture()  # ends an invalidated capture too, with an error
            except Exception:
                pass
            raise
        return stream.end_capture()

    def launch(self, graph, stream) -> None:
        graph.launch(stream=stream)


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

    def upload(self, tensor, array: np.ndarray, stream) -> None:
        torch = self._torch
        if not array.flags.writeable:
            array = array.copy()
        with torch.cuda.stream(stream):
            tensor.copy_(torch.from_numpy(array), non_blocking=True)

    def to_host(self, tensor, stream) -> np.ndarray:
        stream.synchronize()
        return tensor.cpu().numpy()

    def synchronize(self, stream) -> None:
        stream.synchronize()

    def capture(self, stream, enqueue):
        graph = self._torch.cuda.CUDAGraph()
        with self._torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            enqueue()
        return graph

    def launch(self, graph, stream) -> None:
        with self._torch.cuda.stream(stream):
            graph.replay()


def device_buffers() -> CupyBuffers | TorchBuffers:
    """cupy's buffers when cupy is installed, else torch's."""
    try:
        import cupy
    except ImportError:
        import torch

        return TorchBuffers(torch)
    return CupyBuffers(cupy)
