"""Reading a body and writing an answer without a trip through the event loop.

``trio.SocketStream.send_all`` ends with a checkpoint even when the socket took
every byte at once, which costs a small request one more pass of Trio's run loop
(a task step and, on a quiet server, an ``epoll_wait``) between writing its
answer and waiting for the next request. :func:`send_all` writes what the
socket takes at once straight to its descriptor and leaves only the rest, if
any, to ``send_all`` (which also raises whatever a failed write means: a reset,
a closed socket).

The task that calls it must be the only one writing to the stream (as an HTTP
connection's task is): bytes written here bypass the stream's check for
concurrent senders. It is not a checkpoint when the socket takes everything;
the connection's next step, reading the next request, is one. (The gRPC
connection's writer tried it too: under perf_analyzer it cost more CPU per call
at c=16 and saved none at c=1, see benchmarks/README.md. A gRPC call's task
writes its answer this way only when no other call is in flight: with others,
``send_all``'s checkpoint lets their answers join the same write.)

A large answer goes out the same way, gathered (:func:`send_pieces`: one
``writev`` of the head and the tensors' views, no join, no copy), and a body of
declared length comes in straight into its buffer (:func:`receive_into`): a read
that finds bytes is not a checkpoint either, and a read that finds none waits,
with ``SO_RCVLOWAT`` set to what the buffer still lacks, until the kernel holds
that much (or the peer ends): one wake-up for the rest of a body that arrives in
pieces, where Trio's ``recv_into`` makes a pass of its run loop per read and a
wake-up per piece.
"""

from __future__ import annotations

import fcntl
import os
import socket as _socket
import sys
import termios
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import trio

if TYPE_CHECKING:
    from trionserve.protocol.later import LaterBody

__all__ = [
    "EagerReceiver",
    "HeldWrite",
    "kernel_at_least",
    "past",
    "peer_name",
    "receive_after_wait",
    "receive_into",
    "receive_some_now",
    "readv_now",
    "send_all",
    "send_pieces",
    "send_pieces_now",
    "write_now",
]

# The kernel caps SO_RCVLOWAT at half the largest receive buffer (tcp_rmem[2]);
# a request for more than it holds is capped there too, never a wait forever.
_LOWAT = getattr(_socket, "SO_RCVLOWAT", None)
# writev's limit on the pieces of one call (IOV_MAX on Linux).
_IOV_MAX = 1024


def kernel_at_least(major: int, minor: int) -> bool:
    """Whether this runs on a Linux kernel of release ``major.minor`` or later."""
    try:
        release = [int(part) for part in os.uname().release.split(".")[:2]]
    except (AttributeError, ValueError):
        return False
    return release >= [major, minor]


def past(views: tuple[memoryview, ...], size: int) -> tuple[memoryview, ...]:
    """``views`` in turn past their first ``size`` bytes (what a ``readv`` that read ``size``
    of them left to fill)."""
    for index, view in enumerate(views):
        if size < len(view):
            return (view[size:], *views[index + 1 :])
        size -= len(view)
    return ()


# A wait for a whole message (EagerReceiver.receive_whole) where lowering
# SO_RCVLOWAT signals the bytes the socket holds at once (Linux since 4.18:
# tcp_set_rcvlowat); elsewhere such a wait is a wait for any byte.
_WHOLE = _LOWAT is not None and sys.platform.startswith("linux") and kernel_at_least(4, 18)
# How often the watch looks at the sockets waiting for a whole message, and
# after how many looks one that held nothing is woken for any byte.
WATCH_SECS = 0.02
WATCH_IDLE = 25


def write_now(stream: trio.abc.SendStream, data: bytes | bytearray | memoryview) -> int:
    """Write what of ``data`` the stream's socket takes now, without waiting or
    yielding; the number of bytes written. 0 when the stream has no socket of its
    own (TLS, memory streams in tests), its send buffer is full, or the write
    failed: the caller's ``send_all`` then sends the rest, or raises."""
    socket = getattr(stream, "socket", None)
    if socket is None:
        return 0
    try:
        # The descriptor is looked up now: a closed socket's is -1 (EBADF), never
        # a number another file may have reused.
        return os.write(socket.fileno(), data)
    except OSError:
        return 0


