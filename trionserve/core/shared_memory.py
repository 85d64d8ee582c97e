"""System (POSIX) shared memory regions registered by clients.

Triton's system shared memory extension: a client creates a POSIX shared memory
object (``shm_open`` key), registers a region of it by name with an offset and a
size, then names the region in inference requests instead of sending tensor bytes.
Inputs are read as views of the mapping (no copy); outputs are written into it.

Regions are mapped read-write with ``mmap``. Unregistering drops the registry's
reference; a mapping still viewed by a request in flight stays valid until that
request lets go of it, so a client can never pull memory from under a request.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass

from trionserve.core.errors import AlreadyExists, InvalidArgument, NotFound

SHM_DIR = "/dev/shm"


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap

    def status(self) -> dict:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


def _shm_path(key: str) -> str:
    name = key[1:] if key.startswith("/") else key
    if "\0" in name:
        raise InvalidArgument(f"invalid shared memory key {key!r}: it contains a NUL byte")
    if not name or "/" in name or name in (".", ".."):
        raise InvalidArgument(f"invalid shared memory key '{key}'")
    return os.path.join(SHM_DIR, name)


class SystemSharedMemory:
    """The registered regions, by name. Used on the Trio thread only."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgument("a shared memory region needs a name")
        if name in self._regions:
            raise AlreadyExists(f"shared memory region '{name}' is already registered")
        if offset < 0 or byte_size < 0:
            raise InvalidArgument(
                f"shared memory region '{name}': offset and byte_size must be >= 0, "
                f"got offset {offset}, byte_size {byte_size}"
            )
        path = _shm_path(key)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound(
                f"unable to open shared memory region '{name}': key '{key}' does not exist"
            ) from None
        except OSError as exc:
            raise InvalidArgument(
                f"unable to open shared memory key '{key}' for region '{name}': {exc}"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidArgument(
                    f"shared memory region '{name}': offset {offset} + byte_size "
                    f"{byte_size} exceeds the {size} bytes of key '{key}'"
                )
            mapping = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        if mapping is None:
            raise InvalidArgument(f"shared memory key '{key}' is empty")
        self._regions[name] = Region(name, key, offset, byte_size, mapping)

    def unregister(self, name: str | None = None) -> None:
        """Unregister one region, or every region when ``name`` is None or empty."""
        if not name:
            self._regions.clear()
            return
        if self._regions.pop(name, None) is None:
            raise NotFound(f"shared memory region '{name}' is not registered")

    def status(self, name: str | None = None) -> list[dict]:
        if not name:
            return [r.status() for r in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"shared memory region '{name}' is not registered")
        return [region.status()]

    def _window(self, name: str, offset: int, byte_size: int, what: str) -> tuple[Region, int]:
        region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(f"{what}: shared memory region '{name}' is not registered")
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise InvalidArgument(
                f"{what}: offset {offset} + byte size {byte_size} is out of bounds of "
                f"shared memory region '{name}' ({region.byte_size} bytes)"
            )
        return region, region.offset + offset

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """A view of ``byte_size`` bytes of a region, for an input tensor."""
        region, start = self._window(name, offset, byte_size, what)
        return memoryview(region.mapping)[start : start + byte_size]

    def write(self, name: str, offset: int, byte_size: int, data, what: str) -> int:
        """Copy ``data`` into a region window of ``byte_size`` bytes; returns its size."""
        payload = memoryview(data).cast("B")
        if payload.nbytes > byte_size:
            raise InvalidArgument(
                f"{what}: {payload.nbytes} bytes do not fit in the {byte_size} bytes "
                f"given for shared memory region '{name}'"
            )
        region, start = self._window(name, offset, byte_size, what)
        region.mapping[start : start + payload.nbytes] = payload
        return payload.nbytes


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
