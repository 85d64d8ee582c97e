"""The gRPC transport (HTTP/2 with h2 on Trio sockets) with toy handlers.

Clients: grpcio (the C-core gRPC client that tritonclient uses) for ordinary calls,
and a raw h2 client for what grpcio will not do on demand: send a compressed frame
without an encoding, drop the socket, watch GOAWAY frames and pings.
"""

from __future__ import annotations

import gzip
import socket
import struct
from contextlib import asynccontextmanager

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import trio
import trio.testing

from trionserve.protocol.grpc import upstream, writing
from trionserve.protocol.grpc.status import decode_grpc_message
from trionserve.protocol.grpc.transport import (
    GrpcCall,
    GRPCError,
    GrpcTransport,
    Method,
    Status,
    TransportOptions,
)
from trionserve.protocol.sockets import send_pieces_now


class Handlers:
    """Toy methods; each records what happened to it."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()
        self.cancelled: list[str] = []

    async def echo(self, call: GrpcCall) -> None:
        message = await call.receive()
        assert await call.receive() is None
        await call.send(message)

    async def metadata(self, call: GrpcCall) -> None:
        await call.receive()
        await call.send(dict(call.metadata).get("x-key", "").encode())

    async def wait(self, call: GrpcCall) -> None:
        self.entered.set()
        try:
            await self.release.wait()
        except trio.Cancelled:
            self.cancelled.append(call.method)
            raise
        await call.send(b"released")

    async def fail(self, call: GrpcCall) -> None:
        raise GRPCError(Status.NOT_FOUND, "não há ✓ 100%\nend")

    async def crash(self, call: GrpcCall) -> None:
        raise RuntimeError("boom")

    async def chat(self, call: GrpcCall) -> None:
        while (message := await call.receive()) is not None:
            await call.send(message.upper())
        if call.draining:
            raise GRPCError(Status.UNAVAILABLE, "shutting down")

    def methods(self) -> dict[str, Method]:
        return {
            "/t.T/Echo": Method(self.echo),
            "/t.T/Metadata": Method(self.metadata),
            "/t.T/Wait": Method(self.wait),
            "/t.T/Fail": Method(self.fail),
            "/t.T/Crash": Method(self.crash),
            "/t.T/Chat": Method(self.chat, client_streaming=True),
        }


@asynccontextmanager
async def serving(handlers: Handlers, **options):
    """Serve the toy methods on a free loopback port; yields (port, shutdown event)."""
    shutdown = trio.Event()
    transport = GrpcTransport(handlers.methods(), TransportOptions(**options))
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(transport.serve, "127.0.0.1", 0, shutdown, 10.0)
        yield bound[0][1], shutdown
        shutdown.set()


def frame(message: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(message)) + message


class GoAway:
    """A GOAWAY frame the server sent (kept away from h2, which would stop at it)."""

    def __init__(self, payload: bytes) -> None:
        last, self.error_code = struct.unpack(">II", payload[:8])
        self.last_stream_id = last & 0x7FFFFFFF


class RawClient:
    """A minimal HTTP/2 gRPC client: sends requests, collects the server's events.

    GOAWAY frames are taken out of the byte stream before h2 sees them, because h2
    refuses every frame after one, and a draining server keeps answering.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.events: list = []
        self.data: dict[int, bytes] = {}
        self.closed = False
        self._buffer = b""

    @classmethod
    @asynccontextmanager
    async def connect(cls, port: int):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        client = cls(stream)
        client.h2.initiate_connection()
        await client.flush()
        try:
            yield client
        finally:
            await stream.aclose()

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def call(self, path: str, body: bytes | None = b"", headers=(), end: bool = True) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(
            stream_id,
            [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":authority", b"test"),
                (b":path", path.encode()),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
                *headers,
            ],
            end_stream=body is None and end,
        )
        if body is not None:
            self.h2.send_data(stream_id, body, end_stream=end)
        await self.flush()
        return stream_id

    def _frames(self, data: bytes) -> bytes:
        """Whole frames for h2, minus GOAWAYs (recorded as GoAway events)."""
        self._buffer += data
        out = []
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + length:
                break
            raw, self._buffer = self._buffer[: 9 + length], self._buffer[9 + length :]
            if raw[3] == 0x7:
                self.events.append(GoAway(raw[9:]))
            else:
                out.append(raw)
        return b"".join(out)

    async def until(self, done) -> None:
        """Read until ``done(self)`` is true or the server closes the connection."""
        with trio.fail_after(10):
            while not done(self) and not self.closed:
                data = await self.stream.receive_some(65536)
                if not data:
                    self.closed = True
                    break
                for event in self.h2.receive_data(self._frames(data)):
                    self.events.append(event)
                    if isinstance(event, h2.events.DataReceived):
                        self.data[event.stream_id] = (
                            self.data.get(event.stream_id, b"") + event.data
                        )
                        self.h2.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                await self.flush()

    def ended(self, stream_id: int) -> bool:
        return any(
            isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset))
            and e.stream_id == stream_id
            for e in self.events
        )

    def headers(self, stream_id: int) -> dict[bytes, bytes]:
        """Every header and trailer the server sent on a stream."""
        fields: dict[bytes, bytes] = {}
        for e in self.events:
            if isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                if e.stream_id == stream_id:
                    fields.update(e.headers)
        return fields

    def status(self, stream_id: int) -> tuple[int, str]:
        fields = self.headers(stream_id)
        message = decode_grpc_message(fields.get(b"grpc-message", b"").decode())
        return int(fields[b"grpc-status"]), message

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def grpcio_call(port: int, path: str, payload: bytes, **kwargs):
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        return channel.unary_unary(path)(payload, **kwargs)


