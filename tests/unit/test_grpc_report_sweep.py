"""grpc/reportsweep.py: the gRPC server's tick for the threads' reports sweeps
every SWEEP_SECS while no read sweeps, is put off by the reads that do (so a
steady stream of calls never wakes the loop for it), and still delivers a report
left after the last read within SWEEP_SECS. Virtual time (MockClock)."""

from __future__ import annotations

import trio
import trio.testing

from trionserve.protocol.grpc import reportsweep
from trionserve.protocol.grpc.reportsweep import LOOK_EVERY, SWEEP_SECS, ReportSweep


def _run(test, monkeypatch) -> None:
    swept: list[float] = []
    monkeypatch.setattr(reportsweep, "sweep_deferred", lambda: swept.append(trio.current_time()))

    async def main() -> None:
        tick = ReportSweep()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick.run)
            await trio.testing.wait_all_tasks_blocked()
            await test(tick, swept)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_tick_sweeps_every_period_without_reads(monkeypatch):
    async def test(tick, swept):
        start = trio.current_time()
        await trio.sleep(4 * SWEEP_SECS + SWEEP_SECS / 2)
        assert [round(t - start, 6) for t in swept] == [
            round(SWEEP_SECS * k, 6) for k in (1, 2, 3, 4)
        ]

    _run(test, monkeypatch)


def test_reads_that_sweep_put_the_tick_off(monkeypatch):
    """A call every 10 ms for 4 s: the reads' sweeps keep the tick from ever
    waking (it would have swept 16 times)."""

    async def test(tick, swept):
        for _ in range(400):
            tick.swept()
            await trio.sleep(0.01)
        assert swept == []

    _run(test, monkeypatch)


def test_a_report_after_the_last_read_is_swept_within_the_period(monkeypatch):
    """Reads stop: the tick sweeps at most SWEEP_SECS after the last sweep
    that put it off, and then every SWEEP_SECS again."""

    async def test(tick, swept):
        for _ in range(10 * LOOK_EVERY):
            tick.swept()
            await trio.sleep(0.01)
        last_read = trio.current_time() - 0.01
        await trio.sleep(3 * SWEEP_SECS)
        assert swept, "no sweep after the reads stopped"
        assert swept[0] - last_read <= SWEEP_SECS
        assert [round(b - a, 6) for a, b in zip(swept, swept[1:])] == [SWEEP_SECS] * (
            len(swept) - 1
        )

    _run(test, monkeypatch)


def test_reads_too_rare_to_put_it_off_leave_the_tick_as_it_was(monkeypatch):
    """Fewer than LOOK_EVERY reads a half period: the clock is never looked
    at, the tick sweeps on its own period."""

    async def test(tick, swept):
        start = trio.current_time()
        for _ in range(LOOK_EVERY - 1):
            tick.swept()
            await trio.sleep(SWEEP_SECS / 2)
        assert [round(t - start, 6) for t in swept] == [
            round(SWEEP_SECS * k, 6) for k in range(1, len(swept) + 1)
        ]
        assert len(swept) == (LOOK_EVERY - 1) // 2

    _run(test, monkeypatch)
