"""Custom metrics that models define (the Python backend's ``pb_utils.MetricFamily``).

A model creates a *family* (name, description, kind: counter, gauge or histogram)
and, in it, *metrics* keyed by their labels; both are exposed on the metrics
endpoint beside Triton's own ``nv_*`` metrics. The rules are Triton's:

- A family name already in use returns that family when the kind matches (the
  first description stays) and is an error when it does not.
- The same labels in one family are the same metric; a histogram metric needs
  strictly ascending bucket bounds (an empty list is allowed).
- Counters only go up (no ``set``, no negative ``increment``); gauges take
  ``increment`` (either sign) and ``set``; histograms only ``observe``, and have no
  ``value``.
- A family lives while some owner (a stub process) holds a reference to it; a
  metric while some reference to it is held, and never longer than its family.
  An operation on a metric whose family is gone is an error.

Counters are exposed as the ``nv_*`` counters are: typed ``counter`` under the
name the model gave, without the ``_total`` the Prometheus client would add
(:mod:`trionserve.observability.exposition`).

Operations come from stub processes as messages (see :meth:`CustomMetrics.handle`)
on the Trio thread or, while a stub initializes or finalizes, on a worker thread;
a lock keeps the registry consistent for both and for a scrape.

Each server has one :class:`CustomMetrics` (its ``BackendManager``'s
``custom_metrics``): the registry gives it to every model it loads
(``ModelContext.metrics``) and its metrics endpoint exposes it, so two servers in
one process show only their own models' metrics.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from trionserve.observability.exposition import TritonCounter

COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
_KIND_NAMES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
FAMILY_GONE = "Invalid metric operation as the corresponding 'MetricFamily' has been deleted."


class MetricError(Exception):
    """An operation a model asked for that the rules refuse; the message says why."""


@dataclass
class _Series:
    labels: tuple[tuple[str, str], ...]
    value: float = 0.0
    bounds: tuple[float, ...] = ()
    counts: list[int] = field(default_factory=list)  # per bound, not cumulative
    total: int = 0
    refs: int = 0


@dataclass
class _Family:
    id: int
    name: str
    description: str
    kind: int
    refs: Counter = field(default_factory=Counter)  # owner -> references
    series: dict[tuple, _Series] = field(default_factory=dict)


class CustomMetrics:
    """Every custom metric family of one server; also a Prometheus collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners = itertools.count(1)
        self._families: dict[str, _Family] = {}
        self._by_id: dict[int, _Family] = {}
        self._metric_refs: Counter = Counter()  # (owner, family id, labels) -> refs
        self._ids = itertools.count(1)

    def new_owner(self) -> int:
        """A new holder of references (a stub, an in-process instance, a model):
        what it holds is dropped at :meth:`release`."""
        return next(self._owners)

    # -- what models do ------------------------------------------------------------

    def create_family(self, owner: int, name: str, description: str, kind: int) -> int:
        if not isinstance(name, str) or not _NAME.match(name):
            raise MetricError(f"invalid metric family name {name!r}")
        if kind not in _KIND_NAMES:
            raise MetricError(f"metric family '{name}': unknown kind {kind!r}")
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = _Family(next(self._ids), name, str(description), kind)
                self._families[name] = family
                self._by_id[family.id] = family
            elif family.kind != kind:
                raise MetricError(
                    f"metric family '{name}' already exists as a "
                    f"{_KIND_NAMES[family.kind]}, not a {_KIND_NAMES[kind]}"
                )
            family.refs[owner] += 1
            return family.id

    def delete_family(self, owner: int, family_id: int) -> None:
        with self._lock:
            family = self._by_id.get(family_id)
            if family is None or family.refs[owner] <= 0:
                return
            family.refs[owner] -= 1
            if family.refs[owner] == 0:
                del family.refs[owner]
            if not family.refs:
                self._drop(family)

    def create_metric(
        self, owner: int, family_id: int, labels: object, buckets: Iterable[Any] | None
    ) -> tuple:
        key = self._labels(labels)
        with self._lock:
            family = self._family(family_id)
            series = family.series.get(key)
            if series is None:
                series = _Series(key)
                if family.kind == HISTOGRAM:
                    series.bounds = self._bounds(family.name, buckets)
                    series.counts = [0] * len(series.bounds)
                family.series[key] = series
            series.refs += 1
            self._metric_refs[(owner, family_id, key)] += 1
            return key

    def delete_metric(self, owner: int, family_id: int, labels: tuple) -> None:
        with self._lock:
            ref = (owner, family_id, labels)
            if self._metric_refs[ref] <= 0:
                return
            self._metric_refs[ref] -= 1
            if self._metric_refs[ref] == 0:
                del self._metric_refs[ref]
            self._unref_series(family_id, labels, 1)

    def update(self, family_id: int, labels: tuple, action: str, amount: float) -> float | None:
        """``increment``, ``set``, ``observe`` or ``value`` on one metric."""
        amount = float(amount)
        with self._lock:
            family = self._family(family_id)
            series = family.series.get(labels)
            if series is None:
                raise MetricError(f"metric family '{family.name}': the metric was deleted")
            kind = family.kind
            what = f"metric family '{family.name}' ({_KIND_NAMES[kind]})"
            if action == "value":
                if kind == HISTOGRAM:
                    raise MetricError(f"{what}: a histogram has no single value")
                return series.value
            if action == "observe":
                if kind != HISTOGRAM:
                    raise MetricError(f"{what}: only a histogram can observe")
                series.value += amount
                series.total += 1
                for index, bound in enumerate(series.bounds):
                    if amount <= bound:
                        series.counts[index] += 1
                        break
                return None
            if kind == HISTOGRAM:
                raise MetricError(f"{what}: a histogram can only observe")
            if action == "increment":
                if kind == COUNTER and amount < 0:
                    raise MetricError(f"{what}: a counter cannot be decremented ({amount:g})")
                series.value += amount
                return None
            if action == "set":
                if kind == COUNTER:
                    raise MetricError(f"{what}: a counter cannot be set")
                series.value = amount
                return None
            raise MetricError(f"unknown metric operation {action!r}")

    def release(self, owner: int) -> None:
        """An owner (a stub process) is gone: drop every reference it held."""
        with self._lock:
            for ref in [r for r in self._metric_refs if r[0] == owner]:
                self._unref_series(ref[1], ref[2], self._metric_refs.pop(ref))
            for family in list(self._families.values()):
                family.refs.pop(owner, None)
                if not family.refs:
                    self._drop(family)

    # -- the stub's messages -------------------------------------------------------

    def handle(self, owner: int, message: dict[str, Any]) -> dict[str, Any] | None:
        """Apply a stub's ``metric`` message; the reply it waits for (None for a
        release, which nobody waits for)."""
        action = message["action"]
        if message["call"] is None:
            try:
                if action == "family_delete":
                    self.delete_family(owner, message["family"])
                elif action == "metric_delete":
                    self.delete_metric(owner, message["family"], _key(message["labels"]))
            except (KeyError, TypeError, ValueError):
                pass  # a malformed release changes nothing
            return None
        result: int | float | list | None = None  # the deletes answer None
        try:
            if action == "family_create":
                result = self.create_family(
                    owner, message["name"], message["description"], message["kind"]
                )
            elif action == "family_delete":
                self.delete_family(owner, message["family"])
            elif action == "metric_create":
                result = list(
                    self.create_metric(
                        owner, message["family"], message["labels"], message["buckets"]
                    )
                )
            elif action == "metric_delete":
                self.delete_metric(owner, message["family"], _key(message["labels"]))
            else:
                result = self.update(
                    message["family"], _key(message["labels"]), action, message["value"]
                )
        except MetricError as exc:
            return {"op": "metric_reply", "call": message["call"], "error": str(exc)}
        return {"op": "metric_reply", "call": message["call"], "result": result, "error": None}

    # -- exposition ----------------------------------------------------------------

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            families = [
                (f.name, f.description, f.kind, [_copy(s) for s in f.series.values()])
                for f in self._families.values()
            ]
        for name, description, kind, series in families:
            # Metrics of one family may carry different label names (as in
            # Triton), so samples are added with their own labels.
            if kind == HISTOGRAM:
                metric = Metric(name, description, "histogram")
                for s in series:
                    labels = dict(s.labels)
                    cumulative = 0
                    for bound, count in zip(s.bounds, s.counts):
                        cumulative += count
                        if not math.isinf(bound):
                            bucket = {**labels, "le": _le(bound)}
                            metric.add_sample(f"{name}_bucket", bucket, cumulative)
                    metric.add_sample(f"{name}_bucket", {**labels, "le": "+Inf"}, s.total)
                    metric.add_sample(f"{name}_count", labels, s.total)
                    metric.add_sample(f"{name}_sum", labels, s.value)
            else:
                metric = (
                    Metric(name, description, "gauge")
                    if kind == GAUGE
                    else TritonCounter(name, description)
                )
                for s in series:
                    metric.add_sample(name, dict(s.labels), s.value)
            yield metric

    # -- helpers -------------------------------------------------------------------

    def _family(self, family_id: int) -> _Family:
        family = self._by_id.get(family_id)
        if family is None:
            raise MetricError(FAMILY_GONE)
        return family

    def _unref_series(self, family_id: int, labels: tuple, count: int) -> None:
        """Drop ``count`` references to a metric; the last one removes it."""
        family = self._by_id.get(family_id)
        if family is None:
            return
        series = family.series.get(labels)
        if series is not None:
            series.refs -= count
            if series.refs <= 0:
                del family.series[labels]

    def _drop(self, family: _Family) -> None:
        del self._families[family.name]
        del self._by_id[family.id]
        for ref in [r for r in self._metric_refs if r[1] == family.id]:
            del self._metric_refs[ref]

    @staticmethod
    def _labels(labels: object) -> tuple[tuple[str, str], ...]:
        if labels is None:
            return ()
        if not isinstance(labels, dict):
            raise MetricError(f"metric labels must be a dict of strings, not {labels!r}")
        for name, value in labels.items():
            if not isinstance(name, str) or not _LABEL.match(name) or name.startswith("__"):
                raise MetricError(f"invalid metric label name {name!r}")
            if not isinstance(value, str):
                raise MetricError(f"metric label '{name}' must be a string, not {value!r}")
        return tuple(sorted(labels.items()))

    @staticmethod
    def _bounds(name: str, buckets: Iterable[Any] | None) -> tuple[float, ...]:
        if buckets is None:
            raise MetricError(f"metric family '{name}': a histogram metric needs buckets")
        try:
            bounds = tuple(float(b) for b in buckets)
        except (TypeError, ValueError):
            raise MetricError(f"metric family '{name}': buckets must be numbers") from None
        if any(math.isnan(b) for b in bounds) or any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise MetricError(
                f"metric family '{name}': bucket bounds must be strictly ascending, "
                f"got {list(bounds)}"
            )
        return bounds


def _key(labels: Iterable[Iterable[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(pair) for pair in labels)


def _copy(series: _Series) -> _Series:
    return _Series(series.labels, series.value, series.bounds, list(series.counts), series.total)


def _le(bound: float) -> str:
    return f"{bound:g}"
