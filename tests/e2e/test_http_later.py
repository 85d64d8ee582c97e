"""A repeated infer request's binary tensors read by the instance's thread
(trionserve/protocol/http/later.py) through a real server: the answers are the ones the loop's
read gives, the thread reads the tensors of the request the loop found whole in the socket, and
the request after it is read as its own. In-process server, a real socket, the backend's
semaphores instead of timing."""

from __future__ import annotations

import fcntl
import json
import socket
import termios
import threading
import time

import numpy as np
import pytest
import trio

from tests.blocking_backend import http_server
from tests.e2e.test_grpc_cancellation import in_thread
from tests.fake_backend import instance_backend
from tests.repository import write_model
from trionserve.backends.batch_tensors import build_responses
from trionserve.protocol.http.later import LaterBody

SIZE = 100_000  # FP32 values a request: 400 KB of binary tensors
ENTERED = threading.Semaphore(0)
PERMITS = threading.Semaphore(0)


class _Sum:
    """Answers each request with the sum of its INPUT0, once a permit lets its batch run."""

    def __init__(self, context) -> None:
        self.name, self.version = context.name, str(context.version)

    def execute(self, requests):
        ENTERED.release()
        assert PERMITS.acquire(timeout=60), "the test gave no permit"
        sums = np.array([[r.inputs["INPUT0"].data.sum(dtype=np.float64)] for r in requests])
        outputs = {"OUTPUT0": sums.astype(np.float32)}
        return build_responses(requests, self.name, self.version, outputs, {"OUTPUT0": "FP32"})

    def close(self) -> None:
        pass


BACKENDS = instance_backend("test_sum", lambda context, spec: _Sum(context))


@pytest.fixture
def repository(tmp_path):
    write_model(
        tmp_path,
        "sum",
        'name: "sum"\nbackend: "test_sum"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        "dynamic_batching { }\n",
        {"1/model.txt": "test model\n"},
    )
    return tmp_path


@pytest.fixture
def reads(monkeypatch):
    """The thread that read each deferred body's rest (LaterBody._read with a view)."""
    names: list[str] = []
    real = LaterBody._read

    def read(self) -> None:
        if self.view is not None:
            names.append(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(LaterBody, "_read", read)
    return names


def infer_bytes(value: float) -> bytes:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, SIZE],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": SIZE * 4},
                }
            ],
            "outputs": [{"name": "OUTPUT0"}],
        }
    ).encode()
    body = header + np.full(SIZE, value, np.float32).tobytes()
    return (
        b"POST /v2/models/sum/infer HTTP/1.1\r\nHost: test\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
        % (len(header), len(body), body)
    )


def answer_of(sock: socket.socket, buffered: bytearray) -> float:
    """The OUTPUT0 of the next answer on ``sock``."""
    sock.settimeout(60)
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buffered += chunk
    head, _, _ = bytes(buffered).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK"), head
    del buffered[: len(head) + 4]
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if b"content-length" in line.lower()
    )
    while len(buffered) < length:
        buffered += sock.recv(65536)
    body = json.loads(bytes(buffered[:length]))
    del buffered[:length]
    return body["outputs"][0]["data"][0]


def sent_whole(sock: socket.socket) -> None:
    """Wait until the peer's socket holds all that ``sock`` sent (nothing unacknowledged)."""
    for _ in range(60_000):
        if not int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)), "little"):
            return
        time.sleep(0.001)
    raise AssertionError("the server's socket did not take the request")


def exchange(port: int) -> list[float]:
    """Two requests one after the other (the connection learns their head), then a third and,
    while it runs, a fourth sent whole: the loop reads the fourth once the third is answered,
    with all of it in the socket."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    buffered = bytearray()
    answers = []
    try:
        for value in (1.0, 2.0):
            PERMITS.release()
            sock.sendall(infer_bytes(value))
            answers.append(answer_of(sock, buffered))
            assert ENTERED.acquire(timeout=60)
        sock.sendall(infer_bytes(3.0))
        assert ENTERED.acquire(timeout=60)  # the third runs, held
        sock.sendall(infer_bytes(4.0))
        sent_whole(sock)
        PERMITS.release(2)
        answers.append(answer_of(sock, buffered))
        answers.append(answer_of(sock, buffered))
        assert ENTERED.acquire(timeout=60)
        PERMITS.release()  # a fifth, after the fourth: read as its own
        sock.sendall(infer_bytes(5.0))
        answers.append(answer_of(sock, buffered))
        return answers
    finally:
        sock.close()


async def test_the_instance_thread_reads_the_tensors_the_loop_left_in_the_socket(repository, reads):
    server = http_server(repository, BACKENDS)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        answers = await in_thread(exchange, server.options.http_port)
        assert answers == [value * SIZE for value in (1.0, 2.0, 3.0, 4.0, 5.0)]
        # The fourth's tensors (at least) were read by the instance's thread.
        assert any(name.startswith("instance ") for name in reads), reads
        server.shutdown()


async def test_tensors_the_thread_did_not_take_are_read_by_the_loop_as_the_request_settles(
    repository, reads, monkeypatch
):
    # The thread takes nothing (as for a request that never ran: rejected, failed, cancelled
    # before its batch): the loop reads the rest as the request settles, and the request after it
    # is read as its own (its answer right).
    from trionserve.backends.instance_thread import InstanceThread

    monkeypatch.setattr(InstanceThread, "_take_bodies", staticmethod(lambda job: None))
    server = http_server(repository, BACKENDS)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        answers = await in_thread(exchange, server.options.http_port)
        # Each answered 200 in turn: every request after one whose tensors the loop read at its
        # settle was parsed as its own (those that ran on untaken tensors answered what their
        # buffers held then: the thread is what this test takes away).
        assert len(answers) == 5 and answers[:2] == [1.0 * SIZE, 2.0 * SIZE]
        assert reads and not any(name.startswith("instance ") for name in reads), reads
        server.shutdown()
