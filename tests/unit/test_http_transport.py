"""The HTTP/1.1 transport on raw sockets: keep-alive, pipelining, 100-continue,
chunked bodies, body limits, bad requests, resets, graceful shutdown, HEAD,
unknown paths, handler failures, streamed answers."""

from __future__ import annotations

import errno
import resource
import socket
import struct
import sys
import tracemalloc
from functools import partial

import h11
import numpy as np
import pytest
import structlog
import structlog.testing
import trio

from trionserve.protocol.http.transport import HttpServer, HttpServerOptions


class App:
    """A router: ``POST /echo`` answers with the body it got, ``/info`` with
    "METHOD PATH BODY-LENGTH" (201), ``/ignore`` with 404 without looking at the
    body, ``/boom`` raises, ``/stream`` streams three chunks, ``/slow`` waits for
    ``release``; any other path is unknown (None)."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.entered = trio.Event()
        self.bodies: list[bytes] = []
        self.stream_closed = trio.Event()

    def route(self, method: bytes, path: str):
        if method == b"POST" and path == "/echo":
            return self.echo
        if path.startswith("/info"):
            return partial(self.info, method, path)
        return {
            "/slow": self.slow,
            "/ignore": self.ignore,
            "/boom": self.boom,
            "/stream": self.stream,
        }.get(path)

    async def echo(self, headers, body: bytes):
        self.bodies.append(body)
        return 200, [(b"content-length", b"%d" % len(body))], [body]

    async def info(self, method: bytes, path: str, headers, body: bytes):
        payload = f"{method.decode()} {path} {len(body)}".encode()
        return 201, [(b"content-length", b"%d" % len(payload))], [payload]

    async def ignore(self, headers, body: bytes):
        return 404, [(b"content-length", b"0")], ()

    async def boom(self, headers, body: bytes):
        raise RuntimeError("handler bug")

    async def stream(self, headers, body: bytes):
        async def chunks():
            try:
                for piece in (b"a", b"bb", b"ccc"):
                    yield piece
            finally:
                self.stream_closed.set()

        return 200, [(b"content-type", b"text/plain")], chunks()

    async def slow(self, headers, body: bytes):
        self.entered.set()
        await self.release.wait()
        return 200, [(b"content-length", b"4")], [b"done"]


class Client:
    """An HTTP/1.1 client on one connection, parsing answers with h11."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, port: int) -> Client:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def response(self, method: bytes = b"POST") -> tuple[int, dict, bytes]:
        """The next response (to a request of ``method``): status, headers, body;
        informational responses are skipped."""
        # The requests went out as raw bytes; tell the client state machine.
        self.h11.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
        self.h11.send(h11.EndOfMessage())
        status, headers, body = None, {}, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                with trio.fail_after(10):
                    self.h11.receive_data(await self.stream.receive_some(65536))
                continue
            if type(event) is h11.Response:
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
            elif event is h11.PAUSED:
                raise AssertionError("client state machine paused")

    async def closed(self) -> bool:
        """True once the server closed the connection (reads until EOF)."""
        with trio.fail_after(10):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return True
                if not data:
                    return True


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


@pytest.fixture
async def served(nursery):
    """(app, port, shutdown event, finished event) of a server on a free port."""
    app = App()
    server = HttpServer(app.route, HttpServerOptions(max_request_body=1000, linger=0.5))
    shutdown, finished = trio.Event(), trio.Event()

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        try:
            await server.serve("127.0.0.1", 0, shutdown, 5.0, task_status=task_status)
        finally:
            finished.set()

    bound = await nursery.start(run)
    yield app, bound[0][1], shutdown, finished
    shutdown.set()


async def test_keep_alive_serves_requests_in_turn(served):
    app, port, _, _ = served
    client = await Client.connect(port)
    for body in (b"one", b"two", b""):
        await client.send_raw(post("/echo", body))
        status, headers, answer = await client.response()
        assert (status, answer) == (200, body)
        assert "connection" not in headers
    assert app.bodies == [b"one", b"two", b""]


