"""ModelStatistics.record_batch: one executed batch recorded in one place, as the
per-request methods (record_success / record_failure / record_execution) count it."""

from __future__ import annotations

from trionserve.core.errors import InternalError
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import FailureReason, ModelStatistics, to_ns


class _Null(InferenceRequest):
    collect_stats = False  # a sequence batcher's filler: in the batch size only


def _request(arrival: float, batch_size: int, null: bool = False) -> InferenceRequest:
    request = (_Null if null else InferenceRequest)("m")
    request.arrival_time = arrival
    request.batch_size = batch_size
    return request


def _by_hand(
    stats: ModelStatistics, requests, outcomes, start, end, input_ns, infer_ns, output_ns
) -> None:
    """What the executor recorded before record_batch, call by call."""
    batch_size, succeeded = 0, False
    for index, request in enumerate(requests):
        size = request.batch_size or 1
        batch_size += size
        if not request.collect_stats:
            continue
        arrival = request.arrival_time
        outcome = None if outcomes is None else outcomes[index]
        if outcome is None or isinstance(outcome, InferenceResponse):
            succeeded = True
            queue_ns = max(0, to_ns(start - arrival))
            stats.record_success(
                size, to_ns(end - arrival), queue_ns, input_ns, infer_ns, output_ns
            )
        else:
            stats.record_failure(to_ns(end - arrival), FailureReason.BACKEND)
    if succeeded:
        stats.record_execution(batch_size, input_ns, infer_ns, output_ns, end)


async def test_record_batch_counts_what_the_per_request_methods_count():
    ok = InferenceResponse("m", "1")
    batches = [
        # one request, all succeeded (outcomes None), queued 2 ms
        ([_request(10.0, 1)], None, 10.002, 10.005, (0, 3_000_000, 0)),
        # arrival after start (a clock step): queue time 0, never negative
        ([_request(20.001, 0)], [ok], 20.0, 20.004, (10, 20, 30)),
        # a success, a failure and a null request in one batch of sizes 2 + 1 + 1
        (
            [_request(30.0, 2), _request(30.001, 1), _request(30.0, 1, null=True)],
            [ok, InternalError("boom"), ok],
            30.01,
            30.02,
            (5, 6, 7),
        ),
        # every request failed: no execution recorded
        ([_request(40.0, 1)], [InternalError("boom")], 40.0, 40.1, (1, 2, 3)),
    ]
    for summaries in (False, True):
        written, expected = ModelStatistics("m", 1), ModelStatistics("m", 1)
        if summaries:
            for stats in (written, expected):
                stats.enable_summaries([], cache_enabled=False)
        for requests, outcomes, start, end, (input_ns, infer_ns, output_ns) in batches:
            written.record_batch(requests, outcomes, start, end, input_ns, infer_ns, output_ns)
            _by_hand(expected, requests, outcomes, start, end, input_ns, infer_ns, output_ns)
        assert written.as_json() == expected.as_json()
        assert written.failures == expected.failures
        assert written.execution_count == 3
        assert written.failures[FailureReason.BACKEND] == 2
        assert written.queue.ns == 2_000_000 + 0 + 10_000_000
