"""The metrics endpoint's text: prometheus-client's, with Triton's counters typed.

Triton writes its counters in the Prometheus text format (core ``src/metrics.cc``,
prometheus-cpp's ``TextSerializer``) as ``# TYPE nv_inference_count counter``
with samples under the same name, no ``_total``; dashboards query those names
and scrapers read the types. prometheus-client (0.26) cannot write that: its
text format names every counter family ``<name>_total`` and its OpenMetrics
format requires ``_total`` on counter samples. So the families that carry
Triton's counter names (:class:`TritonCounter`: the ``nv_*`` counters and the
counters that Python models define) are written here, by letting
prometheus-client write them untyped and typing the result; every other family
is prometheus-client's text as it is.

The endpoint always answers in the text format 0.0.4, whatever the ``Accept``
header asks, as Triton does: in OpenMetrics these counters could not keep both
their names and their type.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class TritonCounter(Metric):
    """A counter family whose samples are named as the family, as Triton names them."""

    def __init__(self, name: str, documentation: str) -> None:
        super().__init__(name, documentation, "counter")


class _One:
    """A collector of one family, for prometheus-client's writer."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> Iterable[Metric]:
        return [self._family]


def exposition_text(collector: Collector) -> bytes:
    """Every family of ``collector`` (a registry) in the Prometheus text format."""
    return b"".join(_family_text(family) for family in collector.collect())


def _family_text(family: Metric) -> bytes:
    if not isinstance(family, TritonCounter):
        return generate_latest(_One(family))
    untyped = Metric(family.name, family.documentation, "unknown")
    untyped.samples = list(family.samples)
    text = generate_latest(_One(untyped))
    return text.replace(
        b"# TYPE %s untyped\n" % family.name.encode(),
        b"# TYPE %s counter\n" % family.name.encode(),
        1,
    )
