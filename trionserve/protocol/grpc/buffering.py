"""The connection's buffer's decisions applied to h2: the flow-control windows
:class:`~trionserve.protocol.grpc.flow.ConnectionBuffer` lets go given to the
client, as a call's messages are taken, answered and sent, and the receivers
waiting for room woken. A part of
:class:`~trionserve.protocol.grpc.connection.Connection`, apart for its size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import h2.exceptions
import trio

from trionserve.protocol.grpc.flow import ConnectionBuffer, Window

if TYPE_CHECKING:
    from trionserve.protocol.grpc.answer import CallAnswer
    from trionserve.protocol.grpc.call import GrpcCall
    from trionserve.protocol.grpc.upstream import H2Connection

__all__ = ["BufferWindows"]


class BufferWindows:
    """The connection's methods that apply its buffer's decisions (a base of
    :class:`~trionserve.protocol.grpc.connection.Connection`, which sets the
    attributes below)."""

    h2: H2Connection
    calls: dict[int, GrpcCall]
    buffer: ConnectionBuffer
    _room: trio.lowlevel.ParkingLot
    _room_waiters: int  # the receivers parked in _room
    answer: CallAnswer | None

    def flush(self) -> None:
        raise NotImplementedError

    def _give(self, windows: list[Window]) -> None:
        """Give the client the flow-control windows the buffer let go (under
        the armed answer's lock: h2 is the instance thread's while it writes
        the answer, answer.py), then have them written."""
        if not windows:
            return
        answer = self.answer
        lock = answer.lock if answer is not None else None
        if lock is not None:
            lock.acquire()
        try:
            h2conn = self.h2
            calls = self.calls
            for window in windows:
                try:
                    if window.connection:
                        h2conn.increment_flow_control_window(window.connection)
                    call = calls.get(window.stream_id)
                    if call is None or call.state.reset:
                        continue  # the stream is over: its window no longer matters
                    if window.ack:
                        h2conn.acknowledge_received_data(window.ack, window.stream_id)
                    if window.stream:
                        h2conn.increment_flow_control_window(window.stream, window.stream_id)
                except h2.exceptions.ProtocolError:  # the stream closed meanwhile
                    pass
        finally:
            if lock is not None:
                lock.release()
        self.flush()

    def taken(self, call: GrpcCall, size: int) -> None:
        """A handler took a message: it stays held, as work not answered yet;
        flow control held back for the call's queue may be released."""
        if windows := self.buffer.taken(call.account, size):
            self._give(windows)

    def answered(self, call: GrpcCall) -> None:
        """The oldest message ``call`` took is answered."""
        if windows := self.buffer.answered(call.account):
            self._give(windows)
        if self._room_waiters:  # receivers wait for room: there may be some
            self._room.unpark_all()

    def answered_all(self, call: GrpcCall) -> None:
        """Everything ``call`` took is answered (a unary call's response)."""
        if call.account.taken:
            if windows := self.buffer.answered_all(call.account):
                self._give(windows)
            if self._room_waiters:  # receivers wait for room: there may be some
                self._room.unpark_all()

    def sending(self, size: int) -> None:
        """Count ``size`` more bytes of responses waiting to be sent (negative:
        fewer); with the work not answered, they hold new messages back."""
        if windows := self.buffer.sending(size):
            self._give(windows)
        if size < 0:
            if self._room_waiters:  # receivers wait for room: there may be some
                self._room.unpark_all()

    async def wait_for_room(self, size: int) -> None:
        """Wait until a message of ``size`` bytes may be taken (ConnectionBuffer.has_room)."""
        while not self.buffer.has_room(size):
            self._room_waiters += 1
            try:
                await self._room.park()
            finally:
                self._room_waiters -= 1
