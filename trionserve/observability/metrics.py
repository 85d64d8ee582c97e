"""Prometheus metrics with Triton's names, served on the metrics port at ``/metrics``.

The per-model metrics (Triton core's ``MetricModelReporter``,
src/metric_model_reporter.cc; the server-wide ones are its ``Metrics``, src/metrics.cc)
are not counted a second time on the request path: a
:class:`ModelMetricsCollector` reads each loaded version's
:class:`~trionserve.observability.statistics.ModelStatistics` (the same counters the
statistics extension reports) when Prometheus scrapes, so the two never disagree.
What has no counter there is read from its owner at scrape time too (pending
requests from the scheduler) or, for the per-interval metrics Triton has (CPU
utilization and memory), sampled every ``--metrics-interval-ms`` by a task in the
metrics server's nursery. Exposition is prometheus-client's text format, with
Triton's counters typed ``counter`` under Triton's names, without the ``_total``
that prometheus-client would add (see :mod:`trionserve.observability.exposition`).
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import trio
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from trionserve.observability.exposition import TritonCounter
from trionserve.observability.gpu_metrics import GpuMetricsCollector
from trionserve.observability.quantiles import DEFAULT_TARGETS, Target, parse_quantiles
from trionserve.observability.residency_metrics import ResidencyCollector
from trionserve.observability.sampling import sample_every
from trionserve.observability.statistics import (
    FailureReason,
    ModelStatistics,
    ObservedRegistry,
    ObservedVersion,
)

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

log = structlog.get_logger(__name__)

# Triton's default buckets of nv_inference_first_response_histogram_ms.
FIRST_RESPONSE_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)
FIRST_RESPONSE_FAMILY = "nv_inference_first_response_histogram_ms"


@dataclass(frozen=True)
class MetricsOptions:
    """What the metrics endpoint reports, named after tritonserver's flags (whether
    and where it listens are ServerOptions' allow_metrics / metrics_port /
    metrics_address)."""

    allow_cpu_metrics: bool = True
    # Accepted for compatibility: GPU metrics (DCGM) are not collected.
    allow_gpu_metrics: bool = True
    # How often the per-interval metrics (CPU) are sampled.
    interval_ms: float = 2000.0
    # --metrics-config: latency counters on, first-response histogram and latency
    # summaries off (Triton's defaults), the summaries' quantiles Triton's.
    counter_latencies: bool = True
    histogram_latencies: bool = False
    summary_latencies: bool = False
    summary_quantiles: tuple[Target, ...] = DEFAULT_TARGETS


def parse_metrics_config(settings: Sequence[str]) -> dict[str, Any]:
    """``--metrics-config key=value`` settings as MetricsOptions fields.

    Raises ValueError for a malformed setting.
    """
    fields: dict[str, Any] = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(
                f"--metrics-config option format is '<setting>=<value>', got '{setting}'"
            )
        if key in ("counter_latencies", "histogram_latencies", "summary_latencies"):
            lowered = value.lower()
            if lowered not in ("true", "false"):
                raise ValueError(f"--metrics-config {key} must be true or false, got '{value}'")
            fields[key] = lowered == "true"
        elif key == "summary_quantiles":
            fields[key] = parse_quantiles(value)
        else:
            raise ValueError(f"unknown --metrics-config setting '{key}'")
    return fields


# -- first response histogram ------------------------------------------------------


class FirstResponseHistogram:
    """Cumulative buckets of request-to-first-response times, in milliseconds."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, ms: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, ms)] += 1
        self.sum += ms
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, as prometheus-client's histograms take them."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append(("+Inf" if bound == float("inf") else _le(bound), total))
        return out


def _le(bound: float) -> str:
    return str(int(bound)) if bound == int(bound) else repr(bound)


