"""The metrics port: Prometheus' text at ``GET /metrics`` on the HTTP transport
(Triton's metrics endpoint, server src/http_server.cc: HTTPMetricsServer), with the
CPU and GPU samplers that feed it. What is exposed is built in
:mod:`trionserve.observability.metrics`; this module only serves it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from prometheus_client import CollectorRegistry

from trionserve.core.deferred import sweep_deferred
from trionserve.observability.exposition import CONTENT_TYPE, exposition_text
from trionserve.observability.gpu_metrics import GpuMetricsCollector
from trionserve.observability.metrics import (
    CpuMetricsCollector,
    MetricsOptions,
    build_metrics_registry,
)
from trionserve.observability.statistics import ObservedRegistry
from trionserve.protocol.http.transport import (
    Handler,
    Headers,
    HttpServer,
    HttpServerOptions,
    RequestBody,
    Response,
)

_NOT_FOUND = b'{"error":"Not Found: the metrics endpoint is /metrics"}'


def metrics_router(
    metrics: CollectorRegistry, refresh: Callable[[], Awaitable[None]] | None = None
) -> Callable[[bytes, str], Handler]:
    """The HTTP transport's router for the metrics port: the Prometheus text format
    (Triton's, whatever the ``Accept`` header asks; see
    :mod:`trionserve.observability.exposition`) at ``GET /metrics``, a JSON 404
    elsewhere. ``refresh`` runs before each scrape (the workers supervisor fetches
    its workers' metrics there)."""

    async def exposition(headers: Headers, body: RequestBody) -> Response:
        if refresh is not None:
            await refresh()
        sweep_deferred()  # answers written by instances' threads are counted first
        data = exposition_text(metrics)
        return (
            200,
            [
                (b"content-type", CONTENT_TYPE.encode()),
                (b"content-length", b"%d" % len(data)),
            ],
            [data],
        )

    async def not_found(headers: Headers, body: RequestBody) -> Response:
        return (
            404,
            [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(_NOT_FOUND)),
            ],
            [_NOT_FOUND],
        )

    def route(method: bytes, path: str) -> Handler:
        if path == "/metrics" and method in (b"GET", b"HEAD"):
            return exposition
        return not_found

    return route


async def serve_metrics(
    registry: ObservedRegistry,
    options: MetricsOptions,
    address: str,
    port: int,
    shutdown: trio.Event,
    transport: HttpServerOptions | None = None,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` until ``shutdown`` is set, with the limits of
    ``transport`` (the server gives the HTTP port's: see
    ``HttpOptions.transport_options``).

    Children (its own nursery): the HTTP server and, when CPU / GPU
    metrics are on, their samplers; all end when ``shutdown`` is set. Reports the bound
    addresses to ``task_status``.
    """
    cpu = CpuMetricsCollector() if options.allow_cpu_metrics else None
    gpu = GpuMetricsCollector.create() if options.allow_gpu_metrics else None
    server = HttpServer(
        metrics_router(build_metrics_registry(registry, options, cpu, gpu)),
        transport or HttpServerOptions(),
    )
    async with trio.open_nursery() as nursery:
        interval = max(options.interval_ms, 1.0) / 1000.0
        if cpu is not None:
            await nursery.start(cpu.run, interval, shutdown)
        if gpu is not None:
            await nursery.start(gpu.run, interval, shutdown)
        binds = await nursery.start(server.serve, address, port, shutdown, 1.0)
        task_status.started(binds)