# ------------------------------------------------------------------ ordinary calls


async def test_unary_calls_with_grpcio_including_large_messages():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        assert await trio.to_thread.run_sync(grpcio_call, port, "/t.T/Echo", b"hi") == b"hi"
        big = bytes(range(256)) * (20 * 4096)  # 20 MiB: many windows' worth each way
        assert await trio.to_thread.run_sync(grpcio_call, port, "/t.T/Echo", big) == big
        answer = await trio.to_thread.run_sync(
            lambda: grpcio_call(port, "/t.T/Metadata", b"", metadata=[("x-key", "value-1")])
        )
        assert answer == b"value-1"


async def test_error_statuses_carry_an_encoded_grpc_message():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            failed = await client.call("/t.T/Fail", frame(b""))
            crashed = await client.call("/t.T/Crash", frame(b""))
            missing = await client.call("/t.T/Nope", frame(b""))
            await client.until(lambda c: all(c.ended(s) for s in (failed, crashed, missing)))
            assert client.status(failed) == (Status.NOT_FOUND.value, "não há ✓ 100%\nend")
            assert client.headers(failed)[b"grpc-message"].isascii()
            assert client.status(crashed) == (
                Status.INTERNAL.value,
                "internal error: RuntimeError: boom",
            )
            assert client.status(missing) == (
                Status.UNIMPLEMENTED.value,
                "Method not found: /t.T/Nope",
            )
        with pytest.raises(grpc.RpcError) as info:
            await trio.to_thread.run_sync(grpcio_call, port, "/t.T/Fail", b"")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == "não há ✓ 100%\nend"


async def test_client_streaming_call_and_many_streams_on_one_connection():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            chats = []
            for i in range(20):
                chats.append(
                    await client.call("/t.T/Chat", frame(b"a%d" % i) + frame(b"b"), end=False)
                )
            for stream_id in chats:
                client.h2.send_data(stream_id, frame(b"c"), end_stream=True)
            await client.flush()
            await client.until(lambda c: all(c.ended(s) for s in chats))
            for i, stream_id in enumerate(chats):
                assert client.status(stream_id) == (0, "")
                assert client.data[stream_id] == frame(b"A%d" % i) + frame(b"B") + frame(b"C")


# ------------------------------------------------------------------- cancellation


async def test_client_reset_cancels_the_handler_and_the_connection_goes_on():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            waiting = await client.call("/t.T/Wait", frame(b""))
            await handlers.entered.wait()
            client.h2.reset_stream(waiting, h2.errors.ErrorCodes.CANCEL)
            await client.flush()
            echo = await client.call("/t.T/Echo", frame(b"still here"))
            await client.until(lambda c: c.ended(echo))
            assert handlers.cancelled == ["/t.T/Wait"]
            assert client.data[echo] == frame(b"still here")


async def test_a_reset_before_the_answer_is_reported_as_a_cancellation(monkeypatch):
    """Triton logs a client's cancellation of a call it has not answered yet
    (server src/grpc/infer_handler.h HandleCancellation); one answered is not."""
    from trionserve.protocol.grpc import call as call_module

    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(call_module, "log_grpc_cancellation", lambda *args: seen.append(args))
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            waiting = await client.call("/t.T/Wait", frame(b""))
            await handlers.entered.wait()
            client.h2.reset_stream(waiting, h2.errors.ErrorCodes.CANCEL)
            await client.flush()
            echo = await client.call("/t.T/Echo", frame(b"answered"))
            await client.until(lambda c: c.ended(echo))
            assert handlers.cancelled == ["/t.T/Wait"]
    assert seen == [("/t.T/Wait", waiting)]


@pytest.mark.timeout(20)
async def test_calls_reset_before_their_handlers_run_end_and_the_connection_goes_on():
    # HEADERS, the message and RST_STREAM in one read: the calls' tasks start after
    # the reset. Echo's receive() used to spin on its queued message without a
    # checkpoint, freezing the event loop (hence the timeout); Wait's handler used
    # to wait with no cancellation until the connection closed.
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            reset = []
            for path in (b"/t.T/Echo", b"/t.T/Wait"):
                stream_id = client.h2.get_next_available_stream_id()
                client.h2.send_headers(
                    stream_id,
                    [
                        (b":method", b"POST"),
                        (b":scheme", b"http"),
                        (b":authority", b"test"),
                        (b":path", path),
                        (b"content-type", b"application/grpc"),
                    ],
                )
                client.h2.send_data(stream_id, frame(b"never answered"))
                client.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
                reset.append(stream_id)
            await client.flush()
            echo = await client.call("/t.T/Echo", frame(b"still here"))
            await client.until(lambda c: c.ended(echo))
            assert client.data[echo] == frame(b"still here")
            assert not any(stream_id in client.data for stream_id in reset)
            assert handlers.cancelled == ["/t.T/Wait"]


async def test_dropped_connection_cancels_its_handlers():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            await client.call("/t.T/Wait", frame(b""))
            await handlers.entered.wait()
            # An abortive close (RST): the server must neither hang nor crash.
            client.stream.socket.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        with trio.fail_after(10):
            while not handlers.cancelled:
                await trio.sleep(0.01)
        assert handlers.cancelled == ["/t.T/Wait"]
        assert await trio.to_thread.run_sync(grpcio_call, port, "/t.T/Echo", b"ok") == b"ok"


