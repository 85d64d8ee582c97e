"""Prometheus families of the model residency policy (models loaded on demand, budgets).

Triton has no such policy, so these are trionserve's own families, named with its
prefix: loads started by requests, evictions by reason, the bytes charged per model
and per budget, and how long requests waited for a load. Counted by the
:class:`~trionserve.actors.residency.ResidencyManager`, read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from trionserve.repository.repository import ModelId

# Seconds a request waited for its model to load.
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ResidencyMetrics:
    """The counters the residency manager keeps (plain numbers, one owner)."""

    def __init__(self) -> None:
        self.loads: dict[str, int] = {}  # model -> loads a request started
        self.load_failures: dict[str, int] = {}
        self.evictions: dict[tuple[str, str], int] = {}  # (model, "lru" | "idle") -> count
        self._wait_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self._wait_sum = 0.0

    def observe_wait(self, seconds: float) -> None:
        index = next((i for i, b in enumerate(WAIT_BUCKETS) if seconds <= b), len(WAIT_BUCKETS))
        self._wait_counts[index] += 1
        self._wait_sum += seconds

    def wait_buckets(self) -> list[tuple[str, float]]:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*WAIT_BUCKETS, float("inf")), self._wait_counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return buckets


class _Resident(Protocol):
    @property
    def charge(self) -> Mapping[str, int]: ...


class ObservedResidency(Protocol):
    """What the collector reads of a server's residency manager
    (:class:`~trionserve.actors.residency.ResidencyManager`), so that
    observability/ imports nothing from actors/ (as ``ObservedRegistry``)."""

    @property
    def metrics(self) -> ResidencyMetrics: ...

    @property
    def residents(self) -> Mapping[ModelId, _Resident]: ...

    @property
    def budgets(self) -> Mapping[str, int]: ...

    @property
    def retained(self) -> Mapping[str, int]: ...

    def used(self) -> Mapping[str, int]: ...


class ResidencyCollector:
    """A prometheus-client collector over one server's residency manager."""

    def __init__(self, manager: ObservedResidency) -> None:
        self._manager = manager

    def collect(self) -> Iterable[Metric]:
        manager = self._manager
        metrics = manager.metrics
        loads = CounterMetricFamily(
            "trionserve_model_on_demand_loads",
            "Model loads started by an inference request",
            labels=["model"],
        )
        for model, count in sorted(metrics.loads.items()):
            loads.add_metric([model], count)
        yield loads
        failures = CounterMetricFamily(
            "trionserve_model_on_demand_load_failures",
            "Model loads started by an inference request that failed",
            labels=["model"],
        )
        for model, count in sorted(metrics.load_failures.items()):
            failures.add_metric([model], count)
        yield failures
        evictions = CounterMetricFamily(
            "trionserve_model_evictions",
            "Models unloaded by the residency policy, by reason (lru: to make room "
            "under --model-memory-limit; idle: --model-idle-unload-secs)",
            labels=["model", "reason"],
        )
        for (model, reason), count in sorted(metrics.evictions.items()):
            evictions.add_metric([model, reason], count)
        yield evictions
        charged = GaugeMetricFamily(
            "trionserve_model_memory_charged_bytes",
            "Bytes a loaded model is charged, by device (host, gpu:N)",
            labels=["model", "device"],
        )
        for model_id, resident in sorted(manager.residents.items()):
            for device, size in sorted(resident.charge.items()):
                charged.add_metric([model_id.name, device], size)
        yield charged
        budget = GaugeMetricFamily(
            "trionserve_memory_budget_bytes",
            "The memory budget of each device (--model-memory-limit)",
            labels=["device"],
        )
        used = GaugeMetricFamily(
            "trionserve_memory_budget_used_bytes",
            "Bytes charged to the loaded models, by device",
            labels=["device"],
        )
        retained = GaugeMetricFamily(
            "trionserve_memory_retained_bytes",
            "Bytes evicted models were charged and the server did not give back (a "
            "framework's one-time libraries, say): still charged to the budget",
            labels=["device"],
        )
        charges = manager.used()
        for device, size in sorted(manager.budgets.items()):
            budget.add_metric([device], size)
            used.add_metric([device], charges.get(device, 0))
            retained.add_metric([device], manager.retained.get(device, 0))
        yield budget
        yield used
        yield retained
        wait = HistogramMetricFamily(
            "trionserve_model_load_wait_seconds",
            "Seconds an inference request waited for its model to load",
        )
        wait.add_metric([], metrics.wait_buckets(), metrics._wait_sum)
        yield wait
