"""inline.step and inline.Resume: a coroutine run in the calling task until it
would wait, then carried on in that task under Trio as if awaited from the start."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trionserve.protocol.grpc import inline


async def test_a_coroutine_that_never_waits_ends_in_step():
    done: list[str] = []

    async def answer() -> None:
        done.append("answered")

    assert inline.step(answer()) is None
    assert done == ["answered"]


async def test_a_coroutine_that_waits_is_carried_on_by_its_task(autojump_clock):
    event = trio.Event()
    seen: list[object] = []

    async def waits() -> None:
        seen.append(trio.lowlevel.current_task())
        await event.wait()
        await trio.sleep(1)  # a timed wait too: Trio's values come through
        seen.append(trio.lowlevel.current_task())

    async def carrier() -> None:
        resume = inline.step(waits())
        assert resume is not None
        await resume
        seen.append("returned")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(carrier)
        await trio.testing.wait_all_tasks_blocked()
        assert len(seen) == 1  # waiting in the carrier's task
        event.set()
    assert seen[0] is seen[1]  # one task throughout
    assert seen[2] == "returned"


async def test_errors_and_cancellation_reach_the_coroutine_and_its_awaiter(autojump_clock):
    async def fails() -> None:
        raise ValueError("at once")

    with pytest.raises(ValueError, match="at once"):
        inline.step(fails())

    cleaned: list[str] = []

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            cleaned.append("finally")

    with trio.move_on_after(1) as scope:
        resume = inline.step(forever())
        assert resume is not None
        await resume
    assert scope.cancelled_caught
    assert cleaned == ["finally"]


async def test_a_first_step_taken_by_the_caller_is_awaited_as_the_coroutine():
    """inline.Failed (a handler's first step taken by the connection's
    _start_calls, which raised): awaited, the error raised at once, with no
    wait, as the coroutine itself would have."""
    caught: list[object] = []

    async def catches(first) -> None:
        try:
            await first
        except LookupError as exc:
            caught.append(exc)

    error = KeyError("gone")
    assert inline.step(catches(inline.Failed(error))) is None
    assert caught == [error]
