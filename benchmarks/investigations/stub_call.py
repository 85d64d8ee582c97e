"""A Python-backend call without a frontend: the server's side of the stub IPC,
the stub and the core, measured by thread and in instructions.

Usage: python -m benchmarks.investigations.stub_call [--requests 4000] [--rounds 3]
       [--concurrency 16]
       python -m benchmarks.investigations.stub_call --baseline DIR [--rounds 3]
       python -m benchmarks.investigations.stub_call --mode event_loop  (or in_process)

Starts an in-process server (no HTTP or gRPC port is called) over the example
``add_sub_python`` with one instance, and calls ``dataplane.infer`` one request
at a time (c=1), or from ``--concurrency`` tasks at once (requests queue while
the stub is busy). For each round it reports, per request: the CPU of the server's
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

import trio

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


class _Passes(trio.abc.Instrument):
    """Counts the event loop's task steps and waits for I/O while ``on``: how
    often the server parked (a stub's reply that came before the server looked
    for it costs neither), which moves its instructions per call."""

    def __init__(self) -> None:
        self.on = False
        self.steps = 0
        self.waits = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += self.on

    def before_io_wait(self, timeout: float) -> None:
        self.waits += self.on


def _sleeps(pid: int) -> int:
    """Times the process's main thread slept (voluntary context switches): a stub
    that finds its next execute waiting does not."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def _touch(path: str) -> None:
    Path(path).touch()


def _exists(path: str) -> bool:
    return Path(path).exists()


MODES = {
    "stub": "",
    "in_process": 'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n',
    "event_loop": (
        'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'
        'parameters { key: "INPROCESS_EXECUTE_ON" value: { string_value: "event_loop" } }\n'
    ),
}


def _measure(
    requests: int,
    warmup: int,
    mode: str = "stub",
    concurrency: int = 1,
    marks: str | None = None,
    spin_us: int = 0,
) -> dict:
    """Run in the process of the checkout under test (see main)."""
    import numpy as np

    from trionserve.core.inference import InferenceRequest, Tensor
    from trionserve.server import Server, ServerOptions

    root = Path(tempfile.mkdtemp(prefix="stub-call-"))
    model = root / "add_sub_python"
    shutil.copytree(CONFIG, model)
    config = (model / "config.pbtxt").read_text()
    (model / "config.pbtxt").write_text(config.replace("count: 2", "count: 1") + MODES[mode])
    if spin_us:
        # A model that computes: execute holds its thread for spin_us first.
        code = (model / "1" / "model.py").read_text()
        spin = (
            "    def execute(self, requests):\n"
            "        import time\n"
            f"        end = time.perf_counter() + {spin_us / 1e6!r}\n"
            "        while time.perf_counter() < end:\n"
            "            pass\n"
        )
        (model / "1" / "model.py").write_text(
            code.replace("    def execute(self, requests):\n", spin, 1)
        )
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
        passes = _Passes()
        trio.lowlevel.add_instrument(passes)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            inputs = {name: Tensor(name, "INT32", a) for name in ("INPUT0", "INPUT1")}

            async def call_one(n: int) -> None:
                for _ in range(n):
                    await server.dataplane.infer(InferenceRequest("add_sub_python", inputs=inputs))

            async def call(n: int) -> None:
                # ``concurrency`` callers at once, ``n`` calls in all: at c > 1
                # requests queue while the stub is busy.
                async with trio.open_nursery() as callers:
                    for index in range(concurrency):
                        share = n // concurrency + (index < n % concurrency)
                        callers.start_soon(call_one, share)

            await call(warmup)
            if marks is not None:
                # Under valgrind --instr-atstart=no: the caller turns counting
                # on while this waits, so only the measured calls are counted.
                _touch(f"{marks}.warm")
                while not _exists(f"{marks}.go"):
                    await trio.sleep(0.2)
            stubs = _children(os.getpid())
            before = {pid: _ticks(pid) for pid in [os.getpid(), *stubs]}
            slept = sum(_sleeps(pid) for pid in stubs)
            wall = time.perf_counter()
            passes.on = True
            await call(requests)
            passes.on = False
            wall = time.perf_counter() - wall
            after = {pid: _ticks(pid) for pid in [os.getpid(), *stubs]}
            slept = sum(_sleeps(pid) for pid in stubs) - slept
            if marks is not None:
                _touch(f"{marks}.done")
                while not _exists(f"{marks}.stop"):
                    await trio.sleep(0.2)
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
            result["stub_sleeps"] = slept / requests
            result["task_steps"] = passes.steps / requests
            result["io_waits"] = passes.waits / requests
            server.shutdown()

    try:
        trio.run(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _run_in(tree: Path, requests: int, mode: str, concurrency: int, spin_us: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, str(HERE), "--child", "--requests", str(requests), "--mode", mode]
    command += ["--concurrency", str(concurrency), "--spin-us", str(spin_us)]
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
    parser.add_argument(
        "--concurrency", type=int, default=1, help="callers at once (c=16: requests queue)"
    )
    parser.add_argument(
        "--spin-us",
        type=int,
        default=0,
        help="the model's execute first holds the stub's thread this long (a model that computes)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # With --child: PATH.warm is created after the warm-up, the calls start once
    # PATH.go exists, PATH.done is created after them and the server stops once
    # PATH.stop exists (for callgrind_control -i on / off around the calls).
    parser.add_argument("--marks", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = _measure(args.requests, 300, args.mode, args.concurrency, args.marks, args.spin_us)
        print(json.dumps(result))
        return
    trees = [("this checkout", ROOT)]
    if args.baseline is not None:
        trees.append(("baseline", args.baseline.resolve()))
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, tree in trees:
            runs[name].append(
                _run_in(tree, args.requests, args.mode, args.concurrency, args.spin_us)
            )
    print(
        f"add_sub_python ({args.mode}), one instance, dataplane.infer at c={args.concurrency}, "
        f"{args.requests} requests per round"
        + (f", execute spinning {args.spin_us} µs" if args.spin_us else "")
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
        steps = ", ".join(f"{r['task_steps']:.2f} / {r['io_waits']:.2f}" for r in results)
        print(f"  event loop task steps / waits for I/O per call, by round: {steps}")
        sleeps = ", ".join(f"{r['stub_sleeps']:.2f}" for r in results)
        print(f"  stub main thread's sleeps per call, by round: {sleeps}")


if __name__ == "__main__":
    main()
