"""An InferenceRequest's outcome reaches whoever waits for it (``wait`` for one
response, ``stream`` for each), whether it comes before or during the wait; the
event a consumer waits on is made only by a wait that has to (virtual time:
a lost wake-up fails at once instead of hanging)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse


def response(index: int) -> InferenceResponse:
    return InferenceResponse("m", "1", id=str(index))


def run(test) -> None:
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_outcome_before_the_wait_makes_no_event():
    async def main() -> None:
        request = InferenceRequest("m")
        request.respond(response(0))
        assert (await request.wait()).id == "0"
        failed = InferenceRequest("m")
        failed.fail(InvalidArgument("no"))
        with pytest.raises(InvalidArgument):
            await failed.wait()
        assert request._wakeup is None and failed._wakeup is None

    run(main)


def test_a_waiting_consumer_is_woken_by_the_outcome():
    async def main() -> None:
        request = InferenceRequest("m")
        got: list[InferenceResponse] = []

        async def consume() -> None:
            got.append(await request.wait())

        with trio.fail_after(1):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                await trio.testing.wait_all_tasks_blocked()
                assert not got
                request.respond(response(1))
        assert [r.id for r in got] == ["1"]

    run(main)


def test_a_stream_is_woken_for_each_response_sent_during_and_before_its_waits():
    async def main() -> None:
        request = InferenceRequest("m")
        got: list[tuple[str | None, bool]] = []

        async def consume() -> None:
            async for item, final in request.stream():
                got.append((None if item is None else item.id, final))

        request.send(response(0), final=False)  # before the consumer waits
        with trio.fail_after(1):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                for index in (1, 2):
                    await trio.testing.wait_all_tasks_blocked()
                    assert len(got) == index
                    request.send(response(index), final=False)
                await trio.testing.wait_all_tasks_blocked()
                request.send(None, final=True)
        assert got == [("0", False), ("1", False), ("2", False), (None, True)]

    run(main)
