"""Every pass, task step and wake of the event loop per 602 KB call at c=1.

Usage:
    python -m benchmarks.investigations.loop_steps [--protocol grpc] [--calls 1000]
        [--warmup 300] [--tree PATH]

Serves ``cnn_onnx`` of benchmarks.served_vs_direct (FP32 [1,3,224,224], 602 KB a
call, one instance) from this checkout (or ``--tree``) with a Trio instrument in
its run (``trio.run(..., instruments=...)``, public API only) and sends it
``--calls`` tritonclient calls one at a time after ``--warmup``, over gRPC or HTTP.
The client marks the measured stretch by signalling the server (SIGUSR1) before
and after it; per call it prints:

- the run loop's passes (``before_io_wait``: one epoll wait each, those with a
  zero timeout apart), task steps by task, and wakes (``task_scheduled``) by task;
  for each task, what rescheduled it (the innermost frames' functions: an I/O
  wait's wake comes from the run loop's ``process_events``);
- the passes by the tasks they stepped (``_read`` alone: the call's one wake);
- the event loop thread's CPU (``time.thread_time_ns``: medians, and the sum per
  call) from the epoll wait's return to the first step of the pass (Trio's wake:
  its I/O events, the deadlines, the run queue; by the task stepped first, since a
  timer's wake is a cancellation delivered there), in each task's step, and from
  the pass's last step to the next wait (Trio's way back to ``epoll_wait``); the
  garbage collector's runs on the loop's thread, if any;
- the loop thread's voluntary and involuntary context switches and CPU per call
  (``/proc``): a voluntary switch is a sleep, in the epoll wait or for the GIL.

The instrument's hooks cost a few microseconds each; read the counts, and the
CPU figures as an upper bound of Trio's share.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.served_vs_direct import IMAGE, build_repository
from trionserve.testing import ServerProcess, free_port

# The server: trionserve with an instrument counting the run loop's work; each
# SIGUSR1 takes a snapshot, written as JSON to $LOOP_STEPS_OUT when it exits.
_SERVER = r"""
import atexit, collections, gc, json, os, signal, sys, threading, time
import trio

counts = collections.Counter()
patterns = collections.Counter()
cpu = collections.defaultdict(list)
snapshots = []
thread_ns = time.thread_time_ns

def short(task):
    return task.name.rsplit(".", 1)[-1]

class Steps(trio.abc.Instrument):
    def __init__(self):
        self.stepped = []
        self.woke = 0  # the CPU clock when the epoll wait returned
        self.began = 0  # ... when the step (or the pass's last one) began / ended

    def before_io_wait(self, timeout):
        if self.began:
            cpu["from the last step to the wait"].append(thread_ns() - self.began)
            self.began = 0
        counts["pass"] += 1
        if timeout == 0:
            counts["pass without waiting"] += 1
        patterns[" + ".join(self.stepped) or "(none)"] += 1
        self.stepped = []

    def after_io_wait(self, timeout):
        self.woke = thread_ns()

    def before_task_step(self, task):
        now = thread_ns()
        name = short(task)
        if self.woke:  # (by the task stepped first: a timer's wake is a cancellation)
            cpu[f"from the wait to the first step ({name})"].append(now - self.woke)
            self.woke = 0
        self.began = now
        counts["step " + name] += 1
        self.stepped.append(name)

    def after_task_step(self, task):
        now = thread_ns()
        cpu["step " + short(task)].append(now - self.began)
        self.began = now

    def task_scheduled(self, task):
        counts["wake " + short(task)] += 1
        frame, names = sys._getframe(2), []  # (past the instrument's caller in Trio)
        while frame is not None and len(names) < 3:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        counts["woken by " + " < ".join(names) + " -> " + short(task)] += 1

    def task_spawned(self, task):
        counts["spawned " + short(task)] += 1

collecting = [0]

def collected(phase, info):  # the collector's runs on the loop's thread, and their CPU
    if phase == "start":
        collecting[0] = thread_ns()
    elif collecting[0]:
        counts[f"collection of generation {info['generation']}"] += 1
        cpu["the collector"].append(thread_ns() - collecting[0])
        collecting[0] = 0

def snapshot(signum, frame):
    medians = {k: sorted(v)[len(v) // 2] for k, v in cpu.items() if v}
    sums = {k: sum(v) for k, v in cpu.items()}
    snapshots.append({"counts": dict(counts), "patterns": dict(patterns),
                      "cpu": {k: len(v) for k, v in cpu.items()}, "medians": medians, "sums": sums})
    for v in cpu.values():
        v.clear()

signal.signal(signal.SIGUSR1, snapshot)
def collected_here(phase, info):  # (only the loop's thread: the instances' run their own)
    if threading.current_thread() is threading.main_thread():
        collected(phase, info)
gc.callbacks.append(collected_here)
run = trio.run
def instrumented(*args, **kwargs):
    kwargs["instruments"] = [*kwargs.get("instruments", ()), Steps()]
    return run(*args, **kwargs)
trio.run = instrumented

def write():
    with open(os.environ["LOOP_STEPS_OUT"], "w") as f:
        json.dump(snapshots, f)
atexit.register(write)

from trionserve.cli import main
sys.exit(main())
"""


def thread_figures(pid: int) -> tuple[int, int, int]:
    """The event loop thread's (voluntary switches, involuntary switches, CPU ns)."""
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    voluntary = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)[1])
    involuntary = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M)[1])
    ns = int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])
    return voluntary, involuntary, ns


