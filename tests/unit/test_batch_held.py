"""A batch that waits for its batching delay, held by the idle instance's thread.

On the real clock, a batch the dynamic batcher would hold for its delay goes to
the idle instance's thread at once with the delay's end; the thread sleeps out
the rest (the GIL released) and the event loop does not wake at the delay's end.
Requests that come meanwhile join it by the batcher's rules; a full batch, the
batcher's close and the executor's stop start it at once. These tests run on
the real clock (the hold is never used on a virtual one) and are sequenced by
events: the delays that must pass are a few milliseconds, those that must not
are a minute (a hang fails through ``trio.fail_after``).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import trio
import trio.testing

from tests.unit import test_batcher
from trionserve.actors.executor import InstanceExecutor
from trionserve.backends.base import InstanceSpec
from trionserve.backends.instance_thread import HeldJob, InstanceThread, Job
from trionserve.core.errors import Cancelled, Unavailable
from trionserve.core.inference import InferenceResponse
from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler

MINUTE_US = 60_000_000  # a delay no test waits for
SPEC = InstanceSpec("m_0_0", "m", "KIND_CPU", 0)


class _Steps(trio.abc.Instrument):
    """Counts the steps of the batcher's task and of its timer's task."""

    def __init__(self) -> None:
        self.steps = 0

    def after_task_step(self, task) -> None:
        if task.name.endswith(("DynamicBatchScheduler.run", "PreciseWakeup.run")):
            self.steps += 1


class _Held:
    """A thread's held batch, as the batcher sees it."""

    def __init__(self, batch, go_at: float) -> None:
        self.ids = [r.id for r in batch]
        self.go_at = go_at
        self.started = False
        self.released = 0

    def join(self, request) -> bool:
        if self.started:
            return False
        self.ids.append(request.id)
        return True

    def release(self) -> None:
        self.released += 1


async def _idle_executor(nursery, batcher, held: list[_Held], handed: list[list[str]]):
    """An executor waiting in receive_direct with a hand-over and a held one."""
    outlet = batcher.outlet()

    def handover(batch) -> bool:
        handed.append([r.id for r in batch])
        return True

    def delayed(batch, go_at: float) -> _Held:
        held.append(_Held(batch, go_at))
        return held[-1]

    async def idle() -> None:
        with pytest.raises((trio.EndOfChannel, trio.ClosedResourceError)):
            await outlet.receive_direct(lambda batch: False, handover, delayed)

    nursery.start_soon(idle)
    await trio.testing.wait_all_tasks_blocked()
    return outlet


