"""trionserve side by side with Triton, KServe and MLServer: one run, one table.

Usage:
    python -m benchmarks.peers [--peers triton,kserve,mlserver] [--duration 5]
        [--rounds 1] [--concurrency 1,4,16] [--workloads ...] [--python-backend]
        [--load-generator loadgen|perf_analyzer] [--reference LABEL]
        [--cache DIR] [--install-timeout 900] [--install-only] [--chart PATH]

Installs each peer into its own virtual environment under ``--cache``/peers
(default ``~/.cache/trionserve-benchmarks``; reused by later runs), starts
trionserve and every peer that installed on free loopback ports, all at once,
and runs the same matrix against each in turn (benchmarks/matrix.py): `simple`
over HTTP binary, HTTP JSON and gRPC at each concurrency, the same model behind
each server's dynamic batcher (`simple batched`; KServe's ModelServer has none),
and the 4 MB identity over HTTP binary and gRPC. The table gives ratios to trionserve. A peer that
cannot be installed or started is reported and skipped.

``--python-backend`` adds trionserve serving the very Python-backend models
Triton serves, one instance each as Triton's (the like-for-like row; trionserve's
default `simple` is ONNX): in stub processes (``trionserve-py``) and in-process
(``trionserve-inproc``, ``EXECUTION_MODE`` ``in_process``), and in-process with
execute on the event loop (``trionserve-loop``, ``INPROCESS_EXECUTE_ON``
``event_loop``).

``--load-generator perf_analyzer`` drives every point with NVIDIA's perf_analyzer
(benchmarks/perf_analyzer.py: PyPI's wheel, downloaded into the cache, through a
private loader where the host's glibc is too old) instead of the client processes
of benchmarks/loadgen.py; where it cannot run, the run says why and goes on with
loadgen. ``--reference triton`` gives the ratios to Triton.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import tempfile
from pathlib import Path

from benchmarks import perf_analyzer
from benchmarks.chart import chart_from_cells
from benchmarks.loadgen import standard_workloads
from benchmarks.matrix import (
    EXAMPLES,
    format_table,
    peak_rss_of,
    run_matrix,
    start_trionserve,
)
from benchmarks.peers.common import BATCHING, PeerUnavailable
from benchmarks.peers.kserve import KServe
from benchmarks.peers.mlserver import MLServer
from benchmarks.peers.triton import Triton, write_repository

PEERS = {peer.name: peer for peer in (Triton, KServe, MLServer)}
DEFAULT_WORKLOADS = (
    "simple http binary,simple http json,simple grpc,simple batched http binary,"
    "simple batched grpc,identity 4MB http,identity 4MB grpc"
)


def trionserve_repository(root: Path, instances: int | None = None) -> Path:
    """The example repository plus ``simple_batched``: `simple` behind the same
    dynamic batcher the peers get; with ``instances``, both with that many
    CPU instances."""
    repository = root / "trionserve"
    shutil.copytree(EXAMPLES, repository)
    batched = repository / "simple_batched"
    shutil.copytree(EXAMPLES / "simple", batched)
    config = (batched / "config.pbtxt").read_text()
    config = config.replace('name: "simple"', 'name: "simple_batched"')
    (batched / "config.pbtxt").write_text(config + BATCHING + "\n")
    if instances is not None:
        group = f"instance_group [ {{ kind: KIND_CPU, count: {instances} }} ]\n"
        for name in ("simple", "simple_batched"):
            path = repository / name / "config.pbtxt"
            path.write_text(path.read_text() + group)
    return repository


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    parser.add_argument("--client-processes", type=int, default=None)
    parser.add_argument(
        "--trionserve-flags",
        default="",
        metavar="FLAGS",
        help='extra trionserve flags, e.g. "--workers 2"',
    )
    parser.add_argument(
        "--python-backend",
        action="store_true",
        help="also run trionserve on the Python-backend models, in stubs and in-process",
    )
    perf_analyzer.add_load_arguments(parser)
    parser.add_argument(
        "--reference", help="label of the server the ratios are to (default: trionserve)"
    )
    parser.add_argument(
        "--install-timeout",
        type=float,
        default=900.0,
        help="seconds allowed for each peer's pip install",
    )
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--install-only", action="store_true")
    parser.add_argument(
        "--instances",
        type=int,
        default=None,
        help="instances of each model (Triton's, trionserve's Python-backend ones and "
        "its ONNX simple); default: one for the Python-backend models, the example's "
        "own for ONNX",
    )
    parser.add_argument(
        "--chart", type=Path, help="also write the run's infer/s as an SVG bar chart to this file"
    )
    parser.add_argument(
        "--trionserve-rows",
        default="trionserve,trionserve-py,trionserve-inproc,trionserve-loop",
        metavar="LABELS",
        help="which of trionserve's servers run (comma-separated labels; the last three "
        "need --python-backend), e.g. trionserve-py for the stub alone against the peers",
    )
    args = parser.parse_args()
    rows = {label.strip() for label in args.trionserve_rows.split(",") if label.strip()}

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if not 0 < args.duration <= 120 or not all(0 < c <= 128 for c in concurrencies):
        raise SystemExit("--duration must be in (0, 120] and each concurrency in 1..128")
    known = standard_workloads()
    try:
        workloads = [known[name.strip()] for name in args.workloads.split(",")]
    except KeyError as exc:
        raise SystemExit(f"unknown workload {exc}; known: {', '.join(known)}") from None
    try:
        peers = [
            PEERS[name.strip()](args.cache / "peers", args.install_timeout)
            for name in args.peers.split(",")
            if name.strip()
        ]
    except KeyError as exc:
        raise SystemExit(f"unknown peer {exc}; known: {', '.join(PEERS)}") from None

    skipped: dict[str, str] = {}
    installed = []
    for peer in peers:
        try:
            peer.install(log=lambda line: print(line, flush=True))
            installed.append(peer)
        except PeerUnavailable as exc:
            skipped[peer.name] = f"not installed: {exc}"
            print(f"[{peer.name}] skipped: {exc}", flush=True)
    for peer in installed:
        if isinstance(peer, Triton) and args.instances is not None:
            peer.instances = args.instances
    load, why = perf_analyzer.load_from_arguments(args, log=lambda line: print(line, flush=True))
    if why:
        skipped["perf_analyzer"] = why
    if args.install_only:
        return

    running = []
    with tempfile.TemporaryDirectory(prefix="trionserve-peers-") as tmp:
        try:
            flags = shlex.split(args.trionserve_flags)
            if "trionserve" in rows:
                server, target = start_trionserve(
                    "trionserve",
                    repository=trionserve_repository(Path(tmp), args.instances),
                    args=flags,
                )
                running.append((server, target))
            if args.python_backend:
                count = args.instances or 1
                # (label, EXECUTION_MODE, INPROCESS_EXECUTE_ON) of each row.
                modes = (
                    ("trionserve-py", "", ""),
                    ("trionserve-inproc", "in_process", ""),
                    ("trionserve-loop", "in_process", "event_loop"),
                )
                for label, mode, execute_on in modes:
                    if label not in rows:
                        continue
                    repository = write_repository(
                        Path(tmp) / label, mode, execute_on, instances=count
                    )
                    server, target = start_trionserve(label, repository=repository, args=flags)
                    running.append((server, target))
            for peer in installed:
                workdir = Path(tmp) / peer.name
                workdir.mkdir()
                try:
                    started = peer.start(workdir, args.ready_timeout)
                except PeerUnavailable as exc:
                    skipped[peer.name] = f"did not start: {exc}"[:300]
                    print(f"[{peer.name}] skipped: {exc}"[:2000], flush=True)
                    continue
                running.append((started.process, started.target))
            targets = [target for _, target in running]
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
            for process, _ in running:
                process.stop()
    print()
    for peer in peers:
        print(f"{peer.name:<10} {peer.description}")
    print()
    labels = [t.label for t in targets]
    if args.reference and args.reference not in labels:
        print(f"--reference {args.reference} did not run; ratios to {labels[0]}")
    reference = args.reference if args.reference in labels else None
    print(format_table(targets, workloads, concurrencies, cells, rss, reference))
    if args.chart:
        args.chart.write_text(chart_from_cells(targets, workloads, concurrencies, cells))
        print(f"chart: {args.chart}")
    for name, why in skipped.items():
        print(f"{name}: {why}")


if __name__ == "__main__":
    main()
