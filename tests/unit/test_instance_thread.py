"""InstanceThread's hand-off: calls run on the instance's one thread, in order,
and the doorbell that wakes it survives a ring that comes after it closed."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from functools import partial

import trio
import trio.testing

from trionserve.backends.instance_thread import InstanceThread, Job, _Doorbell
from trionserve.core.deferred import deferred_jobs
from trionserve.core.errors import InternalError
from trionserve.core.inference import InferenceResponse


class _Instance:
    """A backend instance that is never given a batch here (only calls)."""

    def execute(self, requests):  # pragma: no cover - not called
        raise AssertionError("no batch in this test")


def test_a_ring_after_close_does_nothing():
    """A producer that saw the thread asleep rings just after the thread took its
    last job and closed the bell: nothing is written (before, a write to the
    closed descriptor: OSError, or another file if its number was reused)."""
    bell = _Doorbell()
    bell.ring()
    bell.wait()
    bell.close()
    bell.ring()


async def test_calls_run_in_order_on_the_instance_thread_and_stop_ends_it():
    thread = InstanceThread("m_0", _Instance())  # type: ignore[arg-type]
    thread.start()
    seen: list[tuple[int, str]] = []

    def calls() -> list[str]:
        return [
            thread.call(lambda i=i: seen.append((i, threading.current_thread().name)) or str(i))
            for i in range(50)
        ]

    answers = await trio.to_thread.run_sync(calls)
    assert answers == [str(i) for i in range(50)]
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"instance m_0"}
    thread.stop()
    assert await trio.to_thread.run_sync(thread.join, 10)


async def test_the_thread_carries_its_name_where_the_os_shows_it():
    """/proc/PID/task/TID/comm (top -H, py-spy, per-thread CPU in the benchmarks)
    names the instance's thread, cut to the OS's 15 bytes."""
    thread = InstanceThread("model_with_a_long_name_0", _Instance())  # type: ignore[arg-type]
    thread.start()

    def comm() -> str:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()

    assert await trio.to_thread.run_sync(thread.call, comm) == "instance model_"
    thread.stop()
    assert await trio.to_thread.run_sync(thread.join, 10)


class _Request:
    """A request (only its life is looked at)."""


async def test_a_finished_job_lets_go_of_its_callbacks_and_is_freed_without_the_collector():
    """An executor's callbacks are partials of their job (a cycle): once the job
    is finished they are dropped, so its requests go with their last reference,
    not at the collector's next run."""
    delivered: list[int] = []
    request = _Request()
    gone = weakref.ref(request)
    job = Job([request])
    del request
    job.on_free = partial(lambda job: None, job)
    job.on_done = partial(lambda job: delivered.append(len(job.requests)), job)
    gc.disable()
    try:
        job.finished()
        assert delivered == [1]
        assert job.on_done is None and job.on_free is None
        del job
        assert gone() is None
    finally:
        gc.enable()


async def test_a_job_nobody_waits_for_makes_no_event_and_a_waiter_is_woken():
    """A job delivered by its callback alone is finished without a trio.Event
    made or set (most jobs); a task that waits for a job gets one, woken as
    the job finishes, and one made after the job finished is set already."""
    delivered: list[bool] = []
    job = Job([_Request()], lambda: delivered.append(True))
    job.finished()
    assert job.over and delivered == [True]
    assert job._done is None  # no event made
    assert job.done.is_set()  # ... until asked for: made set

    waited = Job([_Request()])
    woken: list[bool] = []

    async def waiter() -> None:
        await waited.done.wait()
        woken.append(waited.over)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert not woken
        waited.finished()
    assert woken == [True]


async def test_a_jobs_span_is_the_threads_readings_on_trios_clock():
    """On Trio's own clock (perf_counter() plus a constant) a job's span is its
    thread's readings moved by that constant, read once as the thread starts:
    what reading Trio's clock and perf_counter() per batch gave, within a few
    microseconds (no clock read on the loop per batch)."""
    thread = InstanceThread("m_0", _Instance())  # type: ignore[arg-type]
    thread.start()
    try:
        assert thread._offset is not None
        job = Job([_Request()])
        job.started = time.perf_counter() - 0.003
        job.ended = time.perf_counter() - 0.001
        start, end = thread.span(job)
        now = trio.current_time()
        by_now = now - (time.perf_counter() - job.ended)
        assert abs(end - by_now) < 5e-6
        assert abs((end - start) - (job.ended - job.started)) < 1e-9
    finally:
        thread.stop()
        assert await trio.to_thread.run_sync(thread.join, 10)


def test_on_a_mock_clock_a_jobs_span_is_read_from_it_per_batch():
    """A MockClock's virtual time is no constant away from perf_counter(): the
    span is then read from Trio's clock as the job is delivered."""

    async def main() -> tuple[float | None, float, float, float]:
        thread = InstanceThread("m_0", _Instance())  # type: ignore[arg-type]
        thread.start()
        await trio.sleep(100)  # virtual: jumps
        job = Job([_Request()])
        job.ended = time.perf_counter()
        job.started = job.ended - 0.002
        start, end = thread.span(job)
        thread.stop()
        await trio.to_thread.run_sync(thread.join, 10)
        return thread._offset, start, end, trio.current_time()

    offset, start, end, now = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert offset is None
    assert now - 1 < end <= now
    assert abs((end - start) - 0.002) < 1e-9


class _Answer:
    """A request's answer the thread may write (always takes it whole)."""

    armed = True

    def __init__(self) -> None:
        self.written: list[object] = []

    def write(self, request: object, response: object) -> bool:
        self.written.append(response)
        return True


class _Answered:
    """A request whose answer the thread writes."""

    def __init__(self) -> None:
        self.answer = _Answer()
        self.cancelled = False


class _Echo:
    """A backend instance answering each request with a response, or an error
    for a request named in ``failing``."""

    def __init__(self, failing: object = None) -> None:
        self.failing = failing

    def execute(self, requests):
        return [
            InternalError("no") if r is self.failing else InferenceResponse("m", "1")
            for r in requests
        ]


async def test_a_job_whose_answers_the_thread_wrote_is_known_to_be_responses():
    """The thread checked one response per request as it wrote their answers:
    the job says so (``responses``), so the loop does not look again; a job
    with an error among its results is reported as before, unmarked."""
    deferred = deferred_jobs()
    for failing in (False, True):
        request = _Answered()
        thread = InstanceThread("m_0", _Echo(request if failing else None))  # type: ignore[arg-type]
        thread.quiet = lambda: True
        thread.start()
        reported = trio.Event()
        job = Job([request], reported.set)
        thread.submit(job)
        with trio.fail_after(10):
            if failing:
                await reported.wait()  # reported to the loop
            else:
                while not deferred:
                    await trio.sleep(0.001)
        assert job.responses is not failing
        assert len(request.answer.written) == (0 if failing else 1)
        deferred.sweep()
        assert job.over
        thread.stop()
        assert await trio.to_thread.run_sync(thread.join, 10)
