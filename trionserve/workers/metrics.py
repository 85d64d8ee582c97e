"""The supervisor's metrics port under ``--workers``: every ready worker's
exposition fetched concurrently at each scrape and merged
(:mod:`trionserve.observability.aggregate`), plus ``trionserve_workers_ready`` and
``trionserve_worker_restarts``. A worker whose metrics cannot be fetched is left
out of that scrape (logged)."""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trionserve.observability.aggregate import StaticCollector, merge_expositions
from trionserve.protocol.http.transport import HttpServer, HttpServerOptions
from trionserve.protocol.metrics import metrics_router

if TYPE_CHECKING:
    from trionserve.workers.supervisor import WorkerSlot

log = structlog.get_logger(__name__)

SCRAPE_TIMEOUT_SECS = 5.0


class MergedMetrics:
    """The merged metrics of the workers in ``slots`` (the supervisor's, read at
    each scrape)."""

    def __init__(self, slots: Sequence[WorkerSlot]) -> None:
        self._slots = slots
        self._collector = StaticCollector()

    async def serve(
        self,
        bind: tuple[str, int],
        options: HttpServerOptions,
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the merged metrics on ``bind`` until cancelled."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        server = HttpServer(metrics_router(registry, self.refresh), options)
        address, port = bind
        # Never set: the supervisor's nursery cancels this server once the workers exit.
        await server.serve(address, port, trio.Event(), 1.0, task_status=task_status)

    async def refresh(self) -> None:
        """Fetch every ready worker's exposition, concurrently, and merge them."""
        slots = self._slots
        ports = [(s.index, s.metrics_port) for s in slots if s.ready and s.metrics_port]
        texts: dict[int, str] = {}

        async def fetch(index: int, port: int) -> None:
            try:
                texts[index] = await trio.to_thread.run_sync(_get_metrics, port)
            except OSError as exc:
                log.warning("worker metrics unavailable", worker=index, error=str(exc))

        async with trio.open_nursery() as nursery:
            for index, port in ports:
                nursery.start_soon(fetch, index, port)
        families = merge_expositions([texts[i] for i in sorted(texts)])
        ready = GaugeMetricFamily(
            "trionserve_workers_ready", "Worker processes ready to serve (--workers)"
        )
        ready.add_metric([], sum(s.ready for s in slots))
        restarts = CounterMetricFamily(
            "trionserve_worker_restarts",
            "Worker processes started again after exiting unexpectedly",
        )
        restarts.add_metric([], sum(s.restarts for s in slots))
        self._collector.families = [*families, ready, restarts]


def _get_metrics(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_SECS) as response:
        return response.read().decode("utf-8")