def first_response_buckets(config: ModelConfig) -> tuple[float, ...]:
    """The model's buckets for the histogram: ``model_metrics`` in its config may
    override Triton's defaults."""
    for control in config.model_metrics.metric_control:
        if control.metric_identifier.family == FIRST_RESPONSE_FAMILY:
            buckets = tuple(control.histogram_options.buckets)
            if buckets:
                return buckets
    return FIRST_RESPONSE_BUCKETS_MS


def uncustomizable_families(config: ModelConfig) -> list[str]:
    """The ``model_metrics`` families this server cannot customise: Triton loads the
    model and warns "Metric family '...' in 'metric_identifier' is not a customizable
    metric in Triton core." for each (core src/metric_model_reporter.cc
    MetricReporterConfig::ParseConfig, lines 77-95; only the first-response
    histogram is customisable there)."""
    return [
        control.metric_identifier.family
        for control in config.model_metrics.metric_control
        if control.metric_identifier.family != FIRST_RESPONSE_FAMILY
    ]


def observe_first_response(model: ObservedVersion, seconds: float) -> None:
    """Record one request's time to its first response on its model version."""
    statistics = model.statistics
    histogram = statistics.first_response
    if histogram is None:
        histogram = statistics.first_response = FirstResponseHistogram(
            first_response_buckets(model.config)
        )
    histogram.observe(seconds * 1000.0)


# -- collectors ----------------------------------------------------------------------

_COUNTERS = (
    # (name, help, value of a ModelStatistics)
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        lambda s: s.execution_count,
    ),
)
_LATENCY_COUNTERS = (
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
        lambda s: s.success.ns // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        lambda s: s.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        lambda s: s.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        lambda s: s.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include "
        "cached requests)",
        lambda s: s.compute_output.ns // 1000,
    ),
)

# Reported for models with response_cache enabled.
_CACHE_COUNTERS = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", lambda s: s.cache_hit.count),
    (
        "nv_cache_num_misses_per_model",
        "Number of cache misses per model",
        lambda s: s.cache_miss.count,
    ),
    (
        "nv_cache_hit_duration_per_model",
        "Total cache hit duration per model, in microseconds",
        lambda s: s.cache_hit.ns // 1000,
    ),
    (
        "nv_cache_miss_duration_per_model",
        "Total cache miss (lookup and insert) duration per model, in microseconds",
        lambda s: s.cache_miss.ns // 1000,
    ),
)


# Triton's summary families (core src/metrics.cc), by the statistics' name of the
# duration each summarizes (observability.statistics.SUMMARY_DURATIONS).
_SUMMARIES = (
    (
        "nv_inference_request_summary_us",
        "Summary of inference request duration in microseconds (includes cached requests)",
        "request_duration",
    ),
    (
        "nv_inference_queue_summary_us",
        "Summary of inference queuing duration in microseconds (includes cached requests)",
        "queue_duration",
    ),
    (
        "nv_inference_compute_input_summary_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        "compute_input_duration",
    ),
    (
        "nv_inference_compute_infer_summary_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        "compute_infer_duration",
    ),
    (
        "nv_inference_compute_output_summary_us",
        "Cumulative inference compute output duration in microseconds (does not include "
        "cached requests)",
        "compute_output_duration",
    ),
    (
        "nv_cache_hit_summary_per_model",
        "Summary of cache hit counts/durations per model, in microseconds.",
        "cache_hit_duration",
    ),
    (
        "nv_cache_miss_summary_per_model",
        "Summary of cache miss counts/durations per model, in microseconds.",
        "cache_miss_duration",
    ),
)


def _summary_families(versions: Sequence[ObservedVersion]) -> Iterable[Metric]:
    """Each summary family that some version keeps: per version its quantiles over
    the window (label ``quantile``), ``_count`` and ``_sum``. A family no version
    keeps is left out, as prometheus-cpp leaves out a family without metrics."""
    now = trio.current_time()
    for name, documentation, duration in _SUMMARIES:
        family = None
        for version in versions:
            summaries = version.statistics.summaries
            summary = summaries.get(duration) if summaries is not None else None
            if summary is None:
                continue
            if family is None:
                family = Metric(name, documentation, "summary")
            labels = _labels(version)
            for quantile, value in summary.quantiles(now):
                family.add_sample(name, {**labels, "quantile": str(quantile)}, value)
            family.add_sample(f"{name}_count", labels, summary.count)
            family.add_sample(f"{name}_sum", labels, summary.sum)
        if family is not None:
            yield family


