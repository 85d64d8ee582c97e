"""The HTTP transport's CPU per request body, alone: this tree against others.

Usage:
    python -m benchmarks.investigations.body_receive --tree before=PATH [--size 602112]
        [--duration 4] [--rounds 3] [--concurrency 1,8]

Each tree runs only ``trionserve.protocol.http.transport.HttpServer`` in a process
of its own, with a handler that takes the body, views it as FP32 (as the codec
does) and answers 2 bytes; raw keep-alive socket clients in other processes post
bodies of ``--size`` bytes in a closed loop. What is measured is the server
process's CPU time per request (from /proc): receiving, parsing and handing over
one body, with none of the rest of the server around it. The trees take turns,
the order rotated each round.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.matrix import cpu_seconds

ROOT = Path(__file__).resolve().parents[2]

_SERVER = """
import sys, numpy as np, trio
from trionserve.protocol.http.transport import HttpServer, HttpServerOptions

async def take(headers, body):
    np.frombuffer(body, np.float32)
    return 200, [(b"content-length", b"2")], [b"ok"]

async def main():
    server = HttpServer(lambda method, path: take, HttpServerOptions(max_request_body=1 << 27))
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(server.serve, "127.0.0.1", 0, trio.Event(), 1.0)
        print(bound[0][1], flush=True)

trio.run(main)
"""


def _client(port: int, size: int, go, stop_at, counts) -> None:
    body = b"\x00" * size
    request = (
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size + body
    )
    expected = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    with socket.create_connection(("127.0.0.1", port)) as conn:
        counts.put("ready")
        go.wait()
        done = 0
        while time.monotonic() < stop_at.value:
            conn.sendall(request)
            got = b""
            while len(got) < len(expected):
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("server closed")
                got += chunk
            done += 1
    counts.put(done)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH")
    parser.add_argument("--size", type=int, default=3 * 224 * 224 * 4)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8")
    args = parser.parse_args()
    trees = [("after", ROOT)]
    for spec in args.tree:
        label, _, path = spec.partition("=")
        trees.append((label, Path(path).resolve()))
    servers = {}
    try:
        for label, tree in trees:
            process = subprocess.Popen(
                [sys.executable, "-c", _SERVER],
                stdout=subprocess.PIPE,
                env=dict(os.environ, PYTHONPATH=str(tree)),
                cwd=tree,
            )
            assert process.stdout is not None
            servers[label] = (process, int(process.stdout.readline()))
        context = multiprocessing.get_context("spawn")
        totals: dict[tuple[str, int], list[float]] = {}
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for round_index in range(args.rounds):
                shift = round_index % len(trees)
                for label, _ in trees[shift:] + trees[:shift]:
                    process, port = servers[label]
                    counts = context.Queue()
                    go, stop_at = context.Event(), context.Value("d", 0.0)
                    clients = [
                        context.Process(target=_client, args=(port, args.size, go, stop_at, counts))
                        for _ in range(concurrency)
                    ]
                    for client in clients:
                        client.start()
                    for _ in clients:  # every client connected, whatever its start took
                        assert counts.get(timeout=120) == "ready"
                    cpu_before, began = cpu_seconds([process.pid]), time.monotonic()
                    stop_at.value = began + args.duration
                    go.set()
                    done = sum(counts.get(timeout=120) for _ in clients)
                    seconds = time.monotonic() - began
                    cpu = cpu_seconds([process.pid]) - cpu_before
                    for client in clients:
                        client.join()
                    total = totals.setdefault((label, concurrency), [0.0, 0.0, 0.0])
                    total[0] += done
                    total[1] += cpu
                    total[2] += seconds
                    print(
                        f"  c={concurrency} {label:<8} {done / seconds:8.1f} req/s  "
                        f"{cpu / done * 1e6:7.1f} us CPU/req",
                        flush=True,
                    )
    finally:
        for process, _ in servers.values():
            process.kill()
            process.wait()
    reference = trees[-1][0]
    print(f"\n| c | tree | requests/s | server CPU us/request | x {reference} |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for (label, concurrency), (done, cpu, seconds) in totals.items():
        ref = totals[(reference, concurrency)]
        per, ref_per = cpu / done * 1e6, ref[1] / ref[0] * 1e6
        rate = done / seconds
        print(f"| {concurrency} | {label} | {rate:,.0f} | {per:,.0f} | {per / ref_per:.2f}x |")


if __name__ == "__main__":
    main()
