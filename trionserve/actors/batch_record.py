"""One executed batch in its model's statistics (and its requests' traces), as
Triton core's ``TritonModelInstance`` reports each execution
(src/backend_model_instance.cc, src/infer_stats.cc); a batch's failures, the
requests cancelled before it ran, and an instance's results checked."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from trionserve.core.errors import Cancelled, InternalError, TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import (
    NS_PER_S,
    ComputeTimes,
    FailureReason,
    ModelStatistics,
    to_ns,
)
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
    if times is not None:
        input_ns, infer_ns, output_ns = times
    else:
        input_ns = output_ns = 0
        infer_ns = int((end - start) * NS_PER_S)  # (to_ns, written out)
        if infer_ns < 0:
            infer_ns = 0
    if statistics.traces:
        record_compute(statistics.traces, requests, start, end, input_ns, output_ns)
    statistics.record_batch(requests, outcomes, start, end, input_ns, infer_ns, output_ns)


def record_failures(
    statistics: ModelStatistics | None, requests: list[InferenceRequest], reason: FailureReason
) -> None:
    if statistics is None:
        return
    now = trio.current_time()
    for request in requests:
        if request.collect_stats:
            statistics.record_failure(to_ns(now - request.arrival_time), reason)


def drop_finished(
    statistics: ModelStatistics | None, batch: list[InferenceRequest]
) -> list[InferenceRequest]:
    """The requests of a batch still worth executing; the cancelled are answered."""
    live = []
    for request in batch:
        if request.done:
            continue
        if request.cancelled:
            request.fail(
                Cancelled(
                    f"request '{request.id}' for model '{request.model_name}' was "
                    "cancelled before it executed"
                )
            )
            record_failures(statistics, [request], FailureReason.CANCELED)
            continue
        live.append(request)
    return live


def checked_outcomes(
    instance: str, requests: list[InferenceRequest], results: object
) -> Sequence[Outcome]:
    """An instance's results checked: one response or error per request."""
    if not isinstance(results, list) or len(results) != len(requests):
        count = len(results) if isinstance(results, list) else type(results).__name__
        error = InternalError(
            f"instance '{instance}' returned {count} responses for {len(requests)} requests"
        )
        return [error] * len(requests)
    for index, result in enumerate(results):
        if not isinstance(result, (InferenceResponse, TritonError)):
            results[index] = InternalError(
                f"instance '{instance}' returned {type(result).__name__} instead of a response"
            )
    return results
