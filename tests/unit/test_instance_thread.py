"""InstanceThread's hand-off: calls run on the instance's one thread, in order,
and the doorbell that wakes it survives a ring that comes after it closed."""

from __future__ import annotations

import gc
import threading
import weakref
from functools import partial

import trio

from trionserve.backends.instance_thread import InstanceThread, Job, _Doorbell


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
