"""Baseline: `simple` over HTTP at concurrency 1 and 8 with tritonclient.http.aio.

Usage: python -m benchmarks.http_baseline [--duration 5]
Starts its own trionserve on free loopback ports and stops it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import tritonclient.http.aio as aiohttpclient

from benchmarks.loadgen import run_load, summary
from tests.serverproc import ServerProcess


def simple_call_factory(url: str):
    clients = []

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
            result = await client.infer("simple", inputs)
            if result.as_numpy("OUTPUT0") is None:
                raise RuntimeError("missing output")

        return call

    return make, clients


async def measure(url: str, duration: float):
    results = []
    for concurrency in (1, 8):
        make, clients = simple_call_factory(url)
        results.append(await run_load("http simple", make, concurrency, duration))
        for client in clients:
            await client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args()
    server = ServerProcess()
    try:
        server.wait_ready()
        results = asyncio.run(measure(server.http_url, args.duration))
        print(summary(results))
        print(f"ratio c8/c1: {results[1].throughput / results[0].throughput:.2f}x")
        server.stop()
    finally:
        server.close()


if __name__ == "__main__":
    main()