async def send_all(stream: trio.abc.SendStream, data: bytes | bytearray | memoryview) -> None:
    """``stream.send_all(data)``, with what the socket takes at once written
    without a checkpoint (see the module docstring)."""
    written = write_now(stream, data)
    if written < len(data):
        await stream.send_all(memoryview(data)[written:] if written else data)


async def receive_into(
    stream: trio.abc.ReceiveStream, buffer: memoryview, *, fill: bool = False
) -> int:
    """Bytes read into ``buffer`` (0: the peer ended its side), waiting only when
    the socket has none: then for any byte, or with ``fill`` until the socket
    holds ``len(buffer)`` bytes (the rest of a body), the peer ends or fails,
    whichever comes first. Not a checkpoint when bytes are there. A stream
    without a socket of its own reads through its ``receive_some``. Raises
    BrokenResourceError for a failed read."""
    socket = getattr(stream, "socket", None)
    if socket is None:
        data = await stream.receive_some(len(buffer))
        buffer[: len(data)] = data
        return len(data)
    received = _read_now(socket, buffer)
    if received is not None:
        return received
    return await _wait_and_readv(socket, (buffer,), len(buffer) if fill else 1)


async def receive_view(stream: trio.abc.ReceiveStream, buffer: memoryview) -> memoryview:
    """The bytes of one read into ``buffer`` (:func:`receive_into`), as a view of it
    (empty: the peer ended its side): valid until the next read into ``buffer``. No
    bytes object per read (a ``recv`` allocates its whole size and shrinks it)."""
    return buffer[: await receive_into(stream, buffer)]


