"""The instance thread's write of a gRPC answer (answer._write_now): libc's
``write`` called with the GIL held, so that the thread marks the answer
written and lets its lock go before the loop, woken by the client's next
call, can take it (benchmarks/README.md, issue 39's thirteenth round). Written
whole, cut where the socket stops, raising as ``os.write`` does."""

from __future__ import annotations

import ctypes
import socket

import pytest
import trio

from trionserve.protocol.grpc import answer as grpc_answer


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    yield ours, theirs  # (_write_now reads only the socket's fileno)
    ours.close()
    theirs.close()


def read_all(sock: socket.socket, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        got += sock.recv(size - len(got))
    return bytes(got)


def test_the_write_holds_the_gil():
    write = grpc_answer._HELD_WRITE
    assert write is not None  # (libc on Linux)
    assert type(write)._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # ctypes.PyDLL: the GIL kept


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_an_answer_the_socket_takes_is_written_whole(pair, kind):
    ours, theirs = pair
    data = kind(range(256)) * 16
    assert grpc_answer._write_now(ours, data) == []
    assert read_all(theirs, len(data)) == bytes(data)


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_a_full_socket_leaves_the_rest_in_order(pair, kind):
    ours, theirs = pair
    data = kind(bytes(range(256)) * 4096)  # 1 MiB: more than the socket takes at once
    rest = grpc_answer._write_now(ours, data)
    assert len(rest) == 1 and 0 < rest[0].nbytes < len(data)
    written = len(data) - rest[0].nbytes
    assert rest[0] == memoryview(data)[written:]
    assert read_all(theirs, written) == bytes(data)[:written]


def test_nothing_taken_when_full_is_all_left(pair):
    ours, _theirs = pair
    while not grpc_answer._write_now(ours, bytes(65536)):
        pass  # until the socket is full
    data = bytearray(b"answer")
    assert grpc_answer._write_now(ours, data) == [memoryview(data)]


def test_a_peer_gone_raises_as_os_write(pair):
    ours, theirs = pair
    theirs.close()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        grpc_answer._write_now(ours, bytearray(b"answer"))


def test_a_closed_socket_raises_closed(pair):
    ours, _theirs = pair
    ours.close()
    with pytest.raises(trio.ClosedResourceError):
        grpc_answer._write_now(ours, b"answer")
