"""The h11 HTTP/1.1 transport on raw sockets: keep-alive, pipelining, 100-continue,
chunked bodies, body limits, bad requests, resets, graceful shutdown, ASGI fallback."""

from __future__ import annotations

import socket
import struct

import h11
import numpy as np
import pytest
import trio
import tritonclient.http as httpclient

from tests.serverproc import ServerProcess
from trionserve.protocol.http.transport import H11Server, HttpServerOptions


class App:
    """A direct route ``POST /echo`` (answers with the body it got) and a tiny ASGI
    app for everything else; ``/slow`` waits for ``release``."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.entered = trio.Event()
        self.bodies: list[bytes] = []

    def route(self, method: bytes, path: str):
        if method == b"POST" and path == "/echo":
            return self.echo
        if path == "/slow":
            return self.slow
        return None

    async def echo(self, headers, body: bytes):
        self.bodies.append(body)
        return 200, [(b"content-length", b"%d" % len(body))], [body]

    async def slow(self, headers, body: bytes):
        self.entered.set()
        await self.release.wait()
        return 200, [(b"content-length", b"4")], [b"done"]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["path"] == "/ignore":  # answers without reading the body
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/boom":
            raise RuntimeError("application bug")
        text = f"{scope['method']} {scope['path']} {scope['query_string'].decode()} {len(body)}"
        payload = text.encode()
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-length", b"%d" % len(payload))]})
        await send({"type": "http.response.body", "body": payload})


class Client:
    """An HTTP/1.1 client on one connection, parsing answers with h11."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, port: int) -> "Client":
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
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


@pytest.fixture
async def served(nursery):
    """(app, port, shutdown event, finished event) of a server on a free port."""
    app = App()
    server = H11Server(app, app.route, HttpServerOptions(max_request_body=1000, linger=0.5))
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
    await client.send_raw(post("/echo", b"first") + post("/echo", b"second")
                          + b"GET /asgi?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await client.response())[2] == b"first"
    assert (await client.response())[2] == b"second"
    assert await client.response(b"GET") == (201, {"content-length": "15"}, b"GET /asgi x=1 0")


async def test_expect_100_continue(served):
    _, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                          b"Expect: 100-continue\r\n\r\n")
    with trio.fail_after(10):
        interim = await client.stream.receive_some(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    client.h11.receive_data(interim)
    await client.send_raw(b"hello")
    assert (await client.response())[::2] == (200, b"hello")


async def test_chunked_request_body(served):
    app, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                          b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    assert (await client.response())[::2] == (200, b"hello world")
    # And through the ASGI adapter.
    await client.send_raw(b"PUT /asgi HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                          b"3\r\nabc\r\n0\r\n\r\n")
    assert (await client.response())[2] == b"PUT /asgi  3"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/echo", "/asgi"])
async def test_body_over_the_limit_is_413(served, chunked, path):
    _, port, _, _ = served
    client = await Client.connect(port)
    body = b"x" * 1001
    if chunked:
        await client.send_raw(f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                              "Transfer-Encoding: chunked\r\n\r\n".encode()
                              + b"3e9\r\n" + body + b"\r\n0\r\n\r\n")
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
    for partial in (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc", b"GE"):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        await sock.send(partial)
        await trio.sleep(0.05)
        # SO_LINGER 0: close() sends a reset.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    client = await Client.connect(port)
    await client.send_raw(post("/echo", b"alive"))
    assert (await client.response())[2] == b"alive"


async def test_asgi_fallback_head_and_errors(served):
    _, port, _, _ = served
    client = await Client.connect(port)
    await client.send_raw(b"HEAD /asgi HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await client.response(b"HEAD")
    assert (status, headers["content-length"], body) == (201, "13", b"")
    await client.send_raw(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await client.response(b"GET"))[0] == 500
    await client.send_raw(b"GET /asgi%20x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await client.response(b"GET"))[2] == b"GET /asgi x  0"
    # A body the application did not read is skipped: the connection goes on.
    await client.send_raw(post("/ignore", b"unread") + post("/echo", b"next"))
    assert (await client.response())[0] == 404
    assert (await client.response())[2] == b"next"


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


def test_hypercorn_transport_flag():
    """--http-transport=hypercorn serves the same API."""
    server = ServerProcess(args=["--http-transport=hypercorn", "--allow-grpc=false"])
    try:
        server.wait_ready()
        client = httpclient.InferenceServerClient(server.http_url)
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
                  httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), 2 * a)
        assert server.status("/v2/nothing") == 404
        client.close()
        assert server.stop() == 0
        assert "transport=hypercorn" in server.output()
    finally:
        server.close()