async def test_grpc_timeout_cancels_the_handler_with_deadline_exceeded():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            stream_id = await client.call(
                "/t.T/Wait", frame(b""), headers=[(b"grpc-timeout", b"50m")]
            )
            await client.until(lambda c: c.ended(stream_id))
            assert client.status(stream_id) == (Status.DEADLINE_EXCEEDED.value, "Deadline Exceeded")
            assert handlers.cancelled == ["/t.T/Wait"]


async def test_calls_answered_at_once_leave_no_deadline_and_one_that_waits_takes_its_own(
    autojump_clock,
):
    """A unary call run in the reader's task without waiting runs in no cancel
    scope of its own, and its deadline stays with it: the reader reads on past
    it. One that waits takes the reader task's scope, its deadline with it: it
    ends DEADLINE_EXCEEDED, and the connection's new reader goes on."""
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            timeout = [(b"grpc-timeout", b"1S")]
            first = await client.call("/t.T/Echo", frame(b"one"), headers=timeout)
            await client.until(lambda c: c.ended(first))
            await trio.sleep(5)  # past the first call's deadline
            second = await client.call("/t.T/Echo", frame(b"two"), headers=timeout)
            await client.until(lambda c: c.ended(second))
            assert [client.data[s] for s in (first, second)] == [frame(b"one"), frame(b"two")]
            # another call in flight meanwhile: the answer is not written at once
            # (a checkpoint, which the cancelled task must not reach: the writer writes it)
            untimed = await client.call("/t.T/Wait", frame(b""))
            waiting = await client.call("/t.T/Wait", frame(b""), headers=timeout)
            await client.until(lambda c: c.ended(waiting))
            assert client.status(waiting) == (Status.DEADLINE_EXCEEDED.value, "Deadline Exceeded")
            assert handlers.cancelled == ["/t.T/Wait"]
            handlers.release.set()
            await client.until(lambda c: c.ended(untimed))
            assert client.data[untimed] == frame(b"released")
            await trio.sleep(5)
            third = await client.call("/t.T/Echo", frame(b"three"), headers=timeout)
            await client.until(lambda c: c.ended(third))
            assert client.data[third] == frame(b"three")
            assert client.status(third) == (Status.OK.value, "")


# ---------------------------------------------------------- messages and headers


async def test_request_message_rules():
    handlers = Handlers()
    async with serving(handlers, max_message_size=1000) as (port, _):
        async with RawClient.connect(port) as client:
            sneaky = await client.call("/t.T/Echo", frame(b"x", compressed=True))
            odd = await client.call(
                "/t.T/Echo", frame(b"x"), headers=[(b"grpc-encoding", b"snappy")]
            )
            large = await client.call("/t.T/Echo", frame(b"x" * 1001))
            zipped = await client.call(
                "/t.T/Echo",
                frame(gzip.compress(b"y" * 1000), compressed=True),
                headers=[(b"grpc-encoding", b"gzip")],
            )
            bomb = await client.call(
                "/t.T/Echo",
                frame(gzip.compress(b"z" * 100_000), compressed=True),
                headers=[(b"grpc-encoding", b"gzip")],
            )
            await client.until(
                lambda c: all(c.ended(s) for s in (sneaky, odd, large, zipped, bomb))
            )
            assert client.status(sneaky)[0] == Status.INTERNAL.value
            assert client.status(odd) == (
                Status.UNIMPLEMENTED.value,
                "grpc-encoding 'snappy' is not supported; supported: identity, deflate, gzip",
            )
            assert b"gzip" in client.headers(odd)[b"grpc-accept-encoding"]
            assert client.status(large) == (
                Status.RESOURCE_EXHAUSTED.value,
                "received message larger than max (1001 vs. 1000); see --grpc-max-message-size",
            )
            assert client.data[zipped] == frame(b"y" * 1000)
            assert client.status(bomb)[0] == Status.RESOURCE_EXHAUSTED.value


async def test_requests_that_are_not_grpc():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            base = [(b":scheme", b"http"), (b":authority", b"t"), (b":path", b"/t.T/Echo")]
            get = client.h2.get_next_available_stream_id()
            client.h2.send_headers(get, [(b":method", b"GET"), *base], end_stream=True)
            json = client.h2.get_next_available_stream_id()
            client.h2.send_headers(
                json,
                [(b":method", b"POST"), *base, (b"content-type", b"application/json")],
                end_stream=True,
            )
            await client.flush()
            await client.until(lambda c: c.ended(get) and c.ended(json))
            assert client.headers(get)[b":status"] == b"405"
            assert client.headers(json)[b":status"] == b"415"


async def test_responses_compressed_when_asked_and_accepted():
    handlers = Handlers()
    async with serving(handlers, response_compression_level=6) as (port, _):
        async with RawClient.connect(port) as client:
            stream_id = await client.call(
                "/t.T/Echo", frame(b"a" * 5000), headers=[(b"grpc-accept-encoding", b"gzip")]
            )
            await client.until(lambda c: c.ended(stream_id))
            assert client.headers(stream_id)[b"grpc-encoding"] == b"gzip"
            body = client.data[stream_id]
            assert body[0] == 1 and len(body) < 200
            assert gzip.decompress(body[5:]) == b"a" * 5000
        answer = await trio.to_thread.run_sync(grpcio_call, port, "/t.T/Echo", b"b" * 5000)
        assert answer == b"b" * 5000


async def test_keepalive_pings_the_client():
    handlers = Handlers()
    options = dict(keepalive_time=0.05, keepalive_timeout=5, keepalive_permit_without_calls=True)
    async with serving(handlers, **options) as (port, _):
        async with RawClient.connect(port) as client:
            await client.until(lambda c: c.of(h2.events.PingReceived))
            assert client.of(h2.events.PingReceived)[0].ping_data == b"keepaliv"


