"""What a request would cost to pass from a front-end process to a process that owns the models.

Usage:
    python -m benchmarks.investigations.process_handoff [--calls 3000] [--rounds 5]
        [--size 602112] [--answer 4000]

Issue 39's item 4, its second option: ``--workers N`` front ends (each its own event loop,
protocols and decode) sharing one set of model instances (one GPU's) through a process that
owns them. This measures the hand-off alone, without building the option: per call, the front
end puts a request of ``--size`` bytes (the CNN's 602 KB FP32 image) into a slot of shared
memory (``multiprocessing.shared_memory``) and tells the model process (one 8-byte ``eventfd``
write); the model process wakes (a blocking ``eventfd`` read), takes the tensor as a numpy view
of the slot (no copy), writes an answer of ``--answer`` bytes (the CNN's 1,000 FP32 classes)
into the slot's answer part and tells the front end the same way; the front end wakes and
takes the answer as a view. Two ways of putting the request in: ``copy`` (the body, already
received into the front end's buffer, copied into the slot: a front end as today plus a copy)
and ``direct`` (the slot is the receive buffer: a front end whose socket reads straight into
shared memory; here a socketpair stands for the client, so the kernel's copy is counted as
the loop's receive is today), and ``trio``: ``direct`` with the front end waiting for the
answer's ``eventfd`` under Trio (``wait_readable``: a pass of its run loop per call, what a
front end pays if its loop must hear of each answer; the blocking modes read the ``eventfd``
in place). Each front end's round runs inside ``trio.run``.

Printed per mode, medians over rounds: CPU µs per call on each side (``time.thread_time`` of
the thread doing the work: the front end's, the model process's) and the round trip's wall
µs. The figure to weigh it against is the front end's event-loop CPU per call it would not
remove (each front end still runs the whole protocol) and the cores it would add
(benchmarks/README.md, "The loop off the critical path", issue 39's thirteenth round).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import trio

_ANSWER_AT = 1 << 20  # the answer's offset in a slot (past the largest request)


def _model_process(name: str, to_model: int, to_front: int, size: int, answer: int) -> None:
    """The process that owns the models: wait, view the request, write the answer, tell."""
    memory = shared_memory.SharedMemory(name=name)
    try:
        buffer = memory.buf
        out = np.ndarray((answer // 4,), np.float32, buffer, _ANSWER_AT)
        while True:
            calls = os.eventfd_read(to_model)  # (blocks: the GIL released)
            if calls > 1 << 40:
                break
            request = np.ndarray((size // 4,), np.float32, buffer, 0)
            out[0] = request[0]  # the model's forward would read it here
            del request
            os.eventfd_write(to_front, 1)
    finally:
        del out, buffer
        memory.close()


def _rounds(mode: str, calls: int, rounds: int, size: int, answer: int) -> dict[str, list]:
    memory = shared_memory.SharedMemory(create=True, size=_ANSWER_AT + answer)
    to_model = os.eventfd(0)
    to_front = os.eventfd(0, os.EFD_NONBLOCK if mode == "trio" else 0)
    process = multiprocessing.get_context("fork").Process(
        target=_model_process, args=(memory.name, to_model, to_front, size, answer)
    )
    process.start()
    client, server = socket.socketpair()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    image = np.random.rand(size // 4).astype(np.float32).tobytes()
    received = bytearray(size)  # the front end's own receive buffer (mode copy)
    slot = memory.buf[:size]
    stop = threading.Event()

    def sender() -> None:  # the client: one request after each answer
        while not stop.is_set():
            if not go.acquire(timeout=0.2):
                continue
            client.sendall(image)

    go = threading.Semaphore(0)
    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    figures: dict[str, list] = {"front": [], "model": [], "wall": []}
    pid = process.pid
    try:
        for _ in range(rounds + 1):  # (the first is a warm-up)
            model_before = _process_cpu(pid)

            async def call() -> tuple[float, float]:
                go.release()
                view = memoryview(slot if mode != "copy" else received)
                got = 0
                while got < size:
                    got += server.recv_into(view[got:], size - got, socket.MSG_WAITALL)
                view.release()
                started_cpu, started = time.thread_time(), time.perf_counter()
                if mode == "copy":
                    slot[:] = received
                # the hand-off, there and back
                os.eventfd_write(to_model, 1)
                if mode == "trio":  # the front end's event loop waits: one pass of Trio's
                    await trio.lowlevel.wait_readable(to_front)
                os.eventfd_read(to_front)
                answer_view = np.ndarray((answer // 4,), np.float32, memory.buf, _ANSWER_AT)
                float(answer_view[0])
                del answer_view
                return time.thread_time() - started_cpu, time.perf_counter() - started

            async def calls_in_turn() -> tuple[float, float]:
                cpu = elapsed = 0.0
                for _ in range(calls):
                    spent, took = await call()
                    cpu, elapsed = cpu + spent, elapsed + took
                return cpu, elapsed

            front_cpu, wall = trio.run(calls_in_turn)
            model = _process_cpu(pid) - model_before
            figures["front"].append(front_cpu / calls * 1e6)
            figures["model"].append(model / calls * 1e6)
            figures["wall"].append(wall / calls * 1e6)
        for key in figures:
            del figures[key][0]
        return figures
    finally:
        stop.set()
        thread.join()
        os.eventfd_write(to_model, 1 << 41)
        process.join(10)
        slot.release()
        memory.close()
        memory.unlink()
        client.close()
        server.close()
        os.close(to_model)
        os.close(to_front)


def _process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid``'s one thread (``/proc/PID/schedstat``, nanoseconds)."""
    with open(f"/proc/{pid}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=3 * 224 * 224 * 4)
    parser.add_argument("--answer", type=int, default=4000)
    args = parser.parse_args()
    print(
        f"hand-off of a {args.size:,}-byte request and a {args.answer:,}-byte answer "
        f"between two processes, medians of {args.rounds} rounds of {args.calls} calls"
    )
    print(f"{'mode':<8} {'front CPU us':>12} {'model CPU us':>12} {'wall us':>8}")
    for mode in ("direct", "copy", "trio"):
        figures = _rounds(mode, args.calls, args.rounds, args.size, args.answer)
        front, model, wall = (statistics.median(figures[k]) for k in ("front", "model", "wall"))
        print(f"{mode:<8} {front:>12.1f} {model:>12.1f} {wall:>8.1f}")


if __name__ == "__main__":
    main()
