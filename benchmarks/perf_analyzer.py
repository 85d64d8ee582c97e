"""perf_analyzer, NVIDIA's own load generator, against trionserve: conformance and load.

Usage:
    python -m benchmarks.perf_analyzer [--perf-analyzer PATH] [--concurrency 1:4:3]
        [--interval-ms 2000] [--flags "--workers 2"] [--cases http,grpc,...]

Starts trionserve on the example repository (with client shared memory allowed)
and runs perf_analyzer once per case, each a way Triton users drive their
servers: HTTP and gRPC, async, gRPC streaming, a batch of 8, inputs and outputs in
system shared memory, in CUDA shared memory (where a GPU and cupy exist), and a
sequence model. A case passes when perf_analyzer exits 0 and reports its
throughput; the table gives infer/s and p99 latency per concurrency.

perf_analyzer comes from PyPI's ``perf-analyzer`` wheel (or Triton's SDK image).
Its wheels need glibc 2.38 or newer; on an older host point ``--perf-analyzer``
at a binary that runs there. perf_analyzer asks for the model configuration and
statistics extensions, and checks the responses' shapes: a case that fails
prints perf_analyzer's own error. Stability is perf_analyzer's default (average
latency and throughput within 10% over three windows); ``--pa-args "--percentile
99"`` stabilizes on p99 instead, which a machine shared with other work rarely
meets.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.matrix import start_trionserve

# name -> (protocol, model, extra perf_analyzer arguments, needs a GPU)
CASES: dict[str, tuple[str, str, list[str], bool]] = {
    "http": ("http", "simple", [], False),
    "http async": ("http", "simple", ["--async"], False),
    "http batch 8": ("http", "simple", ["-b", "8"], False),
    "http system shm": (
        "http",
        "simple",
        ["--shared-memory", "system", "--output-shared-memory-size", "64"],
        False,
    ),
    "grpc": ("grpc", "simple", [], False),
    "grpc async": ("grpc", "simple", ["--async"], False),
    "grpc streaming": ("grpc", "simple", ["--streaming"], False),
    "grpc system shm": (
        "grpc",
        "simple",
        ["--shared-memory", "system", "--output-shared-memory-size", "64"],
        False,
    ),
    "grpc cuda shm": (
        "grpc",
        "simple",
        ["--shared-memory", "cuda", "--output-shared-memory-size", "64"],
        True,
    ),
    "http cuda shm": (
        "http",
        "simple",
        ["--shared-memory", "cuda", "--output-shared-memory-size", "64"],
        True,
    ),
    "grpc sequence": ("grpc", "accumulate", ["--sequence-length", "4"], False),
    "grpc bytes": (
        "grpc",
        "identity_bytes",
        ["--string-length", "32", "--shape", "INPUT0:8"],
        False,
    ),
}
_POINT = re.compile(r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec, latency (\d+) usec")
_P99 = re.compile(r"p99 latency: (\d+) usec")


@dataclass
class Outcome:
    case: str
    returncode: int | None
    points: list[tuple[int, float, int]]  # concurrency, infer/s, average latency (us)
    p99_us: list[int]
    error: str = ""


def has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def run_case(
    binary: str,
    case: str,
    http_url: str,
    grpc_url: str,
    concurrency: str,
    interval_ms: int,
    timeout: float,
    extra_args: list[str],
    log_dir: Path | None,
) -> Outcome:
    protocol, model, extra, _ = CASES[case]
    command = [
        binary,
        "-m",
        model,
        "-i",
        protocol,
        "-u",
        http_url if protocol == "http" else grpc_url,
        "--concurrency-range",
        concurrency,
        "--measurement-interval",
        str(interval_ms),
        *extra,
        *extra_args,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(case, None, [], [], f"timed out after {timeout:g} s")
    output = done.stdout + done.stderr
    if log_dir is not None:
        (log_dir / (case.replace(" ", "_") + ".log")).write_text(" ".join(command) + "\n" + output)
    points = [(int(c), float(t), int(lat)) for c, t, lat in _POINT.findall(output)]
    p99 = [int(v) for v in _P99.findall(output)]
    error = ""
    if done.returncode != 0 or not points:
        lines = [line for line in output.splitlines() if line.strip()]
        error = " | ".join(lines[-4:])[:400]
    return Outcome(case, done.returncode, points, p99, error)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--perf-analyzer",
        default=shutil.which("perf_analyzer"),
        help="the perf_analyzer binary (default: on PATH)",
    )
    parser.add_argument("--concurrency", default="1:4:3", help="perf_analyzer's range")
    parser.add_argument("--interval-ms", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated")
    parser.add_argument("--flags", default="", help="extra trionserve flags")
    parser.add_argument("--pa-args", default="", help="extra perf_analyzer arguments")
    parser.add_argument("--log-dir", type=Path, help="keep each case's full output here")
    args = parser.parse_args()
    if not args.perf_analyzer:
        raise SystemExit(
            "no perf_analyzer on PATH: pip install perf-analyzer, or pass --perf-analyzer PATH"
        )
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    gpu = has_gpu()
    flags = ["--allow-client-shm=true", *shlex.split(args.flags)]
    server, target = start_trionserve("trionserve", args=flags)
    outcomes = []
    try:
        for case in cases:
            if CASES[case][3] and not gpu:
                outcomes.append(Outcome(case, None, [], [], "skipped: no GPU / cupy here"))
                continue
            outcome = run_case(
                args.perf_analyzer,
                case,
                target.http_url,
                target.grpc_url,
                args.concurrency,
                args.interval_ms,
                args.timeout,
                shlex.split(args.pa_args),
                args.log_dir,
            )
            print(
                f"{case:<18} exit {outcome.returncode} {outcome.points} {outcome.error}", flush=True
            )
            outcomes.append(outcome)
    finally:
        server.stop()
    print()
    print(f"{'case':<18} {'result':<8} {'concurrency: infer/s (p99 ms with --percentile 99)'}")
    failed = 0
    for outcome in outcomes:
        if outcome.error.startswith("skipped"):
            print(f"{outcome.case:<18} {'skipped':<8} {outcome.error[9:]}")
            continue
        ok = outcome.returncode == 0 and outcome.points
        failed += not ok
        figures = ", ".join(
            f"c={c}: {rate:.0f}"
            + (f" ({outcome.p99_us[i] / 1000:.2f})" if i < len(outcome.p99_us) else "")
            for i, (c, rate, _) in enumerate(outcome.points)
        )
        print(f"{outcome.case:<18} {'pass' if ok else 'FAIL':<8} {figures or outcome.error}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
