"""The device model fed large inputs by client threads: two trionserve servers side by side.

Usage:
    python -m benchmarks.investigations.device_threads [--concurrency 32] [--calls 25]
        [--rounds 6] [--elements 150528] --flags "FLAGS"

benchmarks.device_sim's device (a Python model, in process, that sleeps 4 ms + 0.25 ms per item
with the GIL released, max batch 16) with an input of ``--elements`` FP32 (150528: the CNN's
602 KB image) answered with its first 1,000, served twice: ``off`` (this checkout as it is) and
``on`` (with ``--flags``, trionserve flags to compare: the thirteenth round compared
``--http-receive-thread-bytes=65536``, an option since taken out). Each window,
``--concurrency`` tritonclient HTTP threads (each its own connection, opened before the window)
send ``--calls`` calls each; the windows alternate between
the servers, the order swapped every round. Printed per window and as medians: infer/s, the mean
batch (statistics extension), the device's busy share ``infer/s x (base + per_item x b) / b``,
and the server's CPU per inference on its event loop and in all (``/proc``, 10 ms ticks).

It stands in for perf_analyzer, which did not finish a point at c=16 or c=32 with 602 KB inputs
on the two-core development host (issue 39's thirteenth round, benchmarks/README.md). On two
cores the client threads, not the device, are the limit: read it for the CPU per inference, and
run it on a larger host for the throughput.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from benchmarks.device_sim import IN_PROCESS, write_model
from benchmarks.matrix import start_trionserve, thread_cpu_seconds

_MODEL = "device_sim_inproc"
_BASE, _PER_ITEM = 0.004, 0.00025


def _stats(url: str) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://{url}/v2/models/{_MODEL}/stats", timeout=30) as r:
        stats = json.load(r)["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def _window(target, concurrency: int, calls: int, elements: int) -> tuple[float, ...]:
    """(infer/s, batch, busy, loop ms, server ms) of one window against ``target``."""
    data = np.random.rand(1, elements).astype(np.float32)
    ready = threading.Barrier(concurrency + 1)

    def client() -> None:  # (a client of its own thread: geventhttpclient's hub is per thread)
        connection = httpclient.InferenceServerClient(target.http_url, network_timeout=120)
        tensor = httpclient.InferInput("INPUT0", [1, elements], "FP32")
        tensor.set_data_from_numpy(data, binary_data=True)
        connection.infer(_MODEL, [tensor])  # connected before the window
        ready.wait()
        for _ in range(calls):
            connection.infer(_MODEL, [tensor])
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    while ready.n_waiting < concurrency:
        time.sleep(0.01)
    stats, cpu, started = (
        _stats(target.http_url),
        thread_cpu_seconds(target.pid),
        time.perf_counter(),
    )
    ready.wait()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    cpu_after, stats_after = thread_cpu_seconds(target.pid), _stats(target.http_url)
    inferences, executions = stats_after[0] - stats[0], stats_after[1] - stats[1]
    batch = inferences / executions
    rate = inferences / wall
    busy = rate * (_BASE + _PER_ITEM * batch) / batch
    loop = (cpu_after["loop"] - cpu["loop"]) / inferences * 1000
    total = (cpu_after["total"] - cpu["total"]) / inferences * 1000
    return rate, batch, busy, loop, total


def _row(label: str, figures: tuple[float, ...]) -> str:
    rate, batch, busy, loop, total = figures
    return f"{label:<14} {rate:>8.0f} {batch:>6.1f} {100 * busy:>5.0f}% {loop:>8.3f} {total:>9.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--calls", type=int, default=25, help="calls per thread and window")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--elements", type=int, default=150528)
    parser.add_argument("--flags", required=True, help="the flags of the 'on' server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="device-threads-") as scratch:
        repository = Path(scratch)
        write_model(repository, _MODEL, _BASE, _PER_ITEM, IN_PROCESS, args.elements)
        servers = {}
        try:
            for label, flags in (("off", []), ("on", shlex.split(args.flags))):
                servers[label] = start_trionserve(label, repository, flags, ready_timeout=300)
            for _, target in servers.values():
                _window(target, args.concurrency, 2, args.elements)  # warm-up
            results: dict[str, list[tuple[float, ...]]] = {label: [] for label in servers}
            print(f"{'window':<14} {'infer/s':>8} {'batch':>6} {'busy':>6} {'loop ms':>8} "
                  f"{'server ms':>9}")  # fmt: skip
            for index in range(args.rounds):
                for label in ("off", "on") if index % 2 == 0 else ("on", "off"):
                    figures = _window(
                        servers[label][1], args.concurrency, args.calls, args.elements
                    )
                    results[label].append(figures)
                    print(_row(f"{index + 1} {label}", figures), flush=True)
        finally:
            for process, _ in servers.values():
                process.stop()
    for label, rows in results.items():
        print(_row(f"median {label}", tuple(statistics.median(c) for c in zip(*rows))))
    ratios = [on[0] / off[0] for on, off in zip(results["on"], results["off"], strict=True)]
    print(f"on/off infer/s per round: median {statistics.median(ratios):.3f}, "
          f"{min(ratios):.2f}-{max(ratios):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
