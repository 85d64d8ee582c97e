"""The rest of a large request message read straight from the socket into its
buffer, across its DATA frames. A part of
:class:`~trionserve.protocol.grpc.connection.Connection`, apart for its size.

A large message comes in several DATA frames: grpc-core writes in write cycles
of an adaptive target size (its ``Chttp2WriteSizePolicy``: 128 KiB, growing by
half after two fast writes of at least 70% of it), so at c=1 a 602 KB message
comes as a 442,338-byte frame, then, in the next cycle, the client's
WINDOW_UPDATE for the last answer and a 159,817-byte frame with END_STREAM
(that second write, under 70% of the target, stops the target's growth: the
split is the client's, whatever our settings). Once a read has taken the head
of such a frame (``h2.partial``), the rest of the message is read with one
``readv``: the rest of the frame into the message's buffer, the bytes up to
the next frame's payload into a slot (the next frame's 9-byte header after
the frames that came between the last message's frames: a WINDOW_UPDATE at
c=1), and the rest of the message into its buffer again. The slot's frames go
through the frame loop (``H2Connection.receive``) as any read's; when they end
with a DATA frame header of the message's stream, the bytes after it are that
frame's payload, in place, taken as the frame loop takes a frame in part
(``h2.took``). Any other layout (a frame between that did not come last time,
a frame that ends before the message) gives what landed past the slot to the
frame loop as bytes, copied out first: the same events in the same order, one
copy more. A read that ends between two frames, or inside the next frame's
header (kept in the slot, not given to h2), goes on the same way with the next.

When every call waits for its outcome (the client's next call is expected),
a call that comes as the connection's last one did (its head of the same
frames and length, its message of the same size and first frame: at c=1
grpc-core repeats a call so) is read whole in one ``readv`` (``_read_call``):
its head into a slot, its message straight into a buffer of that size, split
at its first frame's end by the slot for the frames between. The head is
checked frame by frame (a new stream's HEADERS, that stream's DATA header for
a frame of the predicted size, the prefix of a message of the predicted
size) before the frame loop takes it; the message's bytes are then taken in
place (``MessageReader.offered``), else every byte read goes to the frame loop,
copied out, and the prediction is dropped until a call teaches it again (kept
when the bytes began with a PING: grpc-core's bandwidth probe, sent after an
answer's data, lands in front of the next call's head now and then). A
read that holds the head but not the whole call is followed by one more
before anything is taken (the rest of the first DATA frame and a frame header
waited for, all of it once the frames between are in as predicted, else any
byte while too few came for the whole call: one whose frames between are
fewer bytes than the last one's may be whole already, and a wait for more
would last until the client sends its next call, which it sends only once
this one is answered). A call so read whole
whose frames the frame loop would take the common way (its HEADERS the
client's last block, only WINDOW_UPDATEs among its frames, its message ending
the stream within both windows: ``callhead.whole_call``) is taken in one step
(``_take_whole``): h2 moved for all its frames at once
(``h2frames.open_whole``), the call opened with its message whole, no event
per frame. The next call's head and the bytes between its DATA frames are
checked in slices against the last one's so taken, but for its stream id
(``_whole_as``): no frame parsed. Its read waits once, for the whole call
(``sockets.EagerReceiver.receive_whole``: ``SO_RCVLOWAT`` at its bytes but
the window updates among them, which may not come), where it would wake for
grpc-core's first write and again for its second: only while the client's
windows hold its message (it sends the call without hearing from us), and
once ``WHOLE_STREAK`` calls came as predicted since the last miss. A call that
is not (a smaller call, a reset alone) waits for the run's watch to
look, at most ``sockets.WATCH_SECS``, and doubles the streak the connection
needs before it waits whole again (up to ``WHOLE_STREAK_MAX``): a client
whose calls vary in size pays that wait on about log2 of its calls (a mix of
602 and 301 KB calls, one in ten small, waited for the look on most small
calls under a rule of one miss in 16 whole calls: p99 20 against 12 ms). Frames
a client sends on its own, not a call, read alone at a look are no miss: the
last call's window updates, and PINGs (grpc-core's bandwidth probe follows an
answer's data now and then: counted as misses, they doubled the streak needed
from 16 to 2,048 within 3,000 calls at c=1, and each waited for the look
whatever the streak). A call that needs the client's next bytes meanwhile
(its answer waits for a window) ends that wait at once (``hear``).

A read that finds nothing waits (``SO_RCVLOWAT``) for the rest of the frame and
one frame header more: whatever the client sends next is at least a header (a
client that resets the stream sends 13 bytes), so the wait always ends. Only
when both windows (the stream's and the connection's) hold the rest of the
message, so the client sends it without hearing from us; else the rest of the
frame alone is read so, as before.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import h2.exceptions
import structlog
from h2.errors import ErrorCodes

from trionserve.protocol.grpc import callhead, h2frames, laterread, upstream
from trionserve.protocol.grpc.laterread import LaterReads
from trionserve.protocol.grpc.writing import CLOSED
from trionserve.protocol.sockets import past

if TYPE_CHECKING:
    from collections.abc import Sequence

    from trionserve.protocol.grpc.answer import CallAnswer
    from trionserve.protocol.grpc.call import GrpcCall
    from trionserve.protocol.grpc.flow import ConnectionBuffer, Window
    from trionserve.protocol.grpc.framing import CallBuffers
    from trionserve.protocol.grpc.options import TransportOptions
    from trionserve.protocol.grpc.parking import Handler, Parked
    from trionserve.protocol.grpc.state import ConnectionState
    from trionserve.protocol.sockets import EagerReceiver

__all__ = ["CALL_LIMIT", "DIRECT_READ", "HEAD_SLOT", "SLOT", "MessageReads"]

log = structlog.get_logger(__name__)

# The rest of a message in a DATA frame that came in part is read straight into
# the message's buffer when it is at least this large (MessageReads._message_views).
DIRECT_READ = 64 * 1024
# The most bytes read into the slot between two DATA frames of a message, and
# into the slot for a call's head (_read_call).
SLOT = 64
HEAD_SLOT = 1024
# The largest message a call is read whole for (its buffer is made before the
# call comes: its pages are committed only as its bytes come).
CALL_LIMIT = 16 * 1024 * 1024
# Calls as predicted (their heads, their messages' lengths) since the last call
# waited for whole that was not, before the next is waited for whole; doubled
# by each such miss (a connection pays the watch's look on log2 of its calls).
WHOLE_STREAK = 16
WHOLE_STREAK_MAX = 1 << 16
_FRAME_HEADER = struct.Struct(">HBBBL")
_PING = b"\x00\x00\x08\x06"  # (a PING frame's length and type)
_DATA_FRAME, _PADDED = 0x0, 0x8


class MessageReads(LaterReads):
    """The connection's direct reads of a large message (a base of
    :class:`~trionserve.protocol.grpc.connection.Connection`, which sets the
    attributes below)."""

    h2: upstream.H2Connection
    calls: dict[int, GrpcCall]
    state: ConnectionState
    buffer: ConnectionBuffer
    _starting: list[tuple[GrpcCall, Handler | Parked]]
    _parked: dict[GrpcCall, Parked]
    answer: CallAnswer | None
    # The slot for the bytes between a message's DATA frames, and how many the
    # last message had there (its next frame's header and the frames before
    # it); of those, how many came already (whole frames read after the
    # frame's end, given to h2); the stream whose message is read so, 0 for none.
    _slot: memoryview
    _gap: int
    _skipped: int
    _reading: int
    # The start of a frame read into the slot, not given to h2 yet (its header
    # in part, or a small frame in part; the next read's bytes follow it:
    # ``with_kept``).
    _kept: int
    # The last call's layout when its message was read so: the bytes of its
    # read up to the message's first byte (HEADERS, other frames, the DATA
    # header and the message's prefix), the message's size and its first
    # DATA frame's; the next call is read straight into a buffer of that size
    # (_read_call). Then what landed past its head, for _take_arrived.
    _call: tuple[int, int, int] | None
    _head: memoryview
    _buffers: CallBuffers  # the messages' buffers, reused
    _last_read: int
    _arrived: tuple[int, memoryview, tuple[memoryview, ...], int] | None
    # Of a call read whole as predicted, what _take_whole takes (callhead.whole_call);
    # the last such call's layout, for the next one's bytes to be checked
    # against (_whole_as: the _call it was read as, callhead.pieces of its head and
    # of the bytes between its DATA frames, what whole_call made of them).
    _whole: tuple[bytes, list[tuple[int, int]], int] | None
    _template: tuple | None
    # A call waited for whole (_read_call: sockets.EagerReceiver.receive_whole)
    # once ``_streak`` calls came as predicted since the last miss, at least
    # ``_needed`` (WHOLE_STREAK, doubled by each miss); the receiver, for hear.
    _streak: int = 0
    _needed: int = WHOLE_STREAK
    _receiver: EagerReceiver | None = None
    options: TransportOptions
    peer: str

    def flush(self) -> None:
        raise NotImplementedError

    def _sweep(self) -> None:
        raise NotImplementedError

    def _on_data(
        self,
        stream_id: int,
        data: bytes | bytearray | memoryview | None,
        flow: int,
        ended: bool = False,
    ) -> None:
        raise NotImplementedError

    def _act(self, events: list) -> bool:
        raise NotImplementedError

    def _on_window(self, stream_id: int) -> None:
        raise NotImplementedError

    def _on_request(
        self, stream_id: int, headers: Sequence[tuple[bytes, bytes]], ended: bool = False
    ) -> GrpcCall | None:
        raise NotImplementedError

    def _give(self, windows: list[Window]) -> None:
        raise NotImplementedError

    async def _start_calls(self) -> bool:
        raise NotImplementedError

    def close(self, code: ErrorCodes = ErrorCodes.NO_ERROR) -> None:
        raise NotImplementedError

    def _message_views(self) -> tuple[int, tuple[memoryview, ...], int] | None:
        """Where the rest of a large message is read straight from the socket,
        and how many bytes to wait for: its stream id; the rest of the DATA
        frame that came in part (``h2.partial``), then, when the message goes
        on past it within the client's windows, the slot and the rest of the
        message; the rest of the frame and one frame header more (whatever
        the client sends next is at least a frame header: the wait ends).
        After a read that ended at a frame's end (``_reading``), the slot and
        the rest of the message. None when the message has less than
        DIRECT_READ to come (and none of it was read so), or no message is
        being read so."""
        h2conn = self.h2
        partial = h2conn.partial
        if partial is not None:
            stream_id, left, ended = partial
        elif self._reading and h2frames.between_frames(h2conn):
            stream_id, left, ended = self._reading, 0, False
        else:
            self._reading = 0
            return None
        call = self.calls.get(stream_id)
        room = None if call is None or call.error is not None else call.reader.room()
        if (
            room is None
            or (len(room) < DIRECT_READ and stream_id != self._reading)
            or self.state.closing
        ):
            self._reading = 0
            return None
        if stream_id != self._reading and partial is not None:  # learnt for the next call
            assert call is not None
            length = call.reader.size
            filled = length - len(room)  # (of the last read, when its frame began there)
            head = self._last_read - filled
            if 0 < head <= len(self._head) and length <= CALL_LIMIT:
                self._call = (head, length, left + 5 + filled)
        more = len(room) - left
        if more <= 0:  # the frame holds the rest of the message
            self._reading = stream_id
            return stream_id, (room,), len(room)
        if ended or more > h2frames.receive_window(h2conn, stream_id):
            self._reading = 0  # the rest of this frame only (the client waits for a window)
            return None if left < DIRECT_READ else (stream_id, (room[:left],), left)
        self._reading = stream_id
        kept = self._kept
        if kept < 9:
            size = self._gap - self._skipped
            # (between frames, no SO_RCVLOWAT: a header's first byte wakes
            # the reader as well as its ninth, without two setsockopt calls)
            size, least = size if size > 9 else 9, left + 9 - kept if left else 1
        else:  # a small frame in part: its rest and a frame header
            size, least = _frame_size(self._slot) + 9, 1
        return stream_id, (room[:left], self._slot[kept:size], room[left:]), least

    def with_kept(self, data: bytes | bytearray) -> bytes:
        """``data`` read as usual after the start of a frame was kept
        (``_kept``): the two together, for h2."""
        kept, self._kept = self._kept, 0
        return bytes(self._slot[:kept]) + data

    async def _read_call(self, receiver: EagerReceiver) -> bytes | bytearray:
        """Read the next call as the last one came (``_call``): its head into a
        slot, its message straight into a buffer of the last one's size, past
        its first frame the slot for the frames between and the rest. The
        bytes for the frame loop: the head when it is as predicted (what
        landed past it is taken after it, _take_arrived), else all of them."""
        assert self._call is not None
        size, length, first = self._call
        head = self._head[:size]
        message = self._buffers.take(length)
        first -= 5
        if first < length:
            gap = self._gap if self._gap > 9 else 9
            views: tuple[memoryview, ...] = (
                head,
                message[:first],
                self._slot[:gap],
                message[first:],
            )
        else:
            gap, views = 0, (head, message)
        total = size + length + gap
        template = self._template
        if (
            template is not None
            and template[0] == self._call
            and self._streak >= self._needed
            and length + 5 <= h2frames.new_call_window(self.h2)
        ):
            # One wait for the whole call: its bytes but the window updates the
            # last one had, which may not come (see the module docstring).
            self._receiver = receiver
            least = total - 13 * len(template[3][1])
            at = 0
            if gap:  # (its last raw contents where the last call of its layout had them)
                later_call = self.later_call is self._call
                at = self.later_at if later_call else self._later_at(receiver, length, first)
            if not at:
                received = await receiver.receive_whole(views, least)
            else:  # the message up to its last raw contents (see _defer)
                received = await receiver.receive_whole((head, message[:at]), least)
                if received == size + at:
                    received = self._defer(at, first, views, received, total)
            # (the watch woke it short of the call, which waited for the look: a
            # miss unless the call proves as predicted, grpc-core's first write
            # found at a look; one woken idle waited for nothing)
            short = received < least and receiver.woken == "held"
        else:
            received = await receiver.receive_into(views, 1, expect_wait=True)
            short = False
        if received <= size:
            if short and not _no_call(head[:received]):
                self._missed(True)  # (window updates or PINGs alone: no call waited)
            return bytes(head[:received])
        data = bytes(head)
        # (a head as the last one taken whole, but for its stream id: checked
        # in slices, its frames as they were)
        template, sid = self._template, data[5:9]
        if (
            template is not None
            and template[0] == self._call
            and callhead.same_as(template[1], data, sid)
        ):
            stream_id = int.from_bytes(sid, "big") & 0x7FFFFFFF
        else:
            template = None
            stream_id = callhead.call_head(data, length, first + 5)
            if not stream_id:  # not as predicted: every byte through the frame loop
                self._read_later()
                if data[:4] != _PING:  # (a PING in front, the next may come as predicted)
                    self._call = None
                self._missed(short)
                return _joined(views, received)
        # (its head as predicted, its message the last one's length: a wait for
        # the whole call was right, whatever comes between its frames)
        self._streak += 1
        slot = views[2] if gap else None
        if received < total and (slot is None or length + 5 <= h2frames.new_call_window(self.h2)):
            # The rest of the call, read before any of it is taken, after a
            # wait for the bytes the client sends without hearing from us (its
            # windows hold the message): the rest of its first DATA frame and
            # the next frame's header; all of it once the frames between are
            # in as predicted; else a byte, only while the bytes past the head
            # are too few for the whole call (the message and a DATA header:
            # a call with fewer bytes between its frames may be whole).
            got = received - size
            if slot is None or (got >= first + len(slot) and self._whole_as(data, slot, template)):
                least = total - received
            elif got < first:
                least = first - got + 9
            else:
                least = 1 if got < length + 9 else 0
            if least:
                received += await receiver.receive_into(past(views[1:], got), least, True)
        self._arrived = (stream_id, message, views[1:], received - size)
        if received == total:
            self._whole = self._whole_as(data, slot, template)
            if self._whole is None:
                self._read_later()  # (its frames between not as h2 takes them in one step)
        return data

    def _missed(self, waited: bool) -> None:
        """A call not as predicted (its head, or its message's length): when it
        was waited for whole (``waited``: it waited for the watch's look), the
        streak begins again and the one needed is twice as long. (One not so
        waited for cost nothing: the streak goes on, a client's other calls on
        the connection, its window updates or PINGs read alone, do not end it.)"""
        if waited:
            self._streak = 0
            self._needed = min(self._needed * 2, WHOLE_STREAK_MAX)

    def hear(self) -> None:
        """The connection waits for the client (a window for an answer): a
        wait for a whole call (_read_call) ends at its next byte."""
        if self._receiver is not None:
            self._receiver.lower()

    def _whole_as(
        self, data: bytes, slot: memoryview | None, template: tuple | None
    ) -> tuple[bytes, list[tuple[int, int]], int] | None:
        """What callhead.whole_call makes of a call read whole (``data`` its head,
        ``slot`` the bytes between its DATA frames): the ``template``'s when
        the head was checked against it and the slot is as its too (its
        frames as they were), else whole_call's, then kept as the template."""
        sid = data[5:9]
        if template is not None and (slot is None or callhead.same_as(template[2], slot, sid)):
            return template[3]
        assert self._call is not None
        stream_id = int.from_bytes(sid, "big") & 0x7FFFFFFF
        size, length, first = self._call
        whole = callhead.whole_call(data, slot, stream_id, length - first + 5)
        if whole is not None:
            kept = bytes(slot) if slot is not None else b""
            self._template = (
                self._call,
                callhead.pieces(data, sid),
                callhead.pieces(kept, sid),
                whole,
            )
        return whole

    def _take_read(self, data: bytes | bytearray) -> bool | None:
        """A read's bytes through the frame loop and acted on: True when the
        connection is over, None after a protocol error (it closes). A call
        read whole as predicted (``_whole``) is taken in one step, without
        the frame loop, when h2 would take its frames the common way."""
        whole = self._whole
        if whole is not None:
            self._whole = None
            if self._take_whole(*whole):
                later, starting = self.later, self._starting
                if (
                    later is None
                    or later.view is None
                    or (starting and starting[-1][0].method == laterread.MODEL_INFER)
                ):
                    return False  # (no rest, or ModelInfer's, which its handler takes)
                return not self._left_for_infer()
            later = self.later  # (its rest left in the socket: read before the frame loop)
            if later is not None and later.view is not None and not later.settle():
                self.close(ErrorCodes.PROTOCOL_ERROR)
                self._arrived = None
                return True
        try:
            events = self.h2.receive(data)
        except h2.exceptions.ProtocolError as exc:
            log.debug("grpc protocol error", peer=self.peer, error=str(exc))
            self.close(ErrorCodes.PROTOCOL_ERROR)
            self._arrived = None
            return None
        return self._act(events) or (self._arrived is not None and self._take_arrived())

    def _take_whole(self, block: bytes, windows: list[tuple[int, int]], largest: int) -> bool:
        """A call read whole as predicted (_read_call: its HEADERS ``block``,
        its message in its buffer, the client's window updates ``windows``
        between its DATA frames): h2 moved at once (``h2frames.open_whole``),
        then what the frame loop's events would do (``_on_window``,
        ``_on_request``, ``_on_data`` with the message whole and the stream's
        end); False when h2 would not take it so (nothing done)."""
        assert self._arrived is not None
        stream_id, message = self._arrived[0], self._arrived[1]
        length = len(message)
        size = length + 5
        limit = self.options.max_message_size
        if limit is not None and length > limit:  # (the reader refuses it)
            return False
        headers = h2frames.open_whole(self.h2, stream_id, block, size, windows, largest)
        if headers is None:
            return False
        self._arrived = None
        self._skipped = self._reading = 0
        for window_stream, _ in windows:
            # (a closed stream's is dropped, the new one's waits nothing; the
            # connection's wakes no sender when no call is in flight)
            if not window_stream and self.calls:
                self._on_window(0)
        call = self._on_request(stream_id, headers, True)  # (its state ENDED at once)
        if call is None:  # refused: the message's window back, as for a call that is over
            self._on_data(stream_id, None, size, True)
            return True
        call.messages.append(message)
        # Its window back at once, as _give gives it; written with the read's
        # output (_read: _start_calls writes it, the call has started).
        if self.buffer.whole(call.account, length):
            answer = self.answer
            if answer is None:
                self.h2.acknowledge_received_data(size, stream_id)
            else:  # h2 is the instance thread's while it writes the answer (answer.py)
                with answer.lock:
                    self.h2.acknowledge_received_data(size, stream_id)
        else:
            self._give(self.buffer.received(call.account, size, 0, [length]))
        return True

    def _take_arrived(self) -> bool:
        """After the frame loop took a call's head (_read_call): its message's
        bytes that landed in place, taken as the frame loop takes a frame in
        part; True when the connection is over."""
        assert self._arrived is not None
        stream_id, message, views, more = self._arrived
        self._arrived = None
        h2conn = self.h2
        partial = h2conn.partial
        call = self.calls.get(stream_id)
        first = len(views[0])
        if (
            call is None
            or call.error is not None
            or partial is None
            or partial[0] != stream_id
            or partial[1] != first
            or not call.reader.holds(message)
        ):
            return self._receive_and_act(_joined(views, more))
        self._reading = stream_id  # (the layout stays as predicted)
        if more <= first:
            ended = h2conn.took(more)[1]
            self._on_data(stream_id, None, more, ended)
            return False
        h2conn.took(first)
        return self._next_frames(stream_id, first, views, more - first)

    async def _read_message(
        self, receiver: EagerReceiver, stream_id: int, views: tuple[memoryview, ...], least: int
    ) -> bool | None:
        """Read the rest of the message into ``views`` (_message_views) and act
        on it: None to read on, else what the read loop returns (False: the
        client went away or said goodbye; True: a call keeps this task)."""
        try:
            received = await receiver.receive_into(views, least)
        except CLOSED:
            return False
        if not received:
            return False
        if self.answer is not None or self._parked:
            self._sweep()
        left = len(views[0])
        if received <= left:
            ended = self.h2.took(received)[1]
            self._on_data(stream_id, None, received, ended)
        else:
            if left:
                self.h2.took(left)
            if self._next_frames(stream_id, left, views, received - left):
                return False
        if not self._starting:
            self.flush()
        elif await self._start_calls():
            return True
        return None

    def _next_frames(
        self, stream_id: int, left: int, views: tuple[memoryview, ...], more: int
    ) -> bool:
        """The message's frame ended after ``left`` bytes, and ``more`` bytes
        came after it: into the slot (``views[1]``), then into the message's
        buffer (``views[2]``). Act on them; True when the connection is over."""
        slot, rest = views[1], views[2]
        got = more if more < len(slot) else len(slot)
        beyond = more - got
        head = bytes(self._slot[: self._kept + got])  # (views[1] follows what was kept)
        self._kept = 0
        at, whole = _layout(head, stream_id)
        if beyond and at != len(head):  # not the layout read for: all through the frames
            head += bytes(rest[:beyond])
            beyond = 0
            at, whole = _layout(head, stream_id)
        if at:  # the bytes between two frames of a message, for the next one
            self._gap = min(SLOT, self._skipped + at)
            self._skipped = 0
        else:
            self._skipped += whole
            part = len(head) - whole
            if part and (part < 9 or _frame_size(head, whole) + 9 <= SLOT):
                # A frame header, or a small frame, in part: kept for the next read.
                self._kept = part
                self._slot[:part] = head[whole:]
                head = head[:whole]
        h2conn = self.h2
        try:
            events = h2conn.receive(head)
            partial = h2conn.partial
            if beyond and (partial is None or partial[0] != stream_id):
                events += h2conn.receive(bytes(rest[:beyond]))  # h2 took the header
                beyond = 0
        except h2.exceptions.ProtocolError as exc:
            log.debug("grpc protocol error", error=str(exc))
            if left:
                self._on_data(stream_id, None, left)
            self.close(ErrorCodes.PROTOCOL_ERROR)
            return False
        if not beyond:
            if left:
                self._on_data(stream_id, None, left)
            return self._act(events)
        # The next frame's payload, in place in the message's buffer; what came
        # after that frame (it ended before the message) is copied out first.
        assert partial is not None
        take = beyond if beyond < partial[1] else partial[1]
        ended = h2conn.took(take)[1]
        after = bytes(rest[take:beyond]) if beyond > take else None
        if take == len(rest):  # the message is whole
            self._reading = 0
        between = False  # frames other than windows came between the two
        for event in events:
            if type(event) is not tuple or event[0] != upstream.WINDOW:
                between = True
                break
        if between:
            if left:
                self._on_data(stream_id, None, left)
            over = self._act(events)
            if not over:
                self._on_data(stream_id, None, take, ended)
        else:  # only windows: their order and the payload's is free
            for event in events:
                self._on_window(event[1])
            over = False
            self._on_data(stream_id, None, left + take, ended)
        if over or after is None:
            return over
        return self._receive_and_act(after)

    def _receive_and_act(self, data: bytes | bytearray) -> bool:
        """``data`` through the frame loop and acted on (_act); True when the
        connection is over. A protocol error closes the connection."""
        try:
            events = self.h2.receive(data)
        except h2.exceptions.ProtocolError as exc:
            log.debug("grpc protocol error", error=str(exc))
            self.close(ErrorCodes.PROTOCOL_ERROR)
            return False
        return self._act(events)


def _no_call(data: memoryview) -> bool:
    """Whether ``data`` is whole WINDOW_UPDATE and PING frames only (frames a
    client sends on its own, read alone: the watch found them held, no call
    waited for its look)."""
    at, size = 0, len(data)
    while at < size:
        kind = data[at : at + 4]
        if kind == b"\x00\x00\x04\x08":  # (a WINDOW_UPDATE's length and type)
            at += 13
        elif kind == _PING:
            at += 17
        else:
            return False
    return at == size > 0


def _joined(views: tuple[memoryview, ...], size: int) -> bytearray:
    """The first ``size`` bytes of ``views`` in turn, copied out into one buffer."""
    data, left = bytearray(), size
    for view in views:
        data += view[:left]
        left -= len(view)
        if left <= 0:
            break
    return data


def _frame_size(data: bytes | memoryview, at: int = 0) -> int:
    """The size of the frame whose header is at ``at`` in ``data``, header included."""
    high, low = _FRAME_HEADER.unpack_from(data, at)[:2]
    return 9 + (high << 8) + low


def _layout(data: bytes, stream_id: int) -> tuple[int, int]:
    """Where in ``data`` the payload of a DATA frame of ``stream_id`` starts
    after whole frames of other kinds (0: it does not so), and how many bytes
    its whole frames take (the rest: a frame in part)."""
    pos, size, at = 0, len(data), -1
    while size - pos >= 9:
        high, low, kind, flags, stream = _FRAME_HEADER.unpack_from(data, pos)
        if kind == _DATA_FRAME and at < 0:
            ours = stream & 0x7FFFFFFF == stream_id and not flags & _PADDED
            at = pos + 9 if ours else 0
        end = pos + 9 + (high << 8) + low
        if end > size:
            break
        pos = end
    return (at if at > 0 else 0), pos
