"""The event loop's CPU share on large requests: this tree against others, one run.

Usage:
    python -m benchmarks.investigations.loop_cpu --tree before=PATH [--duration 4] [--rounds 2]
        [--concurrency 1,16] [--workloads "602KB http,602KB grpc,4MB http,4MB grpc"]

Every server runs from its own source tree (``--tree LABEL=PATH``, e.g. ``git
archive`` of an older commit unpacked outside the repository; this checkout is
``after``) and serves the example repository; the load is benchmarks.loadgen's
client processes sending ``identity_fp32`` requests of 602 KB (150,528 FP32, a
[3,224,224] image) or 4 MB, which the model echoes. The points are interleaved,
the order of the servers rotated each round.

Per point: infer/s, p50/p99, the server's CPU ms per inference (all its threads),
and the event loop thread's (the main thread, which runs Trio; from
``/proc/PID/task/PID/stat``) CPU ms per inference and its share of the wall
clock: the time it held the GIL, at most (it releases it only in system calls),
during which no other thread of the server (a backend's executor) runs Python.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.loadgen import ClientPool, LoadResult, Workload
from benchmarks.matrix import cpu_seconds, start_trionserve, tree_pids

_TICKS = os.sysconf("SC_CLK_TCK")

WORKLOADS = {
    "602KB http": Workload("602KB http", "http", "identity", "identity_fp32", elements=150_528),
    "602KB grpc": Workload("602KB grpc", "grpc", "identity", "identity_fp32", elements=150_528),
    "4MB http": Workload("4MB http", "http", "identity", "identity_fp32", elements=1_000_000),
    "4MB grpc": Workload("4MB grpc", "grpc", "identity", "identity_fp32", elements=1_000_000),
}


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """User + system CPU seconds of one thread."""
    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@dataclass
class Cell:
    requests: int = 0
    seconds: float = 0.0
    errors: int = 0
    cpu: float = 0.0
    loop_cpu: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    first_error: str = ""

    def add(self, result: LoadResult) -> None:
        cpu, loop_cpu = result.extra  # type: ignore[misc]
        self.requests += result.requests
        self.seconds += result.seconds
        self.errors += result.errors
        self.cpu += cpu
        self.loop_cpu += loop_cpu
        self.latencies_ms.extend(result.latencies_ms)
        self.first_error = self.first_error or result.first_error

    def percentile(self, p: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _window(pid: int):
    def sample(start_at: float, stop_at: float) -> tuple[float, float]:
        time.sleep(max(0.0, start_at - time.monotonic()))
        pids = tree_pids(pid)
        total, loop = cpu_seconds(pids), thread_cpu_seconds(pid, pid)
        time.sleep(max(0.0, stop_at - time.monotonic()))
        return cpu_seconds(pids) - total, thread_cpu_seconds(pid, pid) - loop

    return sample


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH")
    parser.add_argument("--client-processes", type=int, default=None)
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workloads = [WORKLOADS[name.strip()] for name in args.workloads.split(",")]
    trees: list[tuple[str, Path | None]] = [("after", None)]
    for spec in args.tree:
        label, _, path = spec.partition("=")
        trees.append((label, Path(path).resolve()))

    servers, targets = [], []
    cells: dict[tuple[str, int, str], Cell] = {}
    try:
        for label, tree in trees:
            server, target = start_trionserve(label, tree=tree)
            servers.append(server)
            targets.append(target)
        with ClientPool(args.client_processes) as pool:
            for workload in workloads:
                for concurrency in concurrencies:
                    for round_index in range(args.rounds):
                        shift = round_index % len(targets)
                        for target in targets[shift:] + targets[:shift]:
                            result = pool.run(
                                workload,
                                target.url(workload),
                                concurrency,
                                args.duration,
                                args.warmup,
                                on_window=_window(target.pid),
                            )
                            key = (workload.name, concurrency, target.label)
                            cells.setdefault(key, Cell()).add(result)
                            cpu, loop_cpu = result.extra  # type: ignore[misc]
                            per = 1000 / result.requests if result.requests else float("nan")
                            print(
                                f"  {workload.name:<11} c={concurrency:<3} {target.label:<8} "
                                f"{result.throughput:8.1f} infer/s  CPU {cpu * per:.3f} "
                                f"loop {loop_cpu * per:.3f} ms/inf  errors {result.errors}",
                                flush=True,
                            )
    finally:
        for server in servers:
            server.stop()
    reference = targets[-1].label if len(targets) > 1 else targets[0].label
    print()
    print(
        "| workload | c | tree | infer/s | x " + reference + " | p50 ms | p99 ms "
        "| CPU ms/inf | loop CPU ms/inf | loop share |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for workload in workloads:
        for concurrency in concurrencies:
            ref = cells[(workload.name, concurrency, reference)]
            ref_rate = ref.requests / ref.seconds if ref.seconds else 0.0
            for target in targets:
                cell = cells[(workload.name, concurrency, target.label)]
                rate = cell.requests / cell.seconds if cell.seconds else 0.0
                per = 1000 / cell.requests if cell.requests else float("nan")
                print(
                    f"| {workload.name} | {concurrency} | {target.label} | {rate:,.0f} "
                    f"| {rate / ref_rate if ref_rate else float('nan'):.2f}x "
                    f"| {cell.percentile(50):.2f} | {cell.percentile(99):.2f} "
                    f"| {cell.cpu * per:.2f} | {cell.loop_cpu * per:.2f} "
                    f"| {cell.loop_cpu / cell.seconds if cell.seconds else 0:.0%} |"
                )
                if cell.errors:
                    print(f"|   errors {cell.errors}: {cell.first_error[:150]} |")


if __name__ == "__main__":
    main()
