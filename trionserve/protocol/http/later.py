"""A repeated infer request's binary tensors read by the instance's thread, not the loop.

At c=1 the event loop reads a client's next request whole in one ``readv`` (head and body, see
:meth:`~trionserve.protocol.http.h1.H1Connection.take_again`), which costs it the kernel's copy
of the body: ~100 µs of a 602 KB request's ~580 (issue 39). Nothing on the loop reads the binary
tensors' bytes (the codec makes views of the body's buffer), so where the whole request is already
in the socket the loop reads only the head and the JSON header (:func:`read_again`), and the
thread that runs the request's batch reads the rest into the body's buffer before the backend
runs (:meth:`LaterBody.take`, one ``readv`` with the GIL released: the bytes are there, the socket
is non-blocking).

Only where nothing reads the inputs' bytes before the instance's thread (:func:`on_thread`): a
request decoded from its header's plan (every input binary, none BYTES, no shared memory) whose
answer the thread may write, of a model without the response cache, sequence batching or
ensemble scheduling, every instance of it a blocking one run by its instance's thread (ONNX
Runtime, PyTorch, TensorRT; not a Python model, in process or in its stub, whose inputs are read
on the loop) and a body over what a batch run inline on the loop may hold. Anywhere else the loop
reads the rest at once (:meth:`LaterBody.now`), before anything reads the body.

What holds:

- One reader. The body's rest is read exactly once, into the request's own buffer, under
  :class:`LaterBody`'s lock, by the instance's thread before the batch runs or by the loop when
  the request settles without it (failed, rejected, cancelled, timed out, dropped from its batch,
  or a connection that ends): :meth:`LaterBody.settle`, before the connection reads anything more.
  Either way the buffer holds the request's bytes before anyone uses them.
- The connection reads nothing more on its socket while the rest is there: its wait for the
  client's next request (the answer's wait) sets ``SO_RCVLOWAT`` to one byte past the rest, so
  that the rest does not wake it, and the reader sets it back to one as it takes the rest (Linux
  wakes a waiter then if bytes beyond it came). The client's end wakes it whatever the mark.
- A read that fails (the connection reset) fails that request only, with a clear error, and the
  connection closes after its answer (:attr:`LaterBody.broken`).
- The body counts in the client budget from its head to its answer, as any body does.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket as _socket
import termios
import threading
from typing import TYPE_CHECKING

import trio

from trionserve.actors.executor import INLINE_MAX_INPUT_BYTES
from trionserve.backends.base import AsyncBackendInstance
from trionserve.core.errors import InvalidArgument
from trionserve.protocol.http.state import Server

if TYPE_CHECKING:
    from trionserve.actors.model import ModelVersion
    from trionserve.protocol.http.h1 import H1Connection
    from trionserve.protocol.http.h1_request import LastHead

__all__ = ["LaterBody", "on_thread", "read_again"]

_LOWAT = getattr(_socket, "SO_RCVLOWAT", None)
_FIONREAD, _INQ = termios.FIONREAD, bytes(4)
# The peer ended its side (poll's POLLRDHUP; Linux's value where Python has no name for it).
_RDHUP = getattr(select, "POLLRDHUP", 0x2000)


def queued(socket: trio.socket.SocketType) -> int:
    """The bytes the socket holds now, unread (``FIONREAD``)."""
    return int.from_bytes(fcntl.ioctl(socket.fileno(), _FIONREAD, _INQ), "little")


def hung_up(socket: trio.socket.SocketType) -> bool:
    """Whether the peer ended its side (or the connection failed), whatever is still unread."""
    poller = select.poll()
    poller.register(socket.fileno(), _RDHUP)
    return bool(poller.poll(0))


class LaterBody:
    """A connection's request body whose rest (``view``: after the JSON header) is still in the
    socket. The loop :meth:`offer`\\ s it as it reads the request's head; the infer handler either
    :meth:`defer`\\ s it to the instance's thread or reads it :meth:`now`; the thread
    :meth:`take`\\ s it; the loop :meth:`settle`\\ s it as the request's answer is made."""

    __slots__ = ("_lock", "broken", "fd", "pending", "socket", "view")

    def __init__(self, socket: trio.socket.SocketType) -> None:
        self.socket = socket
        # Its descriptor, for the loop's reads while the connection's task serves it (closed only
        # as that task ends: Trio's fileno() is two Python calls a request).
        self.fd = socket.fileno()
        self._lock = threading.Lock()
        # The part of the body's buffer still to read, from offer to the read.
        self.view: memoryview | None = None
        # Deferred to the instance's thread, and not yet read (read on that thread, unlocked).
        self.pending = False
        # A read of it failed: the request fails, the connection closes after its answer.
        self.broken: str | None = None

    def offer(self, view: memoryview) -> None:
        """The loop read the request without ``view``, which the socket holds whole."""
        self.view = view
        self.broken = None

    def defer(self) -> None:
        """Leave the rest to the instance's thread (on the loop, before the request is submitted):
        the connection's wait for the next request wakes for none of it (``SO_RCVLOWAT``)."""
        view = self.view
        assert view is not None
        if _LOWAT is not None:
            try:
                self.socket.setsockopt(_socket.SOL_SOCKET, _LOWAT, len(view) + 1)
            except OSError:
                pass  # (closed: the read says so)
        self.pending = True

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
                self.pending = False
                self._read()
                if _LOWAT is not None:
                    try:
                        self.socket.setsockopt(_socket.SOL_SOCKET, _LOWAT, 1)
                    except OSError:
                        pass
        return self.broken is None

    def settle(self) -> bool:
        """As the request's answer is made (on the loop): a rest not read yet is read now, into
        the request's buffer (the request failed, was rejected or cancelled, or is dropped);
        whether the connection may go on (False: a read failed, it closes)."""
        if self.view is not None:
            if self.pending:
                self.take()
            else:
                self._read()
        return self.broken is None

    def _read(self) -> None:
        """Read ``view`` whole from the socket, which holds it (with the lock, or on the loop
        before it is deferred)."""
        view, self.view = self.view, None
        if view is None:
            return
        try:
            fd = self.socket.fileno()
            while view:
                received = os.readv(fd, (view,))
                if not received:
                    raise ConnectionError("the client ended its side")
                view = view[received:]
        except OSError as exc:  # (BlockingIOError: less was there than its FIONREAD said)
            self.broken = f"the request's binary data could not be read from its connection: {exc}"


