"""Writing an answer without a trip through the event loop.

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
at c=16 and saved none at c=1, see benchmarks/README.md.)
"""

from __future__ import annotations

import os

import trio

__all__ = ["send_all", "write_now"]


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
