"""One Prometheus exposition from the expositions of several worker processes (--workers).

Each worker serves its own metrics on a private loopback port; the supervisor
(:mod:`trionserve.workers`) fetches all of them when it is scraped, merges them
here and exposes the result with prometheus-client. Parsing is prometheus-client's
text parser; nothing here writes the text format.

How samples of the same name and labels combine:

- summed: everything that counts or measures per process — Triton's request,
  inference and duration counters, pending requests, histogram buckets, sums and
  counts, and the ``process_*`` figures (CPU seconds, resident memory and open
  descriptors of all workers together);
- taken from one worker (the lowest-numbered that answered): machine-wide gauges
  that every worker measures for the same machine or device — ``nv_cpu_*``
  (utilization, memory) and the per-GPU ``nv_gpu_*`` and ``nv_energy_consumption``
  families; summing them would count the machine N times;
- ``process_start_time_seconds``: the earliest; ``process_max_fds``: the largest;
- a summary's quantile samples (``--metrics-config summary_latencies=true``): the
  largest of the workers' (NaN ignored). Quantiles do not add up; the largest
  worker's quantile is an upper bound of the quantile of all requests (if no
  worker has more than a share 1 - q of its requests above it, neither have all
  of them together). The summaries' ``_count`` and ``_sum`` are summed.

Families defined by models (Python-backend custom metrics) are summed like the
rest: each worker runs its own instances of the model.

Counters keep Triton's names: the parser reads a worker's ``nv_x`` counter as
family ``nv_x`` with samples ``nv_x_total``; every counter family but
prometheus-client's own ``process_*`` is made a
:class:`~trionserve.observability.exposition.TritonCounter` again, its samples
named as the family. (A model's counter whose own name ends in ``_total`` is
read back without that suffix: the text format does not say which it was.)

A worker that restarts starts its counters from zero, so the sums drop by what
that worker had counted: to Prometheus' ``rate()`` and ``increase()`` this reads
as a counter reset.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from trionserve.observability.exposition import TritonCounter

__all__ = ["merge_expositions", "MACHINE_WIDE_PREFIXES"]

MACHINE_WIDE_PREFIXES = ("nv_cpu_", "nv_gpu_", "nv_energy_")
_EARLIEST = frozenset({"process_start_time_seconds"})
_LARGEST = frozenset({"process_max_fds"})


def _combine(family: str) -> Callable[[float, float], float]:
    """How two values of one sample of ``family`` combine (first worker's, then next)."""
    if family.startswith(MACHINE_WIDE_PREFIXES):
        return lambda first, _: first
    if family in _EARLIEST:
        return min
    if family in _LARGEST:
        return max
    return lambda a, b: a + b


def _largest(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def merge_expositions(texts: Sequence[str]) -> list[Metric]:
    """The families of ``texts`` (expositions in worker order), merged as the module
    docstring says. Families and samples keep the order of first appearance."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            triton_counter = family.type == "counter" and not family.name.startswith("process_")
            if family.name not in merged:
                merged[family.name] = (
                    TritonCounter(family.name, family.documentation)
                    if triton_counter
                    else Metric(family.name, family.documentation, family.type, family.unit)
                )
                values[family.name] = {}
            samples = values[family.name]
            combine = _combine(family.name)
            for sample in family.samples:
                name = family.name if triton_counter else sample.name
                key = (name, tuple(sorted(sample.labels.items())))
                previous = samples.get(key)
                if previous is None:
                    samples[key] = sample.value
                elif family.type == "summary" and "quantile" in sample.labels:
                    samples[key] = _largest(previous, sample.value)
                else:
                    samples[key] = combine(previous, sample.value)
    for name, family in merged.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(merged.values())


class StaticCollector:
    """A prometheus-client collector that reports the families it was last given."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        return list(self.families)
