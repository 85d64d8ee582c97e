"""A request submitted with nothing queued and an executor ready: the batch the
batcher would form of it alone goes straight to that executor, without the
queues (``DynamicBatchScheduler.submit``'s straight way), as the same batch formed through
them would have. Sequenced by events; the delays that must not pass are a minute.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.unit import test_batcher
from tests.unit.test_batch_held import MINUTE_US, _Held, _idle_executor, _Steps
from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler


def test_without_a_delay_a_lone_request_goes_straight_whatever_its_queue_policy():
    """No step of the batcher's task, no queue level made, no queue timeout
    kept (it leaves at once); the next request, with the executor busy, is
    queued as before and goes when the executor offers itself."""

    async def main() -> None:
        batcher = DynamicBatchScheduler(
            test_batcher.make_config(
                "priority_levels: 2 default_priority_level: 2 "
                "default_queue_policy { default_timeout_microseconds: 60000000 "
                "allow_timeout_override: true max_queue_size: 1 }"
            )
        )
        held: list[_Held] = []
        handed: list[list[str]] = []
        steps = _Steps()
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            outlet = await _idle_executor(nursery, batcher, held, handed)
            trio.lowlevel.add_instrument(steps)
            try:
                await batcher.submit(test_batcher.request("a", priority=1, timeout_us=10))
                assert handed == [["a"]] and batcher.pending == 0
                assert batcher._levels == {} and batcher._deadlines == []
                await trio.testing.wait_all_tasks_blocked()
                assert steps.steps == 0
            finally:
                trio.lowlevel.remove_instrument(steps)
            await batcher.submit(test_batcher.request("b"))  # the executor is busy
            assert handed == [["a"]] and batcher.pending == 1
            outlet.complete([], [])
            outlet.offer_again()
            assert handed == [["a"], ["b"]] and held == [] and batcher.pending == 0
            outlet.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_refused_hand_over_goes_to_the_executor_through_its_channel_once():
    async def main() -> None:
        batcher = DynamicBatchScheduler(test_batcher.make_config(""))
        outlet = batcher.outlet()
        offered: list[list[str]] = []
        received: list[list[str]] = []

        def refuse(batch) -> bool:
            offered.append([r.id for r in batch])
            return False

        async def executor() -> None:
            batch = await outlet.receive_direct(lambda batch: False, refuse, None)
            received.append([r.id for r in batch])

        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            nursery.start_soon(executor)
            await trio.testing.wait_all_tasks_blocked()
            await batcher.submit(test_batcher.request("a"))
            await trio.testing.wait_all_tasks_blocked()
            assert offered == [["a"]] and received == [["a"]] and batcher.pending == 0
            outlet.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_with_a_delay_a_lone_request_of_a_preferred_size_goes_straight_and_others_are_held():
    async def main() -> None:
        batcher = DynamicBatchScheduler(
            test_batcher.make_config(
                f"max_queue_delay_microseconds: {MINUTE_US} preferred_batch_size: [ 2 ]"
            )
        )
        held: list[_Held] = []
        handed: list[list[str]] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            outlet = await _idle_executor(nursery, batcher, held, handed)
            first = test_batcher.request("a", batch=2)
            await batcher.submit(first)  # a preferred size: it goes now
            assert handed == [["a"]] and held == []
            outlet.complete([], [])
            outlet.offer_again()
            second = test_batcher.request("b")
            await batcher.submit(second)  # held by the thread for the delay
            assert [h.ids for h in held] == [["b"]] and handed == [["a"]]
            assert held[0].go_at == second.arrival_time + MINUTE_US / 1e6
            await batcher.submit(test_batcher.request("c"))  # joins it: the preferred size
            assert held[0].ids == ["b", "c"] and held[0].released == 1
            outlet.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_ordered_outcomes_count_the_batch_sent_straight():
    """With preserve_ordering the batch sent straight takes its place in the
    delivery order: a later batch's outcomes wait for it."""

    async def main() -> None:
        batcher = DynamicBatchScheduler(test_batcher.make_config("preserve_ordering: true"))
        held: list[_Held] = []
        handed: list[list[str]] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(batcher.run)
            outlet = await _idle_executor(nursery, batcher, held, handed)
            first, second = test_batcher.request("a"), test_batcher.request("b")
            await batcher.submit(first)
            assert handed == [["a"]] and list(outlet._tickets) == [0]
            outlet.offer_again()  # (as if a second instance took the next)
            await batcher.submit(second)
            assert handed == [["a"], ["b"]] and list(outlet._tickets) == [0, 1]
            batcher._complete(1, [second], [test_batcher.response(second)])
            assert not second.done  # waits for the first batch
            batcher._complete(0, [first], [test_batcher.response(first)])
            assert first.done and second.done
            outlet.close()
            nursery.cancel_scope.cancel()

    trio.run(main)