# ------------------------------------------------------------------------- drain


async def test_shutdown_drains_with_goaway_refusing_new_streams():
    handlers = Handlers()
    async with serving(handlers) as (port, shutdown):
        async with RawClient.connect(port) as client:
            waiting = await client.call("/t.T/Wait", frame(b""))
            chat = await client.call("/t.T/Chat", frame(b"x"), end=False)
            await handlers.entered.wait()
            shutdown.set()
            # Two GOAWAYs: "stop soon" (largest id, with a ping), then the last id.
            await client.until(lambda c: len(c.of(GoAway)) == 2)
            first, second = client.of(GoAway)
            assert (first.last_stream_id, first.error_code) == (2**31 - 1, 0)
            assert (second.last_stream_id, second.error_code) == (chat, 0)
            assert client.of(h2.events.PingReceived)
            # A stream the client opens anyway is refused, not served.
            late = await client.call("/t.T/Echo", frame(b"late"))
            await client.until(lambda c: c.ended(late) and c.ended(chat))
            refused = [e for e in client.of(h2.events.StreamReset) if e.stream_id == late]
            assert refused[0].error_code == h2.errors.ErrorCodes.REFUSED_STREAM
            # The streaming call stops reading and ends cleanly...
            assert client.status(chat) == (Status.UNAVAILABLE.value, "shutting down")
            assert client.data[chat] == frame(b"X")
            # ...the unary call in flight is still served...
            assert not client.ended(waiting)
            handlers.release.set()
            await client.until(lambda c: c.ended(waiting))
            assert client.status(waiting) == (0, "")
            assert client.data[waiting] == frame(b"released")
            # ...and then the server says goodbye and closes.
            await client.until(lambda c: c.closed)
            assert len(client.of(GoAway)) == 3
        assert handlers.cancelled == []


class Fanout:
    """A streaming method that answers each message from a task of its own (as the
    ModelStreamInfer service does), with a large response; it counts the messages
    it took."""

    RESPONSE = b"r" * (256 * 1024)

    def __init__(self) -> None:
        self.taken = 0

    async def __call__(self, call: GrpcCall) -> None:
        async with trio.open_nursery() as nursery:
            while await call.receive() is not None:
                self.taken += 1
                await nursery.start(self._answer, call)  # started before the next

    async def _answer(self, call: GrpcCall, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await call.send(self.RESPONSE)
        call.answered()


async def test_a_client_that_reads_no_responses_holds_the_connection_back():
    """Responses waiting for a window the client never grants count against the
    connection's buffer, with the messages not answered yet: a message is taken
    only while it fits beside them, and the client's window runs out instead of
    the server's memory (issue 18 item 6, issue 31 finding 1)."""
    fanout = Fanout()
    handlers = Handlers()
    methods = {**handlers.methods(), "/t.T/Fanout": Method(fanout, client_streaming=True)}
    shutdown = trio.Event()
    limit = 1024 * 1024
    transport = GrpcTransport(methods, TransportOptions(max_connection_buffer=limit))
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(transport.serve, "127.0.0.1", 0, shutdown, 10.0)
        async with RawClient.connect(bound[0][1]) as client:
            # A window of 0: the server can send headers but no response data.
            client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
            stream = await client.call("/t.T/Fanout", frame(b"q" * 64), end=False)
            for _ in range(39):
                client.h2.send_data(stream, frame(b"q" * 64))
            await client.flush()
            await trio.testing.wait_all_tasks_blocked()
            held = limit // len(Fanout.RESPONSE)  # answers and messages within the limit
            assert fanout.taken == held
            # Granting the window lets everything through.
            client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**24})
            client.h2.end_stream(stream)
            await client.flush()
            await client.until(lambda c: c.ended(stream))
            assert fanout.taken == 40
            assert client.status(stream) == (Status.OK.value, "")
            assert len(client.data[stream]) == 40 * (5 + len(Fanout.RESPONSE))
        shutdown.set()


class Holding:
    """A unary method that takes its message and answers only once released,
    counting the messages taken."""

    def __init__(self) -> None:
        self.taken = 0
        self.release = trio.Event()

    async def __call__(self, call: GrpcCall) -> None:
        message = await call.receive()
        self.taken += 1
        await self.release.wait()
        await call.send(message[:8])


async def test_messages_taken_and_not_answered_count_against_the_connection_buffer():
    """Requests being served count against the connection's buffer until
    answered (issue 31 finding 1): with calls that take their message and do
    not answer yet, a connection's calls take only what the buffer holds, across
    all its streams; the others wait (their windows held back), and all are
    answered once the first are. Before, a message taken no longer counted, so
    every call took its own."""
    holding = Holding()
    shutdown = trio.Event()
    limit = 1024 * 1024
    transport = GrpcTransport(
        {"/t.T/Hold": Method(holding)}, TransportOptions(max_connection_buffer=limit)
    )
    message = frame(b"m" * (256 * 1024 - 5))
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(transport.serve, "127.0.0.1", 0, shutdown, 10.0)
        async with RawClient.connect(bound[0][1]) as client:
            streams: list[int] = []

            async def send_all() -> None:  # as the server's windows allow
                for _ in range(10):
                    streams.append(await client.call("/t.T/Hold", None, end=False))
                    await send_respecting_windows(client, streams[-1], message, end=True)

            async with trio.open_nursery() as sending:
                sending.start_soon(send_all)
                await trio.testing.wait_all_tasks_blocked()
                assert holding.taken == limit // len(message)
                assert len(streams) < 10  # the client is held back
                holding.release.set()
            await client.until(lambda c: all(c.ended(s) for s in streams))
            assert holding.taken == 10
            assert all(client.status(s) == (Status.OK.value, "") for s in streams)
        shutdown.set()


