"""The report of a batch handed straight over to the instance's thread
(``HandedJob`` in trionserve/actors/executor.py): the thread writes the lone
request's answer and leaves the report for the loop's sweep, which delivers it
in one function: the executor offered again, the statistics, the outcome.
Sequenced by events; a hang fails through ``trio.fail_after``."""

from __future__ import annotations

import threading

import trio
import trio.testing

from tests.unit import test_batcher
from tests.unit.test_batch_held import SPEC, _Instance
from trionserve.actors.executor import InstanceExecutor
from trionserve.core.deferred import deferred_jobs
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import ModelStatistics
from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler

TIMES = (1_000, 2_000, 3_000)  # the backend's compute_input / infer / output, ns


class _Timed(_Instance):
    """An instance that says how its batches' time divides."""

    compute_times = TIMES


class _Answer:
    """A request's thread answer that takes every write, as an HTTP/1.1
    connection's does (trionserve/protocol/http/answer.py)."""

    armed = True

    def __init__(self) -> None:
        self.written = threading.Event()
        self.finals = 0

    def write(self, request: InferenceRequest, response: InferenceResponse) -> bool:
        self.written.set()
        return True

    async def wait(self) -> None:
        raise AssertionError("not waited for here")

    def finalized(self) -> None:
        self.finals += 1


class _Trace:
    """A request's trace, as the statistics keep it: given the compute's times."""

    def __init__(self) -> None:
        self.computed: list[tuple[int, int]] = []

    def compute(self, start: float, end: float, input_ns: int, output_ns: int) -> None:
        self.computed.append((input_ns, output_ns))


async def _serve(nursery, statistics: ModelStatistics) -> tuple[DynamicBatchScheduler, _Timed]:
    batcher = DynamicBatchScheduler(test_batcher.make_config(""))
    instance = _Timed()
    await nursery.start(batcher.run)
    executor = InstanceExecutor(SPEC, instance, batcher.outlet(), statistics)
    await nursery.start(executor.run)
    await trio.testing.wait_all_tasks_blocked()
    return batcher, instance


def test_the_sweep_delivers_a_report_the_thread_deferred_and_offers_the_instance_again():
    """Each request goes straight to the idle instance, whose thread answers it
    and defers the report: nothing is delivered until the sweep, which answers
    the request, counts it and its batch in the statistics, and offers the
    executor again (the next request goes straight too, not queued)."""

    async def main() -> tuple[ModelStatistics, _Timed, list[tuple[bool, bool, int, int]]]:
        statistics = ModelStatistics("m", 1)
        seen = []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                batcher, instance = await _serve(nursery, statistics)
                deferred = deferred_jobs()
                for name in ("a", "b"):
                    request = test_batcher.request(name)
                    answer = request.answer = _Answer()
                    await batcher.submit(request)
                    assert batcher.pending == 0  # (handed straight over)
                    await trio.to_thread.run_sync(answer.written.wait)
                    before = (request.done, bool(deferred))
                    deferred.sweep()
                    seen.append((*before, answer.finals, statistics.success.count))
                    assert request.done and (await request.wait()).id == name
                nursery.cancel_scope.cancel()
        return statistics, instance, seen

    statistics, instance, seen = trio.run(main)
    assert instance.batches == [["a"], ["b"]]
    assert seen == [(False, True, 1, 1), (False, True, 1, 2)]
    assert statistics.inference_count == 2 and statistics.execution_count == 2
    assert statistics.queue.count == 2 and statistics.success.count == 2
    assert (
        statistics.compute_input.ns,
        statistics.compute_infer.ns,
        statistics.compute_output.ns,
    ) == (2_000, 4_000, 6_000)
    assert statistics.batch_stats[1].compute_infer.count == 2


def test_a_traced_request_answered_by_the_thread_is_delivered_the_whole_way():
    """A request whose statistics keep a trace takes the executor's whole
    delivery (``record_batch`` with the trace's timestamps), not the written-out
    one: answered once, counted once, its trace given the compute's times."""

    async def main() -> tuple[ModelStatistics, bool, int, _Trace]:
        statistics = ModelStatistics("m", 1)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                batcher, _ = await _serve(nursery, statistics)
                request = test_batcher.request("a")
                answer = request.answer = _Answer()
                trace = _Trace()
                statistics.traces[request] = trace  # type: ignore[assignment]
                await batcher.submit(request)
                await trio.to_thread.run_sync(answer.written.wait)
                deferred_jobs().sweep()
                done = request.done
                nursery.cancel_scope.cancel()
        return statistics, done, answer.finals, trace

    statistics, done, finals, trace = trio.run(main)
    assert done and finals == 1 and trace.computed == [(TIMES[0], TIMES[2])]
    assert statistics.success.count == 1 and statistics.execution_count == 1
