"""A request's tensors left in the socket for the instance's thread to read, not the loop.

A large request the client repeats comes whole into the socket before the loop reads it (at c=1
the client sends it without hearing from us). The loop reads what it decodes (the head, the
message or JSON header up to the tensors' bytes), and, where nothing reads the tensors before the
instance's thread (a blocking backend run on that thread: ``http.later.on_thread``), leaves the
rest to that thread, which reads it into the request's own buffer with one ``readv`` (the GIL
released: the bytes are there, the socket is non-blocking) before its batch runs
(``InstanceThread._take_bodies``). That saves the loop the kernel's copy of the tensors: ~100 µs
of a 602 KB request. Over HTTP/1.1 the rest is the body past its JSON header
(:mod:`trionserve.protocol.http.later`); over gRPC the message past the start of its last raw
contents, the bytes between its DATA frames and the second frame's payload
(:mod:`trionserve.protocol.grpc.inflow`, ``_read_call``).

What holds:

- One reader. The rest is read exactly once, into the request's own buffer, under
  :class:`LaterBody`'s lock, by the instance's thread before the batch runs
  (:meth:`~LaterBody.take`) or by the loop (:meth:`~LaterBody.settle`) when the request settles
  without it (failed, rejected, cancelled, timed out, dropped from its batch, a connection that
  ends) or the connection must read on before the thread did. Either way the buffer holds the
  request's bytes before anyone uses them, and the connection reads nothing more of its socket
  before the rest.
- The connection's wait reads none of it: while the rest is deferred, the socket's
  ``SO_RCVLOWAT`` is the mark the connection wants plus the rest (:meth:`~LaterBody.mark`), so
  that the rest does not wake it, and the reader sets the wanted mark back as it takes the rest
  (Linux wakes a waiter then if bytes beyond it came). The client's end wakes it whatever the mark.
- A read that fails (the connection reset) fails that request only, with a clear error, and the
  connection closes after its answer (:attr:`LaterBody.broken`).
"""

from __future__ import annotations

import fcntl
import os
import select
import socket as _socket
import sys
import termios
import threading
from _socket import socket as _raw_socket  # (socket.socket's base: no Python-level __init__)
from typing import TYPE_CHECKING

import trio

from trionserve.backends.base import AsyncBackendInstance
from trionserve.core.errors import InvalidArgument, TritonError
from trionserve.protocol.sockets import kernel_at_least, past

if TYPE_CHECKING:
    from trionserve.actors.model import ModelVersion
    from trionserve.core.inference import InferenceRequest
    from trionserve.dataplane import DataPlane

__all__ = ["LaterBody", "hung_up", "on_thread", "queued", "routed_on_thread"]

_LOWAT = getattr(_socket, "SO_RCVLOWAT", None)
_FIONREAD, _INQ = termios.FIONREAD, bytes(4)
# The peer ended its side (poll's POLLRDHUP; Linux's value where Python has no name for it).
_RDHUP = getattr(select, "POLLRDHUP", 0x2000)


# SO_PEEK_OFF (Linux's value; Python has no name for it): MSG_PEEK at an offset, TCP's since
# Linux 6.10. Elsewhere nothing is peeked (gRPC's message is read whole on the loop).
PEEK_OFF = 42 if sys.platform.startswith("linux") and kernel_at_least(6, 10) else None
# TCP_INQ (Linux's value, since 4.18; Python has no name for it): a recvmsg's ancillary data
# says how many bytes the socket holds unread (FIONREAD's answer, without its ioctl).
_TCP_INQ = 36
_PEEK = PEEK_OFF if PEEK_OFF is not None else -1  # (an int for the peeks: made only with it)
_INQ_SPACE = _socket.CMSG_SPACE(4)


def queued(socket: trio.socket.SocketType) -> int:
    """The bytes the socket holds now, unread (``FIONREAD``)."""
    return int.from_bytes(fcntl.ioctl(socket.fileno(), _FIONREAD, _INQ), "little")


def hung_up(socket: trio.socket.SocketType) -> bool:
    """Whether the peer ended its side (or the connection failed), whatever is still unread."""
    poller = select.poll()
    poller.register(socket.fileno(), _RDHUP)
    return bool(poller.poll(0))


class _Peeker(_raw_socket):
    """A socket object over a connection's descriptor, for its peeks (Trio's socket has no
    non-blocking ``recvmsg``): made once per connection and used on the loop only while the
    connection's task serves it; it never closes the descriptor (detached when dropped)."""

    __slots__ = ()

    def __del__(self) -> None:
        self.detach()


