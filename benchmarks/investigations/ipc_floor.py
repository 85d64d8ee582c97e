"""The floor under a Python-backend call: a bare round trip between two processes.

Usage: python -m benchmarks.investigations.ipc_floor [--seconds 2] [--rounds 3]

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
of each are reported, and the ratio to ``blocking``. Each case also runs with
both processes pinned to one core (``sched_setaffinity``, Linux): the difference
is what waking a process on another core costs on this machine (on a virtual
machine, an idle virtual CPU is woken by an interrupt through the hypervisor,
and the code that runs right after the wake-up runs slower), which every
Python-backend request pays twice, as Triton's stub does. The CPU time of the
stub side per round trip is reported too (from ``/proc/PID/schedstat``: its
running time in nanoseconds).
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
from typing import NamedTuple

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


def _echo_stub(fd: int, other_end: int, shm_fd: int, mode: str, cpus: set[int] | None) -> None:
    """The stub side: answer every message until the socket closes."""
    os.close(other_end)  # inherited: held open, the parent's close would not end this
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
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


def _start_stub(
    mode: str, cpus: set[int] | None
) -> tuple[socket.socket, multiprocessing.Process, mmap.mmap | None]:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    shm_fd = -1
    region = None
    if mode != "blocking":
        shm_fd = os.memfd_create("ipc-floor")
        os.ftruncate(shm_fd, 4 * _TENSOR_BYTES)
        region = mmap.mmap(shm_fd, 4 * _TENSOR_BYTES)
    context = multiprocessing.get_context("fork")
    process = context.Process(
        target=_echo_stub, args=(child.fileno(), parent.fileno(), shm_fd, mode, cpus), daemon=True
    )
    process.start()
    child.close()
    if shm_fd >= 0:
        os.close(shm_fd)
    return parent, process, region


def _running_ns(pid: int) -> int:
    """The CPU time of a process so far (all its threads), from /proc."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
            total += int(stat.read().split()[0])
    return total


class _Rate(NamedTuple):
    round_trips_per_s: float
    stub_cpu_us: float  # per round trip


def _blocking_rate(seconds: float, cpus: set[int] | None) -> _Rate:
    sock, process, _ = _start_stub("blocking", cpus)
    body = b"x" * 64
    count = 0
    _send_message(sock, body)
    _recv_message(sock)  # the stub is up
    assert process.pid is not None
    started = _running_ns(process.pid)
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            for _ in range(100):
                _send_message(sock, body)
                _recv_message(sock)
            count += 100
        stub_ns = _running_ns(process.pid) - started
    finally:
        sock.close()
        process.join(5)
    return _Rate(count / seconds, stub_ns / count / 1000)


def _trio_rate(seconds: float, mode: str, cpus: set[int] | None) -> _Rate:
    """Round trips per second with the server side on Trio."""
    stdlib_sock, process, region = _start_stub(mode, cpus)
    assert process.pid is not None
    stub_pid = process.pid

    async def drive() -> tuple[int, int]:
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
        started = -1
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
                if started < 0:  # the stub is up (and its reader thread started)
                    started = _running_ns(stub_pid)
                count += 1
        stub_ns = _running_ns(stub_pid) - started
        sock.close()
        return count, stub_ns

    try:
        count, stub_ns = trio.run(drive)
    finally:
        process.join(5)
    return _Rate(count / seconds, stub_ns / max(1, count - 1) / 1000)


CASES = {
    "blocking": lambda s, cpus: _blocking_rate(s, cpus),
    "trio server": lambda s, cpus: _trio_rate(s, "plain", cpus),
    "+ marshal + shm": lambda s, cpus: _trio_rate(s, "shm", cpus),
    "+ thread handoff": lambda s, cpus: _trio_rate(s, "handoff", cpus),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    everywhere = os.sched_getaffinity(0)
    one_core = {min(everywhere)}
    placements = {"any cores": None, "one core": one_core}
    rates: dict[tuple[str, str], list[_Rate]] = {
        (name, where): [] for name in CASES for where in placements
    }
    for _ in range(args.rounds):
        for name, case in CASES.items():
            for where, cpus in placements.items():
                os.sched_setaffinity(0, cpus or everywhere)
                try:
                    rates[name, where].append(case(args.seconds, cpus))
                finally:
                    os.sched_setaffinity(0, everywhere)
    floor = statistics.median(r.round_trips_per_s for r in rates["blocking", "any cores"])
    print(
        "| case | processes on | round trips/s | µs per round trip | ratio to blocking "
        "| stub CPU µs per round trip |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, where), values in rates.items():
        rate = statistics.median(r.round_trips_per_s for r in values)
        stub = statistics.median(r.stub_cpu_us for r in values)
        print(
            f"| {name} | {where} | {rate:,.0f} | {1e6 / rate:.1f} | {rate / floor:.2f}x "
            f"| {stub:.1f} |"
        )


if __name__ == "__main__":
    main()
