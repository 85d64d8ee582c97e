"""A repeated HTTP infer request (binary, decoded from the last one's plan) that the handler
begins (``DataPlane.begin``) and returns BEGUN for: the connection's task waits for its
answer in its own frame and carries the handler on (``answer.Carrier``): at once when the
outcome is in, awaited when the wait ended first (pipelined bytes, the client's end)."""

from __future__ import annotations

import json
import socket
import struct

import pytest
import trio
import trio.testing

from tests.blocking_backend import GATE, http_server, wait_entered
from tests.e2e.test_grpc_cancellation import in_thread
from tests.e2e.test_thread_answers import (  # noqa: F401
    read_answer,
    repository,
    writes,
)
from trionserve.protocol.http.infer import InferHandler

_HEADER = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32",
                 "parameters": {"binary_data_size": 8}}],
     "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]}
).encode()  # fmt: skip


def binary_bytes(value: float) -> bytes:
    """The same request head and JSON header each time, ``value`` in its binary tensor."""
    body = _HEADER + struct.pack("<2f", value, value)
    return (
        b"POST /v2/models/blocking/infer HTTP/1.1\r\nHost: test\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
        % (len(_HEADER), len(body), body)
    )


class Ways(list):
    """Which of the handler's ways carried each begun request on, as they come (on the
    Trio thread); ``reached(n)`` waits until n are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = trio.Event()

    def record(self, way: str) -> None:
        self.append(way)
        self._changed.set()
        self._changed = trio.Event()

    async def reached(self, count: int) -> None:
        with trio.fail_after(30):
            while len(self) < count:
                await self._changed.wait()


@pytest.fixture
def carried(monkeypatch) -> Ways:
    ways = Ways()
    for name in ("carry_on", "failed", "drop"):
        real = getattr(InferHandler, name)
        monkeypatch.setattr(
            InferHandler,
            name,
            lambda self, *args, _real=real, _name=name: ways.record(_name) or _real(self, *args),
        )
    real_finish = InferHandler.finish

    async def finish(self, *args):
        ways.record("finish")
        return await real_finish(self, *args)

    monkeypatch.setattr(InferHandler, "finish", finish)
    return ways


async def test_repeated_requests_are_carried_on_by_the_connections_task(
    repository,  # noqa: F811
    writes,  # noqa: F811
    carried,
):
    GATE.release.set()
    server = http_server(repository)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        sock = await in_thread(socket.create_connection, ("127.0.0.1", server.options.http_port))
        buffered = bytearray()
        for value in range(4):
            await in_thread(sock.sendall, binary_bytes(float(value)))
            head, body = await in_thread(read_answer, sock, buffered)
            assert head.startswith(b"HTTP/1.1 200 OK"), head
            assert body["outputs"][0]["data"] == [float(value)] * 2
        # The first is read in full; the three that repeat it are begun, and each is
        # carried on as the next comes (the last one as the tick or the end sweeps).
        assert carried[:2] == ["carry_on"] * 2
        await writes.counted(4)
        assert all(whole for _, whole in writes), writes
        sock.close()
        model = server.dataplane.model("blocking", None)
        await model.idle.wait()  # (the tick sweeps the last report)
        assert model.statistics.success.count == 4
        server.shutdown()
    assert carried == ["carry_on"] * 3


async def test_a_begun_request_whose_wait_ends_on_pipelined_bytes_is_awaited(
    repository,  # noqa: F811
    writes,  # noqa: F811
    carried,
):
    GATE.release.set()
    server = http_server(repository)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        sock = await in_thread(socket.create_connection, ("127.0.0.1", server.options.http_port))
        buffered = bytearray()
        await in_thread(sock.sendall, binary_bytes(1.0))
        await in_thread(read_answer, sock, buffered)
        await wait_entered()  # (the first's execution, counted)
        GATE.reset()  # the next execution blocks
        # The second is begun and waits on the socket; the third comes (pipelined) while the
        # second executes: the wait ends on its bytes, and the second's outcome is awaited.
        await in_thread(sock.sendall, binary_bytes(2.0))
        await wait_entered()
        await trio.testing.wait_all_tasks_blocked()
        assert carried == []
        await in_thread(sock.sendall, binary_bytes(3.0))
        await carried.reached(1)
        assert carried == ["finish"]
        GATE.release.set()
        answers = [await in_thread(read_answer, sock, buffered) for _ in range(2)]
        assert [body["outputs"][0]["data"] for _, body in answers] == [[2.0, 2.0], [3.0, 3.0]]
        sock.close()
        model = server.dataplane.model("blocking", None)
        await model.idle.wait()
        assert model.statistics.success.count == 3
        server.shutdown()


async def test_a_client_gone_while_its_begun_request_runs_cancels_it(
    repository,  # noqa: F811
    writes,  # noqa: F811
    carried,
):
    GATE.release.set()
    server = http_server(repository)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        begun: list = []
        real_begin_now = server.dataplane.begin_now

        def begin_now(request, endpoint):  # (the infer handler's way in)
            begun.append(request)
            return real_begin_now(request, endpoint)

        server.dataplane.begin_now = begin_now
        sock = await in_thread(socket.create_connection, ("127.0.0.1", server.options.http_port))
        await in_thread(sock.sendall, binary_bytes(1.0))
        await in_thread(read_answer, sock, bytearray())
        await wait_entered()
        GATE.reset()
        await in_thread(sock.sendall, binary_bytes(2.0))
        await wait_entered()  # it executes on the instance's thread
        sock.close()  # readable (the end) while armed: the loop takes the answer back
        model = server.dataplane.model("blocking", None)
        with trio.fail_after(30):
            await model.idle.wait()  # the slow request's watcher ends it (the 0.25 s tick)
        assert begun[-1].cancelled
        assert carried == ["finish"]
        GATE.release.set()
        server.shutdown()
