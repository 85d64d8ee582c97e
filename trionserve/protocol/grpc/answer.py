"""A unary ModelInfer call's answer written by the instance's thread that computed it.

Over HTTP/1.1 the instance's thread writes the answer itself
(:mod:`trionserve.protocol.http.answer`), so the event loop wakes once per request
(for the client's next one) instead of twice; a gRPC call's answer was always
written by the loop, woken by the thread's report: about 270 us of loop CPU per
602 KB call (benchmarks/README.md, issue 39's eighth and ninth rounds). A
:class:`CallAnswer` lets the thread write it on a plain-socket connection.

The call *arms* it (:func:`arm`) when nothing else must happen between the
backend's response and its encoding (no trace, access log, compression,
shared memory, classification, debug delay: ``GrpcService._answerable``) and it
is the only call on its connection that may still answer. The instance's thread
(:meth:`CallAnswer.write`), holding the answer's lock and still armed, encodes
the response as the loop would (infercache, else the codec; a response described
as the connection's last one is that one's bytes around the outputs' arrays,
:class:`~trionserve.core.outputs.Described`, kept as ``Connection.repeat``) and gives h2 what
the loop's ``GrpcCall.send`` and ``finish`` give it: the response headers and
the whole message as one DATA frame (``send_unary``: a constant HPACK block,
within both send windows and the peer's frame size; otherwise it declines,
nothing done), then the OK trailers (a constant block); it writes h2's output
(what was queued before, then these frames) with one non-blocking ``writev``.
The frames and h2's state are what the loop's own calls make
(tests/unit/test_grpc_thread_answer.py holds the two side by side).

What holds:

- The loop never touches the connection's h2 state or socket while the thread
  may: the reader *takes* the answer (:meth:`CallAnswer.take`: disarmed under
  the lock, waiting for a write in progress) before it hands h2 any byte the
  client sent (a WINDOW_UPDATE, a PING, a RST_STREAM, the next call); so do
  ``close``, a keepalive PING, a GOAWAY and the connection's end before its
  socket closes. Two touches keep it armed, under the lock: the windows the
  connection's buffer gives (``BufferWindows._give``), and a write of what h2
  queued (``SocketWriter._write_armed``: without waiting; what the socket does
  not take whole leaves the answer to the loop). The thread writes only with
  nothing being written and nothing beside h2's output queued.
- Taken once the thread wrote it (WRITTEN), the call's state moves as the loop's
  send and finish move it (answered: its task sends nothing more); the rest of a
  write the socket did not take whole (PARTIAL) is written first by the loop
  (``SocketWriter.unsent``), which the thread wakes at once, as it does for an
  answer it declined (DISARMED: the loop encodes and writes it as always).
- Taken while the thread's write is in progress (WRITING: h2's output taken,
  the frames made), the answer is the loop's at once, as WRITTEN (a settle
  that waited for the thread's mark cost the loop its lock and two switches,
  13-28% of takes under load): only the socket stays the thread's until its
  write returns (``Connection.stolen``). The loop sees to it (:func:`resolve`:
  what the socket did not take goes first in ``unsent``) before it writes
  (``SocketWriter._pending``), at the next take, and before the socket closes
  (``take_answer``); the thread's next answer declines while such a rest
  waits. Who settles a write in progress is decided once, by whichever of the
  two first takes that write's claim (``Connection.answer_claim``, a
  non-blocking acquire, atomic); the loop that took it makes the next write a
  new one.
- The call keeps exactly one final outcome: carried on by the report (the
  loop's next sweep: the client's next call, or the transport's 0.25 s tick;
  parked in no task meanwhile, :mod:`~trionserve.protocol.grpc.parking`, or
  its task woken), it finds the answer taken and ends without a status of its own;
  cancelled or failed after the thread's answer, it sends nothing either (the
  client has it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import h2.exceptions as h2_exceptions
import trio

from trionserve.core.deferred import sweep_deferred
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.core.outputs import Described
from trionserve.protocol.grpc import codec as grpc_codec
from trionserve.protocol.grpc import infercache as grpc_infercache
from trionserve.protocol.grpc import inline
from trionserve.protocol.grpc.framing import JOIN_LIMIT, OK_TRAILERS, RESPONSE_HEADERS, prefix
from trionserve.protocol.grpc.state import RESPONSE_TRANSITIONS, Request, Response, ResponseEvent
from trionserve.protocol.sockets import send_pieces_now

if TYPE_CHECKING:  # the connection imports this module; no cycle at run time
    from trionserve.protocol.grpc.call import GrpcCall
    from trionserve.protocol.grpc.connection import Connection
    from trionserve.protocol.grpc.writing import SocketWriter
    from trionserve.protocol.later import LaterBody

__all__ = ["ANSWERED", "ARMED", "DISARMED", "PARTIAL", "WRITTEN", "CallAnswer", "arm"]

# States of an answer.
ARMED = 1  # the instance's thread may write it
WRITTEN = 2  # the thread wrote it whole
PARTIAL = 3  # the thread began it: the loop writes ``unwritten``
DISARMED = 4  # the loop answers
WRITING = 5  # the thread writes it (holding the lock)

_FINISH = ResponseEvent.FINISH  # (read once, not per take)

# What ModelInfer's handler returns for an answer the thread wrote (or began):
# GrpcCall.send sends nothing.
ANSWERED: list = []


A = TypeVar("A", bound="CallAnswer")


def arm(call: GrpcCall, request: InferenceRequest, kind: type[A]) -> A | None:
    """Arm ``call``'s answer (a ``kind``) for the thread that computes
    ``request`` (before it is submitted), if the connection allows: a plain
    socket, open, no answer armed, no other call that may still answer (so
    nothing else writes to the stream's connection meanwhile), the call's
    request whole, not compressed. The connection's spare answer of that kind
    (``SocketWriter.spare``: one nothing refers to any more) is armed again,
    not a new one made."""
    conn = call.connection
    state = call.state
    if (
        conn.answer is not None
        or conn.socket is None
        or conn.state.draining
        or call.compress
        or state.request is not Request.ENDED
        or state.response is not Response.IDLE
    ):
        return None
    calls = conn.calls
    for each in calls:  # (by key: no values() call per arm)
        other = calls[each]
        if other is not call and other.state.answerable:
            return None
    answer: Any = conn.spare
    if answer is not None and type(answer) is kind:
        conn.spare = None
        # (__init__'s per-call fields, set again: the lock is the connection's)
        answer._call = call
        answer._request = request
        answer.state = ARMED
        answer.unwritten = answer.owed = answer._token = None
    else:
        answer = kind(conn, call, request)
    conn.answer = request.answer = answer
    return answer  # (typed Any: no cast() call)


class CallAnswer:
    """One unary call's answer, which the instance's thread may write (see the
    module docstring); the :class:`~trionserve.core.inference.ThreadAnswer` of
    its request."""

    __slots__ = ("_call", "_conn", "_request", "_token", "lock", "owed", "state", "unwritten")

    def __init__(self, conn: Connection, call: GrpcCall, request: InferenceRequest) -> None:
        self._conn = conn
        self._call = call
        self._request: InferenceRequest | None = request
        # The connection's (one answer armed at a time; an answer taken is never
        # armed again): made once per connection, not per call.
        self.lock = conn.answer_lock
        self.state = ARMED
        self.unwritten: list[memoryview] | None = None
        # Set by the thread whose write the loop took in progress: what of it
        # the socket did not take, ``(rest,)`` (see resolve).
        self.owed: tuple[list[memoryview]] | None = None
        # The loop's, to be woken for that rest (set before the loop claims).
        self._token: trio.lowlevel.TrioToken | None = None

    # -- on the Trio thread --------------------------------------------------------

    @property
    def later(self) -> LaterBody | None:
        """The rest of a message its connection left in the socket for the
        instance's thread (protocol/later.py), which reads it before the batch
        runs (``InstanceThread._take_bodies``)."""
        return self._conn.later

    @property
    def armed(self) -> bool:
        return self.state == ARMED

    def wait(self) -> Awaitable[None]:
        """Before the request's wait for its outcome: an answer the thread
        wrote already has its report deferred: swept now, not left for later.
        (What is awaited is ``inline.READY``, not a coroutine.)"""
        state = self.state
        if state == WRITTEN or state == PARTIAL:
            sweep_deferred()
        return inline.READY

    def finalized(self) -> None:
        """The outcome was delivered on the loop: the answer is taken (a
        declined one is the loop's: the call's task, woken, writes it)."""
        self.take()

    def take(self) -> int:
        """Disarm the answer (waiting for a write in progress) and, the first
        time, move the call's state (and the connection's output) as the
        thread's write moved the wire: WRITTEN, PARTIAL or DISARMED. A write in
        progress is WRITTEN without waiting for it (see the module docstring).
        A message rest deferred to the thread (this call's: its answer is the
        one armed) is read first: the thread finds it through this answer only
        (``later``), which it no longer sees once taken."""
        state = self.state
        conn = self._conn
        later = conn.later
        if later is not None and later.pending:
            later.settle()
        stolen = conn.stolen
        if stolen is not None and stolen is not self:  # (the last call's: ended since)
            resolve(conn)
        if state == WRITING:
            claim = conn.answer_claim
            self._token = trio.lowlevel.current_trio_token()
            if claim.acquire(False):
                if self.state == WRITING:  # (taken first: the thread leaves the answer alone)
                    conn.answer_claim = threading.Lock()  # (the next write's)
                    conn.stolen = self
                    state = self.state = WRITTEN
                else:  # (the thread ended its write between the two reads)
                    claim.release()
                    state = self.state
        if state == ARMED or state == WRITING:
            with self.lock:
                state = self.state
                if state == ARMED:
                    state = self.state = DISARMED
        if conn.answer is self:
            conn.answer = None
            request, self._request = self._request, None
            if request is not None and request.answer is self:
                request.answer = None
            if state != DISARMED:
                call_state = self._call.state
                # (the headers and the trailers: answered, as FINISH moves IDLE
                # too; response_event written out: its table's move from either
                # answerable state, to one that is not)
                if call_state.answerable:
                    call_state.response = RESPONSE_TRANSITIONS[call_state.response][_FINISH]
                    call_state.answerable = False
                rest, self.unwritten = self.unwritten, None
                if rest:  # written first, before anything h2 queues after it
                    conn.unsent[:0] = rest
                    conn.flush()
        return state

    # -- on the instance's thread ------------------------------------------------------

    def write(self, request: InferenceRequest, response: InferenceResponse) -> bool:
        """Encode and write ``request``'s answer, if still armed for it: True
        when the socket took it whole; False leaves it (or its ``unwritten`` rest) to the
        loop, which the caller wakes."""
        with self.lock:
            if self.state != ARMED or self._request is not request:
                return False
            conn = self._conn
            call = self._call
            h2 = conn.h2
            socket = conn.socket
            stolen = conn.stolen  # (an earlier write's rest, not yet unsent: resolve)
            if (
                conn.writing
                or conn.unsent
                or conn.extra_frames
                or socket is None
                or (stolen is not None and stolen.owed and stolen.owed[0])
            ):
                self.state = DISARMED
                return False
            try:
                repeat = conn.repeat
                pieces = repeat.pieces(request, response) if repeat is not None else None
                if pieces is None:
                    chunks = grpc_infercache.encode_response(
                        response, request
                    ) or grpc_codec.encode_infer_response(response, request, None, None)
                    head = prefix(sum(map(len, chunks)))
                    pieces = [head, *chunks]
                    conn.repeat = Described.of(request, response, [head], chunks)
                data = b"".join(pieces)
                # GrpcCall.send's and finish's calls, as the loop makes them.
                if len(data) > JOIN_LIMIT or not h2.send_unary(
                    call.stream_id, RESPONSE_HEADERS, data
                ):
                    self.state = DISARMED
                    return False
            except Exception:
                self.state = DISARMED  # the loop encodes it again, and answers its error
                return False
            try:  # GrpcCall.finish's
                h2.send_headers(call.stream_id, OK_TRAILERS, end_stream=True)
            except h2_exceptions.ProtocolError:  # (none: the stream is held and open)
                pass
            buffers = h2.buffers_to_send()
            claim = conn.answer_claim  # (this write's: see take)
            self.state = WRITING
            try:
                if len(buffers) == 1:  # (h2's output, this answer last: one write)
                    rest = _write_now(socket, buffers[0])
                else:
                    rest = send_pieces_now(socket, buffers)
            except Exception:  # the loop's write raises what it means (a reset)
                rest = [memoryview(piece) for piece in buffers]
            if not claim.acquire(False):  # the loop took it meanwhile (see resolve)
                self.owed = (rest,)
                if rest and self._token is not None:  # (the loop writes it now)
                    try:
                        self._token.run_sync_soon(_resolve_soon, conn, self)
                    except trio.RunFinishedError:
                        pass
                return not rest
            if rest:
                self.unwritten = rest
                self.state = PARTIAL
            else:
                self.state = WRITTEN
            claim.release()  # (after the state: a take that claims it then reads that)
            return not rest


def _resolve_soon(conn: SocketWriter, answer: CallAnswer) -> None:
    """On the Trio thread: the rest of a write taken in progress, written now."""
    if conn.stolen is answer:
        resolve(conn)


def resolve(conn: SocketWriter) -> None:
    """On the Trio thread, before it writes to the socket, takes the next
    answer or closes the socket: the answer whose write it took in progress
    (``conn.stolen``) has returned (waited for, if not yet: its thread holds
    the lock through it), and what the socket did not take of it goes first
    in ``unsent``."""
    stolen = conn.stolen
    assert stolen is not None
    owed = stolen.owed
    if owed is None:
        with stolen.lock:
            owed = stolen.owed
    if owed is not None and owed[0]:
        conn.unsent[:0] = owed[0]  # (before stolen is cleared: the thread reads either)
        conn.flush()
    conn.stolen = None


def _write_now(socket: trio.socket.SocketType, data: bytes | bytearray) -> list[memoryview]:
    """``send_pieces_now(socket, [data])`` for one buffer: the rest's view, if any."""
    fd = socket.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("the stream was closed")
    try:
        written = os.write(fd, data)
    except BlockingIOError:
        written = 0
    return [memoryview(data)[written:]] if written < len(data) else []
