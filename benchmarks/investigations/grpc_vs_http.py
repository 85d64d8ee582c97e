"""`simple` infer/s over HTTP and gRPC, side by side, with tritonclient in threads.

Usage: python -m benchmarks.investigations.grpc_vs_http [--duration 5] [--concurrency 1,8]

Each point runs ``concurrency`` threads, each with its own tritonclient client, in a
closed loop (send one request, wait for its answer, repeat) for ``--duration``
seconds after a short warm-up, or until ``--max-requests`` in all. Points run one
after another against one server, so HTTP and gRPC see the same conditions; the
table ends with gRPC/HTTP ratios. Without ``--http-url``/``--grpc-url`` it starts
its own trionserve on free loopback ports; given URLs must be loopback addresses.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


@dataclass
class Point:
    label: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float]

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies_ms)
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _inputs(module):
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        module.InferInput("INPUT0", [1, 16], "INT32"),
        module.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    return inputs


def http_worker(url: str) -> tuple[Callable[[], None], Callable[[], None]]:
    client = httpclient.InferenceServerClient(url)
    inputs = _inputs(httpclient)

    def call() -> None:
        if client.infer("simple", inputs).as_numpy("OUTPUT0") is None:
            raise RuntimeError("missing output")

    return call, client.close


def grpc_worker(url: str) -> tuple[Callable[[], None], Callable[[], None]]:
    client = grpcclient.InferenceServerClient(url)
    inputs = _inputs(grpcclient)

    def call() -> None:
        if client.infer("simple", inputs).as_numpy("OUTPUT0") is None:
            raise RuntimeError("missing output")

    return call, client.close


def grpc_stream_worker(url: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """One ModelStreamInfer stream per thread, one request in flight on it."""
    client = grpcclient.InferenceServerClient(url)
    inputs = _inputs(grpcclient)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))

    def call() -> None:
        client.async_stream_infer("simple", inputs)
        error = answers.get(timeout=30)
        if error is not None:
            raise error

    def close() -> None:
        client.stop_stream()
        client.close()

    return call, close


def run_point(label, make_worker, url, concurrency, duration, warmup, max_requests) -> Point:
    # Each thread makes its own client: tritonclient.http's (geventhttpclient) may
    # only be used by the thread that created it.
    lock = threading.Lock()
    latencies: list[float] = []
    counts = {"requests": 0, "errors": 0}
    ready = threading.Barrier(concurrency + 1)
    window: dict[str, float] = {}

    def loop() -> None:
        call, close = make_worker(url)
        try:
            call()  # connect before the clock starts
            ready.wait()
            start_at, stop_at = window["start"], window["stop"]
            while True:
                now = time.monotonic()
                if now >= stop_at or counts["requests"] >= max_requests:
                    return
                began = time.perf_counter()
                try:
                    call()
                except Exception:
                    with lock:
                        counts["errors"] += 1
                    continue
                if now >= start_at:
                    with lock:
                        latencies.append((time.perf_counter() - began) * 1000)
                        counts["requests"] += 1
        finally:
            close()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    window["start"] = time.monotonic() + warmup
    window["stop"] = window["start"] + duration
    ready.wait(timeout=60)
    for thread in threads:
        thread.join(timeout=warmup + duration + 60)
    seconds = min(time.monotonic(), window["stop"]) - window["start"]
    return Point(label, concurrency, counts["requests"], counts["errors"], seconds, latencies)


def check_loopback(url: str) -> str:
    host = url.rsplit(":", 1)[0]
    if host not in LOOPBACK:
        raise SystemExit(f"refusing non-loopback URL {url!r}: this benchmark runs on loopback only")
    return url


def measure(http_url, grpc_url, concurrencies, duration, warmup, max_requests, stream):
    kinds = [("http", http_worker, http_url), ("grpc", grpc_worker, grpc_url)]
    if stream:
        kinds.append(("grpc stream", grpc_stream_worker, grpc_url))
    points = []
    for concurrency in concurrencies:
        for label, make_worker, url in kinds:
            point = run_point(label, make_worker, url, concurrency, duration, warmup, max_requests)
            print(
                f"{label:<12} c={concurrency:<3} {point.throughput:9.1f} infer/s  "
                f"p50 {point.percentile(50):6.2f} ms  p99 {point.percentile(99):6.2f} ms  "
                f"requests {point.requests}  errors {point.errors}",
                flush=True,
            )
            points.append(point)
    return points


def print_ratios(points: list[Point]) -> None:
    by = {(p.label, p.concurrency): p.throughput for p in points}
    print()
    for concurrency in sorted({p.concurrency for p in points}):
        http = by.get(("http", concurrency)) or float("nan")
        line = f"c={concurrency:<3} grpc/http {by[('grpc', concurrency)] / http:5.2f}x"
        if ("grpc stream", concurrency) in by:
            line += f"   grpc stream/http {by[('grpc stream', concurrency)] / http:5.2f}x"
        print(line)
    for label in ("http", "grpc", "grpc stream"):
        rates = [
            by[(label, c)] for c in sorted({p.concurrency for p in points}) if (label, c) in by
        ]
        if len(rates) > 1 and rates[0]:
            print(
                f"{label:<12} scaling c{max(p.concurrency for p in points)}/c1 "
                f"{rates[-1] / rates[0]:5.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per point (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    parser.add_argument("--max-requests", type=int, default=200_000, help="cap per point")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated (default 1,8)")
    parser.add_argument("--no-stream", action="store_true", help="skip the gRPC stream rows")
    parser.add_argument("--http-url", help="an already running server's HTTP address")
    parser.add_argument("--grpc-url", help="an already running server's gRPC address")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if not 0 < args.duration <= 600 or not all(0 < c <= 256 for c in concurrencies):
        raise SystemExit("--duration must be in (0, 600] and each concurrency in 1..256")
    options = (concurrencies, args.duration, args.warmup, args.max_requests, not args.no_stream)

    if args.http_url and args.grpc_url:
        points = measure(check_loopback(args.http_url), check_loopback(args.grpc_url), *options)
    else:
        from benchmarks.matrix import EXAMPLES
        from trionserve.testing import TrionServe

        server = TrionServe(EXAMPLES)
        try:
            server.wait_ready()
            points = measure(server.http_url, f"127.0.0.1:{server.grpc_port}", *options)
            server.stop()
        finally:
            server.close()
    print_ratios(points)
    if any(p.errors for p in points):
        raise SystemExit("some requests failed")


if __name__ == "__main__":
    main()