async def send_respecting_windows(
    client: RawClient, stream_id: int, data: bytes, end: bool, wait: bool = True
) -> bytes:
    """Send ``data`` on a stream as the server's flow-control windows allow, waiting
    for more window (or, with ``wait`` false, returning what did not fit)."""
    view = memoryview(data)
    while len(view):
        window = min(
            client.h2.local_flow_control_window(stream_id), client.h2.max_outbound_frame_size
        )
        if window <= 0:
            if not wait:
                break
            await client.until(lambda c: c.h2.local_flow_control_window(stream_id) > 0)
            continue
        chunk, view = view[:window], view[window:]
        client.h2.send_data(stream_id, bytes(chunk), end_stream=end and not len(view))
        await client.flush()
    return bytes(view)


async def test_unfinished_messages_past_the_connection_buffer_all_complete():
    """Two large messages arriving interleaved, together past the connection's
    buffer: the oldest goes on (the connection window is given back for it) while
    the other waits, then the other; neither call waits for ever."""
    limit = 1024 * 1024
    options = dict(max_connection_buffer=limit, window_size=limit, max_message_size=8 * limit)
    async with serving(Handlers(), **options) as (port, _):
        async with RawClient.connect(port) as client:
            first = frame(b"a" * (4 * limit))
            second = frame(b"b" * (4 * limit))
            a = await client.call("/t.T/Echo", None, end=False)
            b = await client.call("/t.T/Echo", None, end=False)
            await send_respecting_windows(client, a, first[: 2 * limit], end=False)
            # b takes what its window allows, and the server holds b's window back.
            rest = await send_respecting_windows(client, b, second, end=True, wait=False)
            assert len(rest) >= len(second) - limit
            await send_respecting_windows(client, a, first[2 * limit :], end=True)
            await send_respecting_windows(client, b, rest, end=True)
            await client.until(lambda c: c.ended(a) and c.ended(b))
            assert client.status(a) == (Status.OK.value, "")
            assert client.status(b) == (Status.OK.value, "")
            assert client.data[a] == first and client.data[b] == second


async def test_connections_past_the_cap_are_closed_and_the_others_served():
    """--grpc-max-connections (issue 18 item 5): with every connection busy (a call
    in flight), the excess is closed at once and the others are served."""
    handlers = Handlers()
    async with serving(handlers, max_connections=1) as (port, _):
        async with RawClient.connect(port) as first:
            busy = await first.call("/t.T/Wait", frame(b""))
            await handlers.entered.wait()
            async with RawClient.connect(port) as second:
                await second.until(lambda c: False)  # until the server closes it
                assert second.closed
            handlers.release.set()
            await first.until(lambda c: c.ended(busy))
            again = await first.call("/t.T/Echo", frame(b"two"))
            await first.until(lambda c: c.ended(again))
            assert first.status(again) == (Status.OK.value, "")


async def test_an_idle_connection_makes_room_at_the_cap():
    """At the cap, the connection with no call in flight for the longest gets
    GOAWAY and is closed, and the new one is served (issue 31 finding 2)."""
    async with serving(Handlers(), max_connections=1) as (port, _):
        async with RawClient.connect(port) as first:
            stream = await first.call("/t.T/Echo", frame(b"one"))
            await first.until(lambda c: c.ended(stream))
            async with RawClient.connect(port) as second:
                again = await second.call("/t.T/Echo", frame(b"two"))
                await second.until(lambda c: c.ended(again))
                assert second.status(again) == (Status.OK.value, "")
            await first.until(lambda c: False)  # until the server closes it
            assert first.closed
            assert any(isinstance(e, GoAway) for e in first.events)


async def test_a_connection_without_calls_is_closed_after_the_idle_timeout(autojump_clock):
    """A connection with no call in flight for idle_timeout gets GOAWAY and is
    closed (virtual time); one whose calls keep coming is kept."""
    async with serving(Handlers(), idle_timeout=60.0) as (port, _):
        async with RawClient.connect(port) as idle:
            stream = await idle.call("/t.T/Echo", frame(b"hi"))
            await idle.until(lambda c: c.ended(stream))
            start = trio.current_time()
            with trio.fail_after(120):
                while not idle.closed:
                    data = await idle.stream.receive_some(65536)
                    idle.closed = not data
            assert trio.current_time() - start >= 59.0  # not before the timeout


async def test_the_idle_timeout_counts_from_the_last_call_and_never_cuts_one(autojump_clock):
    """The idle timeout runs from the moment the connection last had no call in
    flight (virtual time): a call part way through it starts it again, and a call
    running past it is not cut. Calls do not move the timeout's deadline (it is
    set again when it passes), so this checks where the close lands."""
    handlers = Handlers()
    async with serving(handlers, idle_timeout=60.0) as (port, _):
        async with RawClient.connect(port) as client:
            first = await client.call("/t.T/Echo", frame(b"hi"))
            await client.until(lambda c: c.ended(first))
            await trio.sleep(40)  # idle 40 s of 60
            second = await client.call("/t.T/Echo", frame(b"again"))
            await client.until(lambda c: c.ended(second))
            await trio.sleep(50)  # past the first call's 60 s, not the second's
            waiting = await client.call("/t.T/Wait", frame(b""))
            await handlers.entered.wait()
            await trio.sleep(100)  # a call in flight past the idle timeout
            assert not client.closed
            handlers.release.set()
            await client.until(lambda c: c.ended(waiting))
            assert client.status(waiting) == (Status.OK.value, "")
            idle_from = trio.current_time()
            with trio.fail_after(120):
                while not client.closed:
                    data = await client.stream.receive_some(65536)
                    client.closed = not data
            assert 60.0 <= trio.current_time() - idle_from < 61.0


