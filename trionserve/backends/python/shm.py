"""Shared-memory arenas: where tensors cross between the server and a stub process.

Each direction has its own :class:`Arena`, owned by the process that writes into
it: it allocates a block, copies the tensor's bytes in, and names the block in a
control message as a tensor reference ``(name, datatype, shape, segment, offset,
nbytes)``. The reader maps the writer's segments into an :class:`ArenaView` (their
memfds travel over the control socket) and reads the block: as a view, or copied
out. When it no longer needs a block it says so, and the writer frees it.

An arena starts with one segment of ``default_size`` bytes and adds segments of at
least ``growth_size`` bytes when a tensor does not fit, like Triton's
``shm-default-byte-size`` and ``shm-growth-byte-size``.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import tempfile
import threading
from collections.abc import Iterable

import numpy as np

from trionserve.core.bytes_tensor import read_bytes_elements, serialize_bytes_tensor
from trionserve.core.datatypes import BY_WIRE

ALIGNMENT = 64
# Tensors of at most this many bytes travel in the control message itself: no
# block to allocate, copy into, announce as released and free again, on either
# side, for the bytes of a small request (an in-process model showed what that
# bookkeeping costs per call).
INLINE_MAX_BYTES = 1024
# Segment ids of references without a block: no bytes, and bytes in the reference.
EMPTY, INLINE = -1, -2
# (segment id, offset, size): an allocated block.
Block = tuple[int, int, int]
# (name, wire datatype, shape, segment id, offset, nbytes); segment EMPTY for 0
# bytes; segment INLINE: offset 0 and the bytes themselves in place of nbytes.
TensorRef = tuple[str, str, tuple[int, ...], int, int, "int | bytes"]


def _memfd(size: int) -> int:
    """An anonymous shared-memory file of ``size`` bytes (a memfd where available)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("trionserve-python-backend", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux fallback: an unlinked temporary file
        handle = tempfile.TemporaryFile()
        fd = os.dup(handle.fileno())
        handle.close()
    os.ftruncate(fd, size)
    return fd


class _Segment:
    __slots__ = ("id", "size", "fd", "map", "free")

    def __init__(self, segment_id: int, size: int) -> None:
        self.id = segment_id
        self.size = size
        self.fd = _memfd(size)
        self.map = mmap.mmap(self.fd, size)
        # Free ranges as sorted (offset, size), coalesced.
        self.free: list[tuple[int, int]] = [(0, size)]

    def allocate(self, size: int) -> int | None:
        for index, (offset, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[index]
                else:
                    self.free[index] = (offset + size, length - size)
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        index = bisect.bisect_left(self.free, (offset, 0))
        if index > 0:
            before_offset, before_size = self.free[index - 1]
            if before_offset + before_size == offset:
                index -= 1
                offset, size = before_offset, before_size + size
                del self.free[index]
        if index < len(self.free):
            after_offset, after_size = self.free[index]
            if offset + size == after_offset:
                size += after_size
                del self.free[index]
        self.free.insert(index, (offset, size))


class Arena:
    """The writing side: the segments this process created and their allocator.

    Thread-safe: a stub allocates from its model's threads and frees from its
    reader thread. New segments are kept until :meth:`take_announcements` hands
    them to the next outgoing message, which carries their file descriptors.
    """

    def __init__(self, default_size: int, growth_size: int) -> None:
        self._growth = max(ALIGNMENT, growth_size)
        self._lock = threading.Lock()
        # Notified as blocks are freed (a writer waiting for its backlog to drain).
        self._freed = threading.Condition(self._lock)
        self._used = 0  # bytes allocated and not yet freed
        self._segments: list[_Segment] = []
        self._unannounced: list[_Segment] = []
        self._add_segment(max(ALIGNMENT, default_size))

    def _add_segment(self, size: int) -> _Segment:
        segment = _Segment(len(self._segments), size)
        self._segments.append(segment)
        self._unannounced.append(segment)
        return segment

    @property
    def size(self) -> int:
        return sum(s.size for s in self._segments)

    def allocate(self, nbytes: int) -> Block:
        size = -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
        with self._lock:
            self._used += size
            for segment in self._segments:
                offset = segment.allocate(size)
                if offset is not None:
                    return segment.id, offset, size
            segment = self._add_segment(max(size, self._growth))
            offset = segment.allocate(size)
            assert offset is not None
            return segment.id, offset, size

    def free(self, blocks: Iterable[Block]) -> None:
        with self._lock:
            for segment_id, offset, size in blocks:
                self._segments[segment_id].release(offset, size)
                self._used -= size
            self._freed.notify_all()

    def in_use(self) -> int:
        """Bytes allocated and not yet freed."""
        return self._used

    def wait_freed(self, below: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until fewer than ``below`` bytes are in
        use; whether they are."""
        with self._freed:
            return self._freed.wait_for(lambda: self._used < below, timeout)

    def has_announcements(self) -> bool:
        """Whether a segment is waiting to be announced (a message that refers
        to it must go on the socket, which carries its descriptor)."""
        return bool(self._unannounced)

    def take_announcements(self) -> tuple[list[tuple[int, int]], list[int]]:
        """Segments the peer has not seen yet, as ``[(id, size)]`` and their fds."""
        if not self._unannounced:  # the common case; a writer's own segments are
            return [], []  # visible to it here, so none is announced late
        with self._lock:
            new, self._unannounced = self._unannounced, []
        return [(s.id, s.size) for s in new], [s.fd for s in new]

    def write(self, name: str, datatype: str, array: np.ndarray) -> tuple[TensorRef, Block | None]:
        """Copy one tensor into a new block; returns its reference and the block
        (None for a tensor of no bytes or one small enough to go inline)."""
        if datatype == "BYTES":
            payload = serialize_bytes_tensor(array)
            nbytes = len(payload)
        else:
            payload = None
            nbytes = array.nbytes
        shape = array.shape  # a tuple of ints, as marshal takes it
        if nbytes == 0:
            return (name, datatype, shape, EMPTY, 0, 0), None
        if nbytes <= INLINE_MAX_BYTES:
            data = payload if payload is not None else array.tobytes()
            return (name, datatype, shape, INLINE, 0, data), None
        block = self.allocate(nbytes)
        segment_id, offset, _ = block
        buffer = self._segments[segment_id].map
        if payload is not None:
            buffer[offset : offset + nbytes] = payload
        else:
            target = np.ndarray(array.shape, array.dtype, buffer=buffer, offset=offset)
            np.copyto(target, array, casting="no")
        return (name, datatype, shape, segment_id, offset, nbytes), block

    def close(self) -> None:
        for segment in self._segments:
            try:
                segment.map.close()
            except BufferError:  # a view is still alive; the OS frees it at exit
                pass
            os.close(segment.fd)
        self._segments = []


class ArenaView:
    """The reading side: the peer's segments, mapped as they are announced."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}

    def add(self, segments: list[tuple[int, int]], fds: list[int]) -> None:
        for (segment_id, size), fd in zip(segments, fds, strict=True):
            try:
                self._maps[segment_id] = mmap.mmap(fd, size)
            finally:
                os.close(fd)

    def array(self, ref: TensorRef, copy: bool) -> np.ndarray:
        """The tensor a reference names: a view into shared memory, or a copy."""
        _, datatype, shape, segment_id, offset, nbytes = ref
        dtype = BY_WIRE[datatype].numpy
        if segment_id == INLINE:
            assert isinstance(nbytes, bytes)
            if datatype == "BYTES":
                count = math.prod(shape)
                return read_bytes_elements(
                    nbytes, 0, len(nbytes), count, f"tensor '{ref[0]}'"
                ).reshape(shape)
            # Writable, as a view into shared memory is (a model may write its
            # inputs); made directly on a copy of the bytes (np.frombuffer and a
            # reshape cost three times as much, on every small tensor of a call).
            return np.ndarray(shape, dtype, bytearray(nbytes))
        if nbytes == 0:
            return np.empty(shape, dtype=dtype)
        assert isinstance(nbytes, int)
        buffer = self._maps[segment_id]
        if datatype == "BYTES":
            raw = memoryview(buffer)[offset : offset + nbytes]
            try:
                count = math.prod(shape)
                return read_bytes_elements(raw, 0, nbytes, count, f"tensor '{ref[0]}'").reshape(
                    shape
                )
            finally:
                raw.release()
        view = np.ndarray(shape, dtype, buffer=buffer, offset=offset)
        return view.copy() if copy else view

    def close(self) -> None:
        for buffer in self._maps.values():
            try:
                buffer.close()
            except BufferError:  # a model still holds an input view
                pass
        self._maps = {}


def block_of(ref: TensorRef) -> Block | None:
    """The block a reference occupies, as the writer allocated it."""
    _, _, _, segment_id, offset, nbytes = ref
    if segment_id < 0:
        return None
    assert isinstance(nbytes, int)
    return segment_id, offset, -(-nbytes // ALIGNMENT) * ALIGNMENT
