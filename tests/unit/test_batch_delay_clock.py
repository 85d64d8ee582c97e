"""Batching delays on the real clock: microseconds, not Trio's milliseconds.

Trio's timers end ``epoll_wait`` through its timeout, in whole milliseconds, so a
batcher waiting 200 µs with ``trio.move_on_at`` alone takes about 1.1 ms. These
tests run on the real clock (``trio.run``, not pytest-trio's virtual one), send a
request that must wait the whole delay (the batch cannot fill), and take the median
over many trials, so a loaded machine's outliers do not decide: the median must
stay well under a millisecond, and no batch may leave before its delay.
"""

from __future__ import annotations

import math
import statistics
import time

import pytest
import trio

from tests.helpers import printed_by_new_interpreter
from tests.unit import test_batcher, test_sequence
from trionserve.schedulers import dynamic_batch, timer
from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler
from trionserve.schedulers.sequence_batch import SequenceBatchScheduler
from trionserve.schedulers.sequence_state import load_sequence_states

DELAY_US = 200
TRIALS = 41
# Trio's own timer cannot wake before 1,000 µs (epoll's timeout is rounded up to
# whole milliseconds; it took 1,129 µs here); the delay plus a loaded machine's
# wake-up latency (medians of 255-300 µs at load averages of 7-14) stays below this.
MEDIAN_LIMIT_US = 900


async def _measure(scheduler, outlet, make_request) -> list[float]:
    waits = []
    for trial in range(TRIALS):
        r = make_request(trial)
        started = time.perf_counter()
        await scheduler.submit(r)
        batch = await outlet.receive()
        waits.append((time.perf_counter() - started) * 1e6)
        outlet.complete(batch, [test_batcher.response(b) for b in batch])
    return waits


def test_dynamic_batcher_waits_its_delay_in_microseconds():
    config = test_batcher.make_config(f"max_queue_delay_microseconds: {DELAY_US}")

    async def main() -> list[float]:
        scheduler = DynamicBatchScheduler(config)
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            waits = await _measure(
                scheduler, scheduler.outlet(), lambda i: test_batcher.request(str(i))
            )
            nursery.cancel_scope.cancel()
        return waits

    waits = trio.run(main)
    assert min(waits) >= DELAY_US, waits
    assert statistics.median(waits) < MEDIAN_LIMIT_US, sorted(waits)


def test_sequence_batcher_waits_its_delay_in_microseconds(tmp_path):
    config = test_sequence.make_config(
        "oldest { max_candidate_sequences: 4 preferred_batch_size: [ 3 ] "
        f"max_queue_delay_microseconds: {DELAY_US} }}"
    )

    async def main() -> list[float]:
        states = load_sequence_states(config, tmp_path)
        scheduler = SequenceBatchScheduler(config, None, states=states)
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            outlet = scheduler.outlet()
            # One single-request sequence per trial: a batch of one of a preferred
            # three, which leaves only when the delay has passed.
            waits = await _measure(
                scheduler,
                outlet,
                lambda i: test_sequence.request(i + 1, start=True, end=True),
            )
            nursery.cancel_scope.cancel()
        return waits

    waits = trio.run(main)
    assert min(waits) >= DELAY_US, waits
    assert statistics.median(waits) < MEDIAN_LIMIT_US, sorted(waits)


