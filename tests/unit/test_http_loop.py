"""The HTTP/1.1 Trio loop over memory streams (trio.testing.memory_stream_pair),
no sockets: each connection state it handles, with virtual time for its
deadlines (header and body timeouts, keep-alive idle, slow requests)."""

from __future__ import annotations

import h11
import pytest
import trio
import trio.testing

from trionserve.protocol.http.h1 import LastChunk
from trionserve.protocol.http.transport import HttpServer, HttpServerOptions


class App:
    """``/echo`` answers with its body (and records it), ``/slow`` waits for
    ``release`` (and records a cancellation), ``/boom`` raises, ``/stream``
    streams three chunks; anything else is unknown."""

    def __init__(self) -> None:
        self.bodies: list = []
        self.entered = trio.Event()
        self.release = trio.Event()
        self.cancelled = trio.Event()
        self.stream_closed = trio.Event()

    def route(self, method: bytes, path: str):
        return {
            "/echo": self.echo,
            "/slow": self.slow,
            "/boom": self.boom,
            "/stream": self.stream,
        }.get(path)

    async def echo(self, headers, body):
        self.bodies.append(body)
        return 200, [(b"content-length", b"%d" % len(body))], [bytes(body)]

    async def slow(self, headers, body):
        self.entered.set()
        try:
            await self.release.wait()
        except trio.Cancelled:
            self.cancelled.set()
            raise
        return 200, [(b"content-length", b"4")], [b"done"]

    async def boom(self, headers, body):
        raise RuntimeError("handler bug")

    async def stream(self, headers, body):
        async def chunks():
            try:
                for piece in (b"a", b"bb", b"ccc"):
                    yield piece
            finally:
                self.stream_closed.set()

        return 200, [(b"content-type", b"text/plain")], chunks()


