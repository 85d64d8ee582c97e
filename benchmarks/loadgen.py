"""Closed-loop load generators over the official tritonclient.

Two of them:

- :func:`run_load`: asyncio workers in this process (tritonclient's aio clients);
  simple, used by the small benchmarks.
- :class:`ClientPool`: client *processes* (so the load generator does not share
  one GIL with itself), each running closed-loop worker threads with
  tritonclient's sync HTTP or gRPC client. The :class:`Workload` says what each
  request is; every point is bounded in time and in requests.

Closed loop: each worker sends one request, waits for its response, sends the
next. Loopback only.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


@dataclass
class LoadResult:
    label: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float]
    first_error: str = ""
    extra: object = None  # what ClientPool.run's on_window returned
    # (infer/s, p50 ms, p99 ms) as a load generator of its own reported them
    # (perf_analyzer), instead of figures from ``latencies_ms``.
    reported: tuple[float, float, float] | None = None

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


def check_loopback(url: str) -> str:
    host = url.rsplit(":", 1)[0]
    if host not in LOOPBACK:
        raise SystemExit(f"refusing non-loopback URL {url!r}: benchmarks run on loopback only")
    return url


# ----------------------------------------------------------------- asyncio, in-process


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


# ------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """What one request of a load point is.

    ``kind``: "simple" (two INT32 [1,16] inputs, outputs OUTPUT0 and OUTPUT1) or
    "identity" (one FP32 [1, elements] input echoed as OUTPUT0).
    ``protocol``: "http" or "grpc"; ``binary``: HTTP with the binary tensor
    extension (else JSON tensors, with ``Content-Type: application/json``).
    """

    name: str
    protocol: str
    kind: str
    model: str
    binary: bool = True
    elements: int = 16

    @property
    def request_bytes(self) -> int:
        """Tensor bytes in one request (for MB/s)."""
        return 2 * 16 * 4 if self.kind == "simple" else self.elements * 4

    def make_call(self, url: str) -> tuple[Callable[[], None], Callable[[], None]]:
        """What :class:`ClientPool` asks of any workload: a call and a close, per thread
        (benchmarks.served_vs_direct passes workloads of its own)."""
        return make_call(self, url)


def standard_workloads(identity_model: str = "identity_fp32") -> dict[str, Workload]:
    """The matrix's workloads, by name."""
    items = [
        Workload("simple http binary", "http", "simple", "simple"),
        Workload("simple http json", "http", "simple", "simple", binary=False),
        Workload("simple grpc", "grpc", "simple", "simple"),
        # The same model behind the dynamic batcher (each server's own batching).
        Workload("simple batched http binary", "http", "simple", "simple_batched"),
        Workload("simple batched grpc", "grpc", "simple", "simple_batched"),
        Workload("identity 4MB http", "http", "identity", identity_model, elements=1_000_000),
        Workload("identity 4MB grpc", "grpc", "identity", identity_model, elements=1_000_000),
        # simple's tensors from a Python-backend model (a stub process per instance).
        Workload("add_sub_python http binary", "http", "simple", "add_sub_python"),
        Workload("add_sub_python grpc", "grpc", "simple", "add_sub_python"),
    ]
    return {w.name: w for w in items}


def _client_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module
    return module


def make_call(workload: Workload, url: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """A function sending one request of ``workload`` (raising on a bad answer),
    and one closing its client. Each thread makes its own: tritonclient's HTTP
    client may only be used by the thread that created it."""
    import numpy as np

    module = _client_module(workload.protocol)
    if workload.protocol == "http":
        client = module.InferenceServerClient(url, connection_timeout=60, network_timeout=60)
    else:
        client = module.InferenceServerClient(url)
    if workload.kind == "simple":
        data = np.arange(16, dtype=np.int32).reshape(1, 16)
        specs = [("INPUT0", data), ("INPUT1", np.ones_like(data))]
        output_names = ["OUTPUT0", "OUTPUT1"]
        check = "OUTPUT0"
        expected_shape = (1, 16)
    else:
        data = np.random.default_rng(0).random((1, workload.elements), dtype=np.float32)
        specs = [("INPUT0", data)]
        output_names = ["OUTPUT0"]
        check = "OUTPUT0"
        expected_shape = data.shape
    datatype = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}
    inputs = []
    for name, array in specs:
        tensor = module.InferInput(name, list(array.shape), datatype[array.dtype])
        if workload.protocol == "http":
            tensor.set_data_from_numpy(array, binary_data=workload.binary)
        else:
            tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = None
    headers = None
    if workload.protocol == "http" and not workload.binary:
        outputs = [module.InferRequestedOutput(n, binary_data=False) for n in output_names]
        headers = {"Content-Type": "application/json"}
    model = workload.model

    def call() -> None:
        result = client.infer(model, inputs, outputs=outputs, headers=headers)
        out = result.as_numpy(check)
        if out is None or out.shape != expected_shape:
            raise RuntimeError(f"unexpected {check}: {None if out is None else out.shape}")

    return call, client.close