def test_the_batchers_own_deadline_is_a_fallback_behind_the_wake_up(monkeypatch):
    """At the instant of its deadline Trio cancels the wait before the timer's task
    can wake the batcher, and a cancellation (Cancelled raised through the
    batcher's task) costs the event loop far more than the wake-up: so each wait
    for a delay is bounded by Trio only ``FALLBACK_SLACK`` after the delay, and the
    delays are still kept (the timer ends them). (Requests with a queue timeout
    wake the batcher's task, which then waits for the delay itself; see the
    next test for the batches the timer's task hands over alone.)"""
    margins: list[float] = []
    move_on_at = trio.move_on_at

    def recorded(deadline: float) -> trio.CancelScope:
        margins.append(deadline - trio.current_time())
        return move_on_at(deadline)

    monkeypatch.setattr(dynamic_batch.trio, "move_on_at", recorded)
    config = test_batcher.make_config(
        f"max_queue_delay_microseconds: {DELAY_US} "
        "default_queue_policy { default_timeout_microseconds: 60000000 }"
    )

    async def main() -> list[float]:
        scheduler = DynamicBatchScheduler(config)
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            waits = await _measure(
                scheduler, scheduler.outlet(), lambda i: test_batcher.request(str(i))
            )
            nursery.cancel_scope.cancel()
        return waits

    waits = trio.run(main)
    assert min(waits) >= DELAY_US, waits
    assert statistics.median(waits) < MEDIAN_LIMIT_US, sorted(waits)
    timed = [margin for margin in margins if margin != math.inf]
    # Each trial waits for its delay with a bounded wait, except one whose delay had
    # already passed when the test's task asked for the batch (descheduled that long
    # on a loaded machine): since the executor's request forms a batch that can go at
    # once in its own task, that trial arms no wait at all (seen in 1 of 6 runs).
    assert len(timed) >= TRIALS // 2, timed
    # (wake time - now) + FALLBACK_SLACK; the wake time may have just passed.
    assert min(timed) > timer.FALLBACK_SLACK / 2, timed


def test_a_delayed_batch_goes_from_the_timers_task_without_the_batchers():
    """On the real clock the delay's end is armed by whoever queued the request
    (a submit that finds an idle executor taking hand-overs, an executor asking
    for work) and the timer's task forms and hands over the batch when it fires:
    the batcher's own task takes no step (two passes of the run loop fewer per
    delayed batch). Requests that come during the delay join the batch, and the
    delay is kept in full."""

    async def main() -> tuple[list[list[str]], list[float], int, list[float]]:
        scheduler = DynamicBatchScheduler(
            test_batcher.make_config(f"max_queue_delay_microseconds: {DELAY_US}")
        )
        steps = test_batcher.BatcherSteps()
        handed: list[list[str]] = []
        waits: list[float] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            outlet = scheduler.outlet()
            handed_one = trio.Event()

            def handover(batch) -> bool:
                handed.append([r.id for r in batch])
                handed_one.set()
                return True

            async def idle() -> None:
                with pytest.raises((trio.EndOfChannel, trio.ClosedResourceError)):
                    await outlet.receive_direct(lambda batch: False, handover)

            nursery.start_soon(idle)
            await trio.testing.wait_all_tasks_blocked()
            trio.lowlevel.add_instrument(steps)
            try:
                for trial in range(3):
                    started = time.perf_counter()
                    await scheduler.submit(test_batcher.request(f"{trial}a"))
                    await scheduler.submit(test_batcher.request(f"{trial}b"))
                    with trio.fail_after(10):  # (a hang fails)
                        await handed_one.wait()
                    waits.append((time.perf_counter() - started) * 1e6)
                    handed_one = trio.Event()
                    outlet.complete([], [])
                    outlet.offer_again()
                # An executor asking for work with a request queued arms it too.
                outlet.close()
                plain = scheduler.outlet()
                with trio.fail_after(10):
                    received = await _measure(
                        scheduler, plain, lambda i: test_batcher.request(f"plain{i}")
                    )
            finally:
                trio.lowlevel.remove_instrument(steps)
            nursery.cancel_scope.cancel()
        return handed, waits, steps.steps, received

    handed, waits, steps, received = trio.run(main)
    assert handed == [["0a", "0b"], ["1a", "1b"], ["2a", "2b"]]
    assert min(waits) >= DELAY_US, waits
    assert min(received) >= DELAY_US, received
    assert steps == 0


def test_the_clock_is_told_virtual_without_the_server_importing_trio_testing():
    """core/clocks.py: a MockClock is virtual and Trio's own clock is not, and no
    module the server imports at start-up imports trio.testing (which imports
    pytest where it is installed: a tenth of a second of CPU at every start-up)."""

    import trio.testing

    from trionserve.core.clocks import virtual_clock

    async def current_is_virtual() -> bool:
        return virtual_clock(trio.lowlevel.current_clock())

    assert trio.run(current_is_virtual) is False
    assert trio.run(current_is_virtual, clock=trio.testing.MockClock()) is True
    code = (
        "import sys, trionserve.cli, trionserve.server; "
        "print(sorted({'pytest', 'trio.testing'} & set(sys.modules)))"
    )
    out = printed_by_new_interpreter(code)
    assert out.split() == ["[]"], out
