"""Writing a connection's output: what h2 queues (and the raw frames beside it)
written to the socket by one task at a time, the writer or the task that just
made it (a call's, or the reader's after its read's calls ended, with no
coroutine and no checkpoint when the socket takes it all). A part of
:class:`~trionserve.protocol.grpc.connection.Connection`, apart for its size.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import trio

from trionserve.protocol.grpc import inline
from trionserve.protocol.grpc.answer import ARMED, DISARMED, resolve
from trionserve.protocol.grpc.framing import coalesce
from trionserve.protocol.sockets import send_pieces, send_pieces_now

if TYPE_CHECKING:
    from trionserve.core.outputs import Described
    from trionserve.protocol.grpc.answer import CallAnswer
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
    # The armed answer of the call the instance's thread may answer (answer.py),
    # and what of an answer it began the socket did not take, written first.
    answer: CallAnswer | None
    unsent: list[memoryview]
    # The answer whose write the loop took while the thread's write was in
    # progress, and the claim of the thread's next write (answer.py).
    stolen: CallAnswer | None
    answer_claim: threading.Lock
    # The last answer the instance's thread wrote, to write one described the
    # same without encoding it (answer.py; read and set under the answer's lock).
    repeat: Described | None = None
    # A taken answer nothing refers to any more, armed again for the next call
    # (answer.arm; left by a parked call that ended the common way, parkedinfer.py).
    spare: CallAnswer | None = None
    socket: trio.socket.SocketType | None
    _dirty: trio.Event
    writing: bool
    _written: trio.Event | None

    def cancel(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Ask the writer to send whatever h2 has queued, if anything."""
        if self.h2.has_output() or self.extra_frames or self.unsent:
            self._dirty.set()

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            if not self.writing:  # else the task writing now writes this too
                try:
                    # (gathered straight to a plain socket; joined for TLS's records)
                    await self._write_pending(self.socket is not None)
                except CLOSED:
                    self.cancel()
                    return
            if self.state.closing and not self.writing:
                # Everything up to the final GOAWAY is written.
                self.cancel()
                return

    def _write_at_once(self) -> inline.Resume | None:
        """Write h2's output from the reader's task after its calls ended, as an
        HTTP/1.1 task writes its answer: straight to the socket, no coroutine, no
        checkpoint. The rest (all of it under TLS) goes on as _write_now, a Resume
        for the reader to await (None: all written)."""
        # (nothing queued, the usual case once a call parked: no lock, no write)
        if not (self.h2.has_output() or self.unsent or self.extra_frames):
            if self.state.closing:  # (nothing queued: a read that made no answer)
                self._dirty.set()  # the writer ends the connection
            return None
        answer = self.answer
        # (armed for a call parked in no task: written without disarming it)
        if answer is not None and not self.writing and self._write_armed(answer):
            return None
        if self.writing or self.socket is None:  # (another task writes it, or TLS)
            return inline.step(self._write_now(at_once=True))
        buffers = self._pending()
        try:
            if rest := send_pieces_now(self.socket, buffers):
                return inline.step(self._write_now(at_once=True, first=rest))
        except CLOSED:
            self.cancel()
            return None
        if self.state.closing:
            self._dirty.set()  # the writer ends the connection
        return None

    async def _write_now(self, at_once: bool | None = None, first: list | None = None) -> None:
        """Write what h2 has queued from the calling task, unless another task is
        writing (it writes this too): no wakeup of the writer, for the last call
        in flight; with others in flight, the writer writes it (their answers of
        the same batch join it); ``first`` before h2's output."""
        if self.writing:
            return
        if at_once is None and self.calls:
            # Others in flight: the answers their tasks queue in this pass of
            # the run loop (a batch's) go out in one write, the writer's.
            self.flush()
            return
        try:
            await self._write_pending(True if at_once is None else at_once, first)
        except CLOSED:
            self.cancel()
            return
        if self.state.closing:
            self._dirty.set()  # the writer ends the connection

    async def _write_pending(self, at_once: bool = False, first: list | None = None) -> None:
        """Write everything queued, until nothing is left; ``at_once``: what the
        socket takes at once without a checkpoint (sockets.send_pieces)."""
        if self.answer is not None and not first and self._write_armed(self.answer):
            return
        self.writing = True
        try:
            while True:
                buffers = self._pending()
                if first:
                    buffers[:0], first = first, None
                if not buffers:
                    return
                if at_once:
                    await send_pieces(self.stream, buffers)
                    continue
                for data in coalesce(buffers):
                    await self.stream.send_all(data)
        finally:
            self.writing = False
            if self._written is not None:
                self._written.set()
                self._written = None

    def _pending(self) -> list:
        """Everything queued to write, in order, taken: the rest of an answer
        the instance's thread began, h2's output, the raw frames."""
        buffers = self.h2.buffers_to_send()
        if self.stolen is not None and (buffers or self.extra_frames):
            resolve(self)  # (a thread's write taken in progress: answer.py)
        if self.unsent:
            buffers[:0] = self.unsent
            self.unsent = []
        if self.extra_frames:
            buffers.extend(self.extra_frames)
            self.extra_frames.clear()
        return buffers

    def _write_armed(self, answer: CallAnswer) -> bool:
        """With a call's answer armed for the instance's thread (answer.py): what
        is queued, written under the answer's lock without waiting, the answer
        left armed; True when the socket took all of it. Else (the socket full,
        the answer not armed any more) the answer is taken: the loop writes."""
        socket = self.socket
        with answer.lock:
            if answer.state == ARMED and not self.writing and socket is not None:
                buffers = self._pending()
                try:
                    rest = send_pieces_now(socket, buffers)
                except BaseException:
                    answer.state = DISARMED
                    raise
                if not rest:
                    return True
                self.unsent[:0] = rest
                answer.state = DISARMED
        answer.take()
        return False
