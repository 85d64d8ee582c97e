"""Device buffers and CUDA streams through cupy, or torch when cupy is missing.

Backends that drive CUDA themselves (TensorRT) need device memory they can hand to
the framework as a raw address, a stream handle, copies to and from numpy, and CUDA
graphs captured from the work put on a stream. cupy is preferred: it copies from
read-only host memory (a request body) directly. Both libraries are imported
lazily, on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import cupy
    import torch

    # The device side, by library (cupy's, or torch's without cupy).
    DeviceArray: TypeAlias = cupy.ndarray | torch.Tensor
    Stream: TypeAlias = cupy.cuda.Stream | torch.cuda.Stream
    Graph: TypeAlias = cupy.cuda.Graph | torch.cuda.CUDAGraph


class DeviceBuffers(Protocol):
    """What a backend that drives CUDA itself asks of the library: cupy's buffers
    or torch's, interchangeable. Addresses are raw device pointers."""

    def device(self, index: int) -> AbstractContextManager[object]: ...
    def stream(self) -> tuple[Stream, int]: ...
    def to_device(self, array: np.ndarray, stream: Stream) -> tuple[DeviceArray, int]: ...
    def empty(self, shape: Sequence[int], dtype: np.dtype) -> tuple[DeviceArray, int]: ...
    def upload(self, buffer: DeviceArray, array: np.ndarray, stream: Stream) -> None: ...
    def to_host(self, buffer: DeviceArray, stream: Stream) -> np.ndarray: ...
    def synchronize(self, stream: Stream) -> None: ...
    def capture(self, stream: Stream, enqueue: Callable[[], object]) -> Graph: ...
    def launch(self, graph: Graph, stream: Stream) -> None: ...


# cupy's own objects, which cupy does not type (Any): with torch installed, mypy
# would read the unions above as torch's where cupy's are meant.
CupyArray: TypeAlias = Any
CupyStream: TypeAlias = Any
CupyGraph: TypeAlias = Any


class CupyBuffers:
    def __init__(self, cupy: ModuleType) -> None:
        self._cp = cupy

    def device(self, index: int) -> AbstractContextManager[object]:
        """Context manager making GPU ``index`` current in this thread."""
        return self._cp.cuda.Device(index)

    def stream(self) -> tuple[Stream, int]:
        """A new stream and its raw handle."""
        stream = self._cp.cuda.Stream(non_blocking=True)
        return stream, stream.ptr

    def to_device(self, array: np.ndarray, stream: CupyStream) -> tuple[DeviceArray, int]:
        """A device copy of ``array`` (enqueued on ``stream``) and its address."""
        buffer = self._cp.empty(array.shape, array.dtype)
        buffer.set(array, stream=stream)
        return buffer, buffer.data.ptr

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> tuple[DeviceArray, int]:
        buffer = self._cp.empty(tuple(shape), dtype)
        return buffer, buffer.data.ptr

    def upload(self, buffer: CupyArray, array: np.ndarray, stream: CupyStream) -> None:
        """Copy ``array`` into ``buffer`` (a device buffer of its shape, or a view
        of one: its leading rows), enqueued on ``stream``."""
        buffer.set(array, stream=stream)

    def to_host(self, buffer: CupyArray, stream: CupyStream) -> np.ndarray:
        """The buffer's contents once ``stream`` has produced them."""
        return buffer.get(stream=stream)

    def synchronize(self, stream: CupyStream) -> None:
        stream.synchronize()

    def capture(self, stream: CupyStream, enqueue: Callable[[], object]) -> Graph:
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

    def launch(self, graph: CupyGraph, stream: CupyStream) -> None:
        graph.launch(stream=stream)


class TorchBuffers:
    def __init__(self, torch: ModuleType) -> None:
        self._torch = torch

    def device(self, index: int) -> AbstractContextManager[object]:
        return self._torch.cuda.device(index)

    def stream(self) -> tuple[Stream, int]:
        stream = self._torch.cuda.Stream()
        return stream, stream.cuda_stream

    def to_device(self, array: np.ndarray, stream: Stream) -> tuple[DeviceArray, int]:
        torch = self._torch
        if not array.flags.writeable:
            # torch cannot wrap read-only memory; this host copy is the price of
            # the torch fallback (cupy copies straight from the request body).
            array = array.copy()
        with torch.cuda.stream(stream):
            tensor = torch.from_numpy(array).to("cuda", non_blocking=True)
        return tensor, tensor.data_ptr()

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> tuple[DeviceArray, int]:
        torch = self._torch
        torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        tensor = torch.empty(tuple(shape), dtype=torch_dtype, device="cuda")
        return tensor, tensor.data_ptr()

    def upload(self, tensor: DeviceArray, array: np.ndarray, stream: Stream) -> None:
        torch = self._torch
        if not array.flags.writeable:
            array = array.copy()
        with torch.cuda.stream(stream):
            tensor.copy_(torch.from_numpy(array), non_blocking=True)

    def to_host(self, tensor: DeviceArray, stream: Stream) -> np.ndarray:
        stream.synchronize()
        return tensor.cpu().numpy()

    def synchronize(self, stream: Stream) -> None:
        stream.synchronize()

    def capture(self, stream: Stream, enqueue: Callable[[], object]) -> Graph:
        graph = self._torch.cuda.CUDAGraph()
        with self._torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            enqueue()
        return graph

    def launch(self, graph: Graph, stream: Stream) -> None:
        with self._torch.cuda.stream(stream):
            graph.replay()


def device_buffers() -> DeviceBuffers:
    """cupy's buffers when cupy is installed, else torch's."""
    try:
        import cupy
    except ImportError:
        import torch

        return TorchBuffers(torch)
    return CupyBuffers(cupy)