def test_a_delayed_batch_is_held_by_the_thread_and_requests_join_it():
    """The first request's batch goes to the thread at once with its delay's
    end (no step of the batcher's or the timer's task, no timer armed); the
    next ones join it; the one that fills it to the maximum starts it; once
    the thread started it, a request waits for the next batch, held in turn
    when the executor offers itself again; the batcher's close starts that."""

    async def main() -> None:
        batcher = DynamicBatchScheduler(
            test_batcher.make_config(f"max_queue_delay_microseconds: {MINUTE_US}", max_batch_size=4)
        )
        held: list[_Held] = []
        handed: list[list[str]] = []
        steps = _Steps()
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            outlet = await _idle_executor(nursery, batcher, held, handed)
            trio.lowlevel.add_instrument(steps)
            try:
                first = test_batcher.request("a")
                await batcher.submit(first)
                assert [h.ids for h in held] == [["a"]]
                assert held[0].go_at == first.arrival_time + MINUTE_US / 1e6
                opened = batcher._open  # (one OpenBatch, re-armed for each batch held)
                for name in "bc":
                    await batcher.submit(test_batcher.request(name))
                assert held[0].ids == ["a", "b", "c"] and held[0].released == 0
                await batcher.submit(test_batcher.request("d"))  # the maximum: it starts
                assert held[0].ids == ["a", "b", "c", "d"] and held[0].released == 1
                await batcher.submit(test_batcher.request("e"))
                assert held[0].ids == ["a", "b", "c", "d"]  # not past the maximum
                assert batcher.pending == 1
                await trio.testing.wait_all_tasks_blocked()
                assert steps.steps == 0
                assert batcher._timer is not None and batcher._timer._armed == math.inf
            finally:
                trio.lowlevel.remove_instrument(steps)
            outlet.complete([], [])  # the first batch's outcomes went elsewhere
            outlet.offer_again()
            assert [h.ids for h in held] == [["a", "b", "c", "d"], ["e"]]
            assert batcher._open is opened and opened.batch is held[1] and opened.size == 1
            held[1].started = True  # the thread started it: "f" waits
            await batcher.submit(test_batcher.request("f"))
            assert held[1].ids == ["e"] and batcher.pending == 1
            outlet.complete([], [])
            outlet.offer_again()
            assert [h.ids for h in held][2:] == [["f"]]
            batcher.close()  # nothing more comes: the held batch starts now
            assert held[2].released == 1
            assert handed == []
            outlet.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_request_past_the_preferred_size_starts_the_held_batch_without_it():
    """With preferred sizes, a request that would take the held batch past the
    largest starts the batch without it (the batch formed at that moment
    would go at once without it) and waits for the next; one that reaches a
    preferred size joins and starts it."""

    async def main() -> None:
        batcher = DynamicBatchScheduler(
            test_batcher.make_config(
                f"preferred_batch_size: [ 3, 6 ] max_queue_delay_microseconds: {MINUTE_US}"
            )
        )
        held: list[_Held] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            outlet = await _idle_executor(nursery, batcher, held, [])
            await batcher.submit(test_batcher.request("a", batch=2))
            await batcher.submit(test_batcher.request("b", batch=3))
            assert held[0].ids == ["a", "b"] and held[0].released == 0
            await batcher.submit(test_batcher.request("c", batch=2))  # 7 > 6
            assert held[0].ids == ["a", "b"] and held[0].released == 1
            assert batcher.pending == 1
            outlet.complete([], [])
            outlet.offer_again()
            await batcher.submit(test_batcher.request("d", batch=1))  # 3: preferred
            assert [h.ids for h in held] == [["a", "b"], ["c", "d"]]
            assert held[1].released == 1
            outlet.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize(
    "policy",
    [
        "default_queue_policy { default_timeout_microseconds: 60000000 }",
        "default_queue_policy { allow_timeout_override: true }",
        "default_queue_policy { max_queue_size: 4 }",
        "priority_levels: 2 default_priority_level: 1",
    ],
)
def test_no_batch_is_held_where_a_queue_policy_or_priorities_could_tell(policy):
    """Queue timeouts, a queue size bound and priority levels act on requests
    while they are queued: such a batch waits for its delay at the batcher."""

    async def main() -> None:
        batcher = DynamicBatchScheduler(
            test_batcher.make_config(f"max_queue_delay_microseconds: {MINUTE_US} {policy}")
        )
        held: list[_Held] = []
        handed: list[list[str]] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            outlet = await _idle_executor(nursery, batcher, held, handed)
            await batcher.submit(test_batcher.request("a"))
            await trio.testing.wait_all_tasks_blocked()
            assert held == [] and handed == [] and batcher.pending == 1
            batcher.close()  # it goes now
            await trio.testing.wait_all_tasks_blocked()
            assert handed == [["a"]]
            outlet.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


