"""HTTP/1.1 answers written by the instance's thread (protocol/http/answer.py,
core/deferred.py): the client gets the same bytes as from the event loop, every
request one outcome, statistics and in-flight counts exact, pipelined requests
in order, a client gone mid-request cancelled, a drain that does not wait for a
next request. In-process server, real sockets, the blocking test backend's
events instead of timing."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import trio
import trio.testing

from tests.blocking_backend import GATE, http_server, repository_fixture, wait_entered
from tests.e2e.test_grpc_cancellation import Probe, in_thread
from tests.repository import echo_model
from trionserve.actors import executor
from trionserve.protocol.http import transport
from trionserve.protocol.http.answer import ConnectionAnswer
from trionserve.server import Server

# The dynamic batcher can tell its instance's thread that nothing waits.
repository = repository_fixture(config="dynamic_batching { }")


class Writes(list):
    """Each ConnectionAnswer.write: (the thread's name, whether it wrote it whole).
    The client may read an answer before its write returns: ``counted(n)``
    waits until n writes are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self._recorded = threading.Semaphore(0)

    def record(self, name: str, whole: bool) -> None:
        self.append((name, whole))
        self._recorded.release()

    async def counted(self, count: int) -> None:
        for _ in range(count):
            assert await in_thread(self._recorded.acquire, True, 30), f"{self} of {count}"


@pytest.fixture
def writes(monkeypatch):
    calls = Writes()
    real = ConnectionAnswer.write

    def write(self, request, response):
        whole = real(self, request, response)
        calls.record(threading.current_thread().name, whole)
        return whole

    monkeypatch.setattr(ConnectionAnswer, "write", write)
    return calls


class Answers(dict[str, list]):
    """The clients' answers by name, as they come; ``complete`` once all three
    are here (a server's write is not yet its client's read)."""

    def __init__(self) -> None:
        super().__init__()
        self.complete = trio.Event()


async def queue_behind_a(server: Server, nursery: trio.Nursery) -> Answers:
    """Clients "a", "b" and "c", each on its own connection: "a" executes, "b" and
    "c" wait behind it. Their answers fill the dict returned as they come."""
    port = server.options.http_port
    probe = Probe(server.dataplane)
    answers = Answers()

    async def client(name: str) -> None:
        answers[name] = await in_thread(exchange, port, [infer_bytes(name, 1.0)])
        if len(answers) == 3:
            answers.complete.set()

    nursery.start_soon(client, "a")
    await wait_entered()  # "a" executes
    nursery.start_soon(client, "b")
    nursery.start_soon(client, "c")
    await probe.arrived("b", "c")
    await trio.testing.wait_all_tasks_blocked()  # both queued behind "a"
    assert server.dataplane.model("blocking", None)._scheduler.pending == 2
    return answers


def infer_bytes(request_id: str, value: float) -> bytes:
    body = json.dumps(
        {
            "id": request_id,
            "inputs": [
                {"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}
            ],
        }
    ).encode()
    return (
        b"POST /v2/models/blocking/infer HTTP/1.1\r\nHost: test\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def read_answer(sock: socket.socket, buffered: bytearray) -> tuple[bytes, dict]:
    """One HTTP/1.1 answer from ``sock`` (``buffered``: bytes read past the last)."""
    sock.settimeout(60)
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; read {bytes(buffered)!r}"
        buffered += chunk
    head, _, _ = bytes(buffered).partition(b"\r\n\r\n")
    del buffered[: len(head) + 4]
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if b"content-length" in line.lower()
    )
    while len(buffered) < length:
        buffered += sock.recv(65536)
    body = bytes(buffered[:length])
    del buffered[:length]
    return head, json.loads(body)


def exchange(port: int, requests: list[bytes], together: bool = False) -> list[tuple]:
    """Send each request on one keep-alive connection and read its answer before
    the next (``together``: all at once, pipelined); the answers in order."""
    sock = socket.create_connection(("127.0.0.1", port))
    buffered = bytearray()
    try:
        if together:
            sock.sendall(b"".join(requests))
            return [read_answer(sock, buffered) for _ in requests]
        answers = []
        for request in requests:
            sock.sendall(request)
            answers.append(read_answer(sock, buffered))
        return answers
    finally:
        sock.close()


def stats_get(port: int) -> dict:
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(b"GET /v2/models/blocking/stats HTTP/1.1\r\nHost: test\r\n\r\n")
        return read_answer(sock, bytearray())[1]["model_stats"][0]["inference_stats"]
    finally:
        sock.close()


async def test_keep_alive_answers_come_from_the_instance_thread(repository, writes):
    GATE.release.set()
    server = http_server(repository)
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        requests = [infer_bytes(f"r{i}", float(i)) for i in range(3)]
        answers = await in_thread(exchange, port, requests)
        for i, (head, body) in enumerate(answers):
            assert head.startswith(b"HTTP/1.1 200 OK"), head
            assert body["id"] == f"r{i}"
            assert body["outputs"][0]["data"] == [float(i), float(i)]
        await writes.counted(3)
        assert len(writes) == 3
        assert all(name.startswith("instance ") and whole for name, whole in writes), writes
        # The statistics read sweeps the reports the thread left: exact counts.
        stats = await in_thread(stats_get, port)
        assert stats["success"]["count"] == 3
        model = server.dataplane.model("blocking", None)
        assert model.inflight == 0
        server.shutdown()


async def test_a_drain_does_not_wait_for_the_clients_next_request(repository, writes):
    # The last answer's report waits for a sweep that no request brings: the
    # server's tick makes it, so the drain (in-flight count to 0) ends.
    GATE.release.set()
    server = http_server(repository)
    port = server.options.http_port
    with trio.fail_after(10):  # the tick sweeps every 0.25 s
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            sock = await in_thread(socket.create_connection, ("127.0.0.1", port))
            await in_thread(sock.sendall, infer_bytes("last", 5.0))
            head, body = await in_thread(read_answer, sock, bytearray())
            await writes.counted(1)
            assert body["id"] == "last" and [whole for _, whole in writes] == [True]
            model = server.dataplane.model("blocking", None)
            await model.idle.wait()  # swept without a next request
            assert model.statistics.success.count == 1
            server.shutdown()
    sock.close()


async def test_pipelined_requests_are_answered_in_order(repository, writes):
    server = http_server(repository)
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        requests = [infer_bytes("first", 1.0), infer_bytes("second", 2.0)]
        answering = trio.Event()
        answers: list = []

        async def client() -> None:
            answers.extend(await in_thread(exchange, port, requests, True))
            answering.set()

        nursery.start_soon(client)
        await wait_entered()  # "first" executes, "second" waits its turn, parsed
        GATE.release.set()
        await answering.wait()
        assert [body["id"] for _, body in answers] == ["first", "second"]
        assert [body["outputs"][0]["data"] for _, body in answers] == [[1.0, 1.0], [2.0, 2.0]]
        assert (await in_thread(stats_get, port))["success"]["count"] == 2
        server.shutdown()


async def test_a_client_gone_mid_request_cancels_it(repository, writes):
    server = http_server(repository)
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        probe = Probe(server.dataplane)
        sock = await in_thread(socket.create_connection, ("127.0.0.1", port))
        await in_thread(sock.sendall, infer_bytes("gone", 1.0))
        await wait_entered()  # it executes on the instance's thread
        sock.close()  # readable (the end) while armed: the loop takes the answer back
        await probe.cancelled_all("gone")
        GATE.release.set()
        # The thread finds the answer disarmed: nothing is written to a closed
        # connection; its report reaches the loop, which drops the result.
        answers = await in_thread(exchange, port, [infer_bytes("next", 2.0)])
        assert answers[0][1]["id"] == "next"
        await writes.counted(1)
        assert [whole for _, whole in writes] == [True], writes  # "next" only
        stats = await in_thread(stats_get, port)
        assert stats["success"]["count"] == 2  # "gone" executed, "next": one each
        server.shutdown()


async def test_with_requests_waiting_the_thread_answers_while_the_next_batch_runs(
    repository, writes, monkeypatch
):
    # (Off by default: executor.FREE_EARLY; the mechanism, switched on.)
    monkeypatch.setattr(executor, "FREE_EARLY", True)
    # c>1: "b" and "c" wait at the batcher while "a" executes. As "a" ends the
    # thread tells the loop the instance is free (the next batch, "b" and "c",
    # is handed over) and writes "a"'s answer itself; its report waits for a
    # sweep. Every answer comes from the thread, the counts stay exact.
    server = http_server(repository)
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        answers = await queue_behind_a(server, nursery)
        GATE.release.set()
        await writes.counted(3)
        # "a"'s, written while "b" and "c" waited. (One of theirs may be taken
        # back by a sweep that "a"'s client brings as it closes, before the
        # thread writes it: the loop writes it then, as it delivers the outcome.)
        assert writes[0] == ("instance blocking_0", True), writes
        assert len([name for name, whole in writes if whole]) == 3, writes
        stats = await in_thread(stats_get, port)
        assert stats["success"]["count"] == 3
        await answers.complete.wait()
        assert sorted(answers) == ["a", "b", "c"]
        assert all(answers[n][0][1]["id"] == n for n in answers)
        model = server.dataplane.model("blocking", None)
        assert model.inflight == 0
        server.shutdown()


async def test_with_requests_waiting_the_loop_answers_as_it_delivers_the_outcome(
    repository, writes, monkeypatch
):
    # "a" executes while "b" and "c" wait behind it, each connection's task
    # waiting on its socket. Without a dynamic batcher (nothing tells the thread
    # that no request waits) every report goes to the loop, which writes each
    # answer as it delivers the outcome: the waits are not ended (no
    # notify_closing, no epoll churn) and go on until each client sends again
    # or closes. Every request one outcome, the counts exact.
    monkeypatch.setattr(transport, "SLOW_REQUEST_SECS", 3600.0)  # no tick sweeps
    echo_model(repository, "blocking", "test_blocking")  # (without dynamic_batching)
    ended: list[ConnectionAnswer] = []
    real_end = ConnectionAnswer._end

    def end(self: ConnectionAnswer) -> None:
        ended.append(self)
        real_end(self)

    monkeypatch.setattr(ConnectionAnswer, "_end", end)
    server = http_server(repository)
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        answers = await queue_behind_a(server, nursery)
        GATE.release.set()
        await writes.counted(3)
        assert writes == [(threading.current_thread().name, True)] * 3  # the loop's
        assert ended == []
        stats = await in_thread(stats_get, port)
        assert stats["success"]["count"] == 3
        await answers.complete.wait()
        assert sorted(answers) == ["a", "b", "c"]
        assert all(answers[n][0][1]["id"] == n for n in answers)
        await trio.testing.wait_all_tasks_blocked()
        assert server.dataplane.model("blocking", None).inflight == 0
        server.shutdown()


async def test_a_cached_models_answer_is_stored_before_it_is_written(repository, writes):
    # Triton inserts a response in the cache before it sends it (core
    # src/dynamic_batch_scheduler.cc, DelegateResponse): the client that has
    # its answer finds it cached, on any connection. Neither the thread nor
    # the loop at the delivery writes it: the connection's task does, once stored.
    echo_model(repository, "blocking", "test_blocking", "response_cache { enable: true }")
    server = http_server(repository, response_cache_bytes=1 << 20)
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        first = await in_thread(socket.create_connection, ("127.0.0.1", port))
        await in_thread(first.sendall, infer_bytes("a", 1.0))
        await wait_entered()  # its connection's task waits for the outcome
        GATE.release.set()
        _, body = await in_thread(read_answer, first, bytearray())  # (kept open)
        assert body["id"] == "a"
        answers = await in_thread(exchange, port, [infer_bytes("b", 1.0)])
        assert answers[0][1]["id"] == "b"
        stats = await in_thread(stats_get, port)
        assert (stats["cache_hit"]["count"], stats["cache_miss"]["count"]) == (1, 1)
        assert writes == []
        first.close()
        server.shutdown()


async def test_a_request_for_an_instance_whose_report_waits_does_not_wait_for_the_tick(
    repository, writes, monkeypatch
):
    # "a"'s answer is written by the thread and its report waits for a sweep
    # (its client sends nothing more). "b" comes on another connection: its
    # submit sweeps first, so the instance takes it at once, not at the next
    # tick of the server (here never: the tick is pushed out of the test).
    monkeypatch.setattr(transport, "SLOW_REQUEST_SECS", 3600.0)
    GATE.release.set()
    server = http_server(repository)
    port = server.options.http_port
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            first = await in_thread(socket.create_connection, ("127.0.0.1", port))
            await in_thread(first.sendall, infer_bytes("a", 1.0))
            head, body = await in_thread(read_answer, first, bytearray())
            await writes.counted(1)
            assert body["id"] == "a"
            answers = await in_thread(exchange, port, [infer_bytes("b", 2.0)])
            assert answers[0][1]["id"] == "b"
            stats = await in_thread(stats_get, port)
            assert stats["success"]["count"] == 2
            # "a"'s connection waits for its client (no tick to end the wait
            # here): its end does.
            first.close()
            server.shutdown()
