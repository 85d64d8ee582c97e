"""Python backend vs ONNX Runtime: HTTP throughput of the same add/sub model.

Usage: python -m benchmarks.python_backend [--duration 3] [--rounds 3]
       python -m benchmarks.python_backend --baseline DIR [--chunks 30]

Starts its own trionserve on free loopback ports over a temporary repository with
the example `simple` (ONNX Runtime) and `add_sub_python` (the same tensors and
arithmetic as a Triton Python model, in stub processes), both with two instances,
and measures each at concurrency 1 and 8 with tritonclient.http.aio. The cases
run interleaved, ``--rounds`` times, and the median of each is reported, so that a
burst of other load on the host does not land on one case only.

Then a CPU-bound Python model (about 20 ms of pure-Python work per request) with
one instance and with two, at concurrency 4: with stub processes the second
instance runs on another core, so the ratio approaches 2 on a host with 2+ cores;
on instance threads of the server (``EXECUTION_MODE`` ``in_process``) the two
share one GIL, so it stays near 1.

With ``--baseline DIR`` (another checkout of trionserve, e.g. a ``git worktree`` of
an older commit) it compares instead, side by side in one run: one server from
this checkout and one from DIR, each serving ``add_sub_python`` and ``simple``,
called by a synchronous tritonclient.http client at concurrency 1 in alternating
chunks of 200 requests (so a burst of other load lands on both). It reports the
median and p90 latency, the throughput, and the CPU time per inference of the
server and its stub processes together (from /proc, Linux), and the ratio of
this checkout to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.http.aio as aiohttpclient

from benchmarks.loadgen import run_load, summary
from benchmarks.matrix import EXAMPLES, ROOT
from trionserve.testing import TrionServe, free_port

BUSY_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: {count} }} ]
"""

# The same model on instance threads of the server (EXECUTION_MODE in_process):
# one GIL for every instance and the event loop.
IN_PROCESS = 'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'

BUSY_MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            deadline = time.thread_time() + 0.02  # 20 ms of CPU, holding the GIL
            while time.thread_time() < deadline:
                pass
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]))
        return responses