class ModelMetricsCollector:
    """Triton's per-model metrics, read from the loaded versions at scrape time.

    Runs in the scraping task, on the Trio thread, holding every version's
    statistics lock (an instance's thread may count a batch meanwhile, see
    observability/statistics.py), so the values of one scrape are consistent
    with each other.
    """

    def __init__(self, registry: ObservedRegistry, options: MetricsOptions) -> None:
        self._registry = registry
        self._options = options

    def _versions(self) -> list[ObservedVersion]:
        versions = []
        for name in sorted(self._registry.entries()):
            entry = self._registry.entries()[name]
            for number in sorted(entry.versions):
                version = entry.versions[number]
                if version.state.value in ("READY", "UNLOADING"):
                    versions.append(version)
        return versions

    def collect(self) -> Iterable[Metric]:
        versions = self._versions()
        with contextlib.ExitStack() as locks:
            for version in versions:  # (in the one order _versions gives)
                locks.enter_context(version.statistics.lock)
            return list(self._collect(versions))  # (all read before the locks go)

    def _collect(self, versions: list[ObservedVersion]) -> Iterable[Metric]:
        for name, documentation, value in _COUNTERS:
            yield _family(name, documentation, value, versions)
        failure = TritonCounter(
            "nv_inference_request_failure", "Number of failed inference requests, all batch sizes"
        )
        for version in versions:
            labels = _labels(version)
            for reason in FailureReason:
                failure.add_sample(
                    failure.name,
                    {**labels, "reason": reason.value},
                    version.statistics.failures[reason],
                )
        yield failure
        if self._options.counter_latencies:
            for name, documentation, value in _LATENCY_COUNTERS:
                yield _family(name, documentation, value, versions)
        cached = [v for v in versions if v.config.response_cache.enable]
        if cached:
            for name, documentation, value in _CACHE_COUNTERS:
                yield _family(name, documentation, value, cached)
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
        )
        for version in versions:
            pending.add_sample(pending.name, _labels(version), pending_requests(version))
        yield pending
        if self._options.histogram_latencies:
            namespaced = any(version.namespace for version in versions)
            names = ("model", "namespace", "version") if namespaced else ("model", "version")
            histogram = HistogramMetricFamily(
                FIRST_RESPONSE_FAMILY,
                "Duration from request to first response in milliseconds",
                labels=names,
            )
            for version in versions:
                observed = version.statistics.first_response
                if observed is None:
                    observed = FirstResponseHistogram(first_response_buckets(version.config))
                values = _labels(version)  # namespace "" reads in Prometheus as no label
                histogram.add_metric(
                    [values.get(label, "") for label in names],
                    observed.buckets(),
                    observed.sum,
                )
            yield histogram
        if self._options.summary_latencies:
            yield from _summary_families(versions)


def pending_requests(version: ObservedVersion) -> int:
    """Requests queued for a model version and not yet taken by an instance.

    The scheduler owns its queue; schedulers without one (ensembles, which hand
    each step to its composing model at once) have none pending, as in Triton.
    """
    scheduler = getattr(version, "_scheduler", None)
    return getattr(scheduler, "pending", 0) if scheduler is not None else 0


def _labels(version: ObservedVersion) -> dict[str, str]:
    """A model version's labels; with namespacing, its namespace too (core
    ``metric_model_reporter.cc``, ``GetMetricLabels``)."""
    if version.namespace:
        return {
            "model": version.name,
            "namespace": version.namespace,
            "version": str(version.version),
        }
    return {"model": version.name, "version": str(version.version)}


