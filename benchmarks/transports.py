"""trionserve against itself: HTTP, gRPC, other flags, other source trees.

Usage:
    python -m benchmarks.transports [--duration 5] [--rounds 2] [--concurrency 1,4,16]
        [--workloads "simple http binary,simple grpc"] [--tree before=../old-checkout]
        [--load-generator loadgen|perf_analyzer]

Starts one trionserve per variant on free loopback ports, all at once, and runs
the same matrix against each in turn (see benchmarks/matrix.py), so the ratios
compare like with like on a noisy machine. Default variant: trionserve with its
default flags. ``--tree
LABEL=PATH`` adds trionserve run from another source tree with its default
flags, e.g. a ``git worktree`` of an older commit for before/after figures;
``--variant LABEL=FLAGS`` adds one with other flags. ``--load-generator
perf_analyzer`` loads every point with NVIDIA's perf_analyzer (as in
benchmarks.peers).
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from benchmarks import perf_analyzer
from benchmarks.loadgen import standard_workloads
from benchmarks.matrix import format_table, peak_rss_of, run_matrix, start_trionserve

DEFAULT_WORKLOADS = (
    "simple http binary,simple http json,simple grpc,identity 4MB http,identity 4MB grpc"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per point (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each point")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per point (default 1)")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated (default 1,4,16)")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="comma-separated names")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="load generator processes (default: cores, at most 4)",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also run trionserve from this source tree",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="also run trionserve with these flags",
    )
    parser.add_argument(
        "--no-defaults", action="store_true", help="only the --tree and --variant servers"
    )
    perf_analyzer.add_load_arguments(parser)
    args = parser.parse_args()

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if not 0 < args.duration <= 120 or not all(0 < c <= 128 for c in concurrencies):
        raise SystemExit("--duration must be in (0, 120] and each concurrency in 1..128")
    known = standard_workloads()
    try:
        workloads = [known[name.strip()] for name in args.workloads.split(",")]
    except KeyError as exc:
        raise SystemExit(f"unknown workload {exc}; known: {', '.join(known)}") from None

    variants: list[tuple[str, list[str], Path | None]] = []
    if not args.no_defaults:
        variants += [("default", [], None)]
    for spec in args.variant:
        label, _, flags = spec.partition("=")
        variants.append((label, shlex.split(flags), None))
    for spec in args.tree:
        label, _, path = spec.partition("=")
        variants.append((label, [], Path(path).resolve()))
    if not variants:
        raise SystemExit("nothing to run")

    load, why = perf_analyzer.load_from_arguments(args, log=lambda line: print(line, flush=True))
    servers, targets = [], []
    try:
        for label, flags, tree in variants:
            server, target = start_trionserve(label, args=flags, tree=tree)
            servers.append(server)
            targets.append(target)
        print(
            f"host: {os.cpu_count()} CPUs; {args.duration:g} s x {args.rounds} round(s) "
            f"per point; servers: {', '.join(t.label for t in targets)}",
            flush=True,
        )
        cells = run_matrix(
            targets,
            workloads,
            concurrencies,
            args.duration,
            args.warmup,
            args.rounds,
            args.client_processes,
            log=lambda line: print(line, flush=True),
            load=load,
        )
        rss = peak_rss_of(targets)
    finally:
        for server in servers:
            server.stop()
    print()
    print(format_table(targets, workloads, concurrencies, cells, rss))
    if why:
        print(f"perf_analyzer: {why}")


if __name__ == "__main__":
    main()