async def test_no_batch_is_held_on_a_virtual_clock(autojump_clock):
    """The simulations and MockClock tests keep their exact times: the batch
    waits for its delay at the batcher and goes at its end."""
    batcher = DynamicBatchScheduler(test_batcher.make_config("max_queue_delay_microseconds: 500"))
    held: list[_Held] = []
    handed: list[list[str]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        outlet = await _idle_executor(nursery, batcher, held, handed)
        start = trio.current_time()
        await batcher.submit(test_batcher.request("a"))
        while not handed:
            await trio.sleep(1e-6)
        assert held == [] and handed == [["a"]]
        assert trio.current_time() - start == pytest.approx(500e-6, abs=2e-6)
        outlet.close()
        nursery.cancel_scope.cancel()


# -- the thread's side, with a real instance thread and executor ----------------------


class _Instance:
    """A blocking backend instance that notes each batch and when it started."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started: list[float] = []  # time.perf_counter()

    def execute(self, requests):
        self.started.append(time.perf_counter())
        self.batches.append([r.id for r in requests])
        return [InferenceResponse("m", "1", r.id) for r in requests]

    def close(self) -> None:
        pass


async def _serve(nursery, config_text: str, max_batch_size: int = 8):
    batcher = DynamicBatchScheduler(
        test_batcher.make_config(config_text, max_batch_size=max_batch_size)
    )
    instance = _Instance()
    await nursery.start(batcher.run)
    executor = InstanceExecutor(SPEC, instance, batcher.outlet())
    await nursery.start(executor.run)
    return batcher, instance, executor


def test_the_thread_keeps_the_delay_and_the_loop_does_not_wake_for_its_end():
    """Through a real executor: each request waits out its whole delay in the
    instance's thread, and neither the batcher's task nor its timer's takes
    a step (the loop wakes only for the thread's report)."""
    delay_us = 3000

    async def main() -> tuple[list[float], int, int]:
        steps = _Steps()
        waits = []
        async with trio.open_nursery() as nursery:
            batcher, instance, executor = await _serve(
                nursery, f"max_queue_delay_microseconds: {delay_us}"
            )
            await trio.testing.wait_all_tasks_blocked()
            trio.lowlevel.add_instrument(steps)
            try:
                for i in range(5):
                    r = test_batcher.request(str(i))
                    submitted = time.perf_counter()
                    await batcher.submit(r)
                    with trio.fail_after(10):
                        response = await r.wait()
                    assert response.id == str(i)
                    waits.append((instance.started[-1] - submitted) * 1e6)
                    await trio.testing.wait_all_tasks_blocked()  # (offered again)
            finally:
                trio.lowlevel.remove_instrument(steps)
            held = batcher._timer is not None and executor._thread is not None
            executor.stop()
            nursery.cancel_scope.cancel()
        return waits, steps.steps, held

    waits, steps, held = trio.run(main)
    assert held
    assert min(waits) >= delay_us, waits
    assert steps == 0


def test_requests_join_the_held_batch_and_a_full_one_starts_at_once():
    async def main() -> list[list[str]]:
        async with trio.open_nursery() as nursery:
            batcher, instance, executor = await _serve(
                nursery, f"max_queue_delay_microseconds: {MINUTE_US}", max_batch_size=3
            )
            await trio.testing.wait_all_tasks_blocked()
            requests = [test_batcher.request(name) for name in "abc"]
            for r in requests:
                await batcher.submit(r)
            with trio.fail_after(10):  # not a minute: the third fills the batch
                for r in requests:
                    await r.wait()
            executor.stop()
            nursery.cancel_scope.cancel()
        return instance.batches

    assert trio.run(main) == [["a", "b", "c"]]


def test_a_held_request_cancelled_and_the_batchers_close_each_get_one_outcome():
    """A request whose client went away while held is answered Cancelled (the
    batch runs without it); the batcher's close starts the held batch at
    once, not at its delay's end."""

    async def main() -> tuple[list[list[str]], str]:
        async with trio.open_nursery() as nursery:
            batcher, instance, executor = await _serve(
                nursery, f"max_queue_delay_microseconds: {MINUTE_US}"
            )
            await trio.testing.wait_all_tasks_blocked()
            kept, gone = test_batcher.request("kept"), test_batcher.request("gone")
            await batcher.submit(kept)
            await batcher.submit(gone)
            gone.cancelled = True
            batcher.close()
            with trio.fail_after(10):
                response = await kept.wait()
                with pytest.raises(Cancelled, match="cancelled before it executed"):
                    await gone.wait()
            executor.stop()
            nursery.cancel_scope.cancel()
        return instance.batches, response.id

    batches, kept_id = trio.run(main)
    assert batches == [["kept"]]
    assert kept_id == "kept"


def test_an_executor_cancelled_while_its_thread_holds_a_batch_answers_it_at_once():
    """Unload's deadline or shutdown cancels the executor: its thread skips the
    held batch without waiting out the delay, and each request is answered."""

    async def main() -> list[list[str]]:
        with trio.fail_after(10):  # (the executor's own wait for its thread is shielded)
            async with trio.open_nursery() as nursery:
                batcher, instance, executor = await _serve(
                    nursery, f"max_queue_delay_microseconds: {MINUTE_US}"
                )
                await trio.testing.wait_all_tasks_blocked()
                r = test_batcher.request("a")
                await batcher.submit(r)
                nursery.cancel_scope.cancel()
            with pytest.raises(Unavailable, match="was stopped"):
                await r.wait()
        return instance.batches

    assert trio.run(main) == []


def test_a_join_after_the_thread_started_the_batch_is_refused():
    """The thread's side alone: a join before the start is in the batch, one
    after is refused (the batcher queues that request for the next)."""
    started = threading.Event()
    go = threading.Event()

    class Blocking(_Instance):
        def execute(self, requests):
            started.set()
            go.wait(10)
            return super().execute(requests)

    async def main() -> tuple[bool, bool, list[list[str]]]:
        instance = Blocking()
        thread = InstanceThread("m_0", instance)  # type: ignore[arg-type]
        thread.start()
        job = Job([test_batcher.request("a")])
        held = thread.submit_held(job, trio.current_time() + 60)
        joined = held.join(test_batcher.request("b"))
        held.release()
        await trio.to_thread.run_sync(started.wait, 10)
        late = held.join(test_batcher.request("c"))
        go.set()
        with trio.fail_after(10):
            await job.done.wait()
        thread.stop()
        await trio.to_thread.run_sync(thread.join, 10)
        return joined, late, instance.batches

    assert trio.run(main) == (True, False, [["a", "b"]])


@pytest.mark.parametrize("release", ["before", "after", "never"])
def test_a_held_job_closed_holds_its_gate_again_for_the_next(release):
    """One HeldJob holds a thread's jobs one after the other (re-armed, not
    made per batch): however its last wait ended (released before the delay's
    end, released after it, the delay's end alone), its gate is held again
    once it is closed, so the next job waits for its own delay or release."""
    lock = threading.Lock()
    held = HeldJob(Job([test_batcher.request("a")]), time.perf_counter(), lock)
    if release == "before":
        held.release()
    held.wait_out()  # (the delay's end has passed: no wait)
    if release == "after":
        held.release()  # a release that comes after the delay's end: too late
    assert held._gate.locked()
    assert held.join(test_batcher.request("late")) is False  # closed
    holder = InstanceThread("m_0", _Instance())  # type: ignore[arg-type]  # (not started)
    holder._offset, holder._held = 0.0, held  # (its clock: perf_counter's)
    assert holder.submit_held(Job([test_batcher.request("b")]), time.perf_counter() + 60) is held
    # Not closed yet: the next job is held by a HeldJob of its own.
    other = holder.submit_held(Job([test_batcher.request("c")]), time.perf_counter())
    assert other is not held and holder._held is other
    assert held.join(test_batcher.request("b2")) is True
    waited = threading.Event()

    def wait() -> None:
        held.wait_out()
        waited.set()

    thread = threading.Thread(target=wait)
    thread.start()
    assert not waited.wait(0.05)  # its delay is a minute: it waits
    held.release()
    assert waited.wait(10)
    thread.join(10)
    assert held._gate.locked()


def test_a_thread_holds_its_jobs_one_after_the_other_through_one_held_job():
    """submit_held re-arms the thread's HeldJob for the next job once the last
    one started: each job keeps its own delay (the second waits for its
    release), requests join the job held now, and no lock is made per job."""

    async def main() -> tuple[bool, bool, list[list[str]]]:
        instance = _Instance()
        thread = InstanceThread("m_0", instance)  # type: ignore[arg-type]
        thread.start()
        first = Job([test_batcher.request("a")])
        held = thread.submit_held(first, trio.current_time())  # its delay is over
        with trio.fail_after(10):
            await first.done.wait()
        second = Job([test_batcher.request("b")])
        again = thread.submit_held(second, trio.current_time() + 60)
        assert again.join(test_batcher.request("c"))
        with trio.move_on_after(0.05):
            await second.done.wait()
        waited = not second.over
        again.release()
        with trio.fail_after(10):
            await second.done.wait()
        thread.stop()
        await trio.to_thread.run_sync(thread.join, 10)
        return again is held, waited, instance.batches

    assert trio.run(main) == (True, True, [["a"], ["b", "c"]])