async def receive_after_wait(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes | bytearray:
    """``stream.receive_some(max_bytes)`` for a read that expects to wait (the
    next request of a keep-alive connection, which a client sends only after
    it has read the answer): it waits for the socket to be readable first, then
    reads, where Trio's reads first and waits on EAGAIN (a failed ``recv`` and
    its exception on every request). A checkpoint either way, as
    ``receive_some``. Raises BrokenResourceError for a failed read and
    ClosedResourceError for a closed socket. (Bytes just seen to come, by the
    task waiting for its answer, see http/answer.py: :func:`receive_some_now`.)"""
    socket = getattr(stream, "socket", None)
    if socket is None:
        return await stream.receive_some(max_bytes)
    while True:
        if socket.fileno() < 0:
            raise trio.ClosedResourceError("the stream was closed")
        await trio.lowlevel.wait_readable(socket)
        try:
            return os.read(socket.fileno(), max_bytes)
        except BlockingIOError:
            continue  # readable, then not (another reader): wait again
        except OSError as exc:
            if socket.fileno() < 0:
                raise trio.ClosedResourceError("the stream was closed") from exc
            raise trio.BrokenResourceError(exc) from exc


class EagerReceiver:
    """``stream.receive_some`` for a read loop that acts on each read before it
    reads again (the gRPC connection's): bytes the socket holds now are returned
    at once, without Trio's checkpoint (a pass of the run loop per read that
    finds bytes: at c=1 the client's WINDOW_UPDATE after each answer, or its
    next request, found by the read that follows the answer); a read that finds
    none waits for the socket to be readable (a checkpoint) and reads. At most
    ``eager_reads`` reads in a row return without one: a client that keeps the
    socket full cannot keep its task from yielding to the others, nor from
    seeing a cancellation, for longer. A stream without a socket of its own
    (TLS, memory streams in tests) reads through its ``receive_some``. Raises
    BrokenResourceError for a failed read and ClosedResourceError for a closed
    socket, as ``receive_some`` does. One task reads at a time (this bypasses
    the stream's check for concurrent readers).

    A call's rest left in the socket for the instance's thread (``later``, see
    :mod:`trionserve.protocol.later`) is read by nothing here: a read that
    would find it settles it first (the loop reads it, under its lock), and
    ``receive_whole``'s wait sets the mark past it (:meth:`LaterBody.mark`: every mark
    set here goes through it once it is set)."""

    __slots__ = (
        "_stream",
        "_socket",
        "_eager",
        "_eager_reads",
        "_lowat",
        "_watch",
        "later",
        "woken",
    )

    def __init__(self, stream: trio.abc.ReceiveStream, eager_reads: int = 4) -> None:
        self._stream = stream
        self._socket: trio.socket.SocketType | None = getattr(stream, "socket", None)
        self._eager = self._eager_reads = eager_reads
        # The socket's SO_RCVLOWAT as this receiver set it, 0 before it did (a
        # wait sets its own and leaves it for the next, which may want the
        # same; another receiver of the socket may have left any), the run's
        # watch (receive_whole) and why it last woke a wait short of its
        # bytes (_Watch.look).
        self._lowat = 0
        self._watch: _Watch | None = None
        self.woken: str | None = None
        self.later: LaterBody | None = None

    async def receive_some(
        self, max_bytes: int, eager: bool = True, expect_wait: bool = False
    ) -> bytes | bytearray:
        """``eager=False``: a checkpoint before the read, as Trio's (a gRPC
        connection with calls in flight lets their tasks run first);
        ``expect_wait``: the peer is expected to send nothing before it hears
        from us (a gRPC connection whose calls all wait for their outcomes):
        wait for the socket to be readable first, then read, without the read
        that would find nothing (``EAGAIN``, an exception)."""
        socket = self._socket
        if socket is None:
            return await self._stream.receive_some(max_bytes)
        if self.later is not None:
            self._settle()
            self.later.peek_at = -1  # (what it reads is not counted: see receive_whole)
        if expect_wait:
            self._eager = self._eager_reads
        else:
            if eager and self._eager:
                self._eager -= 1
            else:
                await trio.lowlevel.checkpoint()
                self._eager = self._eager_reads
            data = _read_some(socket, max_bytes)
            if data is not None:
                return data
            self._eager = self._eager_reads
        if self._lowat != 1:
            self.lower()
        while True:
            await trio.lowlevel.wait_readable(socket)
            data = _read_some(socket, max_bytes)
            if data is not None:
                return data

    async def receive_into(
        self, buffers: Sequence[memoryview], least: int, expect_wait: bool = False
    ) -> int:
        """Bytes read into ``buffers`` in turn (one ``readv``; 0: the peer ended
        its side): what the socket holds now, as ``receive_some`` (the same count
        of reads in a row without a checkpoint), else, after one wait until it
        holds ``least`` bytes (``SO_RCVLOWAT``), the peer ends or fails, what it
        holds then. ``least`` must be bytes the peer sends without waiting for
        us (a message's rest within the windows it has). ``expect_wait``: as
        ``receive_some``'s, the wait first."""
        socket = self._socket
        if socket is None:
            return await _receive_some_into(self._stream, buffers)
        if self.later is not None:
            self._settle()
            self.later.peek_at = -1  # (what it reads is not counted: see receive_whole)
        if expect_wait:
            self._eager = self._eager_reads
        elif self._eager:
            self._eager -= 1
        else:
            await trio.lowlevel.checkpoint()
            self._eager = self._eager_reads
        if not expect_wait:
            fd = socket.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the stream was closed")
            try:
                return os.readv(fd, buffers)
            except BlockingIOError:
                pass
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            self._eager = self._eager_reads
        if least != self._lowat and _LOWAT is not None:
            self._lowat = least
            self._mark(socket, least)
        while True:
            await trio.lowlevel.wait_readable(socket)
            received = _readv_now(socket, buffers)
            if received is not None:
                return received

    async def receive_whole(self, buffers: Sequence[memoryview], size: int) -> int:
        """Bytes read into ``buffers`` in turn (one ``readv``; 0: the peer ended
        its side) after one wait until the socket holds ``size`` bytes: a
        message the peer is predicted to send whole without hearing from us,
        which it may not (see the module docstring: ``SO_RCVLOWAT`` stays at
        ``size`` for the next wait, and the run's watch wakes a wait short of
        its bytes within ``WATCH_SECS``, ``woken`` saying why). The wait first,
        as ``receive_into``'s ``expect_wait``. Where the kernel does not signal
        bytes held when ``SO_RCVLOWAT`` is lowered (not Linux), a wait for any
        byte."""
        socket = self._socket
        if socket is None or not _WHOLE:
            return await self.receive_into(buffers, 1, True)
        self._eager = self._eager_reads
        self.woken = None
        later = self.later
        if later is not None and not later.pending:
            self._settle()  # (a rest not deferred: read now)
        if self._lowat != size:
            self._lowat = size
            self._mark(socket, size)
        watch = self._watch
        if watch is None:
            watch = self._watch = _Watch.current()
        waiting = watch.waiting
        waiting[self] = watch.looks
        if watch.idle:
            watch.wake()
        # The descriptor once, waited on and read as a number (no method of the
        # socket per wake, which runs cold after the wait): closed meanwhile, the
        # wait ends in ClosedResourceError (Trio's notify_closing), never a read
        # of a number another socket took since.
        fd = socket.fileno()
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                if later is not None:  # (woken with the rest still there: read first)
                    self._settle()
                try:
                    received = os.readv(fd, buffers)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    raise trio.BrokenResourceError(exc) from exc
                if later is not None:  # (SO_PEEK_OFF goes back by what is read)
                    later.peek_at -= received
                return received
        finally:
            waiting.pop(self, None)

    def lower(self) -> None:
        """Any byte ends a wait now (``SO_RCVLOWAT`` 1): what the socket holds
        is signalled at once (a wait for a whole message short of its bytes,
        or one the connection needs the peer's next bytes for)."""
        if self._lowat != 1 and self._socket is not None:
            self._lowat = 1
            self._mark(self._socket, 1)

    def holds(self) -> bool:
        """Whether the socket holds bytes not read yet (True when it cannot be
        asked: ``lower`` of a closed socket does nothing)."""
        assert self._socket is not None
        try:
            held = fcntl.ioctl(self._socket.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return True
        later = self.later
        if later is not None and later.pending:  # (the rest deferred is not the peer's news)
            return int.from_bytes(held, sys.byteorder) > later.size
        return held != b"\0\0\0\0"

    def attach(self, later: LaterBody) -> None:
        """Set ``later``: from now on a read settles its rest first, and every
        mark goes through it (what this receiver last set is the one wanted)."""
        later.wanted = self._lowat or 1
        self.later = later

    def _settle(self) -> None:
        """The rest left in the socket (``later``), if any, read now, before the socket is:
        a read that fails ends the connection (what follows in the socket is out of step)."""
        later = self.later
        assert later is not None
        if (later.view is not None or later.broken is not None) and not later.settle():
            raise trio.BrokenResourceError(later.broken)

    def _mark(self, socket: trio.socket.SocketType, size: int) -> None:
        """``SO_RCVLOWAT`` at ``size``, past a rest deferred (``later``)."""
        if self.later is not None:
            self.later.mark(size)
        else:
            _set_lowat(socket, size)


class _Watch:
    """The sockets waiting for a whole message (EagerReceiver.receive_whole),
    by the look they began at, looked at every ``WATCH_SECS`` by one daemon
    thread per process while any waits (asleep after ``WATCH_IDLE`` looks
    with none): a wait whose socket holds bytes (fewer than it waits for: its
    peer sent less, or waits for us), or held none for ``WATCH_IDLE`` looks
    (a peer that sends seldom), is woken for what it holds (``lower``). A
    thread, not a task: a look costs the event loop nothing, not even a
    wake-up, unless it wakes a wait. It acts through the socket object, whose
    descriptor reads -1 once the loop closed it (never a number another socket
    took since); the loop's side is one dict item set and popped per wait."""

    __slots__ = ("waiting", "looks", "idle", "_seen", "_resume")

    _current: _Watch | None = None
    _starting = threading.Lock()

    def __init__(self) -> None:
        self.waiting: dict[EagerReceiver, int] = {}
        self.looks = 0
        self._seen = 0  # the last look that found a wait
        self.idle = False  # the thread waits for _resume
        self._resume = threading.Event()

    @classmethod
    def current(cls) -> _Watch:
        """The process's watch, its thread started on first use."""
        with cls._starting:
            watch = cls._current
            if watch is None:
                watch = cls._current = cls()
                threading.Thread(target=watch._run, name="trionserve-lowat", daemon=True).start()
            return watch

    def wake(self) -> None:
        """A wait began while the thread waits for one (``idle``)."""
        self._resume.set()

    @classmethod
    def _forget(cls) -> None:
        """In a forked child: no thread watches; the next use starts one."""
        cls._current = None
        cls._starting = threading.Lock()

    def _run(self) -> None:
        while True:
            if self.looks - self._seen >= WATCH_IDLE:
                self.idle = True
                if not self.waiting:  # (a wait added after this sets _resume)
                    self._resume.wait()
                self._resume.clear()
                self.idle = False
                self._seen = self.looks
            time.sleep(WATCH_SECS)
            self.look()

    def look(self) -> None:
        """One look: the waits short of their bytes woken (see the class)."""
        self.looks += 1
        if not self.waiting:
            return
        self._seen = looks = self.looks
        for receiver, since in list(self.waiting.items()):
            if receiver.holds():
                woken = "held"
            elif looks - since >= WATCH_IDLE:
                woken = "idle"
            else:
                continue
            if self.waiting.pop(receiver, None) is not None:  # (still waiting)
                receiver.woken = woken
                receiver.lower()


async def _receive_some_into(stream: trio.abc.ReceiveStream, buffers: Sequence[memoryview]) -> int:
    """One ``receive_some`` into ``buffers`` in turn (a stream without a socket)."""
    data = await stream.receive_some(sum(map(len, buffers)))
    offset = 0
    for buffer in buffers:
        take = min(len(buffer), len(data) - offset)
        buffer[:take] = memoryview(data)[offset : offset + take]
        offset += take
    return len(data)


def receive_some_now(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes | bytearray | None:
    """What the stream's socket holds now, up to ``max_bytes``, read without
    waiting or a checkpoint (b"": the peer ended its side); None when it holds
    none, or the stream has no socket of its own. Raises as ``receive_some``."""
    socket = getattr(stream, "socket", None)
    return None if socket is None else _read_some(socket, max_bytes)


def _read_some(socket: trio.socket.SocketType, max_bytes: int) -> bytes | bytearray | None:
    """What the socket holds now, up to ``max_bytes`` (b"": the peer ended its
    side); None when it holds nothing."""
    fd = socket.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("the stream was closed")
    try:
        return os.read(fd, max_bytes)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(exc) from exc


def receive_now(stream: trio.abc.ReceiveStream, *buffers: memoryview) -> int | None:
    """Bytes the stream's socket holds now, read into ``buffers`` in turn (one
    ``readv``) without waiting; None when it holds none (or the stream has no
    socket of its own)."""
    socket = getattr(stream, "socket", None)
    if socket is None:
        return None
    try:
        return os.readv(socket.fileno(), buffers)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(exc) from exc


def readv_now(socket: trio.socket.SocketType, buffers: Sequence[memoryview]) -> int | None:
    """:func:`receive_now` of a socket: the bytes it holds now, read into ``buffers`` in turn
    (one ``readv``) without waiting; None when it holds none."""
    try:
        return os.readv(socket.fileno(), buffers)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(exc) from exc


async def _wait_and_readv(
    socket: trio.socket.SocketType, buffers: Sequence[memoryview], least: int
) -> int:
    """Bytes read into ``buffers`` in turn after waiting until the socket holds
    ``least`` bytes (``SO_RCVLOWAT``, set for the wait only), the peer ends or
    the read fails."""
    lowered = _LOWAT is not None and least > 1
    if lowered:
        _set_lowat(socket, least)
    try:
        while True:
            await trio.lowlevel.wait_readable(socket)
            received = _readv_now(socket, buffers)
            if received is not None:
                return received
    finally:
        if lowered:
            _set_lowat(socket, 1)


def _read_now(socket: trio.socket.SocketType, buffer: memoryview) -> int | None:
    return _readv_now(socket, (buffer,))


def _readv_now(socket: trio.socket.SocketType, buffers: Sequence[memoryview]) -> int | None:
    try:
        return os.readv(socket.fileno(), buffers)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(exc) from exc


def _set_lowat(socket: trio.socket.SocketType, size: int) -> None:
    assert _LOWAT is not None
    try:
        socket.setsockopt(_socket.SOL_SOCKET, _LOWAT, size)
    except OSError:
        pass  # closed meanwhile: the read that follows says so


async def send_pieces(
    stream: trio.abc.SendStream, pieces: Sequence[bytes | bytearray | memoryview]
) -> None:
    """Write ``pieces`` in order as one stream of bytes, gathered (``writev``):
    what the socket takes at once goes out without a checkpoint, the rest as
    the socket makes room. Pieces are written from their own buffers, never
    joined. Raises BrokenResourceError (the peer is gone) or
    ClosedResourceError as ``send_all`` does. The task must be the only one
    writing to the stream (see the module docstring)."""
    socket = getattr(stream, "socket", None)
    if socket is None:
        for piece in pieces:
            await stream.send_all(piece)
        return
    views = [_byte_view(piece) for piece in pieces if len(piece)]
    while views := _write_views(socket, views):
        await trio.lowlevel.wait_writable(socket)


def send_pieces_now(
    socket: trio.socket.SocketType, pieces: Sequence[bytes | bytearray | memoryview]
) -> list[memoryview]:
    """Write what of ``pieces`` the socket takes now, gathered, without waiting
    or yielding (a gRPC answer written from the reader's task, as an HTTP/1.1
    connection's task writes its own): the views of the rest, in order, empty
    when it took everything. Raises as :func:`send_pieces` does. The caller
    must be the only one writing to the socket (see the module docstring)."""
    return _write_views(socket, [_byte_view(piece) for piece in pieces if len(piece)])


def _write_views(socket: trio.socket.SocketType, views: list[memoryview]) -> list[memoryview]:
    """One ``writev`` after another while the socket takes whole batches: the
    views left (the first one cut where the socket stopped), empty when none."""
    while views:
        if socket.fileno() < 0:
            raise trio.ClosedResourceError("the stream was closed")
        try:
            written = os.writev(socket.fileno(), views[:_IOV_MAX])
        except BlockingIOError:
            return views
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc
        taken = 0
        while taken < len(views) and written >= views[taken].nbytes:
            written -= views[taken].nbytes
            taken += 1
        batch = min(len(views), _IOV_MAX)
        del views[:taken]
        if written:
            views[0] = views[0][written:]
        if taken < batch:  # the socket took part of the batch: it is full
            return views
    return views


def _byte_view(piece: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(piece)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def peer_name(stream: trio.abc.Stream) -> str:
    """``host:port`` of the stream's peer (under TLS, its transport's), or "unknown"."""
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    try:
        # Streams without a socket (in-memory ones of tests) raise AttributeError.
        host, port, *_ = stream.socket.getpeername()  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):
        return "unknown"
    return f"{host}:{port}"


class Cancellable(Protocol):
    """What a held write ends: a cancel scope, or what cancels one."""

    def cancel(self) -> None: ...


class HeldWrite:
    """A large write waiting for its client: what the client budget's pressure
    policy sees of it (its bytes, since when), and ends (``scope``: the
    connection) if it stalls (see :mod:`trionserve.core.client_budget`)."""

    __slots__ = ("held_bytes", "last_read", "_scope")

    def __init__(self, size: int, scope: Cancellable) -> None:
        self.held_bytes = size
        self.last_read = trio.current_time()
        self._scope = scope

    def evict(self, message: str) -> None:
        self._scope.cancel()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Watch._forget)
