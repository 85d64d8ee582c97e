"""CUDA shared memory regions registered by clients.

Triton's CUDA shared memory extension: a client allocates device memory, exports
it as a CUDA IPC handle (``cudaIpcGetMemHandle``), and registers it by name with
its device id and size. Requests then name the region instead of sending bytes.

The handle is opened lazily, on the first request that touches the region, with
cupy (``cupy.cuda.runtime.ipcOpenMemHandle``). cupy is imported only inside
functions: a host without cupy or a GPU still runs, and registering a region
answers UNAVAILABLE naming what is missing.

Region names share one namespace with system shared memory regions (Triton's
rule), and :class:`SharedMemoryResolver` is the one place a request's region name
is looked up. Simplest correct approach: an input in a CUDA region is copied
device->host into a numpy array, and an output is copied host->device, both
synchronously on the caller's thread, so no request keeps a device pointer after
the call returns and unregistering can close the handle at once.
"""

from __future__ import annotations

import base64
import binascii
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trionserve.core.errors import AlreadyExists, InvalidArgument, Unavailable
from trionserve.core.shared_memory import RegionTable, SystemSharedMemory

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

# sizeof(cudaIpcMemHandle_t)
CUDA_IPC_HANDLE_SIZE = 64

# cudaMemcpyKind
_HOST_TO_DEVICE = 1
_DEVICE_TO_HOST = 2


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    """None when cupy and a CUDA device are usable, else what is missing."""
    try:
        import cupy  # noqa: PLC0415
    except Exception as exc:  # ImportError, or a broken CUDA install
        return f"cupy is not installed or cannot be imported ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device ({exc})"
    if count < 1:
        return "no CUDA device is visible"
    return None


