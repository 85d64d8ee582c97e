"""One executed batch in its model's statistics (and its requests' traces), as
Triton core's ``TritonModelInstance`` reports each execution
(src/backend_model_instance.cc, src/infer_stats.cc)."""

from __future__ import annotations

from collections.abc import Sequence

from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import (
    ComputeTimes,
    FailureReason,
    ModelStatistics,
    to_ns,
)
from trionserve.observability.trace.trace_file import record_compute
from trionserve.schedulers.scheduler import Outcome

# The outcomes of a decoupled batch whose execute returned: all successes.
_ALL_SUCCEEDED = (None,)


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
    each: Sequence[Outcome | None] = (
        _ALL_SUCCEEDED * len(requests) if outcomes is None else outcomes
    )
    batch_size = 0
    succeeded = False
    for request, outcome in zip(requests, each):
        size = request.batch_size or 1
        batch_size += size
        if not request.collect_stats:
            continue  # a sequence batcher's null request: in the batch size only
        arrival = request.arrival_time
        if outcome is None or isinstance(outcome, InferenceResponse):
            succeeded = True
            statistics.record_success(
                size,
                to_ns(end - arrival),
                max(0, to_ns(start - arrival)),
                input_ns,
                infer_ns,
                output_ns,
            )
        else:
            statistics.record_failure(to_ns(end - arrival), FailureReason.BACKEND)
    if succeeded:
        statistics.record_execution(batch_size, input_ns, infer_ns, output_ns, end)
