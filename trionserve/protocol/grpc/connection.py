"""One HTTP/2 client connection carrying gRPC calls: the Trio loop around h2.

:class:`Connection` reads the socket into h2, turns h2's events into the calls'
events (:mod:`~trionserve.protocol.grpc.state`: each call's and the connection's
state machine), applies the flow-control windows its buffer decides
(:mod:`~trionserve.protocol.grpc.flow`), runs the calls and writes what h2
queues: a unary call whose request came whole runs in the reader's task until
it would wait (:mod:`~trionserve.protocol.grpc.inline`), or parks in no task
while its request runs (:mod:`~trionserve.protocol.grpc.parking`), any other in
a task of its own; a ModelInfer call's answer may be written by the instance's thread
(:mod:`~trionserve.protocol.grpc.answer`, taken back before the loop touches
h2). What a handler sees of a call is :mod:`~trionserve.protocol.grpc.call`'s;
framing of messages and statuses is :mod:`~trionserve.protocol.grpc.framing`'s;
the connection's deadlines, keepalive pings and drain are
:mod:`~trionserve.protocol.grpc.lifetime`'s tasks; listening, and telling
connections to drain, is :mod:`~trionserve.protocol.grpc.transport`'s.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import h2.config
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import structlog
import trio

from trionserve.core.deferred import Deferred, deferred_jobs, sweep_deferred
from trionserve.protocol.grpc import framing as grpc_framing
from trionserve.protocol.grpc import inflow, lifetime, upstream
from trionserve.protocol.grpc.answer import DISARMED, CallAnswer, resolve
from trionserve.protocol.grpc.buffering import BufferWindows
from trionserve.protocol.grpc.call import GrpcCall, Method
from trionserve.protocol.grpc.flow import ConnectionBuffer
from trionserve.protocol.grpc.framing import (
    ACCEPT_ENCODING,
    CONSTANT_HEADERS,
    CONTENT_TYPE,
    status_headers,
)
from trionserve.protocol.grpc.inflow import MessageReads
from trionserve.protocol.grpc.options import TransportOptions
from trionserve.protocol.grpc.parking import Handler, Parked, ParkedCalls
from trionserve.protocol.grpc.reportsweep import ReportSweep
from trionserve.protocol.grpc.request import HttpRefusal, RequestHead, read_request_head
from trionserve.protocol.grpc.running import CallRunner
from trionserve.protocol.grpc.state import (
    ConnectionState,
    ConnEvent,
    RequestEvent,
)
from trionserve.protocol.grpc.status import GRPCError, Status
from trionserve.protocol.grpc.writing import CLOSED, SocketWriter
from trionserve.protocol.sockets import EagerReceiver, peer_name

__all__ = ["Connection", "GrpcCall", "Method", "TransportOptions"]

log = structlog.get_logger(__name__)

_MAX_WINDOW = lifetime.MAX_STREAM_ID  # also the largest window (2**31 - 1)
_DEFAULT_WINDOW = 0xFFFF
# The read when no call is in flight or every call waits (the next bytes are
# likely a new call's): a large message's rest is then read straight into its
# buffer (inflow.py).
HEAD_READ = 64 * 1024


class Connection(SocketWriter, BufferWindows, CallRunner, ParkedCalls, MessageReads):
    """One client connection: owns the h2 state machine and every call on it.

    Its nursery holds the writer, the keepalive and drain watchers, and the
    calls' tasks; the reader starts in the nursery's body. A unary call whose
    request came whole runs in the reader's task; one that would wait keeps that
    task, and a new one reads on (_start_calls). One task at a time writes to the
    socket: the writer, the reader after a read, or a call's task writing its own
    answer when the writer is idle. Closing the connection cancels every call.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        methods: Mapping[bytes, Method],
        options: TransportOptions,
        draining: trio.Event,
        idle: dict[Connection, None] | None = None,
        report_sweep: ReportSweep | None = None,
    ) -> None:
        self.stream = stream
        # The server's tick for the threads' reports, put off by this reader's
        # sweeps (reportsweep.py).
        self._report_sweep = report_sweep
        self.methods = methods
        self.options = options
        # The last call's request headers and what they ask for: the same
        # headers (at c=1 the client repeats them) are not read again.
        self._last_head: tuple[Sequence[tuple[bytes, bytes]], RequestHead] | None = None
        self.state = ConnectionState()
        self._server_draining = draining
        self.h2 = upstream.H2Connection(
            CONSTANT_HEADERS,
            h2.config.H2Configuration(
                client_side=False,
                header_encoding=None,
                # Requests are checked where it matters (method, content type,
                # path, timeout); h2's per-header validation cost more than
                # decoding the request message.
                validate_inbound_headers=False,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            ),
            # A unary method's streams are held apart while they go the common
            # way (upstream.H2Connection).
            (path for path, method in methods.items() if not method.client_streaming),
        )
        self.calls: dict[int, GrpcCall] = {}
        # Calls whose HEADERS came in the read being handled, started after it,
        # and the call running in the reader's task now (it leaves its answer
        # to the reader's write after the read), and the reader's cancel scope.
        # An entry's second item is a parked call's Parked (below) when its
        # request got its outcome in the reader's sweep: carried on there.
        self._starting: list[tuple[GrpcCall, Handler | Parked]] = []
        self._inline: GrpcCall | None = None
        # Calls waiting in no task (parking.py).
        self._awaiting: dict[int, tuple[GrpcCall, Handler]] = {}
        self._parked: dict[GrpcCall, Parked] = {}
        self._sweeping = False  # the reader sweeps the reports (take_answer)
        self._swept = 0  # the parked calls it carried on so far (ParkedCalls._carry)
        # The run's deferred reports, which the reader sweeps (found by its first sweep).
        self._deferred: Deferred | None = None
        self._reader_scope: trio.CancelScope | None = None  # the reading task's (_read)
        self._slot = memoryview(bytearray(inflow.SLOT))  # (inflow.MessageReads)
        self._gap, self._skipped, self._reading, self._kept = 9, 0, 0, 0
        self._head = memoryview(bytearray(inflow.HEAD_SLOT))
        self._call, self._arrived, self._whole, self._last_read = None, None, None, 0
        self._template, self._buffers = None, grpc_framing.CallBuffers()
        # Bytes held for the calls (see TransportOptions.max_connection_buffer),
        # and the receivers waiting for room, woken when work in hand or
        # responses waiting go down: there may be room for a message again.
        o = options
        self.buffer = ConnectionBuffer(o.max_connection_buffer, o.window_size, o.budget)
        self._room = trio.lowlevel.ParkingLot()
        self._room_waiters = 0  # parked in it (counted: no call to ask the lot)
        self.peer = peer_name(stream)
        self.socket = getattr(stream, "socket", None)  # None under TLS (_write_at_once)
        self._dirty = trio.Event()
        self.writing = False  # a task is in _write_pending
        # Set when that task leaves it; made only for a task that waits for that.
        self._written: trio.Event | None = None
        self.extra_frames: list[bytes] = []  # raw frames to write after h2's own output
        self.answer: CallAnswer | None = None  # see answer.py and SocketWriter
        self.answer_lock = threading.Lock()  # every answer's lock (answer.py)
        self.answer_claim = threading.Lock()  # the thread's write's (answer.py)
        self.stolen: CallAnswer | None = None  # its write taken in progress (answer.py)
        self.unsent: list[memoryview] = []
        self.last_stream_id = _MAX_WINDOW
        self.ping_acks: dict[bytes, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self.first_call = trio.Event()
        # The transport's connections without a call in flight (after their
        # first), longest idle first.
        self._idle = idle if idle is not None else {}
        # The idle timeout's scope, and when the connection last turned idle: the
        # deadline is set as the connection turns idle with none pending, and
        # left as it turns busy; when it passes, lifetime.idle_deadline closes the
        # connection if it stayed idle, else sets it again from idle_since. A
        # call moves no deadline and wakes no task.
        self.idle_scope: trio.CancelScope | None = None
        self.idle_since: float | None = None  # set with the first call's end
        self.quiet = False  # closed while idle: no linger
        self.idle_timeout = math.inf if options.idle_timeout is None else options.idle_timeout

    # -- the actor ---------------------------------------------------------------

    async def run(self) -> None:
        # trio.current_time()'s clock, read at each call's end without its two
        # calls around it.
        self._clock = trio.lowlevel.current_clock()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._start_h2()
                nursery.start_soon(self._writer)
                nursery.start_soon(lifetime.drain_when, self, self._server_draining)
                if self.options.keepalive_time is not None:
                    nursery.start_soon(lifetime.keepalive, self)
                nursery.start_soon(lifetime.first_call_deadline, self)
                if self.options.idle_timeout is not None:
                    nursery.start_soon(lifetime.idle_deadline, self)
                # A task of its own, as the readers after a call kept one: each
                # wake resumes its two frames, not this task's six (the acceptor's).
                nursery.start_soon(self._read)
        finally:
            self.take_answer()  # (the socket closes: the thread writes no more)
            if self.later is not None:  # (nor reads: a rest left for it is read now)
                self.later.settle()
            self._idle.pop(self, None)
            self.buffer.let_go()
            self._buffers.let_go()
            with trio.CancelScope(shield=True):
                await lifetime.close_socket(self)

    def _start_h2(self) -> None:
        o = self.options
        # Never more window than the connection may hold: what the client sends
        # without waiting stays within the buffer limit.
        window = min(o.window_size, o.max_connection_buffer, _MAX_WINDOW)
        # Stream limit and windows apply at once (being generous early is safe);
        # the frame size must wait for the client's ack, so it goes as an update.
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: o.max_concurrent_streams,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 64 * 1024,
            },
        )
        self.h2.initiate_connection()
        self.h2.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: o.max_frame_size})
        if window > _DEFAULT_WINDOW:
            self.h2.increment_flow_control_window(window - _DEFAULT_WINDOW)
        self.flush()

    async def _read(self) -> None:
        """Feed what the client sends to h2 and act on the events, until the client
        goes away or says goodbye, then end the connection (closing: the writer
        ends it once everything up to the final GOAWAY is written, see close);
        unless a call keeps this task and another reads on: then the task's
        cancel scope is that call's (_start_calls). (One coroutine: each frame
        more would be one call more at each of its wake-ups.)

        Once the connection is closing (the final GOAWAY is queued), h2's state
        machine is CLOSED and would call any frame a protocol error, yet the client
        may still send some (a PING, a WINDOW_UPDATE for an answer it is reading):
        they are read and dropped, so that nothing the client sends can end the
        connection before the writer has written the last answers and the GOAWAY.
        """
        kept = False  # a call keeps this task
        receiver = EagerReceiver(self.stream)
        if self.later is not None:  # (a rest left in the socket: read by none of its reads)
            receiver.attach(self.later)
        receive = receiver.receive_some
        try:
            with trio.CancelScope() as scope:
                self._reader_scope = scope
                while True:
                    if (self.h2.partial or self._reading) and (
                        plan := self._message_views()
                    ) is not None:
                        over = await self._read_message(receiver, *plan)
                        if over is None:
                            continue
                        if over:
                            kept = True
                            return
                        break
                    try:
                        # (eager when no call is in a task of its own: none to let
                        # run; with every call parked the client waits for an
                        # answer first; len only of what is not empty: most reads
                        # find nothing awaiting)
                        calls = len(self.calls) if self.calls else 0
                        parked = len(self._parked) if self._parked else 0
                        eager = calls == parked + (len(self._awaiting) if self._awaiting else 0)
                        expect = eager and 0 < parked == calls
                        if parked != calls:
                            data = await receive(256 * 1024, eager, expect)
                        elif not expect or self._call is None or self._kept or self.state.closing:
                            data = await receive(HEAD_READ, eager, expect)
                        else:  # every call waits: the next is read as the last came (inflow.py)
                            data = await self._read_call(receiver)
                    except CLOSED:
                        break
                    if not data:
                        break
                    self._last_read = len(data)
                    if self._kept:  # the start of a frame header, read before (inflow.py)
                        data = self.with_kept(data)
                    # The armed answer is taken before h2 sees what came (take_answer);
                    # the reports the threads left are delivered after (_sweep's
                    # second half), so that a parked call its report ends finds the
                    # read's next call in ``calls`` (parkedinfer.py).
                    swept = self._parked or self.answer is not None
                    if swept and (answer := self.answer) is not None:
                        answer.take()
                    if self.state.closing:
                        self._arrived = self._whole = None
                        over = None
                    else:
                        over = self._take_read(data)
                    if swept:
                        self._deliver_reports()
                    if over is None:  # a protocol error, or closing
                        continue
                    if over:
                        break
                    if not self._starting:
                        self.flush()
                    elif await self._start_calls():
                        kept = True
                        return
            if not self.state.closing:
                self.cancel()
        finally:
            if not kept:  # nothing reads on: the waiting calls get tasks, as calls do
                self._let_go_waiting()

    def _act(self, events: list) -> bool:
        """Act on the events of a read (upstream.H2Connection.receive); True
        when the connection is over (the calls starting then go on in tasks)."""
        for event in events:
            if type(event) is tuple:  # a frame upstream.H2Connection.receive took
                kind, stream_id = event[0], event[1]
                if kind == upstream.DATA:
                    self._on_data(stream_id, event[2], len(event[2]), event[3])
                elif kind == upstream.REQUEST:
                    self._on_request(stream_id, event[2])
                    if event[3]:
                        self._on_end(stream_id)
                else:
                    self._on_window(stream_id)
            elif self._handle(event):
                for call, handler in self._starting:
                    self._go_on(call, handler)
                self._starting = []
                return True
        return False

    def _sweep(self) -> None:
        """take_answer, in the reader, before h2 sees a read, then the reports
        delivered (:meth:`_deliver_reports`). (_read takes the answer before h2
        sees its read and delivers the reports after it.)"""
        answer = self.answer
        if answer is not None:
            answer.take()  # (take_answer; its report is swept next)
        self._deliver_reports()

    def _deliver_reports(self) -> None:
        """In the reader: the run's reports the threads left, delivered
        (sweep_deferred, once: an answer taken elsewhere left its report too,
        with the run's reports found once per connection). The calls parked for
        the requests whose outcomes it delivers end there (parkedinfer.py) or
        are carried on after the read (_start_calls); the server's tick is put
        off (reportsweep.py)."""
        deferred = self._deferred
        if deferred is None:
            deferred = self._deferred = deferred_jobs()
        self._sweeping, self._swept = True, 0
        try:
            deferred.sweep()
        finally:
            self._sweeping = False
        if self._report_sweep is not None:
            self._report_sweep.swept()

    def take_answer(self) -> None:
        """Before the loop touches h2 or the socket: the armed answer is the
        loop's (answer.py); one the thread wrote has its report swept now."""
        answer = self.answer
        if answer is not None and answer.take() != DISARMED:
            sweep_deferred()
        if self.stolen is not None:  # (a write taken in progress has returned: answer.py)
            resolve(self)

    def _handle(self, event: h2.events.Event) -> bool:
        """Act on one h2 event; True when the connection is over."""
        kind = type(event)
        # Each branch reads its kind's attributes (typed Any: no cast() call per
        # event on the hot path).
        e: Any = event
        if kind is h2.events.DataReceived:
            self._on_data(e.stream_id, e.data, e.flow_controlled_length)
        elif kind is h2.events.RequestReceived:
            self._on_request(e.stream_id, e.headers)
        elif kind is h2.events.StreamEnded:
            self._on_end(e.stream_id)
        elif kind is h2.events.StreamReset:
            call = self.calls.get(e.stream_id)
            if call is not None:
                call.reset_by_client()
                self._release(call)
        elif kind is h2.events.WindowUpdated:
            self._on_window(e.stream_id)
        elif kind is h2.events.RemoteSettingsChanged:  # the initial window may have grown
            for call in self.calls.values():
                call.wake_sender()
        elif kind is h2.events.PingAckReceived:
            ack = self.ping_acks.pop(e.ping_data, None)
            if ack is not None:
                ack.set()
        elif kind is h2.events.ConnectionTerminated:
            # The client said goodbye; h2 refuses to send anything after a GOAWAY.
            return True
        return False

    # -- requests --------------------------------------------------------------

    def _on_window(self, stream_id: int) -> None:
        # (a sender that waits for window has its event: most never wait)
        if stream_id:  # one stream's window
            call = self.calls.get(stream_id)
            if call is not None and call.window_waiter is not None:
                call.wake_sender()
        else:  # the connection's: every sender may go on
            calls = self.calls
            for each in calls:  # (by key: no values() call per update)
                call = calls[each]
                if call.window_waiter is not None:
                    call.wake_sender()

    def _on_end(self, stream_id: int) -> None:
        call = self.calls.get(stream_id)
        if call is not None:
            call.state.request_event(RequestEvent.END_STREAM)
            call.wake()
            if self._awaiting:
                self._release(call)

    def _on_request(
        self, stream_id: int, headers: Sequence[tuple[bytes, bytes]], ended: bool = False
    ) -> GrpcCall | None:
        """A new stream's headers (``ended``: with its END_STREAM, the call's
        state ENDED from the start): the call, or None when it is refused."""
        if self.idle_since is None:  # else it is set
            self.first_call.set()
        if stream_id > self.last_stream_id:
            self._reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return None
        last = self._last_head
        if last is not None and (last[0] is headers or last[0] == headers):  # (a repeated list)
            head: RequestHead | HttpRefusal | GRPCError = last[1]
        else:
            head = read_request_head(headers, self.methods, self.options)
            if type(head) is RequestHead:
                self._last_head = (headers[:], head)
        if type(head) is not RequestHead:  # (one check on the common way)
            if isinstance(head, HttpRefusal):
                self.h2.send_headers(stream_id, [(b":status", head.status)], end_stream=True)
                self.flush()
            else:
                self._trailers_only(stream_id, head.status, head.message)
            return None
        method = head.method
        deadline = None if head.timeout is None else trio.current_time() + head.timeout
        call = self.spare_call
        if call is None or method.client_streaming:
            call = GrpcCall(
                self,
                self.buffer.open(stream_id),
                head.path,
                headers,
                deadline,
                method.client_streaming,
                head.encoding,
                head.compress,
                ended,
            )
        else:  # the last call, ended the common way: re-armed, not made again
            self.spare_call = None
            account = self.buffer.open(stream_id, call.account)
            call.again(account, head.path, headers, deadline, head.encoding, head.compress, ended)
        # An END_STREAM on the headers comes next (_on_end); the
        # call starts once the read's events are all handled (_start_calls).
        if not self.calls:  # busy again (the idle deadline stays: lifetime.idle_deadline)
            self._idle.pop(self, None)
        self.calls[stream_id] = call
        self._starting.append((call, method.handler))
        return call

    def _on_data(
        self,
        stream_id: int,
        data: bytes | bytearray | memoryview | None,
        flow: int,
        ended: bool = False,
    ) -> None:
        """A DATA frame's payload (``ended``: with END_STREAM, as _on_end);
        ``data`` None: ``flow`` bytes of it were read into the call's message
        (inflow.py)."""
        call = self.calls.get(stream_id)
        if call is None or call.error is not None:
            # Data for a call that is over: give the window back and drop it.
            self.h2.acknowledge_received_data(flow, stream_id)
            if ended:
                self._on_end(stream_id)
            return
        reader = call.reader
        if self._arrived is not None and self._arrived[0] == stream_id:
            reader.offered = self._arrived[1]  # the call was read whole (inflow.py)
        try:
            messages = reader.filled(flow) if data is None else reader.feed(data)
        except GRPCError as error:
            call.error = error
            call.state.request_event(RequestEvent.REFUSE)
            call.messages.clear()
            if self._awaiting:
                self._release(call)
            if windows := self.buffer.refused(call.account):
                self._give(windows)
            self.h2.acknowledge_received_data(flow, stream_id)
        else:
            call.messages.extend(messages)
            sizes = list(map(len, messages))
            if windows := self.buffer.received(call.account, flow, reader.buffered, sizes):
                self._give(windows)
        if ended:
            call.state.request_event(RequestEvent.END_STREAM)
            if self._awaiting:
                self._release(call)
        call.wake()

    def _trailers_only(self, stream_id: int, status: Status, message: str | None) -> None:
        headers = [(b":status", b"200"), CONTENT_TYPE, *status_headers(status, message)]
        if status is Status.UNIMPLEMENTED:
            headers.append(ACCEPT_ENCODING)
        try:
            self.h2.send_headers(stream_id, headers, end_stream=True)
        except h2.exceptions.ProtocolError:
            return
        self.flush()

    def _reset_stream(self, stream_id: int, code: h2.errors.ErrorCodes) -> None:
        try:
            self.h2.reset_stream(stream_id, code)
        except h2.exceptions.ProtocolError:
            return
        self.flush()

    def close_idle(self) -> None:
        """Close the connection, which has no call in flight: GOAWAY, then the
        socket, without waiting for the client to close its side."""
        self._idle.pop(self, None)
        self.quiet = True
        self.close()

    def cancel(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def close(self, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR) -> None:
        """Send the final GOAWAY, then end the connection once it is written.

        Everything queued before it (the last calls' answers) goes out first; a
        client that does not read them is given ``keepalive_timeout`` seconds.
        Closing a closing connection does nothing.
        """
        if self.state.closing:
            return
        self.take_answer()
        self.state.event(ConnEvent.CLOSE)
        try:
            self.h2.close_connection(error_code=code)
        except h2.exceptions.ProtocolError:
            pass
        if self._nursery is not None:
            scope = self._nursery.cancel_scope
            scope.deadline = min(
                scope.deadline, trio.current_time() + self.options.keepalive_timeout
            )
        self._dirty.set()  # even with nothing queued: the writer ends the connection
