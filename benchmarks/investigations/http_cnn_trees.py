"""The 602 KB CNN over HTTP, source trees side by side: the event loop's CPU per
inference, the instance's, infer/s, p50 and the statistics' queue time.

Usage:
    python -m benchmarks.investigations.http_cnn_trees --tree before=PATH [--tree ...]
        [--rounds 6] [--duration 4] [--warmup 1]
        [--points cnn_onnx_d0:1,cnn_onnx:8,cnn_onnx:1] [--this-last]

Serves the repository of benchmarks.served_vs_direct (``cnn_onnx``: FP32
[1,3,224,224] in, 602 KB a request, one instance, dynamic batching with a 500 us
delay; ``cnn_onnx_d0``: the same without a delay) from each tree (``--tree
LABEL=PATH``, e.g. ``git archive`` of a commit unpacked outside the repository;
this checkout is ``this``), every server up at once, and loads one at a time with
served_vs_direct's tritonclient HTTP workload (client processes of
benchmarks.loadgen). Per point (MODEL:CONCURRENCY) and round the trees take turns,
their order rotated each round, so that a machine whose load changes shares it
between them. Per run: infer/s, p50, the loop thread's and the instance threads'
CPU ms per inference (user + system, /proc) and the model's mean queue time (us,
the statistics extension); then each point's figures per tree, in run order. The
servers start in the order given (this checkout first, or last with
``--this-last``): on a loaded two-core host the server started first measured
slower, the same tree against itself included, so run it both ways.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.loadgen import ClientPool
from benchmarks.matrix import start_trionserve, thread_cpu_seconds
from benchmarks.served_vs_direct import ImageWorkload, build_repository, model_stats, stats_delta

THIS = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH (repeatable)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--points", default="cnn_onnx_d0:1,cnn_onnx:8,cnn_onnx:1")
    parser.add_argument(
        "--this-last",
        action="store_true",
        help="start this checkout's server last, not first (on a loaded two-core host the "
        "server started first measured slower: run both ways)",
    )
    args = parser.parse_args()
    others = [(label, Path(path)) for label, _, path in (t.partition("=") for t in args.tree)]
    trees = [*others, ("this", THIS)] if args.this_last else [("this", THIS), *others]
    points = [(model, int(c)) for model, _, c in (p.partition(":") for p in args.points.split(","))]
    results: dict[tuple[str, int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, ClientPool() as pool:
        repository = Path(tmp)
        build_repository(repository, ["cnn_onnx"], False, print, [500, 0], {}, False)
        servers = {}
        try:
            for label, tree in trees:
                servers[label] = start_trionserve(
                    label, repository=repository, tree=tree, python=sys.executable
                )
            for round_index in range(args.rounds):
                shift = round_index % len(trees)
                for model, concurrency in points:
                    for label, _ in trees[shift:] + trees[:shift]:
                        row = _run(servers[label][1], model, concurrency, args, pool)
                        results.setdefault((model, concurrency, label), []).append(row)
                        print(
                            f"round {round_index} {model}:{concurrency} {label:<8} "
                            f"{row['rate']:7.1f}/s p50 {row['p50']:6.2f} ms loop "
                            f"{row['loop']:.3f} ms instance {row['instance']:.3f} ms queue "
                            f"{row['queue']:.0f} us load {os.getloadavg()[0]:.1f}",
                            flush=True,
                        )
        finally:
            for server, _ in servers.values():
                server.stop()
    print()
    for (model, concurrency, label), rows in results.items():
        print(f"{model}:{concurrency} {label}")
        for key, fmt in (("loop", ".3f"), ("instance", ".3f"), ("rate", ".0f"), ("p50", ".2f"),
                         ("queue", ".0f")):  # fmt: skip
            print(f"  {key:<9}" + " ".join(f"{row[key]:{fmt}}" for row in rows))


def _run(target, model: str, concurrency: int, args, pool: ClientPool) -> dict:
    """One run against one server: its figures."""
    workload = ImageWorkload("http", "http", model, "INPUT0", "OUTPUT0")
    before = model_stats(target.http_url, model)

    def window(start_at: float, stop_at: float) -> dict[str, float]:
        time.sleep(max(0.0, start_at - time.monotonic()))
        first = thread_cpu_seconds(target.pid)
        time.sleep(max(0.0, stop_at - time.monotonic()))
        last = thread_cpu_seconds(target.pid)
        return {key: last[key] - first[key] for key in last}

    result = pool.run(
        workload, target.http_url, concurrency, args.duration, args.warmup, on_window=window
    )
    _, phases = stats_delta(before, model_stats(target.http_url, model))
    threads = result.extra
    count = max(1, result.requests)
    return {
        "rate": result.throughput,
        "p50": result.percentile(50),
        "loop": threads["loop"] / count * 1e3,
        "instance": threads["instance"] / count * 1e3,
        "queue": phases.get("queue", float("nan")),
    }


if __name__ == "__main__":
    main()
