"""Profile trionserve's request path under load with py-spy (sampling, no restart).

Usage:
    pip install py-spy
    python -m benchmarks.profile [--workload "simple http binary"] [--concurrency 4]
        [--duration 10] [--flags "--log-verbose=1"] [--top 40] [--svg out.svg]

Starts trionserve on free loopback ports, puts it under closed-loop load from
client processes, samples it with ``py-spy record`` (all threads, idle samples
dropped) and prints the functions with the most samples: by their own time
(self) and with their callees (inclusive), as shares of the busy samples.
"""

from __future__ import annotations

import argparse
import collections
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from benchmarks.loadgen import ClientPool, standard_workloads
from benchmarks.matrix import start_trionserve


def read_collapsed(path: Path) -> tuple[collections.Counter, collections.Counter, int]:
    """Self and inclusive sample counts per frame from py-spy's raw (collapsed) output."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";")[1:]]  # drop the thread frame
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return own, inclusive, total


def _short(frame: str) -> str:
    # "function (path/to/module.py:123)" -> "function (module.py)"
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(where).parts
    module = "/".join(parts[-2:]) if len(parts) > 1 else where
    return f"{name} ({module})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="simple http binary")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--flags", default="", help="extra trionserve flags")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--rate", type=int, default=500, help="samples per second")
    parser.add_argument(
        "--all-threads",
        action="store_true",
        help="sample every running thread, not only the one holding the GIL",
    )
    parser.add_argument(
        "--subprocesses",
        action="store_true",
        help="sample the server's child processes too (Python-backend stubs)",
    )
    parser.add_argument("--svg", help="also write a flame graph here")
    args = parser.parse_args()
    if not 0 < args.duration <= 120:
        raise SystemExit("--duration must be in (0, 120]")
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy")
    workload = standard_workloads()[args.workload]

    server, target = start_trionserve("profiled", args=shlex.split(args.flags))
    try:
        with ClientPool() as pool, tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "profile.txt"
            record = [
                py_spy,
                "record",
                "--pid",
                str(server.pid),
                "--rate",
                str(args.rate),
                "--duration",
                str(int(args.duration)),
                "--format",
                "raw",
                "--output",
                str(raw),
                "--threads",
                "--nonblocking",
                *([] if args.all_threads else ["--gil"]),
                *(["--subprocesses"] if args.subprocesses else []),
            ]
            recorder = threading.Thread(
                target=subprocess.run,
                args=(record,),
                kwargs={"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL},
            )
            recorder.start()
            result = pool.run(
                workload, target.url(workload), args.concurrency, args.duration, warmup=1.0
            )
            recorder.join()
            if args.svg:
                subprocess.run(
                    [
                        py_spy,
                        "record",
                        "--pid",
                        str(server.pid),
                        "--duration",
                        "5",
                        "--output",
                        args.svg,
                        "--nonblocking",
                    ],
                    check=False,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            own, inclusive, total = read_collapsed(raw)
    finally:
        server.stop()
    print(
        f"{result.label} c={args.concurrency}: {result.throughput:.1f} infer/s, "
        f"{total} busy samples"
    )
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"\ntop {args.top} by {title} time")
        for frame, n in counter.most_common(args.top):
            print(f"{100 * n / max(total, 1):6.1f}%  {frame}")


if __name__ == "__main__":
    main()