def read_again(
    later: LaterBody, h1: H1Connection, last: LastHead, head: memoryview, body: memoryview
) -> int | None:
    """Read a request expected to repeat ``last`` (the buffers of
    :meth:`~trionserve.protocol.http.h1.H1Connection.again_buffers`) without its binary tensors
    where the socket holds all of them: the bytes read, the rest counted as read and offered to
    ``later``; else what one ``readv`` read, as that method's caller reads it (None: nothing)."""
    at = last.tensors_at
    fd = later.fd
    try:
        received = os.readv(fd, (head, body[:at]))
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(exc) from exc
    if received < len(head) + at:
        return received
    rest = body[at:]
    size = len(rest)
    if (
        head == last.raw
        and h1.state.server is Server.IDLE
        and last.head_size <= h1.max_header_size
        and int.from_bytes(fcntl.ioctl(fd, _FIONREAD, _INQ), "little") >= size  # (queued)
    ):
        later.view, later.broken = rest, None  # (offer)
        return received + size
    try:
        more = os.readv(fd, (rest,))
    except BlockingIOError:
        more = 0
    except OSError as exc:
        raise trio.BrokenResourceError(exc) from exc
    return received + more


def deferrable(last: LastHead) -> bool:
    """Whether a request made from ``last`` has binary tensors worth leaving to the thread: more
    than a batch run inline on the loop may hold (so no batch of it runs there)."""
    return 0 < last.tensors_at and last.length - last.tensors_at > INLINE_MAX_INPUT_BYTES


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