def decode_raw_handle(value: object) -> bytes:
    """The IPC handle bytes from an HTTP register body's ``raw_handle``.

    tritonclient sends ``{"raw_handle": {"b64": "<base64 of the 64-byte handle>"}}``.
    """
    if not isinstance(value, dict) or not isinstance(value.get("b64"), str):
        raise InvalidArgument(
            "'raw_handle' in the CUDA shared memory register request must be "
            '{"b64": "<base64 string>"}'
        )
    try:
        # tritonclient's C++ client (and perf_analyzer) breaks its base64 into
        # lines, as Triton's decoder allows.
        raw = base64.b64decode("".join(value["b64"].split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(
            "'raw_handle.b64' in the CUDA shared memory register request is not valid base64"
        ) from None
    return check_raw_handle(raw)


def check_raw_handle(raw: bytes, name: str = "") -> bytes:
    """An IPC handle of the right size, or Triton's refusal of a handle it cannot
    open (server src/shared_memory_manager.cc OpenCudaIPCRegion: "failed to
    register shared memory region: invalid args", INVALID_ARG), with the reason."""
    if len(raw) != CUDA_IPC_HANDLE_SIZE:
        raise InvalidArgument(
            f"failed to register shared memory region{_named(name)}: invalid args "
            f"(a CUDA IPC handle is {CUDA_IPC_HANDLE_SIZE} bytes, got {len(raw)})"
        )
    return bytes(raw)


def _named(name: str) -> str:
    return f" '{name}'" if name else ""


@dataclass(slots=True)
class CudaRegion:
    name: str
    raw_handle: bytes
    device_id: int
    byte_size: int
    pointer: int | None = field(default=None)

    def status(self) -> dict:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def open(self) -> int:
        if self.pointer is None:
            import cupy  # noqa: PLC0415

            try:
                with cupy.cuda.Device(self.device_id):
                    self.pointer = cupy.cuda.runtime.ipcOpenMemHandle(self.raw_handle)
            except Exception as exc:
                raise InvalidArgument(
                    f"unable to open CUDA IPC handle of shared memory region "
                    f"'{self.name}' on device {self.device_id}: {exc}"
                ) from None
        return self.pointer

    def close(self) -> None:
        if self.pointer is not None:
            import cupy  # noqa: PLC0415

            try:
                with cupy.cuda.Device(self.device_id):
                    cupy.cuda.runtime.ipcCloseMemHandle(self.pointer)
            except Exception:
                pass  # the exporting process may be gone; nothing left to free
            self.pointer = None


class CudaSharedMemory(RegionTable[CudaRegion]):
    """The registered CUDA regions, by name. Used on the Trio thread only.

    ``system`` is the system shared memory registry: a name may be registered in
    one of the two only.
    """

    kind = "CUDA shared memory"

    def __init__(self, system: SystemSharedMemory | None = None) -> None:
        super().__init__()
        self._system = system

    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Checked in Triton's order (server src/shared_memory_manager.cc
        RegisterCUDASharedMemory): a name already registered, then the arguments
        (a handle that cannot be opened is "invalid args"), and only then whether
        this host can open CUDA memory at all (UNAVAILABLE without cupy or a GPU),
        so a client sees what is wrong with its request on any host."""
        if name in self._regions or (
            self._system is not None and name in {r["name"] for r in self._system.status()}
        ):
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        handle = check_raw_handle(raw_handle, name)
        if device_id < 0 or byte_size < 0:
            raise InvalidArgument(
                f"failed to register shared memory region{_named(name)}: invalid args "
                f"(device_id and byte_size must be >= 0, got device_id {device_id}, "
                f"byte_size {byte_size})"
            )
        if not name:
            raise InvalidArgument("a shared memory region needs a name")
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise Unavailable(f"CUDA shared memory is unavailable on this server: {reason}")
        self._regions[name] = CudaRegion(name, handle, device_id, byte_size)

    def check(self, name: str, offset: int, byte_size: int, what: str) -> None:
        """Refuse now a window out of the region's bounds (an output's, before it runs)."""
        self._region(name, offset, byte_size, what)

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """A host copy of ``byte_size`` bytes of a region (device->host)."""
        import cupy  # noqa: PLC0415
        import numpy  # noqa: PLC0415

        region = self._region(name, offset, byte_size, what)
        host = numpy.empty(byte_size, dtype=numpy.uint8)
        if byte_size:
            pointer = region.open()
            with cupy.cuda.Device(region.device_id):
                cupy.cuda.runtime.memcpy(
                    host.ctypes.data, pointer + offset, byte_size, _DEVICE_TO_HOST
                )
        return host.data

    def write(self, name: str, offset: int, byte_size: int, data: Buffer, what: str) -> int:
        """Copy ``data`` host->device into a region window; returns its size."""
        import cupy  # noqa: PLC0415
        import numpy  # noqa: PLC0415

        payload = self._payload(data, byte_size, name, what)
        region = self._region(name, offset, byte_size, what)
        if payload.nbytes:
            host = numpy.frombuffer(payload, dtype=numpy.uint8)
            pointer = region.open()
            with cupy.cuda.Device(region.device_id):
                cupy.cuda.runtime.memcpy(
                    pointer + offset, host.ctypes.data, payload.nbytes, _HOST_TO_DEVICE
                )
                # From pageable memory cudaMemcpy returns once the bytes are staged,
                # before the DMA to the device is done (CUDA's "API synchronization
                # behavior"); the client reads the region as soon as it has the
                # response, so wait for the copy (it went to the default stream).
                cupy.cuda.runtime.streamSynchronize(0)
        return payload.nbytes


class SharedMemoryResolver:
    """The one lookup of a request's ``shared_memory_region``: CUDA or system."""

    def __init__(self, system: SystemSharedMemory, cuda: CudaSharedMemory) -> None:
        self.system = system
        self.cuda = cuda

    def _of(self, name: str) -> SystemSharedMemory | CudaSharedMemory:
        return self.cuda if name in self.cuda else self.system

    def table_of(self, name: str) -> SystemSharedMemory | CudaSharedMemory:
        return self._of(name)

    def check(self, name: str, offset: int, byte_size: int, what: str) -> None:
        self._of(name).check(name, offset, byte_size, what)

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        return self._of(name).view(name, offset, byte_size, what)

    def write(self, name: str, offset: int, byte_size: int, data: Buffer, what: str) -> int:
        return self._of(name).write(name, offset, byte_size, data, what)