def _family(
    name: str,
    documentation: str,
    value: Callable[[ModelStatistics], int],
    versions: Sequence[ObservedVersion],
) -> Metric:
    metric = TritonCounter(name, documentation)
    for version in versions:
        metric.add_sample(name, _labels(version), value(version.statistics))
    return metric


class CpuMetricsCollector:
    """Triton's CPU metrics, sampled from /proc every metrics interval.

    ``nv_cpu_utilization`` is the share of CPU time not idle across all cores
    between the last two samples; memory is system-wide (MemTotal, and
    MemTotal - MemAvailable as used). Where /proc is missing nothing is reported.
    """

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._last_ticks: tuple[int, int] | None = None
        self.utilization: float | None = None
        self.memory_total: int | None = None
        self.memory_used: int | None = None

    def sample(self) -> None:
        # /proc files live in memory: reading them does not block the loop.
        try:
            busy, total = _cpu_ticks(os.path.join(self._proc, "stat"))
            memory = _meminfo(os.path.join(self._proc, "meminfo"))
        except (OSError, ValueError, KeyError):
            return
        if self._last_ticks is not None:
            last_busy, last_total = self._last_ticks
            elapsed = total - last_total
            self.utilization = (busy - last_busy) / elapsed if elapsed > 0 else 0.0
        self._last_ticks = (busy, total)
        self.memory_total = memory["MemTotal"]
        self.memory_used = memory["MemTotal"] - memory["MemAvailable"]

    async def run(
        self,
        interval: float,
        stop: trio.Event,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Sample now and every ``interval`` seconds until ``stop`` is set.

        The first sample's outcome is logged as Triton logs it (core metrics.cc:770
        InitializeCpuMetrics): "Collecting CPU metrics" when /proc could be read."""
        first = True

        async def sample() -> None:
            nonlocal first
            self.sample()
            if first:
                first = False
                if self.memory_total is not None:
                    log.info("Collecting CPU metrics")
                else:
                    log.warning(
                        "error initializing CPU metrics, CPU utilization may not be available",
                        proc=self._proc,
                    )

        await sample_every(sample, interval, stop, task_status)

    def collect(self) -> Iterable[Metric]:
        if self.utilization is not None:
            yield GaugeMetricFamily(
                "nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", value=self.utilization
            )
        if self.memory_total is not None:
            yield GaugeMetricFamily(
                "nv_cpu_memory_total_bytes",
                "CPU total memory (RAM), in bytes",
                value=self.memory_total,
            )
            yield GaugeMetricFamily(
                "nv_cpu_memory_used_bytes",
                "CPU used memory (RAM), in bytes",
                value=self.memory_used,
            )


def _cpu_ticks(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def _meminfo(path: str) -> dict[str, int]:
    values = {}
    with open(path, "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            parts = rest.split()
            if parts:
                values[key.decode()] = int(parts[0]) * 1024
    return values


# -- the endpoint -------------------------------------------------------------------


def build_metrics_registry(
    registry: ObservedRegistry,
    options: MetricsOptions,
    cpu: CpuMetricsCollector | None = None,
    gpu: GpuMetricsCollector | None = None,
) -> CollectorRegistry:
    """A registry of this server's collectors (not prometheus-client's global one, so
    several servers in one process do not mix)."""
    metrics = CollectorRegistry(auto_describe=False)
    metrics.register(ModelMetricsCollector(registry, options))
    residency = getattr(registry, "residency", None)
    if residency is not None:  # models on demand, memory budgets
        metrics.register(ResidencyCollector(residency))
    # Families that this server's models define (pb_utils.MetricFamily).
    metrics.register(registry.custom_metrics)
    if cpu is not None:
        metrics.register(cpu)
    if gpu is not None:
        metrics.register(gpu)
    ProcessCollector(registry=metrics)
    return metrics
