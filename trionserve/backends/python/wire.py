"""Control messages between the server and a stub process: framing and bookkeeping.

A message is a dict of plain values (str, int, float, bool, None, bytes, lists,
tuples, dicts), serialised with :mod:`marshal` (which builds no objects of
arbitrary classes) and preceded by its length. Tensors never travel in messages:
they are written to shared memory (:mod:`.shm`) and named by reference.

Every message also carries the bookkeeping of the two arenas: ``"segments"``, the
sender's new shared-memory segments, whose file descriptors ride along as
SCM_RIGHTS ancillary data; and ``"free"``, blocks of the receiver's arena the sender
no longer needs. :class:`Endpoint` adds and absorbs both without doing any I/O;
:class:`BlockingChannel` is the blocking socket around it (the stub's threads, and
the server while it starts or finalizes a stub).
"""

from __future__ import annotations

import array
import marshal
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterable, Iterator

from trionserve.backends.python.shm import Arena, ArenaView, Block

_HEADER = struct.Struct("<Q")
# Room for the descriptors of this many segments announced in one recvmsg.
MAX_FDS = 64
ANCILLARY_SIZE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
RECEIVE_SIZE = 1 << 16


def encode(message: dict) -> bytes:
    body = marshal.dumps(message)
    return _HEADER.pack(len(body)) + body


def fds_from_ancillary(ancdata: Iterable[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % array.array("i").itemsize
            fds.extend(array.array("i", data[:usable]))
    return fds


def ancillary_for(fds: list[int]) -> list:
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


class Endpoint:
    """One side of a connection: its arena, its view of the peer's, the decoder.

    ``release`` records blocks of the peer's arena this side is done with; they
    leave with the next message, or at once in a ``free`` message when
    :meth:`should_flush` says enough have piled up.
    """

    def __init__(self, arena: Arena, view: ArenaView, flush_bytes: int) -> None:
        self.arena = arena
        self.view = view
        self._flush_bytes = max(1, flush_bytes)
        self._buffer = bytearray()
        self._fds: deque[int] = deque()
        self._released: list[Block] = []
        self._released_bytes = 0
        self._lock = threading.Lock()
        # Messages encoded for the peer, and messages decoded from it: a message
        # on the lane (:mod:`.lane`) carries its sender's count, and its reader
        # waits until it has read that many from the socket, so that what went
        # on the socket first (a response, a new segment) is handled first.
        self.sent = 0
        self.received = 0

    # -- outgoing -----------------------------------------------------------------

    def release(self, blocks: Iterable[Block | None]) -> None:
        held = [block for block in blocks if block is not None]
        if not held:
            return  # small tensors: they came inline, nothing to give back
        with self._lock:
            self._released.extend(held)
            self._released_bytes += sum(block[2] for block in held)

    def should_flush(self) -> bool:
        return self._released_bytes >= self._flush_bytes or len(self._released) >= 256

    def take_released(self) -> list[Block]:
        """The peer's blocks this side is done with, for a message on the lane."""
        if not self._released:
            return []
        with self._lock:
            released, self._released = self._released, []
            self._released_bytes = 0
        return released

    def outgoing(self, message: dict) -> tuple[bytes, list[int]]:
        """The bytes and fds of ``message`` with this side's bookkeeping added.

        Call it under the connection's send lock, so that a segment is announced
        no later than the first message that refers to it.
        """
        segments, fds = self.arena.take_announcements()
        if segments:
            message["segments"] = segments
        if self._released:
            with self._lock:
                message["free"] = self._released
                self._released = []
                self._released_bytes = 0
        self.sent += 1
        return encode(message), fds

    # -- incoming -----------------------------------------------------------------

    def feed(self, data: bytes, fds: list[int]) -> None:
        self._buffer += data
        self._fds.extend(fds)

    def messages(self) -> Iterator[dict]:
        """Complete messages received so far, with their bookkeeping applied."""
        buffer = self._buffer
        while len(buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer)
            end = _HEADER.size + length
            if len(buffer) < end:
                return
            message = marshal.loads(bytes(memoryview(buffer)[_HEADER.size : end]))
            del buffer[:end]
            segments = message.pop("segments", None)
            if segments:
                fds = [self._fds.popleft() for _ in segments]
                self.view.add(segments, fds)
            freed = message.pop("free", None)
            if freed:
                self.arena.free(freed)
            self.received += 1
            yield message

    def close(self) -> None:
        self.arena.close()
        self.view.close()


class BlockingChannel:
    """Blocking send and receive of messages over a connected Unix socket.

    ``send`` may be called from any thread; ``receive`` from one thread at a time.
    ``receive`` returns None once the peer has closed its end.
    """

    def __init__(self, sock: socket.socket, endpoint: Endpoint) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self._send_lock = threading.Lock()
        self._pending: deque[dict] = deque()

    def send(self, message: dict) -> None:
        with self._send_lock:
            data, fds = self.endpoint.outgoing(message)
            sent = self.sock.sendmsg([data], ancillary_for(fds))
            if sent < len(data):
                self.sock.sendall(memoryview(data)[sent:])

    def sent_if_announced(self) -> int | None:
        """How many messages went to the peer so far, or None while a segment of
        this side's arena waits to be announced (a message on the lane must not
        refer to it: its descriptor travels on the socket)."""
        with self._send_lock:
            if self.endpoint.arena.has_announcements():
                return None
            return self.endpoint.sent

    def flush_releases(self) -> None:
        self.send({"op": "free"})

    def receive(self) -> dict | None:
        while not self._pending:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(RECEIVE_SIZE, ANCILLARY_SIZE)
            except ConnectionResetError:
                return None
            fds = fds_from_ancillary(ancdata)
            if not data:
                for fd in fds:
                    os.close(fd)
                return None
            self.endpoint.feed(data, fds)
            self._pending.extend(self.endpoint.messages())
        return self._pending.popleft()

    def poll(self) -> list[dict] | None:
        """The messages received so far, without waiting; None once the peer has
        closed its end. Same rule as ``receive``: one reading thread at a time."""
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(
                    RECEIVE_SIZE, ANCILLARY_SIZE, socket.MSG_DONTWAIT
                )
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:
                return None
            fds = fds_from_ancillary(ancdata)
            if not data:
                for fd in fds:
                    os.close(fd)
                return None
            self.endpoint.feed(data, fds)
            self._pending.extend(self.endpoint.messages())
        messages = list(self._pending)
        self._pending.clear()
        return messages
