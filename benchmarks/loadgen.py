"""A closed-loop load generator over tritonclient's asyncio clients.

``concurrency`` workers each send one request, wait for its response and send the
next, for ``duration`` seconds (or ``max_requests`` in all). Bounded in time and
count, loopback only. Reports throughput and latency percentiles.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass
class LoadResult:
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
        if not self.latencies_ms:
            return 0.0
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    def line(self) -> str:
        return (
            f"{self.label:<28} c={self.concurrency:<3} {self.throughput:9.1f} infer/s  "
            f"p50 {self.percentile(50):6.2f} ms  p99 {self.percentile(99):6.2f} ms  "
            f"errors {self.errors}"
        )


async def run_load(
    label: str,
    make_call: Callable[[], Callable[[], Awaitable[object]]],
    concurrency: int,
    duration: float,
    warmup: float = 0.5,
    max_requests: int = 1_000_000,
) -> LoadResult:
    """Run ``concurrency`` workers; each gets its own call from ``make_call()``."""
    latencies: list[float] = []
    errors = 0
    count = 0
    measuring = False
    stop_at = time.monotonic() + warmup + duration

    async def worker(call: Callable[[], Awaitable[object]]) -> None:
        nonlocal errors, count
        while time.monotonic() < stop_at and count < max_requests:
            started = time.perf_counter()
            try:
                await call()
            except Exception:
                errors += 1
                continue
            if measuring:
                latencies.append((time.perf_counter() - started) * 1000)
                count += 1

    async def measure() -> float:
        nonlocal measuring
        await asyncio.sleep(warmup)
        measuring = True
        began = time.monotonic()
        while time.monotonic() < stop_at and count < max_requests:
            await asyncio.sleep(0.05)
        return time.monotonic() - began

    calls = [make_call() for _ in range(concurrency)]
    results = await asyncio.gather(measure(), *(worker(c) for c in calls))
    seconds = results[0]
    return LoadResult(label, concurrency, count, errors, seconds, latencies)


def summary(results: list[LoadResult]) -> str:
    lines = [r.line() for r in results]
    return "\n".join(lines)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
