"""The floor under a Python-backend call: a bare round trip between two processes.

Usage: python -m benchmarks.ipc_floor [--seconds 2] [--rounds 3]

A Python-backend request crosses from the server to its stub process and back.
Whatever the stub protocol does, it cannot be cheaper than one message each way
over the same kind of socket, so this measures that floor on this machine, and
what each layer above it costs, with the two processes pinned to nothing (they
share the cores as the server and a stub do):

- ``blocking``: both sides block on an AF_UNIX stream socketpair (the stub's
  socket), 64-byte messages: the kernel's and the interpreter's floor.
- ``trio server``: the server side waits with Trio (``await sock.recv``), the
  stub side blocks: the shape of a call from an executor task.
- ``+ marshal + shm``: the message is a marshalled dict, and two 16-element
  INT32 tensors are written to and read from a shared-memory segment (both
  ways), as the Python backend moves tensors.
- ``+ thread handoff``: as before, but the stub reads on a reader thread and
  hands each message to its main thread through a ``queue.Queue`` (a
  cross-thread wake-up per request).

The cases run interleaved ``--rounds`` times; the median round trips per second
of each are reported, and the ratio to ``blocking``.
"""

from __future__ import annotations

import argparse
import marshal
import mmap
import multiprocessing
import os
import queue
import socket
import statistics
import struct
import threading
import time

import numpy as np
import trio

_HEADER = struct.Struct("<I")
_TENSOR_BYTES = 16 * 4


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise EOFError
        chunks += chunk
    return bytes(chunks)


def _recv_message(sock: socket.socket) -> bytes:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return _recv_exact(sock, size)


def _send_message(sock: socket.socket, body: bytes) -> None:
    sock.sendall(_HEADER.pack(len(body)) + body)


def _echo_stub(fd: int, shm_fd: int, mode: str) -> None:
    """The stub side: answer every message until the socket closes."""
    sock = socket.socket(fileno=fd)
    region = mmap.mmap(shm_fd, 4 * _TENSOR_BYTES) if shm_fd >= 0 else None

    def answer(body: bytes) -> bytes:
        if mode in ("blocking", "plain"):
            return body
        message = marshal.loads(body)
        assert region is not None
        a = np.frombuffer(region, dtype=np.int32, count=16, offset=message["in"][0])
        b = np.frombuffer(region, dtype=np.int32, count=16, offset=message["in"][1])
        out0 = np.frombuffer(region, dtype=np.int32, count=16, offset=2 * _TENSOR_BYTES)
        out1 = np.frombuffer(region, dtype=np.int32, count=16, offset=3 * _TENSOR_BYTES)
        np.add(a, b, out=out0)
        np.subtract(a, b, out=out1)
        return marshal.dumps({"id": message["id"], "out": (2 * _TENSOR_BYTES, 3 * _TENSOR_BYTES)})

    try:
        if mode == "handoff":
            inbox: queue.Queue[bytes | None] = queue.Queue()

            def read() -> None:
                try:
                    while True:
                        inbox.put(_recv_message(sock))
                except (EOFError, OSError):
                    inbox.put(None)

            threading.Thread(target=read, daemon=True).start()
            while (body := inbox.get()) is not None:
                _send_message(sock, answer(body))
        else:
            while True:
                _send_message(sock, answer(_recv_message(sock)))
    except (EOFError, OSError):
        pass


def _start_stub(mode: str) -> tuple[socket.socket, multiprocessing.Process, mmap.mmap | None]:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    shm_fd = -1
    region = None
    if mode != "blocking":
        shm_fd = os.memfd_create("ipc-floor")
        os.ftruncate(shm_fd, 4 * _TENSOR_BYTES)
        region = mmap.mmap(shm_fd, 4 * _TENSOR_BYTES)
    context = multiprocessing.get_context("fork")
    process = context.Process(target=_echo_stub, args=(child.fileno(), shm_fd, mode), daemon=True)
    process.start()
    child.close()
    if shm_fd >= 0:
        os.close(shm_fd)
    return parent, process, region


def _blocking_rate(seconds: float) -> float:
    sock, process, _ = _start_stub("blocking")
    body = b"x" * 64
    count = 0
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            for _ in range(100):
                _send_message(sock, body)
                _recv_message(sock)
            count += 100
    finally:
        sock.close()
        process.join(5)
    return count / seconds


def _trio_rate(seconds: float, mode: str) -> float:
    """Round trips per second with the server side on Trio."""
    stdlib_sock, process, region = _start_stub(mode)

    async def drive() -> int:
        sock = trio.socket.from_stdlib_socket(stdlib_sock)
        buffer = bytearray()

        async def receive() -> bytes:
            nonlocal buffer
            while True:
                if len(buffer) >= _HEADER.size:
                    (size,) = _HEADER.unpack_from(buffer)
                    if len(buffer) >= _HEADER.size + size:
                        body = bytes(buffer[_HEADER.size : _HEADER.size + size])
                        del buffer[: _HEADER.size + size]
                        return body
                chunk = await sock.recv(1 << 16)
                if not chunk:
                    raise EOFError
                buffer += chunk

        a = np.arange(16, dtype=np.int32)
        b = np.ones(16, dtype=np.int32)
        count = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for _ in range(100):
                if mode == "plain":
                    body = b"x" * 64
                else:
                    assert region is not None
                    region[0:_TENSOR_BYTES] = a.tobytes()
                    region[_TENSOR_BYTES : 2 * _TENSOR_BYTES] = b.tobytes()
                    body = marshal.dumps({"id": count, "in": (0, _TENSOR_BYTES)})
                await sock.send(_HEADER.pack(len(body)) + body)
                reply = await receive()
                if mode != "plain":
                    assert region is not None
                    out = marshal.loads(reply)["out"]
                    np.frombuffer(region, dtype=np.int32, count=16, offset=out[0]).copy()
                    np.frombuffer(region, dtype=np.int32, count=16, offset=out[1]).copy()
                count += 1
        sock.close()
        return count

    try:
        count = trio.run(drive)
    finally:
        process.join(5)
    return count / seconds


CASES = {
    "blocking": lambda s: _blocking_rate(s),
    "trio server": lambda s: _trio_rate(s, "plain"),
    "+ marshal + shm": lambda s: _trio_rate(s, "shm"),
    "+ thread handoff": lambda s: _trio_rate(s, "handoff"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, case in CASES.items():
            rates[name].append(case(args.seconds))
    floor = statistics.median(rates["blocking"])
    print("| case | round trips/s | µs per round trip | ratio to blocking |")
    print("| --- | --- | --- | --- |")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:,.0f} | {1e6 / rate:.1f} | {rate / floor:.2f}x |")


if __name__ == "__main__":
    main()
