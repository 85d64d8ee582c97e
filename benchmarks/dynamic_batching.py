"""Dynamic batching on `simple`: throughput with and without it, at concurrency 16.

Usage: python -m benchmarks.dynamic_batching [--duration 5] [--concurrency 16] [--rounds 2]

Builds a temporary model repository holding Triton's `simple` twice — as in the
example repository (each request its own batch) and as `simple_dynamic` with
``dynamic_batching { }`` (Triton's defaults: no added delay, batches of up to
max_batch_size 8 gathered while the instance is busy) — serves it with one
trionserve on free loopback ports, and drives each model in turn with the same
closed-loop tritonclient load (bounded in time, loopback only). Rounds alternate
between the two models; the ratio is of the median throughputs of one run. The
server's statistics give the average batch size it formed, and (on Linux) the
server process's CPU time per request is printed beside each throughput: on a
machine the load generator shares, it is the steadier of the two figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient

from benchmarks.loadgen import median, run_load, summary
from benchmarks.matrix import EXAMPLES
from trionserve.testing import TrionServe

MODELS = ("simple", "simple_dynamic")


def make_repository(root: Path) -> Path:
    repository = root / "models"
    shutil.copytree(EXAMPLES / "simple", repository / "simple")
    shutil.copytree(EXAMPLES / "simple", repository / "simple_dynamic")
    config = (EXAMPLES / "simple" / "config.pbtxt").read_text()
    config = config.replace('name: "simple"', 'name: "simple_dynamic"')
    (repository / "simple_dynamic" / "config.pbtxt").write_text(config + "dynamic_batching { }\n")
    return repository


def call_factory(url: str, model: str):
    clients = []

    def make():
        client = aiohttpclient.InferenceServerClient(url)
        clients.append(client)
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        b = np.ones((1, 16), dtype=np.int32)
        inputs = [
            aiohttpclient.InferInput("INPUT0", [1, 16], "INT32"),
            aiohttpclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        expected = a + b

        async def call():
            result = await client.infer(model, inputs)
            if not np.array_equal(result.as_numpy("OUTPUT0"), expected):
                raise RuntimeError("wrong OUTPUT0")

        return call

    return make, clients


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc); 0 where unavailable."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(url: str, pid: int, concurrency: int, duration: float, rounds: int):
    results = {model: [] for model in MODELS}
    cpu_per_request = {model: [] for model in MODELS}
    for _ in range(rounds):
        for model in MODELS:
            make, clients = call_factory(url, model)
            before = cpu_seconds(pid)
            result = await run_load(model, make, concurrency, duration)
            spent = cpu_seconds(pid) - before
            # Warm-up requests are not counted in result.requests; CPU is measured
            # over the whole round, so this slightly overstates the cost per request.
            cpu_per_request[model].append(spent / max(1, result.requests) * 1e6)
            results[model].append(result)
            for client in clients:
                await client.close()
    return results, cpu_per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trionserve-bench-") as tmp:
        server = TrionServe(make_repository(Path(tmp)))
        try:
            server.wait_ready()
            results, cpu = asyncio.run(
                measure(
                    server.http_url,
                    server.process.pid,
                    args.concurrency,
                    args.duration,
                    args.rounds,
                )
            )
            client = httpclient.InferenceServerClient(server.http_url)
            stats = client.get_inference_statistics("simple_dynamic")["model_stats"][0]
            client.close()
            server.stop()
        finally:
            server.close()
    print(summary([r for model in MODELS for r in results[model]]))
    plain = median([r.throughput for r in results["simple"]])
    batched = median([r.throughput for r in results["simple_dynamic"]])
    errors = sum(r.errors for model in MODELS for r in results[model])
    average = stats["inference_count"] / max(1, stats["execution_count"])
    print(f"average batch size formed by the dynamic batcher: {average:.2f}")
    for model in MODELS:
        print(f"server CPU per request, {model}: {median(cpu[model]):.0f} us")
    print(
        f"dynamic batching / no batching at concurrency {args.concurrency}: "
        f"{batched:.1f} / {plain:.1f} infer/s = {batched / plain:.2f}x "
        f"(errors: {errors})"
    )


if __name__ == "__main__":
    main()