"""


def make_repository(root: Path) -> Path:
    for name in ("simple", "add_sub_python"):
        shutil.copytree(EXAMPLES / name, root / name)
    for count in (1, 2):
        for name, mode in ((f"busy_python_x{count}", ""), (f"busy_inproc_x{count}", IN_PROCESS)):
            (root / name / "1").mkdir(parents=True)
            config = BUSY_CONFIG.format(name=name, count=count) + mode
            (root / name / "config.pbtxt").write_text(config)
            (root / name / "1" / "model.py").write_text(BUSY_MODEL)
    return root


def add_sub_calls(url: str, model: str, clients: list):
    def make():
        client = aiohttpclient.InferenceServerClient(url)
        clients.append(client)
        data = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [
            aiohttpclient.InferInput("INPUT0", [1, 16], "INT32"),
            aiohttpclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_data_from_numpy(data)
        inputs[1].set_data_from_numpy(data)

        async def call():
            result = await client.infer(model, inputs)
            if result.as_numpy("OUTPUT1") is None:
                raise RuntimeError("missing output")

        return call

    return make


def busy_calls(url: str, model: str, clients: list):
    def make():
        client = aiohttpclient.InferenceServerClient(url)
        clients.append(client)
        infer_input = aiohttpclient.InferInput("INPUT0", [1], "INT32")
        infer_input.set_data_from_numpy(np.array([1], dtype=np.int32))

        async def call():
            await client.infer(model, [infer_input])

        return call

    return make


CASES = [
    ("http simple (onnxruntime)", add_sub_calls, "simple", 1),
    ("http simple (onnxruntime)", add_sub_calls, "simple", 8),
    ("http add_sub_python", add_sub_calls, "add_sub_python", 1),
    ("http add_sub_python", add_sub_calls, "add_sub_python", 8),
    ("busy python, 1 instance", busy_calls, "busy_python_x1", 4),
    ("busy python, 2 instances", busy_calls, "busy_python_x2", 4),
    ("busy python in-process, 1 instance", busy_calls, "busy_inproc_x1", 4),
    ("busy python in-process, 2 instances", busy_calls, "busy_inproc_x2", 4),
]


async def measure(url: str, duration: float, rounds: int):
    """Every case once per round; the round whose throughput is the median, per case."""
    runs: dict[tuple, list] = {}
    for _ in range(rounds):
        for label, factory, model, concurrency in CASES:
            clients: list = []
            result = await run_load(label, factory(url, model, clients), concurrency, duration)
            runs.setdefault((label, concurrency), []).append(result)
            for client in clients:
                await client.close()
    return [
        sorted(results, key=lambda r: r.throughput)[len(results) // 2] for results in runs.values()
    ]


# -- --baseline: this checkout against another, side by side -------------------------


def _process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (the stubs)."""
    pids = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(child) for child in f.read().split()]
    total = 0
    for each in pids:
        try:
            with open(f"/proc/{each}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _start_checkout(root: Path, repository: Path) -> tuple[subprocess.Popen, str]:
    """A trionserve started from the checkout at ``root``; its HTTP address."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "trionserve",
        f"--model-repository={repository}",
        "--http-address=127.0.0.1",
        f"--http-port={port}",
        "--allow-grpc=false",
        "--allow-metrics=false",
    ]
    env = dict(os.environ, PYTHONPATH=str(root))
    process = subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return process, f"127.0.0.1:{port}"


def _ready(client) -> bool:
    from tritonclient.utils import InferenceServerException

    try:
        return client.is_model_ready("add_sub_python")
    except (OSError, InferenceServerException):
        return False  # not listening yet


def compare(baseline: Path, chunks: int) -> None:
    import tritonclient.http as httpclient

    checkouts = {"this checkout": ROOT, "baseline": baseline}
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    for infer_input in inputs:
        infer_input.set_data_from_numpy(data)
    with tempfile.TemporaryDirectory(prefix="trionserve-bench-") as tmp:
        for name in ("simple", "add_sub_python"):
            shutil.copytree(EXAMPLES / name, Path(tmp) / name)
        servers = {label: _start_checkout(root, Path(tmp)) for label, root in checkouts.items()}
        clients = {}
        try:
            for label, (process, url) in servers.items():
                client = httpclient.InferenceServerClient(url)
                clients[label] = client
                deadline = time.monotonic() + 120
                while not _ready(client):
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise RuntimeError(f"the {label} server did not start")
                    time.sleep(0.1)
            rows = []
            for model in ("add_sub_python", "simple"):
                latencies: dict[str, list[float]] = {label: [] for label in servers}
                cpu = dict.fromkeys(servers, 0.0)
                for client in clients.values():
                    for _ in range(200):
                        client.infer(model, inputs)  # warm-up
                for _ in range(chunks):
                    for label, client in clients.items():
                        pid = servers[label][0].pid
                        before = _process_cpu_seconds(pid)
                        for _ in range(200):
                            start = time.perf_counter()
                            client.infer(model, inputs)
                            latencies[label].append(time.perf_counter() - start)
                        cpu[label] += _process_cpu_seconds(pid) - before
                for label, values in latencies.items():
                    values.sort()
                    rows.append(
                        (
                            model,
                            label,
                            values[len(values) // 2] * 1e6,
                            values[9 * len(values) // 10] * 1e6,
                            len(values) / sum(values),
                            cpu[label] / len(values) * 1e6,
                        )
                    )
        finally:
            for client in clients.values():
                client.close()
            for process, _ in servers.values():
                process.send_signal(signal.SIGTERM)
                process.wait(60)
    print(
        f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; sync "
        f"tritonclient.http, c=1, {chunks} alternating chunks of 200 requests per server"
    )
    print("| model | server | p50 µs | p90 µs | infer/s | CPU µs/infer (server + stubs) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model, label, p50, p90, rate, cpu_us in rows:
        print(f"| {model} | {label} | {p50:,.0f} | {p90:,.0f} | {rate:,.0f} | {cpu_us:,.0f} |")
    by = {(model, label): (p50, rate, cpu_us) for model, label, p50, _, rate, cpu_us in rows}
    for model in ("add_sub_python", "simple"):
        new, old = by[(model, "this checkout")], by[(model, "baseline")]
        print(
            f"{model}: this checkout / baseline: infer/s {new[1] / old[1]:.2f}x, "
            f"p50 latency {new[0] / old[0]:.2f}x, CPU per inference {new[2] / old[2]:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--chunks", type=int, default=30, help="with --baseline")
    args = parser.parse_args()
    if args.baseline is not None:
        compare(args.baseline.resolve(), args.chunks)
        return
    with tempfile.TemporaryDirectory(prefix="trionserve-bench-") as tmp:
        server = TrionServe(make_repository(Path(tmp)))
        try:
            server.wait_ready()
            results = asyncio.run(measure(server.http_url, args.duration, args.rounds))
            server.stop()
        finally:
            server.close()
    print(
        f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; median of "
        f"{args.rounds} interleaved runs of {args.duration:g} s per case"
    )
    print(summary(results))
    by = {(r.label, r.concurrency): r.throughput for r in results}
    for concurrency in (1, 8):
        onnx = by[("http simple (onnxruntime)", concurrency)]
        python = by[("http add_sub_python", concurrency)]
        print(f"add_sub_python / simple at c={concurrency}: {python / onnx:.2f}x")
    one = by[("busy python, 1 instance", 4)]
    two = by[("busy python, 2 instances", 4)]
    print(f"busy python, 2 instances / 1 instance: {two / one:.2f}x")
    one = by[("busy python in-process, 1 instance", 4)]
    two = by[("busy python in-process, 2 instances", 4)]
    print(f"busy python in-process, 2 instances / 1 instance: {two / one:.2f}x")


if __name__ == "__main__":
    main()