class Peer:
    """The client end of a memory stream, reading answers with h11."""

    def __init__(self, stream: trio.abc.HalfCloseableStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def response(self, method: bytes = b"POST") -> tuple[int, dict, bytes]:
        self.h11.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
        self.h11.send(h11.EndOfMessage())
        status, headers, body = 0, {}, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
            elif type(event) is h11.Response:
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif type(event) is h11.Data:
                body += event.data
            elif type(event) is h11.EndOfMessage:
                if self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                return status, headers, body
            elif type(event) is h11.ConnectionClosed:
                raise EOFError("connection closed")

    async def closed(self) -> bool:
        """Reads to the end of the stream: True once the server closed it."""
        while await self.stream.receive_some(65536):
            pass
        return True


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


@pytest.fixture
async def connect(nursery):
    """connect(app, **options) -> (server, peer): one connection served over a
    memory stream pair, and the slow-request watcher running."""

    def start(app: App, **options) -> tuple[HttpServer, Peer]:
        server = HttpServer(app.route, HttpServerOptions(linger=0.1, **options))
        client, served = trio.testing.memory_stream_pair()
        nursery.start_soon(server.serve_connection, served)
        nursery.start_soon(server.watch_slow_requests, nursery)
        return server, Peer(client)

    return start


async def test_keep_alive_and_pipelined_requests_in_order(connect):
    app = App()
    _, peer = connect(app)
    await peer.send(post("/echo", b"one"))
    assert (await peer.response())[::2] == (200, b"one")
    await peer.send(post("/echo", b"two") + post("/echo", b"") + post("/echo", b"three"))
    for body in (b"two", b"", b"three"):
        status, headers, answer = await peer.response()
        assert (status, answer) == (200, body) and "connection" not in headers


async def test_body_in_pieces_is_one_writable_buffer_and_the_next_request_waits(connect):
    """Received once into its Content-Length buffer, never past its end (the
    pipelined request after it is parsed by a fresh parser and served)."""
    app = App()
    _, peer = connect(app)
    body = bytes(range(256)) * 40
    await peer.send(post("/echo", body)[: -len(body) + 100])
    await trio.testing.wait_all_tasks_blocked()
    await peer.send(body[100:5000])
    await peer.send(body[5000:] + post("/echo", b"next"))
    assert await peer.response() == (200, {"content-length": str(len(body))}, body)
    assert (await peer.response())[2] == b"next"
    first = app.bodies[0]
    assert isinstance(first, memoryview) and not first.readonly and bytes(first) == body


class Recording(trio.abc.HalfCloseableStream):
    """A stream that records how many bytes each read asks for."""

    def __init__(self, stream: trio.abc.HalfCloseableStream) -> None:
        self.stream = stream
        self.asked: list[int | None] = []

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        self.asked.append(max_bytes)
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def test_a_request_starts_with_a_small_read_and_its_body_goes_to_its_buffer(nursery):
    """The head is read with head_receive_size (what of the body comes with it goes
    through the parser, copied); the rest of the body is asked for whole, into its
    buffer, and a pipelined request after it is served."""
    app = App()
    server = HttpServer(app.route, HttpServerOptions(linger=0.1, head_receive_size=1000))
    client, served = trio.testing.memory_stream_pair()
    recording = Recording(served)
    nursery.start_soon(server.serve_connection, recording)
    peer = Peer(client)
    body = bytes(range(256)) * 40
    request = post("/echo", body)
    await peer.send(request + post("/echo", b"next"))
    assert (await peer.response())[2] == body
    assert (await peer.response())[2] == b"next"
    head = len(request) - len(body)
    assert recording.asked[:2] == [1000, len(body) - (1000 - head)]
    assert bytes(app.bodies[0]) == body


async def test_expect_100_continue_is_sent_when_the_body_is_read(connect):
    app = App()
    _, peer = connect(app)
    await peer.send(post("/echo", b"", "Expect: 100-continue\r\n").replace(b": 0", b": 3"))
    assert await peer.stream.receive_some(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
    await peer.send(b"abc")
    assert (await peer.response())[2] == b"abc"


async def test_chunked_body(connect):
    app = App()
    _, peer = connect(app)
    await peer.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab")
    await trio.testing.wait_all_tasks_blocked()
    await peer.send(b"c\r\n2\r\nde\r\n0\r\n\r\n")
    assert (await peer.response())[2] == b"abcde"
    assert isinstance(app.bodies[0], bytearray)


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (post("/nothing", b"x"), 404),
        (post("/boom", b""), 500),
        (post("/echo", b"x" * 11), 413),
        (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    ],
)
async def test_an_error_answer_closes_the_connection(connect, request_bytes, status):
    """Keep-alive ends with an error answer: the request after it is not served."""
    app = App()
    _, peer = connect(app, max_request_body=10)
    await peer.send(request_bytes + post("/echo", b"after"))
    answer_status, headers, body = await peer.response()
    assert (answer_status, headers["connection"]) == (status, "close")
    assert body.startswith(b'{"error":')
    assert await peer.closed() and app.bodies == []


async def test_a_head_that_does_not_come_in_time_is_408(connect, autojump_clock):
    app = App()
    _, peer = connect(app, header_timeout=5.0)
    await peer.send(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
    started = trio.current_time()
    status, headers, body = await peer.response()
    assert (status, headers["connection"]) == (408, "close") and b"--http-header-timeout" in body
    assert trio.current_time() - started == pytest.approx(5.0)
    assert await peer.closed()


async def test_the_head_timeout_starts_with_the_first_byte_of_a_later_request(
    connect, autojump_clock
):
    app = App()
    _, peer = connect(app, header_timeout=5.0, keep_alive_timeout=60.0)
    await peer.send(post("/echo", b"1"))
    await peer.response()
    await trio.sleep(30)  # keep-alive idle: no head deadline yet
    await peer.send(b"POST /echo HTTP/1.1\r\n")
    started = trio.current_time()
    assert (await peer.response())[0] == 408
    assert trio.current_time() - started == pytest.approx(5.0)


async def test_a_body_that_stops_arriving_is_408(connect, autojump_clock):
    app = App()
    _, peer = connect(app, header_timeout=5.0)
    await peer.send(post("/echo", b"abcd")[:-2])
    status, _, body = await peer.response()
    assert status == 408 and b"the request body stopped arriving" in body
    assert app.bodies == []


async def test_an_idle_keep_alive_connection_closes_quietly(connect, autojump_clock):
    app = App()
    _, peer = connect(app, keep_alive_timeout=7.0)
    await peer.send(post("/echo", b"1"))
    await peer.response()
    answered = trio.current_time()
    assert await peer.stream.receive_some(65536) == b""  # closed without an answer
    assert trio.current_time() - answered == pytest.approx(7.0)


async def test_drain_closes_idle_connections_at_once(nursery):
    app = App()
    server = HttpServer(app.route, HttpServerOptions(linger=0.1))
    peers = []
    for _ in range(2):
        client, served = trio.testing.memory_stream_pair()
        nursery.start_soon(server.serve_connection, served)
        peers.append(Peer(client))
    answered, silent = peers
    await answered.send(post("/echo", b"1"))
    await answered.response()
    await trio.testing.wait_all_tasks_blocked()
    server.drain()
    assert await answered.closed() and await silent.closed()


async def test_in_flight_request_is_answered_with_connection_close_while_draining(connect):
    app = App()
    server, peer = connect(app)
    await peer.send(post("/slow", b"") + post("/echo", b"never"))
    await app.entered.wait()
    server.drain()
    app.release.set()
    status, headers, body = await peer.response()
    assert (status, body, headers["connection"]) == (200, b"done", "close")
    assert await peer.closed() and app.bodies == []


async def test_a_request_cut_at_the_exit_timeout_is_503(nursery):
    app = App()
    server = HttpServer(app.route, HttpServerOptions(linger=0.1))
    client, served = trio.testing.memory_stream_pair()
    peer = Peer(client)
    async with trio.open_nursery() as connection:
        connection.start_soon(server.serve_connection, served)
        await peer.send(post("/slow", b""))
        await app.entered.wait()
        connection.cancel_scope.cancel()
    status, headers, body = await peer.response()
    assert (status, headers["connection"]) == (503, "close") and b"--exit-timeout-secs" in body
    assert app.cancelled.is_set()
    assert await peer.closed()  # closed under cancellation too (e45f070)


async def test_at_the_cap_the_connection_idle_longest_after_an_answer_makes_room(nursery):
    """Only connections answered and idle since are evicted, oldest first; one that
    has not sent its first request is not (646dbcd)."""
    app = App()
    server = HttpServer(app.route, HttpServerOptions(linger=0.1))
    peers = []
    for _ in range(3):
        client, served = trio.testing.memory_stream_pair()
        nursery.start_soon(server.serve_connection, served)
        peers.append(Peer(client))
    fresh, older, newer = peers
    for peer in (older, newer):
        await peer.send(post("/echo", b"1"))
        await peer.response()
        await trio.testing.wait_all_tasks_blocked()
    assert server._close_oldest_idle()
    assert await older.closed()
    await newer.send(post("/echo", b"2"))
    assert (await newer.response())[2] == b"2"  # still served
    await trio.testing.wait_all_tasks_blocked()
    assert server._close_oldest_idle() and await newer.closed()
    assert not server._close_oldest_idle()  # the fresh one is not idle after an answer
    await fresh.send(post("/echo", b"3"))
    assert (await fresh.response())[2] == b"3"


async def test_a_client_gone_during_a_slow_request_cancels_it(connect, autojump_clock):
    app = App()
    _, peer = connect(app)
    await peer.send(post("/slow", b""))
    await app.entered.wait()
    await peer.stream.send_eof()
    with trio.fail_after(1):  # virtual: the watcher starts after 0.25-0.5 s
        await app.cancelled.wait()
    assert await peer.closed()


async def test_a_request_pipelined_during_a_slow_one_waits_its_turn(connect, autojump_clock):
    """The watcher of a slow request parses what arrives meanwhile; that request is
    served after the slow one, not lost."""
    app = App()
    _, peer = connect(app)
    await peer.send(post("/slow", b""))
    await app.entered.wait()
    await trio.sleep(0.6)  # the watcher is on the socket
    await peer.send(post("/echo", b"second"))
    await trio.testing.wait_all_tasks_blocked()
    app.release.set()
    assert (await peer.response())[2] == b"done"
    assert (await peer.response())[2] == b"second"


async def test_client_gone_mid_body_ends_the_connection_without_an_answer(connect):
    app = App()
    _, peer = connect(app)
    await peer.send(post("/echo", b"abcdef")[:-3])
    await peer.stream.send_eof()
    assert await peer.stream.receive_some(65536) == b"" and app.bodies == []


async def test_streamed_answer_is_chunked_and_head_has_no_body(connect):
    app = App()
    _, peer = connect(app)
    await peer.send(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await peer.response(b"GET")
    assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"abbccc")
    assert app.stream_closed.is_set()
    await peer.send(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n" + post("/echo", b"x"))
    status, headers, body = await peer.response(b"HEAD")
    assert (status, headers["content-length"], body) == (200, "0", b"")
    assert (await peer.response())[2] == b"x"


async def test_a_head_over_the_limit_is_431_and_closed(connect):
    app = App()
    _, peer = connect(app, max_header_size=1000)
    await peer.send(b"GET /echo HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 2000)
    status, headers, _ = await peer.response()
    assert (status, headers["connection"]) == (431, "close")
    assert await peer.closed()


class Writes(trio.abc.HalfCloseableStream):
    """A stream that records each write the server makes to it."""

    def __init__(self, inner: trio.abc.HalfCloseableStream) -> None:
        self.inner = inner
        self.writes: list[bytes] = []

    async def send_all(self, data) -> None:
        self.writes.append(bytes(data))
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_streamed_answer_s_head_goes_with_its_first_chunk_at_once(nursery):
    next_chunk = trio.Event()

    async def stream(headers, body):
        async def chunks():
            yield b"first"
            await next_chunk.wait()
            yield b"second"

        return 200, [(b"content-type", b"text/event-stream")], chunks()

    server = HttpServer(lambda method, path: stream, HttpServerOptions(linger=0.1))
    client, served = trio.testing.memory_stream_pair()
    writes = Writes(served)
    nursery.start_soon(server.serve_connection, writes)
    await client.send_all(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
    received = b""
    while not received.endswith(b"5\r\nfirst\r\n"):  # before the second chunk exists
        received += await client.receive_some(65536)
    assert len(writes.writes) == 1 and writes.writes[0].startswith(b"HTTP/1.1 200 ")
    next_chunk.set()
    while not received.endswith(b"0\r\n\r\n"):
        received += await client.receive_some(65536)
    assert writes.writes[1:] == [b"6\r\nsecond\r\n", b"0\r\n\r\n"]


async def test_a_last_chunk_goes_with_the_end_of_the_body_and_ends_it(nursery):
    closed = trio.Event()

    async def stream(headers, body):
        async def chunks():
            try:
                yield b"first"
                yield LastChunk(b"last")
                yield b"never written"
            finally:
                closed.set()

        return 200, [(b"content-type", b"text/event-stream")], chunks()

    server = HttpServer(lambda method, path: stream, HttpServerOptions(linger=0.1))
    client, served = trio.testing.memory_stream_pair()
    writes = Writes(served)
    nursery.start_soon(server.serve_connection, writes)
    peer = Peer(client)
    await peer.send(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await peer.response(b"GET"))[::2] == (200, b"firstlast")
    assert writes.writes[1:] == [b"4\r\nlast\r\n0\r\n\r\n"] and closed.is_set()
