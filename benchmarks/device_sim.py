"""A GPU-shaped check on the CPU: how busy each server keeps a device it batches for.

Usage:
    python -m benchmarks.device_sim [--duration 5] [--rounds 1] [--concurrency 32]
        [--protocols http,grpc] [--servers stub,inproc,triton]
        [--base-ms 4] [--per-item-ms 0.25] [--elements 1000] [--server-flags "..."]
        [--perf-analyzer PATH] [--cache DIR]

The model is the benchmark's own (``benchmarks/models/device_sim``): a
Python-backend ``model.py`` whose ``execute`` reads every request's ``INPUT0``,
sleeps ``base + per_item x items`` seconds with the GIL released (a device's
forward: 4 ms + 0.25 ms per item by default, a GPU's order of magnitude) and
answers each request with its input as ``OUTPUT0``; FP32 ``[1000]`` in and out
(4 KB; ``--elements 150528``: a 602 KB input, the CNN's image, answered with its first
1000), ``max_batch_size: 16``, ``dynamic_batching { max_queue_delay_microseconds:
200 }``, one ``KIND_CPU`` instance. The servers, side by side in one run:

- ``stub``: trionserve, the model in a stub process (Triton's way);
- ``inproc``: trionserve, the same model.py with ``EXECUTION_MODE`` ``in_process``
  (on the instance's thread in the server);
- ``triton``: Triton 2.51 (the ``tritonserver`` of PyPI's ``nvidia-pytriton``,
  installed as benchmarks.peers installs it) on the same model.py.

Each point is one perf_analyzer run (``--concurrency-range C``, windows of
``--duration`` seconds until three agree within 25%, at most 6; one that does not
settle reports its last three windows' mean, marked) per server and protocol,
the servers' order rotated each round. Reported: perf_analyzer's infer/s and
p50/p99, the mean batch ``b`` from the statistics extension over the run, the
device's busy fraction ``infer/s x (base + per_item x b) / b`` (the share of the
wall clock it computes), and the server's CPU per inference: all of it and, for
trionserve, by thread (the event loop, the instance's thread, the rest: other
threads and the stub process).

What it shows: with the device's time fixed, the time between batches is the
server's; a server that forms full batches but keeps the device waiting
between them loses throughput the model never spends.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.matrix import (
    ROOT,
    Target,
    cpu_seconds,
    default_cache,
    start_trionserve,
    thread_cpu_seconds,
    tree_pids,
)
from benchmarks.peers.common import PeerUnavailable
from benchmarks.peers.triton import Triton
from benchmarks.perf_analyzer import _WINDOW, Unavailable, resolve

MODEL = ROOT / "benchmarks" / "models" / "device_sim"
_TICKS = os.sysconf("SC_CLK_TCK")


def write_model(
    repository: Path,
    name: str,
    base_s: float,
    per_item_s: float,
    extra: str = "",
    elements: int = 1000,
) -> None:
    """The device model into ``repository`` as ``name``, with its timings and any
    ``extra`` config lines (trionserve's execution mode); ``elements``: FP32 elements
    of INPUT0 (other than 1000: OUTPUT0 is its first 1000, a classifier's answer)."""
    directory = repository / name
    (directory / "1").mkdir(parents=True)
    shutil.copy(MODEL / "1" / "model.py", directory / "1" / "model.py")
    config = (MODEL / "config.pbtxt").read_text().replace('"device_sim"', f'"{name}"')
    parameters = [("BASE_SECONDS", base_s), ("PER_ITEM_SECONDS", per_item_s)]
    if elements != 1000:
        config = config.replace(
            'name: "INPUT0" data_type: TYPE_FP32 dims: [ 1000 ]',
            f'name: "INPUT0" data_type: TYPE_FP32 dims: [ {elements} ]',
        )
        parameters.append(("OUTPUT_ELEMENTS", 1000))
    timings = "".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value!r}" }} }}\n'
        for key, value in parameters
    )
    (directory / "config.pbtxt").write_text(config + timings + extra)


