"""A client that hangs up over HTTP cancels its request (DESIGN §3): a queued
request leaves the queue without executing, a running one has its result
dropped. In-process server, real sockets, events instead of timing."""

from __future__ import annotations

import json
import socket

import numpy as np
import trio
import tritonclient.http as httpclient

from tests.blocking_backend import GATE, http_server, repository_fixture, wait_entered
from tests.e2e.test_grpc_cancellation import Probe, executions_since, in_thread

BODY = json.dumps(
    {
        "id": "{id}",
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
    }
)


repository = repository_fixture()


def send_infer(port: int, request_id: str) -> socket.socket:
    """Send one infer request on a raw socket and leave it waiting for the answer."""
    body = BODY.replace("{id}", request_id).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v2/models/blocking/infer HTTP/1.1\r\nHost: test\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


async def test_hanging_up_cancels_queued_and_running_requests(repository):
    server = http_server(repository)
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        probe = Probe(server.dataplane)
        running = await in_thread(send_infer, port, "running")
        await wait_entered()  # "running" executes; "queued" waits behind it
        queued = await in_thread(send_infer, port, "queued")
        await probe.arrived("queued")
        queued.close()
        await probe.cancelled_all("queued")
        assert probe.requests["queued"].cancelled
        running.close()
        await probe.cancelled_all("running")

        GATE.release.set()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.full((1, 4), 3.0, dtype=np.float32))
        later = await in_thread(lambda: client.infer("blocking", [tensor]))
        np.testing.assert_array_equal(later.as_numpy("OUTPUT0"), np.full((1, 4), 3.0))
        client.close()
        assert executions_since() == 1  # the later request only: "queued" never ran
        stats = server.dataplane.model("blocking", None).statistics
        # "running" did execute (its answer was dropped) and the later one: two
        # successes; "queued" neither succeeded nor failed in the model.
        assert stats.success.count == 2
        server.shutdown()


def read_answer(sock: socket.socket) -> bytes:
    """Everything the server sends on ``sock`` until it closes it."""
    sock.settimeout(60)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    return answer


async def test_a_request_cut_at_the_exit_timeout_gets_503_before_the_close(repository):
    """Issue 18 item 8: a request still running when --exit-timeout-secs expires is
    answered 503 (JSON, Connection: close) before its connection closes."""
    server = http_server(repository)
    server.options.exit_timeout_secs = 0.5
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        running = await in_thread(send_infer, port, "running")
        await wait_entered()
        server.shutdown()
        answer = await in_thread(read_answer, running)
        GATE.release.set()  # the model's thread ends; the server can finish
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:300]
    assert b"connection: close" in answer.lower()
    assert b"--exit-timeout-secs" in answer