def on_thread(model: ModelVersion) -> bool:
    """Whether nothing reads a request's inputs before its instance's thread (see the module):
    no response cache, sequence batching or ensemble; every instance a blocking one."""
    config = model.config
    if (
        config.response_cache.enable
        or config.HasField("sequence_batching")
        or config.HasField("ensemble_scheduling")
        or config.platform == "ensemble"
    ):
        return False
    executors = model.executors
    if not executors:
        return False
    for executor in executors:
        if isinstance(executor.instance, AsyncBackendInstance):
            return False
    return True


# on_thread of the versions requests were routed to, by name, version and namespace: the
# routes it was decided under (the registry's lifecycle and its generation) and the answer.
_routed: dict[tuple[str, object, str | None], tuple[object, int, bool]] = {}


def routed_on_thread(dataplane: DataPlane, request: InferenceRequest) -> bool:
    """:func:`on_thread` of the version ``request`` routes to, decided once for it and kept until
    the routes change (a load, unload, eviction, or a name's meaning); False when it routes to
    none (the request's begin says why)."""
    routes = dataplane.registry.lifecycle
    key = (request.model_name, request.model_version, request.model_namespace)
    known = _routed.get(key)
    if known is not None and known[0] is routes and known[1] == routes.generation:
        return known[2]
    generation = routes.generation
    try:
        model = dataplane.registry.route(*key)
    except TritonError:
        return False
    if len(_routed) >= 256:
        _routed.clear()
    answer = _routed[key] = (routes, generation, on_thread(model))
    return answer[2]


