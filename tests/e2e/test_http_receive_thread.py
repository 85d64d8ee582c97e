"""Repeated large binary infer requests on one keep-alive connection with
--http-receive-thread-bytes: the loop reads only the repeated head, the listener's thread
the body; every answer right, one outcome each, and the requests still made from the
connection's last head."""

from __future__ import annotations

import json
import socket
import struct

import trio

from tests.blocking_backend import BACKENDS, repository_fixture
from tests.e2e.test_grpc_cancellation import in_thread
from tests.e2e.test_thread_answers import read_answer
from tests.serverproc import free_port
from trionserve.protocol.http.frontend import HttpOptions
from trionserve.protocol.http.h1 import H1Connection
from trionserve.protocol.receive_thread import ReceiveThread
from trionserve.server import Server, ServerOptions

repository = repository_fixture(config="dynamic_batching { }", released=True)
_COUNT = 50_000  # FP32: 200,000 bytes a tensor
_HEADER = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, _COUNT], "datatype": "FP32",
                 "parameters": {"binary_data_size": 4 * _COUNT}}],
     "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]}
).encode()  # fmt: skip


def request(value: float) -> bytes:
    body = _HEADER + struct.pack(f"<{_COUNT}f", *[value] * _COUNT)
    return (
        b"POST /v2/models/blocking/infer HTTP/1.1\r\nHost: test\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
        % (len(_HEADER), len(body), body)
    )


async def test_repeated_large_requests_read_by_the_thread(
    repository,
    monkeypatch,
):
    again, bodies = [], []
    take_again, receive = H1Connection.take_again, ReceiveThread.receive
    monkeypatch.setattr(
        H1Connection,
        "take_again",
        lambda self, size, head, body: again.append(size) or take_again(self, size, head, body),
    )
    monkeypatch.setattr(
        ReceiveThread,
        "receive",
        lambda self, stream, rest, timeout: (
            bodies.append(len(rest)) or receive(self, stream, rest, timeout)
        ),
    )
    server = Server(
        ServerOptions(
            model_repositories=[repository],
            http_address="127.0.0.1",
            http_port=free_port(),
            http=HttpOptions(receive_thread_bytes=65536),
            allow_grpc=False,
            allow_metrics=False,
        ),
        backends=BACKENDS,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        sock = await in_thread(socket.create_connection, ("127.0.0.1", server.options.http_port))
        buffered = bytearray()
        # One alone, then four pipelined: each of those waits for its answer with the
        # next one's bytes already there (the wait ends readable: the loop reads the
        # repeated head alone, H1Connection.take_again).
        await in_thread(sock.sendall, request(0.0))
        await in_thread(sock.sendall, b"".join(request(float(value)) for value in range(1, 5)))
        for value in range(5):
            head, answer = await in_thread(read_answer, sock, buffered)
            assert head.startswith(b"HTTP/1.1 200 OK"), head
            assert answer["outputs"][0]["data"] == [float(value)] * _COUNT
        sock.close()
        model = server.dataplane.model("blocking", None)
        await model.idle.wait()
        assert model.statistics.success.count == 5
        server.shutdown()
    # The repeats' heads were read alone (no byte of their bodies), the bodies by the thread.
    body = 4 * _COUNT + len(_HEADER)
    assert again and all(size == len(request(0.0)) - body for size in again), again
    # (a request whose head came in a first read of 16 KB: the rest of its body)
    assert len(bodies) == 5 and bodies.count(body) >= len(again), bodies
