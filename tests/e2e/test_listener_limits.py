"""Every HTTP listener has the HTTP port's limits (body size, connection cap, head
timeout): the metrics port, and with --workers the supervisor's metrics port, its
private statistics port and each worker's private statistics port (real servers,
real sockets on loopback). Each worker binds its private ports itself and reports
them; nothing is chosen for it."""

from __future__ import annotations

import re
import shutil
import socket
import time

import pytest

from tests.serverproc import EXAMPLES, ServerProcess

LIMITS = ["--http-max-input-size=65536", "--http-max-connections=4", "--http-header-timeout=1"]


def answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes (or 5 s pass)."""
    sock.settimeout(5)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def oversized_post(port: int, path: str) -> bytes:
    """A head announcing 1 GiB, no body: refused on the head alone."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (path, 1 << 30))
        return answer(sock)


def check_limits(port: int, path: bytes) -> None:
    assert oversized_post(port, path).startswith(b"HTTP/1.1 413"), port
    # A head that never ends: timed out.
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert answer(sock).startswith(b"HTTP/1.1 408"), port
    assert time.monotonic() - started < 4.5
    # Four idle connections hold the cap; a fifth is refused.
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            assert answer(sock).startswith(b"HTTP/1.1 503"), port
    finally:
        for sock in held:
            sock.close()


@pytest.fixture
def started(tmp_path):
    shutil.copytree(EXAMPLES / "identity_fp32", tmp_path / "identity_fp32")
    procs: list[ServerProcess] = []

    def start(**kwargs) -> ServerProcess:
        proc = ServerProcess(tmp_path, **kwargs)
        procs.append(proc)
        proc.wait_ready()
        return proc

    yield start
    for proc in procs:
        code = proc.stop()
        assert code == 0, proc.output()
        proc.close()


def test_the_metrics_port_has_the_http_limits(started):
    proc = started(args=LIMITS)
    check_limits(proc.metrics_port, b"/metrics")
    # The HTTP port is served meanwhile, and metrics are still scraped.
    assert proc.status("/v2/health/live") == 200
    with socket.create_connection(("127.0.0.1", proc.metrics_port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert b"nv_inference_count" in answer(sock)


def test_every_listener_of_workers_has_the_http_limits(started):
    proc = started(args=LIMITS, workers=2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.output().count("worker ready") < 2:
        time.sleep(0.05)
    log = proc.output()
    private = [int(p) for p in re.findall(r"statistics=127\.0\.0\.1:(\d+)", log)]
    supervisor = re.findall(
        r"supervisor statistics service started +listening=\[\('127\.0\.0\.1', (\d+)\)", log
    )
    assert len(private) == 2 and len(supervisor) == 1, log
    check_limits(proc.metrics_port, b"/metrics")
    check_limits(int(supervisor[0]), b"/workers/statistics")
    for port in private:
        check_limits(port, b"/worker/statistics")
    # Statistics still add up across the workers through those ports.
    assert proc.status("/v2/models/stats") == 200
