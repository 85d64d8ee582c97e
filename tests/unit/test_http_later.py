"""A repeated infer request's binary tensors left in the socket for the instance's thread
(trionserve/protocol/http/later.py), on a real socket pair: what the loop reads of the request,
who reads the rest and when, what the connection's wait wakes for meanwhile, a read that fails,
and the instance's thread reading it before its batch runs (a failed read fails that request
only)."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import numpy as np
import trio

from trionserve.backends.instance_thread import InstanceThread, Job
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.protocol.http import later as later_module
from trionserve.protocol.http.h1 import H1Connection
from trionserve.protocol.http.h1_request import body_buffer
from trionserve.protocol.http.later import LaterBody, hung_up, read_again

HEADER = b'{"inputs":[{"name":"INPUT0","shape":[1,100000],"datatype":"FP32"}]}'
TENSORS = np.arange(100_000, dtype=np.float32).tobytes()  # 400,000 bytes


def request_bytes(tensors: bytes = TENSORS) -> bytes:
    body = HEADER + tensors
    return (
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: test\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
        % (len(HEADER), len(body), body)
    )


def pair() -> tuple[trio.socket.SocketType, socket.socket]:
    """A server socket (Trio's, non-blocking) and its client over TCP on the loopback (a Unix
    socket's poll takes no low-water mark), with room for two requests."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # (the server's)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return trio.socket.from_stdlib_socket(server), client


def send(client: socket.socket, server: trio.socket.SocketType, data: bytes) -> None:
    """Send ``data`` and wait until the server's socket holds all of it (TCP on the loopback
    hands it over in segments)."""
    before = later_module.queued(server)
    client.sendall(data)
    for _ in range(10_000):
        if later_module.queued(server) >= before + len(data):
            return
        time.sleep(0.001)
    raise AssertionError("the bytes sent did not arrive")


def connection_with_last_head(server: trio.socket.SocketType, client: socket.socket):
    """A protocol that parsed one request (its last head kept), and that request's bytes."""
    h1 = H1Connection()
    raw = request_bytes()
    h1.receive_data(raw)
    request = h1.next_request()
    assert request is not None and request.complete
    h1.answer_kept()  # (answered: the server idle again)
    return h1, raw


def readable(sock: trio.socket.SocketType) -> bool:
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def test_the_loop_reads_the_head_and_the_json_header_and_offers_the_rest():
    server, client = pair()
    with server, client:
        h1, raw = connection_with_last_head(server, client)
        send(client, server, raw)
        body = LaterBody(server)
        head, buffer = h1.again_buffers()
        last = h1._last_head
        size = read_again(body, h1, last, head, buffer)
        assert size == len(raw)  # the whole request, counted as read
        assert bytes(buffer[: len(HEADER)]) == HEADER
        assert body.view is not None and len(body.view) == len(TENSORS)
        assert later_module.queued(server) == len(TENSORS)  # the rest is still in the socket
        request = h1.take_again(size, head, buffer)
        assert request is not None and request.complete
        body.now()  # (not deferred: the loop reads it before anything uses the body)
        assert bytes(buffer[len(HEADER) :]) == TENSORS
        assert body.view is None and later_module.queued(server) == 0


def test_a_request_not_whole_in_the_socket_is_read_as_before():
    server, client = pair()
    with server, client:
        h1, raw = connection_with_last_head(server, client)
        send(client, server, raw[:-1000])  # the last 1,000 bytes still to come
        body = LaterBody(server)
        head, buffer = h1.again_buffers()
        size = read_again(body, h1, h1._last_head, head, buffer)
        assert size == len(raw) - 1000  # all that came, read by the loop
        assert body.view is None
        assert h1.take_again(size, head, buffer) is None  # (the rest: read as any body)
        assert h1.requests and not h1.requests[0].complete