class LaterBody:
    """A connection's request whose rest (``view``, then the views ``more``) is still in the
    socket. The loop :meth:`offer`\\ s it as it reads the request's head; the infer handler either
    :meth:`defer`\\ s it to the instance's thread or reads it :meth:`now`; the thread
    :meth:`take`\\ s it; the loop :meth:`settle`\\ s it as the request's answer is made, or
    before it reads the socket again."""

    __slots__ = (
        "_lock",
        "_peeker",
        "broken",
        "fd",
        "more",
        "next_peek",
        "peek_at",
        "pending",
        "raised",
        "routed",
        "size",
        "socket",
        "view",
        "wanted",
    )

    def __init__(self, socket: trio.socket.SocketType) -> None:
        self.socket = socket
        # Its descriptor, for the loop's reads while the connection's task serves it (closed only
        # as that task ends: Trio's fileno() is two Python calls a request).
        self.fd = socket.fileno()
        self._lock = threading.Lock()
        # The part of the request's buffer still to read, from offer to the read, and what follows
        # it in the socket (gRPC: the bytes between two DATA frames, the next frame's payload).
        self.view: memoryview | None = None
        self.more: tuple[memoryview, ...] = ()
        # Deferred to the instance's thread, and not yet read (read on that thread, unlocked).
        self.pending = False
        # A read of it failed: the request fails, the connection closes after its answer.
        self.broken: str | None = None
        # The bytes deferred; the socket's SO_RCVLOWAT the connection wants, and whether the
        # rest raised it (mark).
        self.size = 0
        self.wanted = 1
        self.raised = False
        self._peeker: _Peeker | None = None
        # The SO_PEEK_OFF the next call's peek wants (gRPC: where the bytes between its DATA
        # frames are, counted from its first byte; 0: none), set by whoever reads the rest (the
        # thread: off the loop); and the socket's SO_PEEK_OFF as known (the kernel takes each
        # byte read off it: EagerReceiver.receive_whole does the same here, its other reads and a
        # peek make it unknown, any value below 1).
        self.next_peek = 0
        self.peek_at = -1
        # gRPC's last request's routing, its routes and their generation, and whether its
        # rest may be left to the thread (grpc/laterread.py place: routed_on_thread's answer).
        self.routed: tuple | None = None

    def offer(self, view: memoryview, more: tuple[memoryview, ...] = ()) -> None:
        """The loop read the request without ``view`` and ``more``, which the socket holds
        whole."""
        self.view = view
        self.more = more
        self.size = view.nbytes + sum(part.nbytes for part in more)
        self.broken = None

    def offer_peeked(
        self,
        view: memoryview,
        slot: memoryview,
        more: tuple[memoryview, ...],
        size: int,
    ) -> bool:
        """:meth:`offer` ``view`` and ``more`` (``size`` bytes in all) when the socket holds them
        whole, with the bytes after ``view`` (``len(slot)`` of them, what ``more[0]`` is read
        from) copied into ``slot`` without reading them: one ``MSG_PEEK`` ``recvmsg`` at
        ``SO_PEEK_OFF``, whose ``TCP_INQ`` says what the socket holds. False, nothing offered,
        where it cannot tell (no ``PEEK_OFF``, fewer bytes, a failed call). No call sets
        ``SO_PEEK_OFF`` when it is where the peek wants it (``peek_at``: the last rest's reader
        set it at ``next_peek``, and it went back by each byte the loop read since)."""
        peeker = self._peeker
        if peeker is None:
            if PEEK_OFF is None:
                return False
            peeker = self._peeker = _Peeker(_socket.AF_INET, _socket.SOCK_STREAM, 0, self.fd)
            try:
                peeker.setsockopt(_socket.IPPROTO_TCP, _TCP_INQ, 1)
            except OSError:
                pass  # (no TCP_INQ: no ancillary data, nothing is offered)
        peeked, offset, known = more[0].nbytes, view.nbytes, self.peek_at
        self.peek_at = -1  # (the peek moves it on)
        try:
            if known != offset:
                peeker.setsockopt(_socket.SOL_SOCKET, _PEEK, offset)
            got, ancillary, _, _ = peeker.recvmsg_into((slot,), _INQ_SPACE, _socket.MSG_PEEK)
        except OSError:
            return False
        if got != peeked or not ancillary:
            return False
        inq = ancillary[0]
        if inq[1] != _TCP_INQ or int.from_bytes(inq[2], sys.byteorder) < size:
            return False
        self.view, self.more, self.size, self.broken = view, more, size, None
        return True

    def defer(self) -> None:
        """Leave the rest to the instance's thread (on the loop, before the request is submitted):
        the connection's waits wake for none of it (``SO_RCVLOWAT``)."""
        view = self.view
        assert view is not None
        size = self.size if self.more else view.nbytes  # (offer's, else HTTP's view alone)
        with self._lock:
            self.size = size
            self.pending = True
            if self.wanted <= size:  # (a mark past the rest already wakes for none of it)
                self.raised = True
                self._set(self.wanted + size)

    def mark(self, size: int) -> None:
        """The connection's wait wants ``SO_RCVLOWAT`` at ``size`` (the loop's, or the watch's as
        it lowers a wait): set so, past the rest while one is deferred."""
        with self._lock:
            self.wanted = size
            if self.pending and size <= self.size:
                size += self.size
                self.raised = True
            self._set(size)

    def now(self) -> None:
        """Read the rest on the loop, if it is not read (the request is not deferred). Raises
        InvalidArgument when it cannot be read (the connection then closes)."""
        if self.view is not None and not self.pending:
            self._read()
            if self.broken is not None:
                raise InvalidArgument(self.broken)

    def take(self) -> bool:
        """Read the rest deferred to this thread (the instance's, before its batch runs), unless
        the loop did; False: the read failed (``broken`` says why)."""
        with self._lock:
            if self.pending:
                self._read()
                self.pending = False
                self._lower()
        return self.broken is None

    def settle(self) -> bool:
        """On the loop, as the request's answer is made or before the connection reads on: a rest
        not read yet is read now, into the request's buffer; whether the connection may go on
        (False: a read failed, it closes)."""
        if self.view is not None:
            with self._lock:  # (waits for the thread's read in progress)
                if self.view is not None:
                    self._read()
                    self.pending = False
                    self._lower()
        return self.broken is None

    def _lower(self) -> None:
        """The rest read (with the lock): the wanted mark back, if the rest raised it."""
        if self.raised:
            self.raised = False
            self._set(self.wanted)

    def _set(self, size: int) -> None:
        if _LOWAT is not None:
            try:
                self.socket.setsockopt(_socket.SOL_SOCKET, _LOWAT, size)
            except OSError:
                pass  # (closed: the read says so)

    def _read(self) -> None:
        """Read ``view`` and ``more`` whole from the socket, which holds them (with the lock, or
        on the loop before it is deferred); ``view`` is None once they are read, not before (a
        read in progress on the thread is one the loop's settle waits for)."""
        view = self.view
        if view is None:
            return
        views = (view, *self.more) if self.more else (view,)
        try:
            fd = self.socket.fileno()
            while views:
                received = os.readv(fd, views)
                if not received:
                    raise ConnectionError("the client ended its side")
                views = past(views, received)
        except OSError as exc:  # (BlockingIOError: less was there than its FIONREAD said)
            self.broken = f"the request's binary data could not be read from its connection: {exc}"
            self.peek_at = -1
        else:
            peek = self.next_peek
            if peek:  # (the next call's peek offset, set here: off the loop when on the thread)
                try:
                    self.socket.setsockopt(_socket.SOL_SOCKET, _PEEK, peek)
                    self.peek_at = peek
                except OSError:
                    self.peek_at = -1
        self.view, self.more = None, ()
