"""A Python-backend model under perf_analyzer: CPU per inference by thread (the
server's event loop, each stub's main thread), user and system time and context
switches, for this checkout and other trees side by side.

Usage:
    python -m benchmarks.investigations.stub_threads [--tree before=DIR ...]
        [--mode stub|in_process|event_loop] [--instances 1]
        [--points http:1,http:16,grpc:1,grpc:16] [--seconds 3] [--rounds 2]

Serves Triton's add_sub ``simple`` (the repository benchmarks.peers gives
Triton, ``--instances`` each) from each tree at once, and loads each in turn
with perf_analyzer at each point, the trees' order reversed every other round.
For each run it reads ``/proc/PID/task/TID/schedstat`` (CPU time), ``stat``
(user / system split) and ``status`` (voluntary and involuntary context
switches) of every thread of the server and of its stubs before and after, and
divides by the inferences the server's statistics extension counted meanwhile.
On a loaded machine the rates move a lot from run to run; the CPU per inference
by thread, interleaved, is what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from benchmarks import perf_analyzer
from benchmarks.matrix import ROOT, default_cache, start_trionserve
from benchmarks.peers.triton import write_repository

_TICK = os.sysconf("SC_CLK_TCK")
# EXECUTION_MODE and INPROCESS_EXECUTE_ON of each --mode.
MODES = {
    "stub": ("", ""),
    "in_process": ("in_process", ""),
    "event_loop": ("in_process", "event_loop"),
}


def _threads(pid: int) -> dict[str, tuple[float, float, float, int, int]]:
    """Per thread ``pid/tid/name``: CPU s, user s, system s, voluntary and
    involuntary context switches."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9
            with open(f"{base}/stat", "rb") as f:
                stat = f.read()
            with open(f"{base}/status") as f:
                status = f.read()
        except OSError:
            continue
        name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode()
        fields = stat[stat.rindex(b")") + 2 :].split()
        switches = {
            line.split(":")[0]: int(line.split(":")[1])
            for line in status.splitlines()
            if line.endswith(tuple("0123456789")) and "ctxt_switches" in line
        }
        out[f"{pid}/{tid}/{name}"] = (
            cpu,
            int(fields[11]) / _TICK,
            int(fields[12]) / _TICK,
            switches.get("voluntary_ctxt_switches", 0),
            switches.get("nonvoluntary_ctxt_switches", 0),
        )
    return out


def _children(pid: int) -> list[int]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            found.extend(int(child) for child in f.read().split())
    return found


def _inferences(http_url: str) -> int:
    if "://" not in http_url:
        http_url = f"http://{http_url}"
    with urllib.request.urlopen(f"{http_url}/v2/models/simple/stats", timeout=30) as response:
        return sum(m["inference_count"] for m in json.load(response)["model_stats"])


def _run(command: list[str], server, point: str, seconds: float) -> dict:
    protocol, concurrency = point.split(":")
    url = server.http_url if protocol == "http" else server.grpc_url
    pids = [server.pid, *_children(server.pid)]
    before = {pid: _threads(pid) for pid in pids}
    counted = _inferences(server.http_url)
    done = subprocess.run(
        [*command, "-m", "simple", "-i", protocol, "-u", url.split("://")[-1],
         "--concurrency-range", f"{concurrency}:{concurrency}",
         "--measurement-interval", str(int(seconds * 1000)), "--max-trials", "3",
         "--stability-percentage", "999"],
        capture_output=True, text=True,
    )  # fmt: skip
    counted = _inferences(server.http_url) - counted
    rate = 0.0
    for line in done.stdout.splitlines():
        if "Throughput:" in line:
            rate = float(line.split("Throughput:")[1].split()[0])
    by: dict[str, list[float]] = {}
    for number, pid in enumerate(pids):
        for key, now in _threads(pid).items():
            _, tid, name = key.split("/", 2)
            # Each stub on lines of its own: whether a second instance's stub runs.
            side = "server" if pid == server.pid else f"stub {number}"
            label = f"{side} {'main' if tid == str(pid) else name}"
            then = before[pid].get(key, (0.0, 0.0, 0.0, 0, 0))
            sums = by.setdefault(label, [0.0] * 5)
            for index in range(5):
                sums[index] += now[index] - then[index]
    per = max(counted, 1)
    return {
        "rate": rate,
        "inferences": counted,
        "threads": {
            label: (v[0] / per * 1e6, v[1] / per * 1e6, v[2] / per * 1e6, v[3] / per, v[4] / per)
            for label, v in by.items()
            if v[0] > 0
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--mode", choices=("stub", "in_process", "event_loop"), default="stub")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--points", default="http:1,http:16,grpc:1,grpc:16")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args()
    command = perf_analyzer.resolve(None, args.cache)
    trees = [("this", ROOT)] + [
        (name, Path(path)) for name, path in (t.split("=", 1) for t in args.tree)
    ]
    mode = MODES[args.mode]
    with tempfile.TemporaryDirectory(prefix="stub-threads-") as tmp:
        repository = write_repository(Path(tmp), *mode, instances=args.instances)
        servers = {}
        try:
            for name, tree in trees:
                servers[name] = start_trionserve(name, repository, tree=tree)[0]
            for server in servers.values():
                _run(command, server, "http:1", 1.0)  # warm-up
            for round_ in range(args.rounds):
                for point in args.points.split(","):
                    order = list(servers.items())
                    if round_ % 2:
                        order.reverse()
                    for name, server in order:
                        result = _run(command, server, point, args.seconds)
                        total = sum(v[0] for v in result["threads"].values())
                        print(
                            f"round {round_ + 1} {point:8} {name:8} {result['rate']:9,.1f} infer/s"
                            f"  {total:6.0f} µs/inf  load {os.getloadavg()[0]:.1f}",
                            flush=True,
                        )
                        for label, (cpu, user, system, vol, invol) in sorted(
                            result["threads"].items()
                        ):
                            print(
                                f"    {label:<24} {cpu:6.0f} µs (user {user:.0f}, system "
                                f"{system:.0f}), switches {vol:.2f} + {invol:.2f} forced"
                            )
        finally:
            for server in servers.values():
                server.close()


if __name__ == "__main__":
    main()