def test_the_thread_takes_the_rest_and_the_wait_does_not_wake_for_it():
    server, client = pair()
    with server, client:
        h1, raw = connection_with_last_head(server, client)
        send(client, server, raw)
        body = LaterBody(server)
        head, buffer = h1.again_buffers()
        h1.take_again(read_again(body, h1, h1._last_head, head, buffer), head, buffer)
        body.defer()
        assert body.pending
        assert not readable(server)  # the rest alone does not wake the connection's wait
        taken: list[bool] = []
        thread = threading.Thread(target=lambda: taken.append(body.take()))
        thread.start()
        thread.join()
        assert taken == [True] and not body.pending and body.view is None
        assert bytes(buffer[len(HEADER) :]) == TENSORS
        assert not readable(server)  # nothing more came
        send(client, server, b"P")  # the next request's first byte wakes it (the mark is back at 1)
        assert readable(server)
        assert body.settle()  # nothing left to read: the connection goes on
        assert later_module.queued(server) == 1


def test_the_wait_wakes_for_bytes_after_the_rest_and_for_the_clients_end():
    server, client = pair()
    with server, client:
        h1, raw = connection_with_last_head(server, client)
        send(client, server, raw)
        body = LaterBody(server)
        head, buffer = h1.again_buffers()
        h1.take_again(read_again(body, h1, h1._last_head, head, buffer), head, buffer)
        body.defer()
        assert not readable(server) and not hung_up(server)
        send(client, server, b"P")  # pipelined: past the rest
        assert readable(server) and not hung_up(server)
        client.shutdown(socket.SHUT_WR)
        assert hung_up(server)
        assert body.settle()  # read by the loop: the request did not run
        assert bytes(buffer[len(HEADER) :]) == TENSORS and not body.pending
        assert later_module.queued(server) == 1


def test_a_rest_not_taken_is_read_by_the_loop_as_the_request_settles():
    # The request failed, was rejected or cancelled before its batch ran: the loop reads the
    # rest into the request's buffer, and the thread, if it comes later, reads nothing.
    server, client = pair()
    with server, client:
        h1, raw = connection_with_last_head(server, client)
        send(client, server, raw + raw)  # the next request after it
        body = LaterBody(server)
        head, buffer = h1.again_buffers()
        h1.take_again(read_again(body, h1, h1._last_head, head, buffer), head, buffer)
        body.defer()
        assert body.settle()
        assert bytes(buffer[len(HEADER) :]) == TENSORS
        assert body.take()  # (the thread: nothing to read)
        assert later_module.queued(server) == len(raw)  # the next request, whole


def test_a_read_that_fails_breaks_the_request_and_the_connection():
    server, client = pair()
    with server, client:
        h1, raw = connection_with_last_head(server, client)
        send(client, server, raw)
        body = LaterBody(server)
        head, buffer = h1.again_buffers()
        h1.take_again(read_again(body, h1, h1._last_head, head, buffer), head, buffer)
        body.defer()
        # The bytes are not there when the thread reads (what cannot happen with one reader
        # and FIONREAD's count: a failure of the socket's read stands for it).
        while later_module.queued(server):
            os.read(server.fileno(), 1 << 20)
        assert not body.take()
        assert body.broken is not None and "could not be read" in body.broken
        assert not body.settle()  # the connection closes after the request's error


def test_the_loop_reads_now_what_it_does_not_defer_and_says_when_it_cannot():
    server, client = pair()
    with server, client:
        h1, raw = connection_with_last_head(server, client)
        send(client, server, raw[:-10])
        body = LaterBody(server)
        buffer = body_buffer(len(TENSORS), 0)
        head = memoryview(bytearray(len(raw) - len(TENSORS)))
        os.readv(server.fileno(), [head])
        body.view = buffer  # offered, though 10 bytes are missing (cannot happen: FIONREAD)
        try:
            body.now()
        except InvalidArgument as exc:
            assert "could not be read" in exc.message
        else:
            raise AssertionError("a short read must fail the request")
        assert not body.settle()