class StepCounter(trio.abc.Instrument):
    """The tasks that ran a step, while counting."""

    def __init__(self) -> None:
        self.tasks: set = set()

    def before_task_step(self, task) -> None:
        self.tasks.add(task)


async def test_a_unary_call_answered_at_once_runs_in_one_step_of_the_reader():
    """A unary call whose request came whole and that is answered without waiting
    runs in the connection's reader task, with no task of its own, and the reader
    writes its answer at once: the server runs one task step for it, as an HTTP
    request does (before: a step of the reader and one of the call's own task,
    and two before that, with send_all's checkpoint)."""
    steps: list[str] = []

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task) -> None:
            steps.append(task.name)

    async with serving(Handlers()) as (port, _):
        async with RawClient.connect(port) as client:
            first = await client.call("/t.T/Echo", frame(b"warm"))
            await client.until(lambda c: c.ended(first))
            await trio.testing.wait_all_tasks_blocked()
            instrument = Steps()
            trio.lowlevel.add_instrument(instrument)
            try:
                second = await client.call("/t.T/Echo", frame(b"x" * 300))
                await client.until(lambda c: c.ended(second))
                await trio.testing.wait_all_tasks_blocked()
            finally:
                trio.lowlevel.remove_instrument(instrument)
            server = [name for name in steps if name.startswith("trionserve.")]
            assert len(server) == 1, steps
            assert not any("_run_call" in name or "_writer" in name for name in server)
            assert client.data[second] == frame(b"x" * 300)
            assert client.status(second) == (Status.OK.value, "")


async def test_a_unary_call_that_waits_keeps_the_reader_task_and_another_reads_on():
    """A call that runs in the reader's task and then waits keeps that task; a new
    task reads on: calls after it on the connection are answered meanwhile, in
    the new reader's task (answered at once, they need no task of their own),
    and it is answered when it can be."""
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            waiting = await client.call("/t.T/Wait", frame(b""))
            with trio.fail_after(10):
                await handlers.entered.wait()
            counter = StepCounter()
            trio.lowlevel.add_instrument(counter)
            try:
                echoes = [await client.call("/t.T/Echo", frame(b"e%d" % i)) for i in range(3)]
                await client.until(lambda c: all(c.ended(s) for s in echoes))
            finally:
                trio.lowlevel.remove_instrument(counter)
            assert not [t for t in counter.tasks if "_run_call" in t.name]
            assert [client.data[s] for s in echoes] == [frame(b"e%d" % i) for i in range(3)]
            assert not client.ended(waiting)
            handlers.release.set()
            await client.until(lambda c: c.ended(waiting))
            assert client.data[waiting] == frame(b"released")
            assert client.status(waiting) == (Status.OK.value, "")
            after = await client.call("/t.T/Echo", frame(b"after"))
            await client.until(lambda c: c.ended(after))
            assert client.data[after] == frame(b"after")