# ------------------------------------------------------------- client processes


@dataclass
class _Job:
    workload: Workload  # or any picklable object with Workload's name and make_call
    url: str
    threads: int
    start_at: float  # time.monotonic(): the same clock in every process on Linux
    stop_at: float
    max_requests: int


@dataclass
class _JobResult:
    requests: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    first_error: str = ""


def _run_job(job: _Job) -> _JobResult:
    result = _JobResult()
    lock = threading.Lock()

    def loop() -> None:
        latencies: list[float] = []
        requests = errors = 0
        first_error = ""
        try:
            call, close = job.workload.make_call(job.url)
        except Exception as exc:
            with lock:
                result.errors += 1
                result.first_error = result.first_error or f"client: {exc!r}"
            return
        try:
            stop_at, start_at = job.stop_at, job.start_at
            limit = job.max_requests
            perf = time.perf_counter
            while requests < limit:
                began_at = time.monotonic()
                if began_at >= stop_at:
                    break
                began = perf()
                try:
                    call()
                except Exception as exc:
                    errors += 1
                    first_error = first_error or repr(exc)[:300]
                    if errors > 1000:
                        break
                    continue
                if began_at >= start_at and time.monotonic() <= stop_at:
                    latencies.append((perf() - began) * 1000)
                    requests += 1
        finally:
            close()
            with lock:
                result.requests += requests
                result.errors += errors
                result.latencies_ms.extend(latencies)
                result.first_error = result.first_error or first_error

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(job.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, job.stop_at - time.monotonic()) + 120)
    return result


def _client_process(connection) -> None:
    # Import the clients before the first job, so that its clock does not pay for it.
    import tritonclient.grpc  # noqa: F401
    import tritonclient.http  # noqa: F401

    connection.send("ready")
    while True:
        job = connection.recv()
        if job is None:
            return
        connection.send(_run_job(job))


class ClientPool:
    """Client processes that run load points together.

    A point of concurrency C spreads C worker threads over the processes (each
    process gets C/P, the first ones one more). Use as a context manager.
    """

    def __init__(self, processes: int | None = None) -> None:
        self.size = processes or max(1, min(4, os.cpu_count() or 1))
        context = multiprocessing.get_context("spawn")
        self._connections = []
        self._processes = []
        for _ in range(self.size):
            parent, child = context.Pipe()
            process = context.Process(target=_client_process, args=(child,), daemon=True)
            process.start()
            self._connections.append(parent)
            self._processes.append(process)
        for connection in self._connections:
            if not connection.poll(120):
                raise RuntimeError("a load generator process did not start")
            connection.recv()

    @property
    def pids(self) -> list[int]:
        """The client processes' ids (e.g. to read their CPU time)."""
        return [process.pid for process in self._processes]

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for connection in self._connections:
            try:
                connection.send(None)
            except (OSError, BrokenPipeError):
                pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self._connections.clear()
        self._processes.clear()

    def run(
        self,
        workload: Workload,
        url: str,
        concurrency: int,
        duration: float,
        warmup: float = 1.0,
        max_requests: int = 1_000_000,
        on_window: Callable[[float, float], object] | None = None,
    ) -> LoadResult:
        """One point: ``concurrency`` closed-loop workers for ``duration`` seconds
        after ``warmup``. ``on_window(start_at, stop_at)`` runs in this process
        while the clients work (e.g. to sample the server's CPU time) and its
        result is stored as ``LoadResult.extra``."""
        check_loopback(url)
        used = min(self.size, concurrency)
        start_at = time.monotonic() + warmup
        stop_at = start_at + duration
        for index in range(used):
            threads = concurrency // used + (1 if index < concurrency % used else 0)
            job = _Job(workload, url, threads, start_at, stop_at, max(1, max_requests // used))
            self._connections[index].send(job)
        extra = on_window(start_at, stop_at) if on_window is not None else None
        merged = _JobResult()
        for connection in self._connections[:used]:
            if not connection.poll(duration + warmup + 300):
                raise RuntimeError("a load generator process did not answer")
            part: _JobResult = connection.recv()
            merged.requests += part.requests
            merged.errors += part.errors
            merged.latencies_ms.extend(part.latencies_ms)
            merged.first_error = merged.first_error or part.first_error
        result = LoadResult(
            workload.name,
            concurrency,
            merged.requests,
            merged.errors,
            duration,
            merged.latencies_ms,
            merged.first_error,
            extra,
        )
        return result
