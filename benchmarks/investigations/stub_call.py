"""A Python-backend call without a frontend: the server's side of the stub IPC,
the stub and the core, measured by thread and in instructions.

Usage: python -m benchmarks.investigations.stub_call [--requests 4000] [--rounds 3]
       python -m benchmarks.investigations.stub_call --baseline DIR [--rounds 3]
       python -m benchmarks.investigations.stub_call --mode event_loop  (or in_process)

Starts an in-process server (no HTTP or gRPC port is called) over the example
``add_sub_python`` with one instance, and calls ``dataplane.infer`` one request
at a time (c=1). For each round it reports, per request: the CPU of the server's
event-loop thread and of the stub process (from ``/proc/.../schedstat``, by thread),
the server's main thread being its event loop, the stub's main thread the one
that runs ``execute``.

With ``--baseline DIR`` (another checkout, e.g. a ``git worktree`` of main) the
same measurement runs in turn on this checkout and on DIR, interleaved
``--rounds`` times, each in a fresh process importing its own ``trionserve``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
CONFIG = ROOT / "examples" / "model_repository" / "add_sub_python"


def _ticks(pid: int) -> dict[str, float]:
    """CPU seconds by thread of a process (``schedstat``: time on a CPU, in ns)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[f"thread:{tid}"] = int(f.read().split()[0]) / 1e9
        except FileNotFoundError:
            continue
    return out


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            children.extend(int(child) for child in f.read().split())
    return children


MODES = {
    "stub": "",
    "in_process": 'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n',
    "event_loop": (
        'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'
        'parameters { key: "INPROCESS_EXECUTE_ON" value: { string_value: "event_loop" } }\n'
    ),
}


def _measure(requests: int, warmup: int, mode: str = "stub") -> dict:
    """Run in the process of the checkout under test (see main)."""
    import numpy as np
    import trio

    from trionserve.core.inference import InferenceRequest, Tensor
    from trionserve.server import Server, ServerOptions

    root = Path(tempfile.mkdtemp(prefix="stub-call-"))
    model = root / "add_sub_python"
    shutil.copytree(CONFIG, model)
    config = (model / "config.pbtxt").read_text()
    (model / "config.pbtxt").write_text(config.replace("count: 2", "count: 1") + MODES[mode])
    result: dict = {}

    async def run() -> None:
        options = ServerOptions(
            model_repositories=[root],
            http_address="127.0.0.1",
            http_port=0,
            allow_grpc=False,
            allow_metrics=False,
        )
        server = Server(options)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            inputs = {name: Tensor(name, "INT32", a) for name in ("INPUT0", "INPUT1")}

            async def call(n: int) -> None:
                for _ in range(n):
                    await server.dataplane.infer(InferenceRequest("add_sub_python", inputs=inputs))

            await call(warmup)
            stubs = _children(os.getpid())
            before = {pid: _ticks(pid) for pid in [os.getpid(), *stubs]}
            wall = time.perf_counter()
            await call(requests)
            wall = time.perf_counter() - wall
            after = {pid: _ticks(pid) for pid in [os.getpid(), *stubs]}
            by_thread: dict[str, float] = {}
            for pid, ticks in after.items():
                side = "server" if pid == os.getpid() else "stub"
                for thread, seconds in ticks.items():
                    main_thread = thread.split(":")[1] == str(pid)
                    name = f"{side}:{'main' if main_thread else 'other threads'}"
                    spent = seconds - before[pid].get(thread, 0.0)
                    by_thread[name] = by_thread.get(name, 0.0) + spent
            result["cpu_us"] = {
                k: v / requests * 1e6 for k, v in sorted(by_thread.items()) if v > 0
            }
            result["infer_per_s"] = requests / wall
            server.shutdown()

    try:
        trio.run(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _run_in(tree: Path, requests: int, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, str(HERE), "--child", "--requests", str(requests), "--mode", mode]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument(
        "--mode",
        choices=sorted(MODES),
        default="stub",
        help="where model.py runs: a stub process, an instance thread, the event loop",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.requests, 300, args.mode)))
        return
    trees = [("this checkout", ROOT)]
    if args.baseline is not None:
        trees.append(("baseline", args.baseline.resolve()))
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, tree in trees:
            runs[name].append(_run_in(tree, args.requests, args.mode))
    print(
        f"add_sub_python ({args.mode}), one instance, dataplane.infer at c=1, "
        f"{args.requests} requests per round"
    )
    print("medians over the rounds, per request")
    for name, results in runs.items():
        rates = ", ".join(f"{r['infer_per_s']:,.0f}" for r in results)
        print(f"\n{name}: {statistics.median(r['infer_per_s'] for r in results):,.0f} infer/s")
        print(f"  infer/s by round: {rates}")
        totals = ", ".join(f"{sum(r['cpu_us'].values()):.0f}" for r in results)
        print(f"  CPU µs per request by round: {totals}")
        keys = sorted({k for r in results for k in r["cpu_us"]})
        for key in keys:
            values = [r["cpu_us"].get(key, 0.0) for r in results]
            print(f"  CPU {key:<28} {statistics.median(values):7.1f} µs")
        total = [sum(r["cpu_us"].values()) for r in results]
        print(f"  CPU {'total':<28} {statistics.median(total):7.1f} µs")


if __name__ == "__main__":
    main()
