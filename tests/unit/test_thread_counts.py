"""A batch whose answers the instance's thread writes is counted by that thread
(``Job.statistics``, InstanceThread._answered): before any answer is written, and
not again by its report on the loop (HandedJob.finished), which offers the
executor again and answers the requests in one call of the outlet. A traced
batch, or statistics with latency summaries (they read Trio's clock), are
counted on the loop as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trionserve.actors.executor import HandedJob
from trionserve.backends.instance_thread import InstanceThread
from trionserve.core.deferred import deferred_jobs
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.quantiles import DEFAULT_TARGETS
from trionserve.observability.statistics import ComputeTimes, ModelStatistics

RESPONSE = InferenceResponse("m", "1")


class _Instance:
    def execute(self, requests):  # pragma: no cover - not run here
        raise AssertionError("the batch is given finished")


class _Answer:
    """An armed answer that notes what the statistics said as it was written."""

    armed = True

    def __init__(self, statistics: ModelStatistics) -> None:
        self._statistics = statistics
        self.counted_when_written: int | None = None

    def write(self, request, result) -> bool:
        self.counted_when_written = self._statistics.success.count
        return True


def _finished_job(statistics: ModelStatistics) -> tuple[HandedJob, InferenceRequest]:
    """A batch of one request as the thread leaves it once run: 2 s queued from
    its arrival, 1 s computing, its answer armed."""
    request = InferenceRequest("m")
    request.arrival_time = 1.0
    request.answer = _Answer(statistics)  # type: ignore[assignment]
    job = HandedJob([request])
    job.statistics = statistics
    job.results = [RESPONSE]
    job.times = ComputeTimes(1_000, 2_000, 3_000)
    job.started, job.ended = 3.0, 4.0
    return job, request


def _thread() -> InstanceThread:
    thread = InstanceThread("m_0", _Instance())  # type: ignore[arg-type]
    thread.quiet = lambda: True  # nothing waits for the instance
    thread._offset = 0.0  # Trio's clock is perf_counter's here
    return thread


def _executor(statistics: ModelStatistics, job: HandedJob) -> SimpleNamespace:
    """What HandedJob.finished reads of its executor; the outlet notes its calls."""
    calls: list = []
    outlet = SimpleNamespace(offer_again=lambda: calls.append("offer_again"))
    executor = SimpleNamespace(
        _handed=job,
        _stopped=False,
        _freed=set(),
        _statistics=statistics,
        _offset=0.0,
        _inline_budget=0,
        _outlet=outlet,
        _respond=lambda requests, results, again=False: calls.append(("respond", again)),
        _deliver_handed=lambda job: calls.append("deliver"),
        calls=calls,
    )
    job.executor = executor  # type: ignore[assignment]
    return executor


async def test_the_thread_counts_the_batch_before_its_answers_and_the_loop_not_again():
    statistics = ModelStatistics("m", 1)
    job, request = _finished_job(statistics)
    deferred = deferred_jobs()
    assert _thread()._answered(job, deferred)
    assert job.recorded
    assert request.answer.counted_when_written == 1  # type: ignore[union-attr]
    counted = statistics.as_json()
    assert counted["inference_count"] == counted["execution_count"] == 1
    assert counted["inference_stats"]["success"] == {"count": 1, "ns": 3_000_000_000}
    assert counted["inference_stats"]["queue"] == {"count": 1, "ns": 2_000_000_000}
    assert counted["inference_stats"]["compute_infer"] == {"count": 1, "ns": 2_000}
    assert [b["batch_size"] for b in counted["batch_stats"]] == [1]
    executor = _executor(statistics, job)
    deferred.sweep()  # the report, on the loop
    assert executor.calls == [("respond", True)]  # offered again and answered: one call
    assert executor._handed is None
    assert statistics.as_json() == counted  # not counted twice


@pytest.mark.parametrize("why", ["traced", "summaries"])
async def test_a_batch_the_thread_may_not_count_is_counted_on_the_loop(why):
    statistics = ModelStatistics("m", 1)
    if why == "traced":
        statistics.traces[InferenceRequest("m")] = object()  # type: ignore[assignment]
    else:
        statistics.enable_summaries(DEFAULT_TARGETS, cache_enabled=False)
    job, request = _finished_job(statistics)
    deferred = deferred_jobs()
    assert _thread()._answered(job, deferred)
    assert not job.recorded
    assert request.answer.counted_when_written == 0  # type: ignore[union-attr]
    executor = _executor(statistics, job)
    deferred.sweep()
    if why == "traced":  # the executor's own delivery (traces stamped there)
        assert executor.calls == ["offer_again", "deliver"]
    else:  # counted by the report, then answered
        assert executor.calls == ["offer_again", ("respond", False)]
        assert statistics.success.count == statistics.execution_count == 1
