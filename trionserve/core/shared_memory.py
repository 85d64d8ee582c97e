"""System (POSIX) shared memory regions registered by clients.

Triton's system shared memory extension (the server's ``SharedMemoryManager``,
src/shared_memory_manager.cc): a client creates a POSIX shared memory
object (``shm_open`` key), registers a region of it by name with an offset and a
size, then names the region in inference requests instead of sending tensor bytes.

A region's file belongs to the client, which can truncate it at any time. A byte of
a mapping past the end of its file faults (SIGBUS, the whole process dies), so
client regions are never mapped: the server keeps the region's descriptor open and
copies with ``pread``/``pwrite``, checking the file's size (``fstat`` on that
descriptor) before each access and the byte count after it. A region cut short is a
400 naming the region, whenever it was cut. Keys are opened as ``shm_open`` opens
them: a name directly inside ``/dev/shm``, no symbolic link followed, a regular file
only, so no key can make the server read or write another file.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from trionserve.core.errors import AlreadyExists, InvalidArgument, NotFound

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

SHM_DIR = "/dev/shm"


#: Flags of ``shm_open(key, O_RDWR)``: no link followed, not inherited by children.
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


@dataclass(slots=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def check_size(self, end: int, what: str) -> None:
        """Refuse an access up to file offset ``end`` when the file is shorter now."""
        size = os.fstat(self.fd).st_size
        if end > size:
            raise InvalidArgument(
                f"{what}: shared memory region '{self.name}' is shorter than registered: "
                f"key '{self.key}' now has {size} bytes, the access needs {end}"
            )

    def status(self) -> dict:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


#: Keys Triton keeps for the Python backend's own regions (server src/common.h
#: kTritonSharedMemoryRegionPrefix).
RESERVED_KEY_PREFIX = "triton_python_backend_shm_region_"

#: SIZE_MAX of a 64-bit server: offsets and byte sizes are size_t in Triton.
SIZE_MAX = 2**64 - 1


def check_key(name: str, key: str) -> None:
    """Triton's ValidateSharedMemoryKey (server src/common.cc 166-199), its words:
    a key of slashes only, or one whose name (past its leading slashes) starts with
    the reserved prefix, is refused before anything else is looked at."""
    stripped = key.lstrip("/")
    if not stripped:
        raise InvalidArgument(
            f"cannot register shared memory region '{name}' - invalid shm key '{key}'"
        )
    if stripped.startswith(RESERVED_KEY_PREFIX):
        raise InvalidArgument(
            f"cannot register shared memory region '{name}' with key '{key}' as the key "
            f"contains the reserved prefix '{RESERVED_KEY_PREFIX}'"
        )


def _shm_path(key: str) -> str:
    # glibc's shm_open skips every leading slash of a name.
    name = key.lstrip("/")
    if "\0" in name:
        raise InvalidArgument(f"invalid shared memory key {key!r}: it contains a NUL byte")
    if not name or "/" in name or name in (".", ".."):
        raise InvalidArgument(f"invalid shared memory key '{key}'")
    return os.path.join(SHM_DIR, name)


class SharedMemory(Protocol):
    """What the codecs read request inputs from and write outputs to: the system
    regions alone (SystemSharedMemory), or system and CUDA regions in one namespace
    (cuda_shared_memory.SharedMemoryResolver)."""

    def check(self, name: str, offset: int, byte_size: int, what: str) -> None: ...

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview: ...

    def write(self, name: str, offset: int, byte_size: int, data: Buffer, what: str) -> int: ...

    def table_of(self, name: str) -> RegionTable:
        """The table that holds (or would hold) region ``name``."""
        ...


class _Region(Protocol):
    name: str
    byte_size: int

    def status(self) -> dict: ...

    def close(self) -> None: ...


R = TypeVar("R", bound=_Region)


class RegionTable(Generic[R]):
    """Registered regions of one kind (``kind``, as messages name it), by name:
    what system and CUDA shared memory share. Used on the Trio thread only."""

    kind = "shared memory"

    def __init__(self) -> None:
        self._regions: dict[str, R] = {}
        # Requests in flight that named each region (RequestRegions), and the
        # regions unregistered while held: they go when their last request ends.
        self._holds: dict[str, int] = {}
        self._awaiting: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._regions

    def table_of(self, name: str) -> RegionTable:
        return self

    def unregister(self, name: str | None = None) -> None:
        """Unregister one region, or every region when ``name`` is None or empty.

        As Triton's ``SharedMemoryManager::UnregisterHelper`` (server
        src/shared_memory_manager.cc 676-718): a name that is not registered is no
        error (qa/L0_shared_memory ``test_unregister_before_register``), and a region
        that requests in flight named stays registered, and listed, until the last of
        them ends, then goes without another call (its ``awaiting_unregister_``, the
        frontends' request destructors, http_server.h ~InferRequestClass;
        ``TestSharedMemoryUnregister``)."""
        for each in list(self._regions) if not name else [name]:
            if each not in self._regions:
                continue
            if self._holds.get(each):
                self._awaiting.add(each)
            else:
                self._regions.pop(each).close()

    def hold(self, name: str) -> bool:
        """Count a request in flight that names region ``name``; False if none is registered."""
        if name not in self._regions:
            return False
        self._holds[name] = self._holds.get(name, 0) + 1
        return True

    def release(self, name: str) -> None:
        """The end of a hold; a region unregistered meanwhile goes with its last one."""
        left = self._holds[name] - 1
        if left:
            self._holds[name] = left
            return
        del self._holds[name]
        if name in self._awaiting:
            self._awaiting.discard(name)
            self._regions.pop(name).close()

    def status(self, name: str | None = None) -> list[dict]:
        if not name:
            return [r.status() for r in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"{self.kind} region '{name}' is not registered")
        return [region.status()]

    def _region(self, name: str, offset: int, byte_size: int, what: str) -> R:
        """The region ``name``, whose bounds hold ``byte_size`` bytes at ``offset``."""
        region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(f"{what}: shared memory region '{name}' is not registered")
        # Triton's SharedMemoryManager::GetMemoryInfo, its order and words (server
        # src/shared_memory_manager.cc 446-498; qa/L0_shared_memory
        # test_infer_offset_out_of_bound, _byte_size_out_of_bound, _integer_overflow).
        if offset < 0 or offset >= region.byte_size:
            raise InvalidArgument(
                f"Invalid offset for shared memory region: '{name}' ({what}: offset "
                f"{offset}, {self.kind} region of {region.byte_size} bytes)"
            )
        if byte_size < 0 or byte_size > SIZE_MAX - offset:
            raise InvalidArgument(
                f"Integer overflow detected: byte_size ({byte_size}) + offset ({offset}) "
                f"exceeds maximum value ({SIZE_MAX}) for region '{name}' ({what})"
            )
        if offset + byte_size > region.byte_size:
            raise InvalidArgument(
                f"Invalid offset + byte size for shared memory region: '{name}' ({what}: "
                f"offset {offset} + byte size {byte_size} is out of bounds of the "
                f"{region.byte_size} bytes of {self.kind} region '{name}')"
            )
        return region

    @staticmethod
    def _payload(data: Buffer, byte_size: int, name: str, what: str) -> memoryview:
        """``data`` as bytes, refused if more than the ``byte_size`` given for it."""
        payload = memoryview(data).cast("B")
        if payload.nbytes > byte_size:
            raise InvalidArgument(
                f"{what}: {payload.nbytes} bytes do not fit in the {byte_size} bytes "
                f"given for shared memory region '{name}'"
            )
        return payload


class SystemSharedMemory(RegionTable[Region]):
    """The registered regions, by name. Used on the Trio thread only."""

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Checked in Triton's order (server src/shared_memory_manager.cc
        RegisterSystemSharedMemory 351-400): the key (check_key), a name already
        registered ("already in manager"), the key's object, then the window against
        the object's size ("failed to register shared memory region ...: invalid
        args", CheckSharedMemoryRegionSize)."""
        if not name:
            raise InvalidArgument("a shared memory region needs a name")
        check_key(name, key)
        if name in self._regions:
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        if offset < 0 or byte_size < 0:
            raise InvalidArgument(
                f"shared memory region '{name}': offset and byte_size must be >= 0, "
                f"got offset {offset}, byte_size {byte_size}"
            )
        path = _shm_path(key)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            # Triton's words first (server src/shared_memory_manager.cc
            # OpenSharedMemoryRegion), though as NOT_FOUND: the client named it.
            raise NotFound(
                f"Unable to open shared memory region: '{key}' (region '{name}'): the key "
                "does not exist"
            ) from None
        except OSError as exc:
            # ELOOP: the key is a symbolic link, which shm_open never follows.
            raise InvalidArgument(
                f"unable to open shared memory key '{key}' for region '{name}': "
                f"{exc.strerror or exc}"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(
                    f"unable to open shared memory key '{key}' for region '{name}': "
                    "not a shared memory object"
                )
            if offset + byte_size > info.st_size:
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': invalid args "
                    f"(offset {offset} + byte_size {byte_size} exceeds the {info.st_size} "
                    f"bytes of key '{key}')"
                )
            if not info.st_size:
                raise InvalidArgument(f"shared memory key '{key}' is empty")
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, fd)

    def _window(self, name: str, offset: int, byte_size: int, what: str) -> tuple[Region, int]:
        region = self._region(name, offset, byte_size, what)
        return region, region.offset + offset

    def check(self, name: str, offset: int, byte_size: int, what: str) -> None:
        """Refuse now a window that is out of the region's bounds or past its file's end."""
        region, start = self._window(name, offset, byte_size, what)
        region.check_size(start + byte_size, what)

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """A copy of ``byte_size`` bytes of a region, for an input tensor."""
        region, start = self._window(name, offset, byte_size, what)
        region.check_size(start + byte_size, what)
        data = bytearray(byte_size)
        done = 0
        while done < byte_size:
            got = os.preadv(region.fd, [memoryview(data)[done:]], start + done)
            if not got:  # cut short between the size check and the read
                region.check_size(start + byte_size, what)
                raise InvalidArgument(f"{what}: shared memory region '{name}' was cut short")
            done += got
        return memoryview(data)

    def write(self, name: str, offset: int, byte_size: int, data: Buffer, what: str) -> int:
        """Copy ``data`` into a region window of ``byte_size`` bytes; returns its size."""
        payload = self._payload(data, byte_size, name, what)
        region, start = self._window(name, offset, byte_size, what)
        # Written past a file's end, pwrite grows the file (it never faults); the
        # check keeps a region cut short an error rather than a silently grown file.
        region.check_size(start + byte_size, what)
        done = 0
        while done < payload.nbytes:
            done += os.pwrite(region.fd, payload[done:], start + done)
        return payload.nbytes


