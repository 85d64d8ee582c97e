"""Python backend vs ONNX Runtime: HTTP throughput of the same add/sub model.

Usage: python -m benchmarks.python_backend [--duration 3] [--rounds 3]

Starts its own trionserve on free loopback ports over a temporary repository with
the example `simple` (ONNX Runtime) and `add_sub_python` (the same tensors and
arithmetic as a Triton Python model, in stub processes), both with two instances,
and measures each at concurrency 1 and 8 with tritonclient.http.aio. The cases
run interleaved, ``--rounds`` times, and the median of each is reported, so that a
burst of other load on the host does not land on one case only.

Then a CPU-bound Python model (about 20 ms of pure-Python work per request) with
one instance and with two, at concurrency 4: with stub processes the second
instance runs on another core, so the ratio approaches 2 on a host with 2+ cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.http.aio as aiohttpclient

from benchmarks.loadgen import run_load, summary
from tests.serverproc import EXAMPLES, ServerProcess

BUSY_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: {count} }} ]
"""

BUSY_MODEL = '''
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
'''


def make_repository(root: Path) -> Path:
    for name in ("simple", "add_sub_python"):
        shutil.copytree(EXAMPLES / name, root / name)
    for count in (1, 2):
        name = f"busy_python_x{count}"
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(BUSY_CONFIG.format(name=name, count=count))
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
        sorted(results, key=lambda r: r.throughput)[len(results) // 2]
        for results in runs.values()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trionserve-bench-") as tmp:
        server = ServerProcess(make_repository(Path(tmp)))
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


if __name__ == "__main__":
    main()
