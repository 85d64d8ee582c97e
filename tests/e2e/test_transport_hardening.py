"""What a hostile or careless client can make the transports hold (issue 31), against
a real server on loopback with its limits scaled down by flags, each probe bounded
in time and memory (the server's RSS is read from /proc)."""

from __future__ import annotations

import shutil
import socket
import struct
import time

import pytest

from tests.serverproc import EXAMPLES, ServerProcess

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _GOAWAY = 0x4, 0x7
FRAME_SIZE_ERROR = 0x6


def rss_mib(proc: ServerProcess) -> float:
    """The server's resident memory, in MiB."""
    with open(f"/proc/{proc.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"", length=None) -> bytes:
    """One HTTP/2 frame; ``length`` announces another length than the payload's."""
    size = len(payload) if length is None else length
    return struct.pack(">HBBBL", size >> 8, size & 0xFF, kind, flags, stream_id) + payload


def frames_until_goaway(sock: socket.socket, timeout: float) -> tuple[int, int] | None:
    """(last stream id, error code) of the first GOAWAY the server sends within
    ``timeout`` seconds; None if none came (or the connection ended without one)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while len(data) >= 9:
            size = int.from_bytes(data[:3], "big")
            if len(data) < 9 + size:
                break
            kind, payload = data[3], data[9 : 9 + size]
            data = data[9 + size :]
            if kind == _GOAWAY:
                last, code = struct.unpack(">LL", payload[:8])
                return last & 0x7FFFFFFF, code
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return None
        if not chunk:
            return None
        data += chunk
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    shutil.copytree(EXAMPLES / "identity_fp32", repository / "identity_fp32")
    proc = ServerProcess(repository)
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


# -- finding 6: HTTP/2 frames past SETTINGS_MAX_FRAME_SIZE ------------------------


def test_an_oversized_frame_is_refused_on_its_header(server):
    """A DATA frame announcing 16 MiB (past the 1 MiB SETTINGS_MAX_FRAME_SIZE the
    server advertises) is refused with GOAWAY FRAME_SIZE_ERROR as soon as its
    9-byte header is in (RFC 9113 section 4.2), before any payload is sent: the
    server never waits to buffer it."""
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5) as sock:
        sock.sendall(PREFACE + frame(_SETTINGS, 0, 0))
        # The server's MAX_FRAME_SIZE applies once acknowledged.
        sock.sendall(frame(_SETTINGS, 0x1, 0))
        sock.sendall(frame(0x0, 0, 1, length=(1 << 24) - 1))
        assert frames_until_goaway(sock, 5) == (0, FRAME_SIZE_ERROR)


def test_oversized_frames_on_many_connections_hold_no_memory(server):
    """Connections announcing 16 MiB frames and sending 4 MiB of each hold next to
    nothing: each is closed on the header (before the fix each payload was
    buffered until the frame was complete)."""
    before = rss_mib(server)
    socks = []
    try:
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5)
            socks.append(sock)
            sock.sendall(PREFACE + frame(_SETTINGS, 0, 0) + frame(_SETTINGS, 0x1, 0))
        chunk = b"\0" * (1 << 20)
        for sock in socks:
            sock.sendall(frame(0x0, 0, 1, length=(1 << 24) - 1))
            try:
                for _ in range(4):
                    sock.sendall(chunk)
            except OSError:
                pass  # refused and closed meanwhile: what is asked
        grown = rss_mib(server) - before
        assert grown < 16, f"the server grew by {grown:.0f} MiB"
        for sock in socks:
            assert frames_until_goaway(sock, 5) in ((0, FRAME_SIZE_ERROR), None)
    finally:
        for sock in socks:
            sock.close()


# -- finding 2: no client holds every connection slot ------------------------------

HTTP_CAP = 8
HTTP_LIMITS = [
    f"--http-max-connections={HTTP_CAP}",
    "--http-header-timeout=1",
    "--http-keep-alive-timeout=2",
]
LIVE = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    shutil.copytree(EXAMPLES / "identity_fp32", repository / "identity_fp32")
    proc = ServerProcess(repository, args=HTTP_LIMITS)
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and its content-length body); b"" if the server
    closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def idle_keep_alive(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that each made one request and now idle."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(LIVE)
        assert read_response(sock).startswith(b"HTTP/1.1 200"), "not served"
        socks.append(sock)
    return socks


def test_idle_keep_alive_connections_make_room_for_new_clients(http_server):
    """With the cap held by connections idle after one request each, a new client
    is served (before: 503 for as long as they stayed): the longest idle one is
    closed to make room, and only it."""
    socks = idle_keep_alive(http_server.http_port, HTTP_CAP)
    try:
        with socket.create_connection(("127.0.0.1", http_server.http_port), timeout=5) as new:
            new.sendall(LIVE)
            assert read_response(new).startswith(b"HTTP/1.1 200")
        assert closed_by_server(socks[0], 1)
        # The others are still open and served.
        socks[-1].sendall(LIVE)
        assert read_response(socks[-1]).startswith(b"HTTP/1.1 200")
    finally:
        for sock in socks:
            sock.close()


def test_connections_in_the_middle_of_a_request_are_not_closed_for_room(http_server):
    """Only idle connections make room: with the cap held by connections in the
    middle of a request head, a new one is refused 503 as before."""
    socks = []
    try:
        for _ in range(HTTP_CAP):
            sock = socket.create_connection(("127.0.0.1", http_server.http_port), timeout=5)
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
            socks.append(sock)
        with socket.create_connection(("127.0.0.1", http_server.http_port), timeout=5) as new:
            assert read_response(new).startswith(b"HTTP/1.1 503")
    finally:
        for sock in socks:
            sock.close()
    # Their slots are free again once the server has seen them close.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", http_server.http_port), timeout=5) as new:
            new.sendall(LIVE.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n"))
            if read_response(new).startswith(b"HTTP/1.1 200"):
                break
    else:
        raise AssertionError("the slots were not freed")


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(http_server):
    (sock,) = idle_keep_alive(http_server.http_port, 1)
    with sock:
        started = time.monotonic()
        assert closed_by_server(sock, 5)
        assert 1.5 < time.monotonic() - started < 4.5  # --http-keep-alive-timeout=2


def test_a_body_that_stops_arriving_times_out(http_server):
    """A request whose body stops half-way is answered 408 naming the flag after
    --http-header-timeout without a byte of it (before: held until the client
    left), and its slot is free again."""
    with socket.create_connection(("127.0.0.1", http_server.http_port), timeout=5) as sock:
        sock.sendall(
            b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nhost: x\r\n"
            b"content-length: 1000\r\n\r\n" + b"{" * 10
        )
        started = time.monotonic()
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"--http-header-timeout" in answer
        assert time.monotonic() - started < 4
