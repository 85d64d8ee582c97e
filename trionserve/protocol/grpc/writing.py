"""Writing a connection's output: what h2 queues (and the raw frames beside it)
written to the socket by one task at a time, the writer or the task that just
made it (a call's, or the reader's after its read's calls ended, with no
coroutine and no checkpoint when the socket takes it all). A part of
:class:`~trionserve.protocol.grpc.connection.Connection`, apart for its size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from trionserve.protocol.grpc import inline
from trionserve.protocol.grpc.framing import coalesce
from trionserve.protocol.sockets import send_pieces, send_pieces_now

if TYPE_CHECKING:
    from trionserve.protocol.grpc.call import GrpcCall
    from trionserve.protocol.grpc.state import ConnectionState
    from trionserve.protocol.grpc.upstream import H2Connection

__all__ = ["CLOSED", "SocketWriter"]

CLOSED = (trio.BrokenResourceError, trio.ClosedResourceError)


class SocketWriter:
    """The connection's writing (a base of
    :class:`~trionserve.protocol.grpc.connection.Connection`, which sets the
    attributes below)."""

    h2: H2Connection
    stream: trio.abc.Stream
    state: ConnectionState
    calls: dict[int, GrpcCall]
    extra_frames: list[bytes]
    _socket: trio.socket.SocketType | None
    _dirty: trio.Event
    _writing: bool
    _written: trio.Event | None

    def cancel(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Ask the writer to send whatever h2 has queued, if anything."""
        if self.h2.has_output() or self.extra_frames:
            self._dirty.set()

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            if not self._writing:  # else the task writing now writes this too
                try:
                    await self._write_pending()
                except CLOSED:
                    self.cancel()
                    return
            if self.state.closing and not self._writing:
                # Everything up to the final GOAWAY is written.
                self.cancel()
                return

    def _write_at_once(self) -> inline.Resume | None:
        """Write h2's output from the reader's task after its calls ended, as an
        HTTP/1.1 task writes its answer: straight to the socket, no coroutine, no
        checkpoint. The rest (all of it under TLS) goes on as _write_now, a Resume
        for the reader to await (None: all written)."""
        if self._writing or self._socket is None:  # (another task writes it, or TLS)
            return inline.step(self._write_now(at_once=True))
        buffers = self.h2.buffers_to_send()
        if self.extra_frames:
            buffers.extend(self.extra_frames)
            self.extra_frames.clear()
        try:
            if rest := send_pieces_now(self._socket, buffers):
                return inline.step(self._write_now(at_once=True, first=rest))
        except CLOSED:
            self.cancel()
            return None
        if self.state.closing:
            self._dirty.set()  # the writer ends the connection
        return None

    async def _write_now(self, at_once: bool | None = None, first: list | None = None) -> None:
        """Write what h2 has queued from the calling task, unless another task is
        writing (it writes this too): no wakeup of the writer. ``at_once`` by
        default for the last call in flight; with others in flight, send_all's
        checkpoint lets their answers join this write; ``first`` before h2's output."""
        if self._writing:
            return
        try:
            await self._write_pending(not self.calls if at_once is None else at_once, first)
        except CLOSED:
            self.cancel()
            return
        if self.state.closing:
            self._dirty.set()  # the writer ends the connection

    async def _write_pending(self, at_once: bool = False, first: list | None = None) -> None:
        """Write everything queued, until nothing is left; ``at_once``: what the
        socket takes at once without a checkpoint (sockets.send_pieces)."""
        self._writing = True
        try:
            while True:
                buffers = self.h2.buffers_to_send()
                if first:
                    buffers[:0], first = first, None
                if self.extra_frames:
                    buffers.extend(self.extra_frames)
                    self.extra_frames.clear()
                if not buffers:
                    return
                if at_once:
                    await send_pieces(self.stream, buffers)
                    continue
                for data in coalesce(buffers):
                    await self.stream.send_all(data)
        finally:
            self._writing = False
            if self._written is not None:
                self._written.set()
                self._written = None