def client(protocol: str, url: str):
    """A function that sends one 602 KB call."""
    image = np.random.default_rng(1).random((1, *IMAGE), dtype=np.float32)
    if protocol == "grpc":
        import tritonclient.grpc as grpcclient

        grpc = grpcclient.InferenceServerClient(url)
        tensor = grpcclient.InferInput("INPUT0", list(image.shape), "FP32")
        tensor.set_data_from_numpy(image)
        return lambda: grpc.infer("cnn_onnx", [tensor])
    import tritonclient.http as httpclient

    http = httpclient.InferenceServerClient(url)
    tensor = httpclient.InferInput("INPUT0", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image, binary_data=True)
    return lambda: http.infer("cnn_onnx", [tensor])


def report(before: dict, after: dict, loop: list[float], calls: int, protocol: str) -> None:
    def per_call(key: str) -> dict[str, float]:
        return {
            k: (v - before[key].get(k, 0)) / calls
            for k, v in after[key].items()
            if v != before[key].get(k, 0)
        }

    counts = per_call("counts")
    voluntary, involuntary, ns = loop
    print(f"\ncnn_onnx over {protocol}, c=1, {calls} calls; load average {os.getloadavg()[0]:.1f}")
    print(
        f"the loop thread per call: {voluntary:.2f} voluntary and {involuntary:.2f} "
        f"involuntary switches, {ns / 1000:.1f} us of CPU (with the instrument)\n"
    )
    print("| per call | count |")
    print("| --- | ---: |")
    for key in ("pass", "pass without waiting"):
        print(f"| {key} | {counts.pop(key, 0):.3f} |")
    for prefix in ("step ", "wake ", "spawned ", "collection ", "woken by "):
        for key, value in sorted(counts.items(), key=lambda kv: -kv[1]):
            if key.startswith(prefix) and value >= 0.001:
                print(f"| {key} | {value:.3f} |")
    print("\n| the tasks one pass stepped | passes per call |")
    print("| --- | ---: |")
    for key, value in sorted(per_call("patterns").items(), key=lambda kv: -kv[1])[:12]:
        if value >= 0.001:
            print(f"| {key} | {value:.3f} |")
    print("\n| the loop thread's CPU | median us | per call us | times per call |")
    print("| --- | ---: | ---: | ---: |")
    for key, value in sorted(after["medians"].items(), key=lambda kv: -after["cpu"][kv[0]]):
        if after["cpu"][key] >= calls // 100:
            each = after["sums"][key] / calls / 1000
            print(f"| {key} | {value / 1000:.1f} | {each:.1f} | {after['cpu'][key] / calls:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--tree", type=Path, help="another source tree's server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loop-steps-") as scratch:
        root = Path(scratch)
        build_repository(root / "models", ["cnn_onnx"], False, print)
        http_port, grpc_port = free_port(), free_port()
        out = root / "server.json"
        command = [
            sys.executable,
            "-c",
            _SERVER,
            f"--model-repository={root / 'models'}",
            "--http-address=127.0.0.1",
            f"--http-port={http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={grpc_port}",
            "--allow-metrics=false",
        ]
        env = {"LOOP_STEPS_OUT": str(out)}
        if args.tree is not None:
            env["PYTHONPATH"] = str(args.tree)
        server = ServerProcess("loop-steps", command, env, cwd=args.tree or os.getcwd())
        try:
            server.wait_http(f"127.0.0.1:{http_port}", "/v2/health/ready", 120)
            url = f"127.0.0.1:{grpc_port if args.protocol == 'grpc' else http_port}"
            call = client(args.protocol, url)
            for _ in range(args.warmup):
                call()
            server.process.send_signal(signal.SIGUSR1)
            time.sleep(0.2)  # (the snapshot is taken between two of the loop's steps)
            began = thread_figures(server.pid)
            for _ in range(args.calls):
                call()
            ended = thread_figures(server.pid)
            server.process.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
        finally:
            server.stop()
        if not out.exists():
            raise SystemExit("the server wrote no counts:\n" + server.output())
        snapshots = json.loads(out.read_text())
        if len(snapshots) != 2:
            raise SystemExit(f"{len(snapshots)} snapshots, not 2:\n" + server.output())
    loop = [(b - a) / args.calls for a, b in zip(began, ended)]
    report(snapshots[0], snapshots[1], loop, args.calls, args.protocol)


if __name__ == "__main__":
    main()
