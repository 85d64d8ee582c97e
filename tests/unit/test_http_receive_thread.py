"""Large HTTP bodies received by a thread of the listener (--http-receive-thread-bytes):
whole into one writable buffer, the request after them parsed as usual; small bodies, streams
without a socket and bodies past the thread's job cap read by the loop; a client gone, a body
that stops arriving (408) and a connection cancelled while the thread holds its body each end
with exactly one outcome, the thread having let go of the body first."""

from __future__ import annotations

import socket

import numpy as np
import trio
import trio.testing

from tests.unit.test_http_transport import App, Client, post
from trionserve.protocol.http.transport import HttpServer, HttpServerOptions
from trionserve.protocol.receive_thread import ReceiveThread

_BODY = bytes(range(256)) * 2000  # 512,000 bytes


async def _serve(nursery, app: App, **options) -> tuple[HttpServer, int, trio.Event, trio.Event]:
    """A server whose thread takes bodies of 64 KiB or more: (server, port, shutdown, done)."""
    options.setdefault("receive_thread_bytes", 65536)
    server = HttpServer(app.route, HttpServerOptions(max_request_body=1 << 20, **options))
    shutdown, done = trio.Event(), trio.Event()

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        try:
            await server.serve("127.0.0.1", 0, shutdown, 0.2, task_status=task_status)
        finally:
            done.set()

    [(_, port)] = await nursery.start(run)
    return server, port, shutdown, done


async def test_a_large_body_comes_whole_from_the_thread_and_a_small_one_from_the_loop(nursery):
    app = App()
    server, port, _, _ = await _serve(nursery, app)
    receiver = server.receiver
    assert receiver is not None
    client = await Client.connect(port)
    client.stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = post("/echo", _BODY)[: -len(_BODY)]
    await client.send_raw(head + _BODY[:100])
    for start in range(100, len(_BODY), 4093):
        await client.send_raw(_BODY[start : start + 4093])
    await client.send_raw(post("/echo", b"next"))  # pipelined behind the body's last bytes
    assert await client.response() == (200, {"content-length": str(len(_BODY))}, _BODY)
    assert (await client.response())[2] == b"next"
    received = app.bodies[0]
    assert isinstance(received, memoryview) and not received.readonly
    assert bytes(received) == _BODY
    assert np.frombuffer(received, np.float32).flags.writeable
    assert (receiver.bodies, receiver.active) == (1, 0)  # "next" was the loop's

    await client.send_raw(post("/echo", _BODY[:1000]))  # under the threshold
    assert (await client.response())[2] == _BODY[:1000]
    assert receiver.bodies == 1


async def test_a_stream_without_a_socket_or_past_the_job_cap_is_read_by_the_loop(nursery):
    receiver = ReceiveThread(10, max_jobs=1)
    rest = memoryview(bytearray(20))
    left, _ = trio.testing.memory_stream_pair()
    assert not receiver.takes(rest, left)  # (TLS streams too: no socket of their own)
    assert not receiver.takes(None, object())  # (a chunked body)
    assert not receiver.takes(rest[:9], object())

    app = App()
    server, port, _, _ = await _serve(nursery, app)
    assert server.receiver is not None
    server.receiver.max_jobs = 1
    first, second = await Client.connect(port), await Client.connect(port)
    request = post("/echo", _BODY)
    await first.send_raw(request[:-300_000])
    await trio.testing.wait_all_tasks_blocked()
    assert server.receiver.active == 1
    await second.send_raw(request[:-300_000])  # no room: the loop reads it
    await trio.testing.wait_all_tasks_blocked()
    assert (server.receiver.bodies, server.receiver.active) == (1, 1)
    await second.send_raw(request[-300_000:])
    await first.send_raw(request[-300_000:])
    assert (await second.response())[2] == _BODY
    assert (await first.response())[2] == _BODY
    assert server.receiver.active == 0


async def test_a_client_gone_mid_body_ends_its_connection_only(nursery):
    app = App()
    server, port, _, _ = await _serve(nursery, app)
    client = await Client.connect(port)
    await client.send_raw(post("/echo", _BODY)[:-200_000])
    await client.stream.send_eof()
    assert await client.closed()
    other = await Client.connect(port)
    await other.send_raw(post("/echo", b"still here"))
    assert (await other.response())[2] == b"still here"
    assert app.bodies == [b"still here"]
    assert server.receiver is not None and server.receiver.active == 0


async def test_a_body_that_stops_arriving_is_408(nursery):
    """The thread keeps the body's timeout on the monotonic clock (no byte for
    --http-header-timeout: 408, as the loop's read)."""
    app = App()
    server, port, _, _ = await _serve(nursery, app, header_timeout=0.2)
    client = await Client.connect(port)
    await client.send_raw(post("/echo", _BODY)[:-200_000])
    status, _, answer = await client.response()
    assert status == 408 and b"--http-header-timeout" in answer
    assert await client.closed()
    assert app.bodies == []


async def test_a_connection_cancelled_while_the_thread_holds_its_body(nursery):
    """The drain's exit timeout cancels a connection whose body the thread reads: the
    thread lets go of it first (no read into a buffer, no poll of a descriptor, that
    the connection closed), then the connection ends and the server with it."""
    app = App()
    server, port, shutdown, done = await _serve(nursery, app)
    client = await Client.connect(port)
    await client.send_raw(post("/echo", _BODY)[:-200_000])
    await trio.testing.wait_all_tasks_blocked()
    assert server.receiver is not None and server.receiver.active == 1
    shutdown.set()
    with trio.fail_after(10):
        await done.wait()
    assert server.receiver.active == 0
    assert await client.closed()
    assert app.bodies == []


async def test_a_thread_that_fails_gives_back_what_it_holds_and_the_loop_reads_on(
    nursery, monkeypatch
):
    """A bug in the thread ends the body it holds as a failed read (its connection only) and
    leaves the next bodies to the loop: no connection waits for a thread that is gone."""

    def broken(job, now):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ReceiveThread, "_read", staticmethod(broken))
    app = App()
    server, port, _, _ = await _serve(nursery, app)
    client = await Client.connect(port)
    await client.send_raw(post("/echo", _BODY))
    assert await client.closed()
    assert server.receiver is not None and server.receiver.failed
    other = await Client.connect(port)
    await other.send_raw(post("/echo", _BODY))
    assert (await other.response())[2] == _BODY
    assert server.receiver.bodies == 1 and server.receiver.active == 0