class RequestRegions:
    """One request's shared memory: what the codecs read inputs from and write
    outputs to, holding each region the request names (``RegionTable.hold``) from
    the first time it is named until ``release``, called once the request is
    answered, as Triton's frontends keep a request's ``SharedMemoryInfo`` until it
    ends (server src/http_server.cc AddShmRegionInfo, src/grpc/infer_handler.h)."""

    def __init__(self, shared_memory: SharedMemory) -> None:
        self._shared_memory = shared_memory
        self._held: dict[str, RegionTable] = {}

    def _hold(self, name: str) -> None:
        if name not in self._held:
            table = self._shared_memory.table_of(name)
            if table.hold(name):
                self._held[name] = table

    def table_of(self, name: str) -> RegionTable:
        return self._shared_memory.table_of(name)

    @property
    def held(self) -> bool:
        """Whether the request named any region (for its inputs or outputs)."""
        return bool(self._held)

    def check(self, name: str, offset: int, byte_size: int, what: str) -> None:
        self._hold(name)
        self._shared_memory.check(name, offset, byte_size, what)

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        self._hold(name)
        return self._shared_memory.view(name, offset, byte_size, what)

    def write(self, name: str, offset: int, byte_size: int, data: Buffer, what: str) -> int:
        self._hold(name)
        return self._shared_memory.write(name, offset, byte_size, data, what)

    def release(self) -> None:
        held, self._held = self._held, {}
        for name, table in held.items():
            table.release(name)


def shared_memory_window(params: dict, what: str) -> tuple[str, int, int]:
    """The (region, offset, byte_size) an input or output names; checks the types."""
    region = params.get("shared_memory_region")
    offset = params.get("shared_memory_offset", 0)
    byte_size = params.get("shared_memory_byte_size")
    if type(region) is not str or not region:
        raise InvalidArgument(f"{what}: 'shared_memory_region' must be a non-empty string")
    if type(byte_size) is not int or byte_size < 0:
        raise InvalidArgument(
            f"{what}: 'shared_memory_byte_size' must be a non-negative integer, got "
            f"{json.dumps(byte_size)}"
        )
    if type(offset) is not int or offset < 0:
        raise InvalidArgument(
            f"{what}: 'shared_memory_offset' must be a non-negative integer, got "
            f"{json.dumps(offset)}"
        )
    return region, offset, byte_size