class Entering(Handlers):
    """``all_entered`` is set once ``count`` calls of Wait are in."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.left = count
        self.all_entered = trio.Event()

    async def wait(self, call: GrpcCall) -> None:
        self.left -= 1
        if not self.left:
            self.all_entered.set()
        await super().wait(call)


async def test_the_answers_of_calls_ended_in_one_pass_go_out_in_one_write(monkeypatch):
    """Calls that end in the same pass of the run loop (a batch's, here four
    released at once): their answers go out in one gathered write, not the
    first alone (a ``send_all`` and its checkpoint) and the others after."""
    writes: list[int] = []
    gathered = writing.send_pieces

    async def counted(stream, pieces):
        writes.append(len(pieces))
        await gathered(stream, pieces)

    def joined(buffers):
        raise AssertionError("an answer written with send_all")

    monkeypatch.setattr(writing, "send_pieces", counted)
    monkeypatch.setattr(writing, "coalesce", joined)
    handlers = Entering(4)
    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            calls = [await client.call("/t.T/Wait", frame(b"")) for _ in range(4)]
            with trio.fail_after(10):
                await handlers.all_entered.wait()
            await trio.testing.wait_all_tasks_blocked()
            writes.clear()
            handlers.release.set()
            await client.until(lambda c: all(c.ended(s) for s in calls))
            assert all(client.data[s] == frame(b"released") for s in calls)
            assert len(writes) == 1, writes


async def test_unary_calls_of_one_read_run_in_order_in_the_reader_until_one_waits():
    """Unary calls whose requests came whole in one read run one after another in
    the reader's task, each answered at once, all written in one step (as on a
    connection multiplexing several clients' calls); the first that would wait
    keeps that task, and the calls after it run in tasks of their own, answered
    meanwhile."""
    handlers = Handlers()
    steps: list[str] = []

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task) -> None:
            steps.append(task.name)

    def queue(client: RawClient, path: str, body: bytes) -> int:
        stream_id = client.h2.get_next_available_stream_id()
        client.h2.send_headers(
            stream_id,
            [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":authority", b"test"),
                (b":path", path.encode()),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
            ],
        )
        client.h2.send_data(stream_id, body, end_stream=True)
        return stream_id

    async with serving(handlers) as (port, _):
        async with RawClient.connect(port) as client:
            warm = await client.call("/t.T/Echo", frame(b"warm"))
            await client.until(lambda c: c.ended(warm))
            await trio.testing.wait_all_tasks_blocked()
            trio.lowlevel.add_instrument(instrument := Steps())
            try:
                echoes = [queue(client, "/t.T/Echo", frame(b"e%d" % i)) for i in range(3)]
                await client.flush()  # one write: one read on the server
                await client.until(lambda c: all(c.ended(s) for s in echoes))
                await trio.testing.wait_all_tasks_blocked()
            finally:
                trio.lowlevel.remove_instrument(instrument)
            served = [name for name in steps if name.startswith("trionserve.")]
            assert len(served) == 1, steps
            assert [client.data[s] for s in echoes] == [frame(b"e%d" % i) for i in range(3)]

            counter = StepCounter()
            trio.lowlevel.add_instrument(counter)
            try:
                waiting = queue(client, "/t.T/Wait", frame(b""))
                after = [queue(client, "/t.T/Echo", frame(b"a%d" % i)) for i in range(2)]
                await client.flush()
                await client.until(lambda c: all(c.ended(s) for s in after))
            finally:
                trio.lowlevel.remove_instrument(counter)
            assert len([t for t in counter.tasks if "_run_call" in t.name]) == 2
            assert [client.data[s] for s in after] == [frame(b"a%d" % i) for i in range(2)]
            assert not client.ended(waiting)
            handlers.release.set()
            await client.until(lambda c: c.ended(waiting))
            assert client.data[waiting] == frame(b"released")


async def test_a_window_update_for_one_stream_wakes_only_that_streams_sender():
    """Responses waiting for flow-control window: a WINDOW_UPDATE for one stream
    lets that call's response out and wakes no other call's task (before, every
    update woke every sender on the connection, each to find no window and wait
    again: work per update in the number of calls in flight)."""
    async with serving(Handlers()) as (port, _):
        async with RawClient.connect(port) as client:
            # A stream window of 0: the server can send headers but no response data.
            client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
            await client.flush()
            streams = [await client.call("/t.T/Echo", frame(b"x" * 10)) for _ in range(4)]
            await client.until(lambda c: len(c.of(h2.events.ResponseReceived)) == 4)
            await trio.testing.wait_all_tasks_blocked()
            counter = StepCounter()
            trio.lowlevel.add_instrument(counter)
            try:
                client.h2.increment_flow_control_window(15, stream_id=streams[0])
                await client.flush()
                await client.until(lambda c: c.ended(streams[0]))
                await trio.testing.wait_all_tasks_blocked()
            finally:
                trio.lowlevel.remove_instrument(counter)
            # The reader, the task that holds that call (each waiting call kept
            # the task it ran in: a task per call either way), and the writer
            # (with other calls in flight, it writes the answers: writing.py).
            server = [t for t in counter.tasks if t.name.startswith("trionserve.")]
            assert len(server) == 3, [t.name for t in counter.tasks]
            assert any(t.name.endswith("SocketWriter._writer") for t in server)
            assert client.data[streams[0]] == frame(b"x" * 10)
            assert not any(client.ended(s) for s in streams[1:])
            for stream in streams[1:]:
                client.h2.increment_flow_control_window(15, stream_id=stream)
            await client.flush()
            await client.until(lambda c: all(c.ended(s) for s in streams))
            assert all(client.status(s) == (Status.OK.value, "") for s in streams)


async def test_a_connection_that_starts_no_call_is_closed(autojump_clock):
    """A client that connects and sends nothing (slowloris) is closed after the
    first-call timeout (virtual time); one that calls in time is kept."""
    async with serving(Handlers(), first_call_timeout=30.0) as (port, _):
        async with RawClient.connect(port) as idle, RawClient.connect(port) as busy:
            stream = await busy.call("/t.T/Echo", frame(b"hi"))
            await busy.until(lambda c: c.ended(stream))
            start = trio.current_time()
            with trio.fail_after(60):
                while not idle.closed:
                    data = await idle.stream.receive_some(65536)
                    idle.closed = not data
            assert trio.current_time() - start >= 29.0  # not before the timeout
            again = await busy.call("/t.T/Echo", frame(b"still here"))
            await busy.until(lambda c: c.ended(again))
            assert busy.status(again) == (Status.OK.value, "")


async def test_large_compressed_messages_are_inflated_off_the_event_loop():
    """A large gzip message is inflated in a worker thread (issue 18 item 4) and
    arrives whole; one that inflates past the limit is RESOURCE_EXHAUSTED."""
    import os

    payload = os.urandom(200_000)  # incompressible: the compressed message is large too
    async with serving(Handlers(), max_message_size=300_000) as (port, _):
        async with RawClient.connect(port) as client:
            gz = [(b"grpc-encoding", b"gzip")]
            ok = await client.call("/t.T/Echo", None, gz, end=False)
            await send_respecting_windows(client, ok, frame(gzip.compress(payload), True), True)
            bomb = await client.call("/t.T/Echo", None, gz, end=False)
            await send_respecting_windows(
                client, bomb, frame(gzip.compress(bytes(10**7)), True), True
            )
            await client.until(lambda c: c.ended(ok) and c.ended(bomb))
            assert client.status(ok) == (Status.OK.value, "")
            assert client.data[ok] == frame(payload)
            status, message = client.status(bomb)
            assert status == Status.RESOURCE_EXHAUSTED.value and "300000" in message


@pytest.mark.parametrize(
    "options,window",
    [({}, 16 * 1024 * 1024), ({"max_connection_buffer": 1024 * 1024}, 1024 * 1024)],
    ids=["default", "small-buffer"],
)
async def test_large_messages_flow_in_the_advertised_windows(options, window):
    """The server advertises its stream and connection windows and its frame size
    (never more window than --grpc-max-connection-buffer); a client sending up to
    them without waiting is within flow control, and a 4 MB message, in frames of
    the advertised size, comes back whole."""
    async with serving(Handlers(), **options) as (port, _):
        async with RawClient.connect(port) as client:
            await client.until(
                lambda c: (
                    c.h2.remote_settings.max_frame_size == 1024 * 1024
                    and c.h2.outbound_flow_control_window == window
                )
            )
            assert client.h2.remote_settings.initial_window_size == window
            message = frame(bytes(range(256)) * 16384)  # 4 MiB + 5
            stream = await client.call("/t.T/Echo", None, end=False)
            rest = await send_respecting_windows(client, stream, message, end=True, wait=False)
            assert len(message) - len(rest) == min(len(message), window)
            await send_respecting_windows(client, stream, rest, end=True)
            await client.until(lambda c: c.ended(stream))
            assert client.status(stream) == (Status.OK.value, "")
            assert client.data[stream] == message


class Large(Handlers):
    """Echo, and Large: a small request answered with 4 MiB, past any socket buffer."""

    answer = bytes(range(256)) * 16384

    async def large(self, call: GrpcCall) -> None:
        await call.receive()
        await call.send(self.answer)

    def methods(self) -> dict[str, Method]:
        return {**super().methods(), "/t.T/Large": Method(self.large)}


async def test_an_answer_the_socket_takes_in_part_is_written_whole_and_in_order(monkeypatch):
    """The reader writes an answer straight to the socket when it can
    (writing.SocketWriter._write_at_once); what the socket does not take follows through
    the writing task, before anything queued after it: a 4 MiB answer to a
    client that reads only once it has asked comes whole, and the calls in the
    same read after it come after it, whole."""
    from trionserve.protocol.grpc import writing

    left: list[int] = []

    def spy(socket, pieces):
        rest = send_pieces_now(socket, pieces)
        left.append(sum(view.nbytes for view in rest))
        return rest

    monkeypatch.setattr(writing, "send_pieces_now", spy)
    async with serving(Large()) as (port, _):
        async with RawClient.connect(port) as client:
            client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
            client.h2.increment_flow_control_window(2**31 - 1 - 65535)
            await client.flush()
            await client.until(lambda c: c.of(h2.events.SettingsAcknowledged))
            # One read: the large call, then two echoes, answered in the reader.
            large = client.h2.get_next_available_stream_id()
            ids = [large, large + 2, large + 4]
            for stream_id, path, body in zip(
                ids, ["/t.T/Large", "/t.T/Echo", "/t.T/Echo"], [b"", b"one", b"two"], strict=True
            ):
                client.h2.send_headers(
                    stream_id,
                    [
                        (b":method", b"POST"),
                        (b":scheme", b"http"),
                        (b":authority", b"test"),
                        (b":path", path.encode()),
                        (b"content-type", b"application/grpc"),
                        (b"te", b"trailers"),
                    ],
                )
                client.h2.send_data(stream_id, frame(body), end_stream=True)
            await client.flush()
            await client.until(lambda c: all(c.ended(s) for s in ids))
            assert any(left), left  # the socket took the reader's write in part
            assert client.data[large] == frame(Large.answer)
            assert [client.data[s] for s in ids[1:]] == [frame(b"one"), frame(b"two")]
            assert all(client.status(s) == (Status.OK.value, "") for s in ids)
            ended = [e.stream_id for e in client.of(h2.events.StreamEnded)]
            assert ended == ids
            after = await client.call("/t.T/Echo", frame(b"after"))
            await client.until(lambda c: c.ended(after))
            assert client.data[after] == frame(b"after")


async def test_the_rest_of_a_large_message_is_read_straight_into_its_buffer(monkeypatch):
    """A large message's DATA frame that comes in part: the rest of it is read
    from the socket into the message's own buffer (one wait for all of it),
    never through the frame loop, and the message comes back whole; a frame
    after it is read as usual."""
    through_frames = []
    receive = upstream.H2Connection.receive
    first_part_read = trio.Event()

    def counted(self, data):
        through_frames.append(len(data))
        taken = receive(self, data)
        if self.partial is not None:  # the DATA frame came in part
            first_part_read.set()
        return taken

    monkeypatch.setattr(upstream.H2Connection, "receive", counted)
    message = frame(bytes(range(256)) * 2048)  # 512 KiB + 5
    first, second = message[:400_000], message[400_000:]
    async with serving(Handlers()) as (port, _):
        async with RawClient.connect(port) as client:
            await client.until(lambda c: c.h2.remote_settings.max_frame_size == 1024 * 1024)
            # a first call opens the connection (its HEADERS are h2's: SERVER_OPEN)
            opening = await client.call("/t.T/Echo", frame(b"hi"))
            await client.until(lambda c: c.ended(opening))
            stream = await client.call("/t.T/Echo", None, end=False)
            header = struct.pack(">HBBBL", len(first) >> 8, len(first) & 0xFF, 0, 0, stream)
            await client.stream.send_all(header + first[:100_000])
            await first_part_read.wait()  # the server has read the frame's first bytes
            end = struct.pack(">HBBBL", len(second) >> 8, len(second) & 0xFF, 0, 1, stream)
            await client.stream.send_all(first[100_000:] + end + second)
            await client.until(lambda c: c.ended(stream))
            assert client.status(stream) == (Status.OK.value, "")
            assert client.data[stream] == message
    # the first frame's first 100 kB and the second frame went through the frame
    # loop; the first frame's other 300 kB did not
    assert sum(through_frames) < len(message) - 250_000