class _Instance:
    """Records what each request's INPUT0 holds as its batch runs."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def execute(self, requests):
        self.seen.extend(r.inputs["INPUT0"].data.tobytes() for r in requests)
        return [InferenceResponse("m", "1") for _ in requests]

    def close(self) -> None:
        pass


class _Answer:
    """A connection's answer as the instance's thread sees it: the body left to it."""

    armed = False

    def __init__(self, body: LaterBody) -> None:
        self.later = body


async def test_the_instance_thread_reads_each_body_before_its_batch_and_fails_a_broken_one():
    from trionserve.core.inference import Tensor

    good_server, good_client = pair()
    bad_server, bad_client = pair()
    with good_server, good_client, bad_server, bad_client:
        requests, bodies = [], []
        for server, client in ((good_server, good_client), (bad_server, bad_client)):
            send(client, server, TENSORS)
            buffer = body_buffer(len(TENSORS), 0)
            body = LaterBody(server)
            body.view = buffer
            body.defer()
            request = InferenceRequest("m")
            request.inputs["INPUT0"] = Tensor("INPUT0", "FP32", np.frombuffer(buffer, np.float32))
            request.answer = _Answer(body)  # type: ignore[assignment]
            requests.append(request)
            bodies.append(body)
        while later_module.queued(bad_server):  # (its bytes gone: the thread's read fails)
            os.read(bad_server.fileno(), 1 << 20)
        instance = _Instance()
        thread = InstanceThread("m", instance)  # type: ignore[arg-type]
        thread.start()
        job = Job(list(requests))
        thread.submit(job)
        await thread.wait(job)
        thread.stop()
        assert thread.join(10)
        assert instance.seen == [TENSORS]  # the good one ran, with its bytes read
        assert job.requests == requests[:1] + requests[1:]  # both given back, in the batch
        assert isinstance(job.results[0], InferenceResponse)
        assert isinstance(job.results[1], InvalidArgument)
        assert "could not be read" in job.results[1].message
        assert not bodies[0].pending and bodies[0].broken is None
        assert bodies[1].broken is not None


def test_the_kept_decision_for_a_model_is_made_again_when_the_routes_change(monkeypatch):
    """InferHandler._on_thread decides once per routed version and keeps it while the routes'
    generation stands: a switch (a load, an unload, a reload's new version) or an eviction makes
    it route again, so a reloaded model whose inputs are read on the loop is never left a
    deferred body."""
    from types import SimpleNamespace

    from trionserve.actors.model_lifecycle import ModelLifeCycle
    from trionserve.core.errors import NotFound
    from trionserve.protocol.http.infer import InferHandler, _Again
    from trionserve.repository.repository import ModelId

    lifecycle = ModelLifeCycle({})
    serving: list[object] = []
    looked_up: list[object] = []

    def model(name: str, version: int | None) -> object:
        if not serving:
            raise NotFound("unloaded")
        looked_up.append(serving[0])
        return serving[0]

    plane = SimpleNamespace(
        registry=SimpleNamespace(lifecycle=lifecycle),
        model=model,
        tracing=SimpleNamespace(active=False),
    )
    monkeypatch.setattr(later_module, "on_thread", lambda version: version.blocking)
    handler = InferHandler(plane)  # type: ignore[arg-type]
    again = _Again(None, [], 0, b"", None, "m", None, None, True)  # type: ignore[arg-type]
    first = SimpleNamespace(blocking=True)
    serving.append(first)
    assert handler._on_thread(again) and handler._on_thread(again)
    assert looked_up == [first]  # (kept: routed once)
    # Reloaded as a model whose inputs the loop reads (a Python model): routed again.
    serving[0] = SimpleNamespace(blocking=False)
    lifecycle.switch(ModelId("", "m"))
    assert not handler._on_thread(again) and not handler._on_thread(again)
    assert len(looked_up) == 2
    # Unloaded: nothing to defer to (begin says why); loaded again: routed again.
    serving.clear()
    lifecycle.switch(ModelId("", "m"))
    assert not handler._on_thread(again)
    serving.append(first)
    lifecycle.switch(ModelId("", "m"))
    assert handler._on_thread(again) and handler._on_thread(again)
    assert len(looked_up) == 3
    generation = lifecycle.generation
    lifecycle.unroute(ModelId("", "m"))  # evicted
    assert lifecycle.generation == generation + 1
    assert handler._on_thread(again) and len(looked_up) == 4
