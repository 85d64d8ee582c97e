"""One executed batch in its model's statistics (and its requests' traces), as
Triton core's ``TritonModelInstance`` reports each execution
(src/backend_model_instance.cc, src/infer_stats.cc)."""

from __future__ import annotations

from collections.abc import Sequence

from trionserve.core.inference import InferenceRequest
from trionserve.observability.statistics import ComputeTimes, ModelStatistics, to_ns
from trionserve.observability.trace.trace_file import record_compute
from trionserve.schedulers.scheduler import Outcome


def record_batch(
    statistics: ModelStatistics,
    requests: list[InferenceRequest],
    outcomes: Sequence[Outcome] | None,
    start: float,
    end: float,
    times: ComputeTimes | None,
) -> None:
    """Record one executed batch that ran from ``start`` to ``end`` (Trio's
    clock); ``outcomes`` None: every request succeeded."""
    total_ns = to_ns(end - start)
    if times is not None:
        input_ns, infer_ns, output_ns = times
    else:
        input_ns = output_ns = 0
        infer_ns = total_ns
    if statistics.traces:
        record_compute(statistics.traces, requests, start, end, input_ns, output_ns)
    statistics.record_batch(requests, outcomes, start, end, input_ns, infer_ns, output_ns)
