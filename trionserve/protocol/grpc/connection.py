"""One HTTP/2 client connection carrying gRPC calls: the h2 state machine on Trio.

:class:`Connection` owns the h2 state machine and every call on the connection;
:class:`GrpcCall` is what a method handler sees of one call. Framing of messages
and statuses is :mod:`trionserve.protocol.grpc.framing`'s; listening, and telling
connections to drain, is :mod:`trionserve.protocol.grpc.transport`'s.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import h2.config
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import numpy as np
import structlog
import trio
from hyperframe.frame import GoAwayFrame

from trionserve.protocol.grpc import framing as grpc_framing
from trionserve.protocol.grpc import upstream
from trionserve.protocol.grpc.framing import ACCEPT_ENCODING, ENCODINGS, status_headers
from trionserve.protocol.grpc.status import (
    GRPCError,
    Status,
    decode_metadata,
    decode_timeout,
)

log = structlog.get_logger(__name__)

_MAX_WINDOW = 2**31 - 1
_DEFAULT_WINDOW = 0xFFFF
_CONTENT_TYPE = (b"content-type", b"application/grpc")
_RESPONSE_HEADERS = [(b":status", b"200"), _CONTENT_TYPE, ACCEPT_ENCODING]
_GZIP_RESPONSE_HEADERS = [*_RESPONSE_HEADERS, (b"grpc-encoding", b"gzip")]
_OK_TRAILERS = status_headers(Status.OK, None)
# What nearly every call sends: HPACK-encoded once per connection
# (upstream.CachingEncoder).
_CONSTANT_HEADERS = (_RESPONSE_HEADERS, _GZIP_RESPONSE_HEADERS, _OK_TRAILERS)
_DRAIN_PING = b"drainGA\x00"
_CUT_MESSAGE = (
    "the server is shutting down: the request was still running at the exit timeout "
    "(--exit-timeout-secs)"
)
_KEEPALIVE_PING = b"keepaliv"
# Messages up to this size go out as one joined DATA payload; larger ones are
# written chunk by chunk from memoryviews, without joining.
_JOIN_LIMIT = 64 * 1024
# Compressed messages up to this size are inflated on the event loop.
_INLINE_DECOMPRESS = 16 * 1024


@dataclass(frozen=True, slots=True)
class Method:
    """A handler and whether its client sends a stream of messages."""

    handler: Callable[[GrpcCall], Awaitable[None]]
    client_streaming: bool = False


@dataclass(frozen=True, slots=True)
class TransportOptions:
    """HTTP/2 and gRPC settings of the transport."""

    # Largest request message accepted (after decompression); None: the most
    # the 32-bit length prefix can say.
    max_message_size: int | None = 64 * 1024 * 1024
    # Our HTTP/2 receive windows (connection and each stream), in bytes, at most
    # max_connection_buffer. A 4 MB message goes in without waiting for a window
    # update; tritonclient (grpc-core) advertises 4 MiB windows and frames itself.
    window_size: int = 16 * 1024 * 1024
    # Largest DATA frame the client may send: large frames mean fewer frames for
    # h2 to parse, each copied once (upstream.FrameBuffer).
    max_frame_size: int = 1024 * 1024
    max_concurrent_streams: int = 1024
    # Bytes one connection may hold for its calls: request messages not taken
    # yet (whole or partial), messages its handlers took and have not answered
    # (decoded, queued or executing), and responses waiting for the client's
    # flow-control window. A handler takes a message only while the answered-not
    # bytes and the waiting responses leave room for it (one is always taken
    # when the connection has none). Past the limit the client gets no more
    # window, connection window included, so it sends nothing more; only the
    # oldest unfinished message may go on (so it completes and no call waits on
    # another), and when nothing of the connection's would drain by itself the
    # connection window is given back for it.
    max_connection_buffer: int = 256 * 1024 * 1024
    # Server keepalive: ping after this long (seconds; None: never), close the
    # connection when the ack takes longer than keepalive_timeout.
    keepalive_time: float | None = 7200.0
    keepalive_timeout: float = 20.0
    keepalive_permit_without_calls: bool = False
    # zlib level for gzip-compressed responses to clients that accept gzip; None:
    # responses are not compressed.
    response_compression_level: int | None = None
    # How long a closing connection waits for the client to close its side, and a
    # draining one for the ack of its first GOAWAY's ping.
    linger: float = 1.0
    # Seconds a TLS client gets to complete its handshake.
    handshake_timeout: float = 10.0
    # Connections served at once; past it a new one is closed at once. None: no cap.
    max_connections: int | None = 1024
    # Seconds a new connection gets to send its first call's headers; a client
    # that connects and sends nothing (slowloris) is closed after it.
    first_call_timeout: float = 30.0
    # Seconds a connection may stay with no call in flight after its first: then
    # it is closed (GOAWAY). At max_connections the longest idle one is closed to
    # make room for a new connection. None: never.
    idle_timeout: float | None = 300.0
    # Bind with SO_REUSEPORT: worker processes share the port (--workers).
    reuse_port: bool = False


class GrpcCall:
    """One call as its handler sees it.

    ``receive`` returns the next request message (None once the client finished
    sending, or, for client-streaming methods, once the server drains); its bytes
    count against the connection's buffer until the call ``answered`` them (a
    client-streaming handler, per request), its first response is sent (a unary
    call) or it ends; ``send``
    writes one response message, waiting for HTTP/2 flow control, and raises
    ``trio.BrokenResourceError`` once the stream is gone. A unary call's messages
    are sent by one task; a client-streaming call's may come from several at once.
    The handler ends the call by returning (OK) or raising :class:`GRPCError`.
    """

    __slots__ = (
        "method",
        "_headers",
        "_metadata",
        "deadline",
        "peer",
        "client_streaming",
        "_conn",
        "_stream_id",
        "_compress",
        "_reader",
        "_messages",
        "_queued_bytes",
        "_partial_bytes",
        "_working_bytes",
        "_taken",
        "_deferred_ack",
        "_deferred_stream",
        "_ended",
        "_reset",
        "_error",
        "_wakeup",
        "_window",
        "_send_lock",
        "_headers_sent",
        "_scope",
    )

    def __init__(
        self,
        conn: Connection,
        stream_id: int,
        method: str,
        headers: list[tuple[bytes, bytes]],
        deadline: float | None,
        client_streaming: bool,
        reader: grpc_framing.MessageReader,
        compress: bool,
    ) -> None:
        self.method = method
        self._headers = headers
        self._metadata = None
        self.deadline = deadline
        self.peer = conn.peer
        self.client_streaming = client_streaming
        self._conn = conn
        self._stream_id = stream_id
        self._compress = compress
        self._reader = reader
        self._messages: deque[grpc_framing.Message] = deque()
        self._queued_bytes = 0
        self._partial_bytes = 0  # of an unfinished message, in the reader
        self._working_bytes = 0  # of messages taken and not answered yet
        self._taken: deque[int] = deque()  # their sizes, oldest first
        self._deferred_ack = 0  # bytes whose stream and connection window is held back
        self._deferred_stream = 0  # bytes whose stream window only is held back
        self._ended = False
        self._reset = False
        self._error: GRPCError | None = None
        self._wakeup = trio.Event()
        self._window = trio.Event()
        # Streaming calls' responses come from several tasks at once; a unary
        # call has one sender (its handler) and needs no lock.
        self._send_lock = trio.Lock() if client_streaming else None
        self._headers_sent = False
        self._scope: trio.CancelScope | None = None

    @property
    def metadata(self):
        """The request's metadata (custom headers), decoded on first use: most
        calls never look at it."""
        if self._metadata is None:
            self._metadata = decode_metadata(
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self._headers]
            )
        return self._metadata

    @property
    def draining(self) -> bool:
        """True once the server began shutting down."""
        return self._conn.draining

    async def receive(self) -> grpc_framing.Message | None:
        while True:
            if self._error is not None:
                raise self._error
            if self._reset:
                raise trio.BrokenResourceError("the client reset the stream")
            if self.client_streaming and self._conn.draining:
                return None
            if self._messages:
                # Work not answered yet and responses the client does not take
                # hold new requests back.
                await self._conn.wait_for_room(len(self._messages[0]))  # no checkpoint with room
                if self._reset or self._error is not None:
                    continue  # raised above
                message = self._messages.popleft()
                self._conn.consumed(self, len(message))
                if type(message) is grpc_framing.Compressed:
                    message = await self._decompress(message)
                return message
            if self._ended:
                return None
            await self._wakeup.wait()
            self._wakeup = trio.Event()

    async def _decompress(self, message: grpc_framing.Message) -> bytes:
        # Inflating can take many times the compressed size: large ones run in a
        # worker thread, so the event loop goes on serving everyone else.
        if len(message) <= _INLINE_DECOMPRESS:
            return self._reader.decompress(message)
        return await trio.to_thread.run_sync(self._reader.decompress, message)

    def answered(self) -> None:
        """The handler answered one of the messages it took (a request of a
        client-streaming call): its bytes (as received, the oldest taken's) no
        longer count against the connection's buffer."""
        if self._taken:
            self._conn.release(self, self._taken.popleft())

    async def send(self, message: bytes | Sequence[bytes | memoryview]) -> None:
        chunks = [message] if isinstance(message, (bytes, bytearray, memoryview)) else message
        if self._send_lock is None and self._taken:
            # A unary call's answer: its request's bytes are now its response's.
            self._taken.clear()
            self._conn.release(self, self._working_bytes)
        compressed = self._compress
        if compressed:
            level = self._conn.options.response_compression_level or 0
            chunks = [grpc_framing.compress(b"".join(chunks), level)]
        size = sum(len(c) for c in chunks)
        head = grpc_framing.prefix(size, compressed)
        conn = self._conn
        conn.hold_unsent(size)
        try:
            if self._send_lock is None:
                await self._send_message(head, chunks, size)
                # The answer goes out with the trailers, written by the call's task
                # as it ends (Connection._run_call): no wakeup of the writer.
                return
            async with self._send_lock:
                await self._send_message(head, chunks, size)
        finally:
            conn.hold_unsent(-size)
        conn.flush()

    async def _send_message(self, head: bytes, chunks: Sequence, size: int) -> None:
        if self._reset:
            raise trio.BrokenResourceError("the client reset the stream")
        try:
            if not self._headers_sent:
                self._conn.send_response_headers(self)
            if size + 5 <= _JOIN_LIMIT:
                await self._conn.send_data(self, [b"".join([head, *chunks])])
            else:
                await self._conn.send_data(self, [head, *chunks])
        except h2.exceptions.ProtocolError as exc:  # the stream or connection closed
            raise trio.BrokenResourceError(str(exc)) from exc

    def _wake(self) -> None:
        self._wakeup.set()
        self._window.set()


class Connection:
    """One client connection: owns the h2 state machine and every call on it.

    Its nursery holds the writer, the keepalive and drain watchers, and one task
    per call; the reader runs in the nursery's body. One task at a time writes to
    the socket: the writer, or a unary call's task writing its own answer when the
    writer is idle. Closing the connection cancels every call still running.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        methods: Mapping[bytes, Method],
        options: TransportOptions,
        draining: trio.Event,
        idle: dict[Connection, None] | None = None,
    ) -> None:
        self.stream = stream
        self.methods = methods
        self.options = options
        self.draining = False
        self._server_draining = draining
        self.h2 = upstream.H2Connection(
            _CONSTANT_HEADERS,
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
        )
        self.calls: dict[int, GrpcCall] = {}
        # Bytes held for the calls (see TransportOptions.max_connection_buffer),
        # the calls whose window is held back for it, and an event set while
        # there is room again.
        self.held = 0
        self.unsent = 0  # of those, responses waiting for the client's window
        self.working = 0  # and messages handlers took and have not answered
        self.peak_held = 0  # the most held at once
        self._held_back: set[GrpcCall] = set()
        self._drained = trio.Event()  # set (and replaced) when either goes down
        self.peer = _peer_name(stream)
        self._dirty = trio.Event()
        self._writing = False  # a task is in _write_pending
        self._written = trio.Event()  # set when that task leaves it
        self._extra: list[bytes] = []  # raw frames to write after h2's own output
        self._closing = False
        self._last_stream_id = _MAX_WINDOW
        self._ping_acks: dict[bytes, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._first_call = trio.Event()
        # The transport's connections without a call in flight (after their
        # first), longest idle first; and an event set (and replaced) when this
        # one turns idle or busy.
        self._idle = idle if idle is not None else {}
        # The idle timeout's scope: its deadline is set as the connection turns
        # idle and lifted as it turns busy, so a call wakes no task for it.
        self._idle_scope: trio.CancelScope | None = None
        self._quiet = False  # closed while idle: no linger
        self._idle_timeout = math.inf if options.idle_timeout is None else options.idle_timeout

    # -- the actor ---------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._start_h2()
                nursery.start_soon(self._writer)
                nursery.start_soon(self._drain_when, self._server_draining)
                if self.options.keepalive_time is not None:
                    nursery.start_soon(self._keepalive)
                nursery.start_soon(self._first_call_deadline)
                if self.options.idle_timeout is not None:
                    nursery.start_soon(self._idle_deadline)
                await self._read_loop()
                if not self._closing:
                    nursery.cancel_scope.cancel()
                # Closing: the writer ends the connection once everything up to the
                # final GOAWAY is written (see _close).
        finally:
            self._idle.pop(self, None)
            with trio.CancelScope(shield=True):
                await self._close_socket()

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

    async def _read_loop(self) -> None:
        """Feed what the client sends to h2 and act on the events, until the client
        goes away or says goodbye.

        Once the connection is closing (the final GOAWAY is queued), h2's state
        machine is CLOSED and would call any frame a protocol error, yet the client
        may still send some (a PING, a WINDOW_UPDATE for an answer it is reading):
        they are read and dropped, so that nothing the client sends can end the
        connection before the writer has written the last answers and the GOAWAY.
        """
        receive = self.stream.receive_some
        while True:
            try:
                data = await receive(256 * 1024)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            if self._closing:
                continue
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                log.debug("grpc protocol error", peer=self.peer, error=str(exc))
                self._close(h2.errors.ErrorCodes.PROTOCOL_ERROR)
                continue
            for event in events:
                if self._handle(event):
                    return
            self.flush()

    def _handle(self, event) -> bool:
        """Act on one h2 event; True when the connection is over."""
        kind = type(event)
        if kind is h2.events.DataReceived:
            self._on_data(event)
        elif kind is h2.events.RequestReceived:
            self._on_request(event)
        elif kind is h2.events.StreamEnded:
            call = self.calls.get(event.stream_id)
            if call is not None:
                call._ended = True
                call._wakeup.set()
        elif kind is h2.events.StreamReset:
            call = self.calls.get(event.stream_id)
            if call is not None:
                call._reset = True
                if call._scope is not None:
                    call._scope.cancel()
                call._wake()
        elif kind is h2.events.WindowUpdated or kind is h2.events.RemoteSettingsChanged:
            for call in self.calls.values():
                call._window.set()
        elif kind is h2.events.PingAckReceived:
            ack = self._ping_acks.pop(event.ping_data, None)
            if ack is not None:
                ack.set()
        elif kind is h2.events.ConnectionTerminated:
            # The client said goodbye; h2 refuses to send anything after a GOAWAY.
            return True
        return False

    # -- requests --------------------------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        self._first_call.set()
        stream_id = event.stream_id
        if stream_id > self._last_stream_id:
            self._reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        http_method = content_type = path = encoding = timeout = accept = None
        for name, value in event.headers:
            if name == b":path":
                path = value
            elif name == b":method":
                http_method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-accept-encoding":
                accept = value
        if http_method != b"POST":
            self._respond_http(stream_id, b"405")
            return
        if content_type is None or not content_type.startswith(b"application/grpc"):
            self._respond_http(stream_id, b"415")
            return
        path = path or b""
        method = self.methods.get(path)
        if method is None:
            self._trailers_only(
                stream_id, Status.UNIMPLEMENTED, f"Method not found: {path.decode('latin-1')}"
            )
            return
        encoding = encoding or b"identity"
        if encoding not in ENCODINGS:
            self._trailers_only(
                stream_id,
                Status.UNIMPLEMENTED,
                f"grpc-encoding '{encoding.decode('latin-1')}' is not supported; "
                "supported: identity, deflate, gzip",
            )
            return
        deadline = None
        if timeout is not None:
            try:
                deadline = trio.current_time() + decode_timeout(timeout.decode("ascii"))
            except (ValueError, UnicodeDecodeError):
                self._trailers_only(
                    stream_id,
                    Status.INVALID_ARGUMENT,
                    f"invalid grpc-timeout header {timeout.decode('latin-1')!r}",
                )
                return
        compress = (
            self.options.response_compression_level is not None
            and accept is not None
            and b"gzip" in accept
        )
        call = GrpcCall(
            self,
            stream_id,
            path.decode("latin-1"),
            event.headers,
            deadline,
            method.client_streaming,
            grpc_framing.MessageReader(
                encoding, self.options.max_message_size, defer_decompression=True
            ),
            compress,
        )
        if event.stream_ended is not None:
            call._ended = True
        self.calls[stream_id] = call
        if len(self.calls) == 1:  # busy again
            self._idle.pop(self, None)
            if self._idle_scope is not None:
                self._idle_scope.deadline = math.inf
        assert self._nursery is not None
        self._nursery.start_soon(self._run_call, call, method.handler)

    def _on_data(self, event: h2.events.DataReceived) -> None:
        stream_id = event.stream_id
        flow = event.flow_controlled_length
        call = self.calls.get(stream_id)
        if call is None or call._error is not None:
            # Data for a call that is over: give the window back and drop it.
            self.h2.acknowledge_received_data(flow, stream_id)
            return
        reader = call._reader
        try:
            messages = reader.feed(event.data)
        except GRPCError as error:
            call._error = error
            self.hold(-call._queued_bytes - call._partial_bytes)
            call._messages.clear()
            call._queued_bytes = call._partial_bytes = 0
            call._wakeup.set()
            self.h2.acknowledge_received_data(flow, stream_id)
            return
        added = reader.buffered - call._partial_bytes
        call._partial_bytes = reader.buffered
        for message in messages:
            call._messages.append(message)
            call._queued_bytes += len(message)
            added += len(message)
        self.hold(added)
        # Flow control: hold the window back while the handler has a window's worth
        # of messages it has not taken yet. While the connection holds too much,
        # hold back the stream windows of all but the oldest unfinished message,
        # and give the connection window back so that one can always complete.
        if call._queued_bytes > self.options.window_size:
            call._deferred_ack += flow
            self._held_back.add(call)
        elif self.held > self.options.max_connection_buffer and (
            self.working or self.unsent or not self._leads(call)
        ):
            if flow:
                if self.working or self.unsent:
                    # Work in hand drains by itself: the client gets no more
                    # window, not even for the oldest unfinished message.
                    call._deferred_ack += flow
                else:  # only messages: the oldest must be able to complete
                    call._deferred_stream += flow
                    self.h2.increment_flow_control_window(flow)
                self._held_back.add(call)
        elif flow:
            self.h2.acknowledge_received_data(flow, stream_id)
        if event.stream_ended is not None:
            call._ended = True
        call._wakeup.set()

    def consumed(self, call: GrpcCall, size: int) -> None:
        """A handler took a message: it stays held, as work not answered yet;
        flow control held back for the call's queue may be released."""
        call._queued_bytes -= size
        call._working_bytes += size
        call._taken.append(size)
        self.working += size
        self.hold(0)

    def release(self, call: GrpcCall, size: int) -> None:
        """``size`` bytes of the work ``call`` took are answered."""
        call._working_bytes -= size
        self.working -= size
        self._drain_event()
        self.hold(-size)

    def hold_unsent(self, size: int) -> None:
        """Count ``size`` more bytes of responses waiting to be sent (negative:
        fewer); with the work not answered, they hold new messages back."""
        self.unsent += size
        if size < 0:
            self._drain_event()
        self.hold(size)

    def _drain_event(self) -> None:
        self._drained.set()
        self._drained = trio.Event()

    def hold(self, size: int) -> None:
        """Count ``size`` more bytes held for the calls (negative: fewer); below the
        limit again, give back the flow-control window held back."""
        self.held += size
        if self.held > self.peak_held:
            self.peak_held = self.held
        over = self.held > self.options.max_connection_buffer
        if not self._held_back or (size > 0 and over):
            return
        window = self.options.window_size
        if over and (self.working or self.unsent):  # work in hand drains first
            released = []
        elif over:  # only the oldest unfinished message may go on
            released = [c for c in self._held_back if c._queued_bytes <= window and self._leads(c)]
        else:
            released = [c for c in self._held_back if c._queued_bytes <= window]
        for call in released:
            self._held_back.discard(call)
            if not call._reset and call._stream_id in self.calls:
                try:
                    if call._deferred_ack:
                        self.h2.acknowledge_received_data(call._deferred_ack, call._stream_id)
                    if call._deferred_stream:
                        self.h2.increment_flow_control_window(
                            call._deferred_stream, call._stream_id
                        )
                except h2.exceptions.ProtocolError:  # the stream closed meanwhile
                    pass
            call._deferred_ack = call._deferred_stream = 0
        if over and size < 0 and not (self.working or self.unsent):
            # Nothing of the connection's drains by itself any more, only
            # messages wait: give the connection window held back, so that the
            # oldest unfinished message can complete (stream windows stay held).
            for call in self._held_back:
                if call._deferred_ack:
                    try:
                        self.h2.increment_flow_control_window(call._deferred_ack)
                    except h2.exceptions.ProtocolError:
                        continue
                    call._deferred_stream += call._deferred_ack
                    call._deferred_ack = 0
                    released.append(call)  # flushed below; stays held back
        if released:
            self.flush()

    async def wait_for_room(self, size: int) -> None:
        """Wait until a message of ``size`` bytes fits beside the work not
        answered and the responses waiting (at once when the connection holds
        neither)."""
        limit = self.options.max_connection_buffer
        while self.working + self.unsent and self.working + self.unsent + size > limit:
            await self._drained.wait()

    def _leads(self, call: GrpcCall) -> bool:
        """Whether ``call`` has the oldest unfinished message of the connection."""
        if not call._partial_bytes:
            return False
        return all(
            other._stream_id >= call._stream_id
            for other in self.calls.values()
            if other._partial_bytes
        )

    # -- calls ---------------------------------------------------------------------

    async def _run_call(self, call: GrpcCall, handler) -> None:
        try:
            outcome = await self._outcome(call, handler)
            if outcome is not None:
                self._finish(call, *outcome)
        except BaseException:
            # Cancelled (alone or grouped by the handler's nursery): when the server
            # is draining, that is the exit timeout cutting the call.
            if self._server_draining.is_set() and not call._reset:
                await self._cut(call)
            raise
        finally:
            self.calls.pop(call._stream_id, None)
            if not self.calls and not self._closing:  # idle
                self._idle[self] = None
                if self._idle_scope is not None:
                    self._idle_scope.deadline = trio.current_time() + self._idle_timeout
            self._held_back.discard(call)
            call._taken.clear()
            if call._working_bytes:
                self.working -= call._working_bytes
                self._drain_event()
            left = call._queued_bytes + call._partial_bytes + call._working_bytes
            if left:
                call._queued_bytes = call._partial_bytes = call._working_bytes = 0
                self.hold(-left)
            if self.draining and not self.calls:
                self._close()
        await self._write_now()

    async def _outcome(self, call: GrpcCall, handler) -> tuple[Status, str | None] | None:
        """Run the handler under the call's deadline: the status to end the call
        with, or None when there is nobody left to answer."""
        status, message = Status.OK, None
        with trio.CancelScope() as scope:
            call._scope = scope
            if call._reset:  # reset before this task started: nobody to answer
                scope.cancel()
            if call.deadline is not None:
                scope.deadline = call.deadline
            try:
                await handler(call)
            except GRPCError as error:
                status, message = error.status, error.message
            except trio.BrokenResourceError:
                return None  # the stream is gone: nobody to answer
            except Exception as exc:
                log.exception("grpc handler failed", method=call.method)
                status, message = Status.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
        if call._reset:
            return None
        if scope.cancelled_caught:
            status, message = Status.DEADLINE_EXCEEDED, "Deadline Exceeded"
        return status, message

    async def _cut(self, call: GrpcCall) -> None:
        """The server cut this call (its drain ended at the exit timeout): end it
        UNAVAILABLE, if the socket takes the trailers within a second."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + 1.0
            self._finish(call, Status.UNAVAILABLE, _CUT_MESSAGE)
            # The task writing now may be one being cancelled, which would leave
            # these trailers unwritten: wait for it, then write them from here.
            while self._writing:
                await self._written.wait()
            try:
                await self._write_pending()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    def _finish(self, call: GrpcCall, status: Status, message: str | None) -> None:
        stream_id = call._stream_id
        if call._headers_sent:
            headers = _OK_TRAILERS if status is Status.OK else status_headers(status, message)
        else:  # "trailers only": one HEADERS frame carries the status
            headers = [(b":status", b"200"), _CONTENT_TYPE, *status_headers(status, message)]
        try:
            self.h2.send_headers(stream_id, headers, end_stream=True)
            if not call._ended:
                # The client is still sending; tell it to stop.
                self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError:  # the stream or connection closed meanwhile
            pass

    def send_response_headers(self, call: GrpcCall) -> None:
        headers = _GZIP_RESPONSE_HEADERS if call._compress else _RESPONSE_HEADERS
        self.h2.send_headers(call._stream_id, headers)
        call._headers_sent = True

    async def send_data(self, call: GrpcCall, chunks: list) -> None:
        h2conn = self.h2
        stream_id = call._stream_id
        for chunk in chunks:
            # Large chunks go as uint8 views, written without copies (upstream.H2Connection).
            view = chunk if len(chunk) <= _JOIN_LIMIT else np.frombuffer(chunk, np.uint8)
            while len(view):
                window = h2conn.local_flow_control_window(stream_id)
                if window <= 0:
                    self.flush()
                    call._window = trio.Event()
                    await call._window.wait()
                    if call._reset:
                        raise trio.BrokenResourceError("the client reset the stream")
                    continue
                size = min(window, h2conn.max_outbound_frame_size, len(view))
                # cast: h2 annotates the data as bytes | memoryview; the uint8 array
                # views are upstream.H2Connection's own, written from their buffers.
                if size == len(view):
                    h2conn.send_data(stream_id, cast(memoryview, view))
                    break
                h2conn.send_data(stream_id, cast(memoryview, view[:size]))
                view = view[size:]

    def _trailers_only(self, stream_id: int, status: Status, message: str | None) -> None:
        headers = [(b":status", b"200"), _CONTENT_TYPE, *status_headers(status, message)]
        if status is Status.UNIMPLEMENTED:
            headers.append(ACCEPT_ENCODING)
        try:
            self.h2.send_headers(stream_id, headers, end_stream=True)
        except h2.exceptions.ProtocolError:
            return
        self.flush()

    def _respond_http(self, stream_id: int, status: bytes) -> None:
        self.h2.send_headers(stream_id, [(b":status", status)], end_stream=True)
        self.flush()

    def _reset_stream(self, stream_id: int, code) -> None:
        try:
            self.h2.reset_stream(stream_id, code)
        except h2.exceptions.ProtocolError:
            return
        self.flush()

    # -- writing -----------------------------------------------------------------

    def flush(self) -> None:
        """Ask the writer to send whatever h2 has queued, if anything."""
        if self.h2.has_output() or self._extra:
            self._dirty.set()

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            if not self._writing:  # else the task writing now writes this too
                try:
                    await self._write_pending()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._cancel()
                    return
            if self._closing and not self._writing:
                # Everything up to the final GOAWAY is written.
                self._cancel()
                return

    async def _write_now(self) -> None:
        """Write what h2 has queued from the calling task, unless another task is
        writing (it writes this too, before it stops): a call's answer goes out
        without a wakeup of the writer."""
        if self._writing:
            return
        try:
            await self._write_pending()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._cancel()
            return
        if self._closing:
            self._dirty.set()  # the writer ends the connection

    async def _write_pending(self) -> None:
        """Write everything queued, until nothing is left."""
        self._writing = True
        self._written = trio.Event()
        try:
            while True:
                buffers = self.h2.buffers_to_send()
                if self._extra:
                    buffers.extend(self._extra)
                    self._extra.clear()
                if not buffers:
                    return
                for data in _coalesce(buffers):
                    await self.stream.send_all(data)
        finally:
            self._writing = False
            self._written.set()

    async def _first_call_deadline(self) -> None:
        with trio.move_on_after(self.options.first_call_timeout):
            await self._first_call.wait()
            return
        log.info(
            "grpc connection sent no call within the first-call timeout; closing",
            peer=self.peer,
            timeout=self.options.first_call_timeout,
        )
        self._cancel()

    async def _idle_deadline(self) -> None:
        """Close the connection once it has had no call in flight for the idle
        timeout (before its first call, the first-call timeout applies)."""
        await self._first_call.wait()
        with trio.CancelScope() as scope:
            if not self.calls:
                scope.deadline = trio.current_time() + self._idle_timeout
            self._idle_scope = scope
            await trio.sleep_forever()
        self._idle_scope = None
        log.info("grpc connection idle for the idle timeout; closing", peer=self.peer)
        self.close_idle()

    def close_idle(self) -> None:
        """Close the connection, which has no call in flight: GOAWAY, then the
        socket, without waiting for the client to close its side."""
        self._idle.pop(self, None)
        self._quiet = True
        self._close()

    def _cancel(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _close(self, code=h2.errors.ErrorCodes.NO_ERROR) -> None:
        """Send the final GOAWAY, then end the connection once it is written.

        Everything queued before it (the last calls' answers) goes out first; a
        client that does not read them is given ``keepalive_timeout`` seconds.
        """
        if self._closing:
            return
        self._closing = True
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

    async def _close_socket(self) -> None:
        # Half-close and wait a moment for the client to close too, so that
        # unread bytes do not turn our close into a reset that loses the answers.
        if self._closing and not self._quiet:
            with trio.move_on_after(self.options.linger):
                try:
                    # A TLS stream cannot half-close: the client closes on the GOAWAY.
                    if isinstance(self.stream, trio.abc.HalfCloseableStream):
                        await self.stream.send_eof()
                    while await self.stream.receive_some(65536):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                    pass
        await self.stream.aclose()

    # -- drain and keepalive -------------------------------------------------------

    async def _drain_when(self, event: trio.Event) -> None:
        await event.wait()
        if self._closing:
            return
        # Step 1: "stop soon" with the largest stream id, and a ping; requests the
        # client sent before it saw the GOAWAY still arrive before the ping's ack.
        self._send_goaway(_MAX_WINDOW)
        ack = self._ping(_DRAIN_PING)
        with trio.move_on_after(self.options.linger):
            await ack.wait()
        # Step 2: the real last stream id; anything later is refused.
        self._last_stream_id = self.h2.highest_inbound_stream_id
        self._send_goaway(self._last_stream_id)
        self.draining = True
        for call in self.calls.values():
            call._wakeup.set()
        if not self.calls:
            self._close()

    def _send_goaway(self, last_stream_id: int) -> None:
        # h2's close_connection() would also close its state machine and break the
        # calls still in flight, so the GOAWAY frame is written beside it.
        frame = GoAwayFrame(stream_id=0, last_stream_id=last_stream_id, error_code=0)
        self._extra.append(frame.serialize())
        self.flush()

    def _ping(self, opaque: bytes) -> trio.Event:
        ack = self._ping_acks[opaque] = trio.Event()
        self.h2.ping(opaque)
        self.flush()
        return ack

    async def _keepalive(self) -> None:
        o = self.options
        assert o.keepalive_time is not None
        while True:
            await trio.sleep(o.keepalive_time)
            if not self.calls and not o.keepalive_permit_without_calls:
                continue
            ack = self._ping(_KEEPALIVE_PING)
            with trio.move_on_after(o.keepalive_timeout):
                await ack.wait()
                continue
            log.info("grpc keepalive ping not answered; closing", peer=self.peer)
            self._cancel()
            return


def _coalesce(buffers: list) -> list:
    """The buffers with each run of small ones joined: few writes, no large copies."""
    if len(buffers) <= 1:
        return buffers
    out: list = []
    run: list = []
    for buffer in buffers:
        if len(buffer) > _JOIN_LIMIT:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(buffer)
        else:
            run.append(buffer)
    if run:
        out.append(b"".join(run))
    return out


def _peer_name(stream: trio.abc.Stream) -> str:
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    try:
        # Streams without a socket (in-memory ones of tests) raise AttributeError.
        host, port, *_ = stream.socket.getpeername()  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):
        return "unknown"
    return f"{host}:{port}"