IN_PROCESS = 'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'


class _TritonWithDevice(Triton):
    """Triton serving the peers' repository plus the device model."""

    base_s = 0.004
    per_item_s = 0.00025
    elements = 1000

    def write_models(self, workdir: Path) -> Path:
        repository = super().write_models(workdir)
        write_model(repository, "device_sim", self.base_s, self.per_item_s, elements=self.elements)
        return repository


@dataclass
class Point:
    server: str
    protocol: str
    rate: float = 0.0
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    batch: float = 0.0
    busy: float = 0.0
    cpu_ms: float = 0.0
    loop_ms: float | None = None
    instance_ms: float | None = None
    other_ms: float | None = None
    unstable: bool = False  # perf_analyzer did not settle: its last windows' mean
    error: str = ""


def _stats(http_url: str, model: str) -> tuple[int, int]:
    """(inferences, executions) of ``model``, from the statistics extension."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=30) as r:
        stats = json.load(r)["model_stats"]
    return sum(s["inference_count"] for s in stats), sum(s["execution_count"] for s in stats)


def run_point(
    perf_analyzer: list[str],
    target: Target,
    server: str,
    model: str,
    protocol: str,
    concurrency: int,
    duration: float,
    timings: tuple[float, float],
    split: bool,
) -> Point:
    point = Point(server, protocol)
    url = target.http_url if protocol == "http" else target.grpc_url
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.csv"
        command = [
            *perf_analyzer,
            "-m", model,
            "-i", protocol,
            "-u", url,
            "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-interval", str(int(duration * 1000)),
            "--max-trials", "6",
            "--stability-percentage", "25",
            "-v",  # each window's throughput, for a point that does not settle
            "-f", str(report),
        ]  # fmt: skip
        before = _stats(target.http_url, model)
        cpu_before = cpu_seconds(tree_pids(target.pid))
        split_before = thread_cpu_seconds(target.pid) if split else None
        done = subprocess.run(command, capture_output=True, text=True, timeout=duration * 10 + 120)
        cpu = cpu_seconds(tree_pids(target.pid)) - cpu_before
        split_after = thread_cpu_seconds(target.pid) if split else None
        after = _stats(target.http_url, model)
        rows = list(csv.DictReader(io.StringIO(report.read_text()))) if report.exists() else []
    inferences, executions = after[0] - before[0], after[1] - before[1]
    output = done.stdout + done.stderr
    windows = [float(rate) for rate in _WINDOW.findall(output)]
    if rows and inferences:
        row = rows[-1]
        point.rate = float(row["Inferences/Second"])
        point.p50_ms = float(row["p50 latency"]) / 1000
        point.p99_ms = float(row["p99 latency"]) / 1000
    elif "Failed to obtain stable measurement" in output and len(windows) >= 3 and inferences:
        point.rate = sum(windows[-3:]) / 3  # not settled: its last three windows' mean
        point.unstable = True
    else:
        lines = [line for line in output.splitlines() if line.strip()]
        point.error = "perf_analyzer: " + " | ".join(lines[-3:])[:300]
        return point
    point.batch = inferences / max(1, executions)
    base_s, per_item_s = timings
    point.busy = point.rate * (base_s + per_item_s * point.batch) / point.batch
    point.cpu_ms = cpu / inferences * 1000
    if split_before is not None and split_after is not None:
        loop, instance, total = (
            (split_after[k] - split_before[k]) / inferences * 1000
            for k in ("loop", "instance", "total")
        )
        point.loop_ms, point.instance_ms = loop, instance
        point.other_ms = total - loop - instance
    return point


def format_table(points: list[Point]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def number(value: float) -> str:
        return "-" if value != value else f"{value:.2f}"

    lines = [
        "| server | protocol | infer/s | x triton | p50 ms | p99 ms | batch | device busy "
        "| CPU ms/inf | loop ms/inf | instance ms/inf | other ms/inf |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    reference = {p.protocol: p.rate for p in points if p.server == "triton" and p.rate}
    for p in points:
        if p.error:
            lines.append(f"| {p.server} | {p.protocol} | {p.error} |")
            continue
        ratio = f"{p.rate / reference[p.protocol]:.2f}x" if p.protocol in reference else ""
        if p.unstable:
            ratio += " (unsettled)"
        lines.append(
            f"| {p.server} | {p.protocol} | {p.rate:,.0f} | {ratio} | {number(p.p50_ms)} | "
            f"{number(p.p99_ms)} | {p.batch:.1f} | {p.busy:.0%} | {p.cpu_ms:.3f} | "
            f"{ms(p.loop_ms)} | {ms(p.instance_ms)} | {ms(p.other_ms)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--servers", default="stub,inproc,triton")
    parser.add_argument("--base-ms", type=float, default=4.0)
    parser.add_argument("--per-item-ms", type=float, default=0.25)
    parser.add_argument(
        "--elements",
        type=int,
        default=1000,
        help="FP32 elements of a request's input (150528: the CNN's 602 KB image; the "
        "answer is then its first 1000)",
    )
    parser.add_argument("--server-flags", default="", help="more trionserve flags")
    parser.add_argument("--perf-analyzer", help="the perf_analyzer binary (default: PyPI's)")
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args()
    timings = (args.base_ms / 1000, args.per_item_ms / 1000)
    servers = args.servers.split(",")
    protocols = args.protocols.split(",")
    try:
        perf_analyzer = resolve(args.perf_analyzer, args.cache)
    except Unavailable as exc:
        raise SystemExit(f"perf_analyzer cannot run here: {exc}") from None
    print(f"load generator: {shlex.join(perf_analyzer)}")

    with tempfile.TemporaryDirectory(prefix="device-sim-") as scratch:
        root = Path(scratch)
        running = []
        targets: dict[str, tuple[Target, str]] = {}
        try:
            if {"stub", "inproc"} & set(servers):
                repository = root / "trionserve"
                repository.mkdir()
                write_model(repository, "device_sim", *timings, elements=args.elements)
                write_model(
                    repository,
                    "device_sim_inproc",
                    *timings,
                    extra=IN_PROCESS,
                    elements=args.elements,
                )
                process, target = start_trionserve(
                    "trionserve", repository, shlex.split(args.server_flags), ready_timeout=300
                )
                running.append(process)
                targets["stub"] = (target, "device_sim")
                targets["inproc"] = (target, "device_sim_inproc")
            if "triton" in servers:
                _TritonWithDevice.base_s, _TritonWithDevice.per_item_s = timings
                _TritonWithDevice.elements = args.elements
                triton = _TritonWithDevice(args.cache / "peers", install_timeout=1800)
                try:
                    triton.install()
                    peer = triton.start(root / "triton", ready_timeout=300)
                except PeerUnavailable as exc:
                    print(f"triton: unavailable ({exc})")
                else:
                    running.append(peer.process)
                    targets["triton"] = (peer.target, "device_sim")
            points: list[Point] = []
            order = [s for s in servers if s in targets]
            for round_ in range(args.rounds):
                turn = order[round_ % len(order) :] + order[: round_ % len(order)]
                for protocol in protocols:
                    for server in turn:
                        target, model = targets[server]
                        point = run_point(
                            perf_analyzer, target, server, model, protocol,
                            args.concurrency, args.duration, timings, server != "triton",
                        )  # fmt: skip
                        print(f"round {round_ + 1}: {format_table([point]).splitlines()[-1]}")
                        points.append(point)
        finally:
            for process in running:
                process.stop()
    points.sort(key=lambda p: (p.protocol, order.index(p.server)))
    print(
        f"\ndevice {args.base_ms:g} ms + {args.per_item_ms:g} ms per item, max batch 16, "
        f"c={args.concurrency}, load average {os.getloadavg()[0]:.1f}\n"
    )
    print(format_table(points))


if __name__ == "__main__":
    main()