async def test_pipelined_requests_are_answered_in_order(served):
    _, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(
        post("/echo", b"first")
        + post("/echo", b"second")
        + b"GET /info?x=1 HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    assert (await client.response())[2] == b"first"
    assert (await client.response())[2] == b"second"
    assert await client.response(b"GET") == (201, {"content-length": "11"}, b"GET /info 0")


async def test_expect_100_continue(served):
    _, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    )
    with trio.fail_after(10):
        interim = await client.stream.receive_some(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    client.h11.receive_data(interim)
    await client.send_raw(b"hello")
    assert (await client.response())[::2] == (200, b"hello")


async def test_chunked_request_body(served):
    _, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    assert (await client.response())[::2] == (200, b"hello world")
    await client.send_raw(
        b"PUT /info HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    )
    assert (await client.response())[2] == b"PUT /info 3"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/echo", "/info"])
async def test_body_over_the_limit_is_413(served, chunked, path):
    _, port, _, _ = served
    client = await Client.connect(port)
    body = b"x" * 1001
    if chunked:
        await client.send_raw(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + b"3e9\r\n"
            + body
            + b"\r\n0\r\n\r\n"
        )
    else:
        await client.send_raw(post(path, body))
    status, headers, answer = await client.response()
    assert status == 413
    assert headers["connection"] == "close"
    assert b"larger than the limit of 1000 bytes" in answer
    assert await client.closed()


async def test_malformed_request_gets_400_and_server_goes_on(served):
    _, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(b"NOT HTTP AT ALL\r\n\r\n")
    status, _, answer = await client.response(b"GET")
    assert status == 400
    assert b'"error"' in answer
    assert await client.closed()
    other = await Client.connect(port)
    await other.send_raw(post("/echo", b"still here"))
    assert (await other.response())[2] == b"still here"


async def test_peer_reset_does_not_stop_the_server(served):
    _, port, _, _ = served
    for fragment in (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc", b"GE"):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        await sock.send(fragment)
        await trio.sleep(0.05)
        # SO_LINGER 0: close() sends a reset.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    client = await Client.connect(port)
    await client.send_raw(post("/echo", b"alive"))
    assert (await client.response())[2] == b"alive"


async def test_head_unknown_paths_and_handler_errors(served):
    _, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(b"HEAD /info HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await client.response(b"HEAD")
    assert (status, headers["content-length"], body) == (201, "12", b"")
    await client.send_raw(b"GET /info%20x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await client.response(b"GET"))[2] == b"GET /info x 0"
    # A body the handler did not look at is read anyway: the connection goes on.
    await client.send_raw(post("/ignore", b"unread") + post("/echo", b"next"))
    assert (await client.response())[0] == 404
    assert (await client.response())[2] == b"next"
    # A handler that raises: a JSON 500, and the server goes on.
    await client.send_raw(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = await client.response(b"GET")
    assert (status, body) == (500, b'{"error":"internal error"}')
    client = await Client.connect(port)
    await client.send_raw(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await client.response(b"GET"))[::2] == (404, b'{"error":"Not Found: GET /nothing"}')


async def test_streamed_answer_is_chunked(served):
    app, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await client.response(b"GET")
    assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"abbccc")
    assert app.stream_closed.is_set()
    # The connection stays usable.
    await client.send_raw(post("/echo", b"after"))
    assert (await client.response())[2] == b"after"


async def test_graceful_shutdown(served):
    """Idle connections close, the request in flight is answered with
    Connection: close, new connections are refused, then serve returns."""
    app, port, shutdown, finished = served
    idle = await Client.connect(port)
    await idle.send_raw(post("/echo", b"x"))
    await idle.response()
    busy = await Client.connect(port)
    await busy.send_raw(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await app.entered.wait()
    shutdown.set()
    assert await idle.closed()
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)
    assert not finished.is_set()
    app.release.set()
    status, headers, body = await busy.response(b"GET")
    assert (status, headers["connection"], body) == (200, "close", b"done")
    with trio.fail_after(10):
        await finished.wait()


class _FailingListener:
    """A listener whose accept fails with EMFILE ``failures`` times, then closes."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def accept(self):
        self.calls += 1
        if self.calls > self.failures:
            raise trio.ClosedResourceError
        raise OSError(errno.EMFILE, "Too many open files")


async def test_accept_errors_back_off_and_are_logged_rarely(autojump_clock):
    """Out of descriptors: the accept loop waits between tries instead of spinning,
    and a minute of failures logs a handful of lines, not one per failure."""
    acceptor = HttpServer(lambda method, path: None).acceptor
    listener = _FailingListener(600)
    start = trio.current_time()
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await acceptor.accept(listener, nursery)
    assert listener.calls == 601
    assert trio.current_time() - start >= 59  # 600 tries, 0.1 s apart
    lines = [entry for entry in logs if entry["event"] == "HTTP accept failed; retrying"]
    assert 1 <= len(lines) <= 7
    # Each line after the first counts the failures it stood for.
    assert sum(entry["suppressed_since_last"] for entry in lines) >= 490


async def test_head_over_the_limit_is_431_and_closed(nursery):
    """A request head past ``max_header_size``, whole or still arriving (one endless
    header line the parser would buffer), is answered 431 and its connection
    closed."""
    server = HttpServer(App().route, HttpServerOptions(max_header_size=1024, linger=0.5))
    [(_, port)] = await nursery.start(server.serve, "127.0.0.1", 0, trio.Event(), 1.0)
    for tail in (b"\r\n\r\n", b""):
        client = await Client.connect(port)
        await client.send_raw(b"GET /info HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2000 + tail)
        status, headers, body = await client.response(b"GET")
        assert (status, headers["connection"]) == (431, "close")
        assert b"larger than the limit of 1024 bytes" in body
        assert await client.closed()


async def test_http_1_0_and_upgrade_requests_are_answered_then_closed(served):
    """An HTTP/1.0 request, or one asking to switch protocols, gets its answer with
    ``Connection: close`` and nothing after it on the connection is served."""
    _, port, _, _ = served
    for request in (
        b"GET /info HTTP/1.0\r\n\r\n",
        b"GET /info HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    ):
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(request + b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while data := await stream.receive_some(65536):
                answer += data
        assert answer.startswith(b"HTTP/1.1 201 "), answer
        assert b"connection: close\r\n" in answer
        assert answer.count(b"HTTP/1.1 ") == 1
        assert answer.endswith(b"GET /info 0")


async def _serve_large(nursery, app: App, limit: int | None) -> int:
    server = HttpServer(app.route, HttpServerOptions(max_request_body=limit, linger=0.5))
    [(_, port)] = await nursery.start(server.serve, "127.0.0.1", 0, trio.Event(), 1.0)
    return port


async def test_body_is_received_into_one_writable_buffer(nursery):
    """A body of declared length reaches the handler as one writable memoryview of
    exactly its bytes, whether it came with its head, in many small pieces after
    it, or only after 100 Continue; the request after it on the connection is
    parsed as usual (pipelined behind the body's last bytes)."""
    app = App()
    port = await _serve_large(nursery, app, 1 << 20)
    client = await Client.connect(port)
    client.stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = bytes(range(256)) * 2000  # 512,000 bytes
    head = post("/echo", body)[: -len(body)]
    await client.send_raw(head + body[:100])
    for start in range(100, len(body), 4093):
        await client.send_raw(body[start : start + 4093])
    await client.send_raw(post("/echo", b"next"))
    assert await client.response() == (200, {"content-length": str(len(body))}, body)
    assert (await client.response())[2] == b"next"

    await client.send_raw(head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
    with trio.fail_after(10):
        interim = await client.stream.receive_some(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    client.h11.receive_data(interim)
    for start in range(0, len(body), 1000):
        await client.send_raw(body[start : start + 1000])
    assert (await client.response())[2] == body

    for received in (app.bodies[0], app.bodies[2]):
        assert isinstance(received, memoryview)
        assert not received.readonly
        assert received.nbytes == len(body)
        assert bytes(received) == body
        assert np.frombuffer(received, np.float32).flags.writeable
    assert app.bodies[1] == b"next"


async def test_a_body_waited_for_whole_still_times_out_only_without_bytes(nursery, mock_clock):
    """The rest of a declared body is waited for whole (one wake-up), so bytes that
    come meanwhile do not wake the server: when --http-header-timeout passes they
    count as a read and the body goes on; a body after which nothing comes gets
    the 408."""
    app = App()
    server = HttpServer(app.route, HttpServerOptions(max_request_body=1 << 20, header_timeout=10))
    [(_, port)] = await nursery.start(server.serve, "127.0.0.1", 0, trio.Event(), 1.0)
    body = bytes(range(256)) * 1600  # 409,600 bytes
    client = await Client.connect(port)
    request = post("/echo", body)
    head = len(request) - len(body)
    await client.send_raw(request[: head + 100_000])
    await trio.testing.wait_all_tasks_blocked()
    await client.send_raw(request[head + 100_000 : head + 150_000])  # below the mark
    await trio.testing.wait_all_tasks_blocked()
    mock_clock.jump(11)
    await trio.testing.wait_all_tasks_blocked()
    await client.send_raw(request[head + 150_000 :])
    assert await client.response() == (200, {"content-length": str(len(body))}, body)
    assert bytes(app.bodies[0]) == body

    await client.send_raw(request[: head + 100_000])
    await trio.testing.wait_all_tasks_blocked()
    mock_clock.jump(11)
    status, _, answer = await client.response()
    assert status == 408, answer
    assert b"--http-header-timeout" in answer


async def test_client_gone_in_the_middle_of_a_body(nursery):
    """A client that closes before its declared body is whole ends its connection
    only: nothing reaches the handler and the server serves the next client."""
    app = App()
    port = await _serve_large(nursery, app, 1 << 20)
    client = await Client.connect(port)
    await client.send_raw(post("/echo", b"x" * 300_000)[:-200_000])
    await client.stream.send_eof()
    assert await client.closed()
    other = await Client.connect(port)
    await other.send_raw(post("/echo", b"still here"))
    assert (await other.response())[2] == b"still here"
    assert app.bodies == [b"still here"]


async def test_declared_body_commits_memory_only_as_it_arrives(nursery):
    """A head declaring a large body with none of it sent costs the server the
    bytes it received, not the declared length (the buffer is allocated, not
    written): a client cannot make the server hold memory it did not send."""
    app = App()
    port = await _serve_large(nursery, app, None)
    declared = 128 * 1024 * 1024
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    clients = []
    for _ in range(2):
        client = await Client.connect(port)
        await client.send_raw(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % declared + b"ab"
        )
        clients.append(client)
    other = await Client.connect(port)
    await other.send_raw(post("/echo", b"served"))
    assert (await other.response())[2] == b"served"
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024, f"peak RSS grew by {grown_kib} KiB"
    for client in clients:
        await client.stream.aclose()


async def test_chunked_body_is_one_writable_buffer_in_at_most_65536_chunks(nursery):
    """A chunked body reaches the handler as one writable bytearray of its bytes;
    a body in more than 65,536 non-empty chunks (Triton's kMaxChunkedChunks) is
    answered 400 and its connection closed, whatever its size."""
    app = App()
    port = await _serve_large(nursery, app, 1 << 20)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    client = await Client.connect(port)
    await client.send_raw(head + b"1\r\nA\r\n" * 65536 + b"0\r\n\r\n")
    assert (await client.response())[::2] == (200, b"A" * 65536)
    (received,) = app.bodies
    assert isinstance(received, bytearray) and received == b"A" * 65536

    client = await Client.connect(port)
    await client.send_raw(head + b"1\r\nA\r\n" * 65537 + b"0\r\n\r\n")
    status, headers, answer = await client.response()
    assert (status, headers["connection"]) == (400, "close")
    assert b"exceeds maximum of 65536 non-empty chunks" in answer
    assert await client.closed()
    assert len(app.bodies) == 1


async def test_a_body_already_there_is_read_without_arming_its_deadline(nursery, monkeypatch):
    """A declared body whose bytes are all in the socket when its head is parsed
    (as a client that writes head and body at once sends it over loopback) is
    read without the body's deadline (no cancel scope: a few microseconds a
    request); one that is still coming keeps it."""
    app = App()
    port = await _serve_large(nursery, app, 1 << 20)
    armed: list[float] = []  # the deadlines of the body reads' cancel scopes
    move_on_at = trio.move_on_at

    def counted(deadline: float, *args, **kwargs):
        if sys._getframe(1).f_code.co_name == "read_body":
            armed.append(deadline)
        return move_on_at(deadline, *args, **kwargs)

    monkeypatch.setattr(trio, "move_on_at", counted)
    client = await Client.connect(port)
    body = bytes(range(256)) * 400  # 102,400 bytes: past the first 16 KB read
    for _ in range(3):  # (the first ones may find the connection's window small)
        before = len(armed)
        await client.send_raw(post("/echo", body))
        assert await client.response() == (200, {"content-length": str(len(body))}, body)
    assert len(armed) == before  # the last one: all there, not armed
    request = post("/echo", body)
    await client.send_raw(request[: len(request) - 1000])
    await trio.testing.wait_all_tasks_blocked()
    await client.send_raw(request[len(request) - 1000 :])
    assert (await client.response())[2] == body
    assert len(armed) == before + 1  # still coming: armed


def _deadline_heap_size() -> int:
    """Entries in the Trio run's heap of deadlines (stale ones included: Trio drops
    them when they come first or when they outnumber the live ones by 1,000)."""
    return len(trio._core._run.GLOBAL_RUN_CONTEXT.runner.deadlines._heap)


async def test_a_bodys_reads_do_not_each_move_its_deadline(nursery, mock_clock):
    """The deadline of a body still coming is moved on when it passes, not at each
    read: each move of a Trio deadline pushes an entry onto the run's heap, kept
    (with its cancel scope) until it comes due, so 300 reads of a chunked body
    added 300 entries. The timeout keeps its meaning: a body may take longer than
    --http-header-timeout in all, not a pause that long (408)."""
    app = App()
    server = HttpServer(app.route, HttpServerOptions(max_request_body=1 << 20, header_timeout=10))
    [(_, port)] = await nursery.start(server.serve, "127.0.0.1", 0, trio.Event(), 1.0)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    client = await Client.connect(port)
    await client.send_raw(head + b"1\r\nA\r\n")
    await trio.testing.wait_all_tasks_blocked()
    before = _deadline_heap_size()
    for _ in range(300):
        mock_clock.jump(0.01)
        await client.send_raw(b"1\r\nA\r\n")
        await trio.testing.wait_all_tasks_blocked()
    assert _deadline_heap_size() < before + 10
    mock_clock.jump(9)
    await trio.testing.wait_all_tasks_blocked()
    await client.send_raw(b"1\r\nB\r\n")
    await trio.testing.wait_all_tasks_blocked()
    mock_clock.jump(9)  # 21 s since the body began, 9 since its last byte
    await trio.testing.wait_all_tasks_blocked()
    await client.send_raw(b"0\r\n\r\n")
    assert (await client.response())[::2] == (200, b"A" * 301 + b"B")

    client = await Client.connect(port)
    await client.send_raw(head + b"1\r\nA\r\n")
    await trio.testing.wait_all_tasks_blocked()
    mock_clock.jump(10)
    status, _, answer = await client.response()
    assert status == 408 and b"--http-header-timeout" in answer


async def test_a_chunked_body_is_read_without_a_bytes_object_per_read(nursery):
    """A chunked body is read into the server's one read buffer, not into a bytes
    object per read (a recv allocates the whole size asked, then shrinks it, and
    those allocations fragment the heap): while 20,000 one-byte chunks come in 64 KB
    writes the server allocates far less than one read's size (4 MiB here)."""
    app = App()
    options = HttpServerOptions(max_request_body=1 << 20, receive_size=4 << 20)
    server = HttpServer(app.route, options)
    [(_, port)] = await nursery.start(server.serve, "127.0.0.1", 0, trio.Event(), 1.0)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    request = head + b"1\r\nA\r\n" * 20_000 + b"0\r\n\r\n"
    client = await Client.connect(port)
    tracemalloc.start()
    try:
        for start in range(0, len(request), 65536):
            await client.send_raw(request[start : start + 65536])
            await trio.testing.wait_all_tasks_blocked()
        status, _, body = await client.response()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (status, body) == (200, b"A" * 20_000)
    assert peak < 1 << 20, f"{peak} bytes allocated at the peak"
