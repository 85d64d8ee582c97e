"""What makes the event loop's steps cold: one step like the loop's, timed after gaps of each kind.

Usage:
    python -m benchmarks.investigations.cold_steps [--trials 400] [--gap-ms 5] [--cpu 0]

The loop runs each call's steps once, after waiting for the next call while the model ran
(5 ms for the CNN of ``benchmarks.served_vs_direct``), and each step costs many times its warm
time (issue 39's fifteenth round: ``np.ndarray`` over the message's buffer 10 us median on the
loop, 0.5 us under ``timeit``). This times one such step (an ``ndarray`` over a 602 KB buffer,
an object made, a dict read) right after a gap of ``--gap-ms`` of each kind, the kinds shuffled
in every trial:

- ``warm``: no gap (the ``timeit`` figure);
- ``sleep``: the thread sleeps, as the loop waits in ``epoll_wait``;
- ``spin``: the thread stays busy on its CPU (nothing else runs there unless it is preempted);
- ``other_core``: another thread computes (a matrix product, the GIL released) on another
  CPU, as the model's instance thread does, while this one waits for it;
- ``same_core``: that thread computes on this thread's CPU;
- ``sweep``: this thread touches 32 MB (its caches emptied).

This thread is pinned to ``--cpu``; the other thread to another CPU, or to the same one for
``same_core``. The medians, p90s, and how many trials saw this thread preempted
(its involuntary switches, read before the gap and after the step; ``warm`` is timed as the
second of two steps in a row, no read between). If ``sleep`` costs what
``other_core`` costs, the model's run is not what makes the loop cold: the wait is (its core
idles or runs something else). If ``other_core`` costs what ``warm`` costs, keeping the model
off the loop's core would pay. Run it on a quiet host: under load every gap is a preemption.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

import numpy as np

KINDS = ("warm", "sleep", "spin", "other_core", "same_core", "sweep")


class _Made:
    __slots__ = ("array", "value", "size")

    def __init__(self, array: np.ndarray, value: int, size: int) -> None:
        self.array, self.value, self.size = array, value, size


class _Steps:
    def __init__(self, gap: float, cpu: int, other: int) -> None:
        self.gap, self.cpu, self.other = gap, cpu, other
        self.raw = bytearray(602_112)  # the CNN's input, [1, 3, 224, 224] FP32
        self.table = {f"key{i}": i for i in range(200)}
        self.big = np.zeros(32 << 20, np.uint8)
        self.weights = np.random.default_rng(0).random((400, 400), dtype=np.float32)
        self._go = threading.Event()
        self._done = threading.Event()
        self._worker = threading.Thread(target=self._compute, daemon=True)
        self._worker.start()

    def step(self) -> float:
        """One step like the loop's; its µs."""
        start = time.perf_counter_ns()
        array = np.ndarray((1, 3, 224, 224), np.float32, self.raw)
        _Made(array, self.table["key5"], len(self.raw))
        return (time.perf_counter_ns() - start) / 1000

    def _compute(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            start = time.perf_counter()
            while time.perf_counter() - start < self.gap:
                self.weights @ self.weights
            self._done.set()

    def wait(self, kind: str) -> None:
        if kind == "warm":
            return
        if kind == "sleep":
            time.sleep(self.gap)
        elif kind == "spin":
            start = time.perf_counter()
            while time.perf_counter() - start < self.gap:
                pass
        elif kind == "sweep":
            self.big[::64] += 1
        else:
            cpu = self.other if kind == "other_core" else self.cpu
            os.sched_setaffinity(self._worker.native_id, {cpu})
            self._go.set()
            self._done.wait()
            self._done.clear()


def _involuntary() -> int:
    with open("/proc/thread-self/status") as status:
        for line in status:
            if line.startswith("nonvoluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--cpu", type=int, default=0, help="this thread's CPU")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    others = [cpu for cpu in cpus if cpu != args.cpu]
    if args.cpu not in cpus or not others:
        raise SystemExit("needs two CPUs this process may use, --cpu one of them")
    os.sched_setaffinity(0, {args.cpu})
    steps = _Steps(args.gap_ms / 1000, args.cpu, others[0])
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    preempted: dict[str, int | str] = dict.fromkeys(KINDS, 0)
    preempted["warm"] = "-"
    for _ in range(5):
        steps.step()
    order = list(KINDS)
    for _ in range(args.trials):
        random.shuffle(order)
        for kind in order:
            if kind == "warm":  # (no read of /proc between the last step and this one)
                steps.step()
                times[kind].append(steps.step())
                continue
            before = _involuntary()
            steps.wait(kind)
            times[kind].append(steps.step())
            preempted[kind] = int(preempted[kind]) + (_involuntary() != before)
    print(f"one step after a {args.gap_ms:g} ms gap, {args.trials} trials (us)")
    print(f"{'gap':<11} {'median':>7} {'p90':>7} {'preempted':>10}")
    for kind in KINDS:
        ordered = sorted(times[kind])
        print(
            f"{kind:<11} {statistics.median(ordered):>7.1f} "
            f"{ordered[int(0.9 * len(ordered))]:>7.1f} {preempted[kind]:>10}"
        )


if __name__ == "__main__":
    main()
