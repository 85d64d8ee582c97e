"""The rate limiter's decisions (resource table, wait queue) and its actor, in virtual time.

Triton's rules (core src/rate_limiter.cc): available counts are the command line's or
the largest need; a resource is per device unless global; waiters are granted in the
order of execution count * priority, then arrival, while the first one's resources
are free.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trionserve._generated import model_config_pb2 as mc
from trionserve.actors.rate_limiter import (
    GLOBAL_RESOURCE_KEY,
    MAX_WAITING_PER_INSTANCE,
    InstanceSlot,
    RateLimiter,
    RateLimiterResource,
    RateLimitMode,
    ResourceTable,
    WaitQueue,
    explicit_resources,
    parse_resource,
)
from trionserve.core.errors import InternalError, InvalidArgument, Unavailable


def limiter_config(*resources: tuple[str, int, bool], priority: int = 0) -> mc.ModelRateLimiter:
    config = mc.ModelRateLimiter(priority=priority)
    for name, count, is_global in resources:
        resource = config.resources.add(name=name, count=count)
        setattr(resource, "global", is_global)
    return config


def slot(name: str, needs: dict, priority: int = 0, device: int = 0) -> InstanceSlot:
    return InstanceSlot(name, f"{name}_0", device, priority, needs)


# -- parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("R1:10", RateLimiterResource("R1", 10, -1)),
        ("R2:5:0", RateLimiterResource("R2", 5, 0)),
        ("R2:8:1", RateLimiterResource("R2", 8, 1)),
    ],
)
def test_parse_resource(text, expected):
    assert parse_resource(text) == expected


@pytest.mark.parametrize("text", ["R1", "R1:x", "R1:1:2:3", ":4", "R1:1:dev", "R1:-1"])
def test_parse_resource_refuses_with_tritons_message(text):
    with pytest.raises(ValueError, match=f"option format is .*Got {text}"):
        parse_resource(text)


def test_a_resource_given_twice_for_a_device_keeps_the_smaller_count():
    table = explicit_resources(
        [
            RateLimiterResource("R1", 10),
            RateLimiterResource("R1", 4),
            RateLimiterResource("R1", 7, 1),
        ]
    )
    assert table == {-1: {"R1": 4}, 1: {"R1": 7}}


# -- the resource table --------------------------------------------------------------


def test_without_explicit_counts_the_largest_need_is_available():
    # The example of Triton's docs/user_guide/rate_limiter.md "Resources".
    table = ResourceTable()
    table.add(slot("A", {0: {"R1": 4, "R2": 4}}))
    table.add(slot("B", {0: {"R2": 5, "R3": 10, "R4": 5}}))
    table.add(slot("C", {0: {"R1": 1, "R3": 7, "R4": 2}}))
    assert table.available == {0: {"R1": 4, "R2": 5, "R3": 10, "R4": 5}}


def test_explicit_counts_per_device_and_for_every_device():
    # docs/user_guide/rate_limiter.md: R1:10 R2:5:0 R2:8:1 R3:2, R3 global.
    given = [
        RateLimiterResource("R1", 10),
        RateLimiterResource("R2", 5, 0),
        RateLimiterResource("R2", 8, 1),
        RateLimiterResource("R3", 2),
    ]
    table = ResourceTable(explicit_resources(given))
    table.add(slot("A", {0: {"R1": 1, "R2": 1}}, device=0))
    table.add(slot("B", {1: {"R1": 1, "R2": 1}}, device=1))
    table.add(slot("C", {GLOBAL_RESOURCE_KEY: {"R3": 1}}))
    assert table.available == {
        GLOBAL_RESOURCE_KEY: {"R3": 2},
        0: {"R1": 10, "R2": 5},
        1: {"R1": 10, "R2": 8},
    }


@pytest.mark.parametrize(
    ("given", "needs", "message"),
    [
        # qa/L0_rate_limiter Case1 and Case3 (a count for another device only).
        (
            [("resource1", 1, -1)],
            {0: {"resource1": 4}},
            "limited to 1 .* minimum required count is 4",
        ),
        (
            [("resource1", 10, 10)],
            {0: {"resource1": 4}},
            "limited to 0 .* minimum required count is 4",
        ),
        ([("R2", 2, -1)], {0: {"R1": 1}}, 'Resource count for "R1" is limited to 0'),
    ],
)
def test_explicit_counts_below_a_need_refuse_the_instance(given, needs, message):
    table = ResourceTable(explicit_resources(RateLimiterResource(*g) for g in given))
    with pytest.raises(InvalidArgument, match=message):
        table.add(slot("A", needs))
    assert table.slots == [] and table.available == {}


def test_a_global_resource_takes_the_largest_count_given_on_any_device():
    table = ResourceTable(explicit_resources([RateLimiterResource("R1", 4, 1)]))
    table.add(slot("A", {GLOBAL_RESOURCE_KEY: {"R1": 4}}))
    assert table.available == {GLOBAL_RESOURCE_KEY: {"R1": 4}}


def test_a_resource_both_global_and_per_device_is_refused():
    table = ResourceTable()
    table.add(slot("A", {GLOBAL_RESOURCE_KEY: {"resource2": 2}}))
    with pytest.raises(
        InvalidArgument,
        match='Resource "resource2" is present as both global and device-specific resource',
    ):
        table.add(slot("B", {0: {"resource2": 2}}))
    assert len(table.slots) == 1


def test_removing_an_instance_recomputes_the_largest_need():
    table = ResourceTable()
    big, small = slot("A", {0: {"R1": 4}}), slot("B", {0: {"R1": 2}})
    table.add(big)
    table.add(small)
    table.remove(big)
    assert table.available == {0: {"R1": 2}}


def test_per_device_resources_are_counted_per_device_global_ones_across():
    table = ResourceTable()
    on0, on1 = slot("A", {0: {"R1": 2}}, device=0), slot("A", {1: {"R1": 2}}, device=1)
    g0, g1 = (
        slot("G", {GLOBAL_RESOURCE_KEY: {"R2": 2}}),
        slot("H", {GLOBAL_RESOURCE_KEY: {"R2": 2}}),
    )
    for s in (on0, on1, g0, g1):
        table.add(s)
    table.allocate(on0)
    assert table.fits(on1)  # its own device's R1
    table.allocate(g0)
    assert not table.fits(g1)  # the one R2 of the server
    table.release(g0)
    assert table.fits(g1)


# -- the wait queue: a state table ---------------------------------------------------

# Two models exclusive on R1 (capacity 1), priorities 1 and 2, each always waiting
# again right after it executed: (event, expected grant).
PRIORITY_TABLE = [
    ("stage B", None),
    ("stage A", None),
    ("grant", "A"),  # both at 0 executions: the higher priority first
    ("release A, stage A", None),
    ("grant", "B"),  # A 1*1, B 0*2
    ("release B, stage B", None),
    ("grant", "A"),  # A 1*1 < B 1*2
    ("release A, stage A", None),
    ("grant", "A"),  # A 2*1 = B 1*2: the higher priority
    ("release A, stage A", None),
    ("grant", "B"),  # A 3 > B 2
    ("release B, stage B", None),
    ("grant", "A"),  # A 3 < B 4
    ("release A, stage A", None),
    ("grant", "A"),  # A 4 = B 4
    ("release A, stage A", None),
    ("grant", "B"),  # A 5 > B 4
]


def test_priority_state_table():
    table = ResourceTable()
    slots = {"A": slot("A", {0: {"R1": 1}}, priority=1), "B": slot("B", {0: {"R1": 1}}, priority=2)}
    for s in slots.values():
        table.add(s)
    queue = WaitQueue(table)
    for event, expected in PRIORITY_TABLE:
        if event == "grant":
            granted = queue.grant()
            assert [w.slot.model for w in granted] == [expected], event
            continue
        for step in event.split(", "):
            action, name = step.split()
            if action == "stage":
                queue.stage(slots[name])
            else:
                queue.release(slots[name])


def test_equal_priorities_take_turns_in_arrival_order():
    table = ResourceTable()
    a, b = slot("A", {0: {"R1": 1}}), slot("B", {0: {"R1": 1}})
    table.add(a)
    table.add(b)
    queue = WaitQueue(table)
    queue.stage(b)
    queue.stage(a)
    order = []
    for _ in range(4):
        (granted,) = queue.grant()
        order.append(granted.slot.model)
        queue.release(granted.slot)
        queue.stage(granted.slot)
    assert order == ["B", "A", "B", "A"]


def test_the_first_waiter_blocks_those_behind_it():
    table = ResourceTable()
    big, small, other = (
        slot("big", {0: {"R1": 4}}),
        slot("small", {0: {"R1": 1}}),
        slot("other", {0: {"R1": 1}}),
    )
    for s in (big, small, other):
        table.add(s)
    queue = WaitQueue(table)
    queue.stage(other)
    assert [w.slot for w in queue.grant()] == [other]
    queue.stage(big)
    queue.stage(small)
    assert queue.grant() == []  # big needs all four; small waits behind it
    queue.release(other)
    assert [w.slot for w in queue.grant()] == [big]


def test_waiters_of_one_instance_are_bounded():
    table = ResourceTable()
    a = slot("A", {0: {"R1": 1}})
    table.add(a)
    queue = WaitQueue(table)
    for _ in range(MAX_WAITING_PER_INSTANCE):
        queue.stage(a)
    with pytest.raises(InternalError, match="already waits"):
        queue.stage(a)


# -- the actor, in virtual time ------------------------------------------------------


async def test_off_mode_and_groups_without_a_rate_limiter_are_not_registered():
    off = RateLimiter(RateLimitMode.OFF)
    assert off.register("A", "A_0", 0, limiter_config(("R1", 1, False))) is None
    on = RateLimiter(RateLimitMode.EXEC_COUNT)
    assert on.register("A", "A_0", 0, None) is None
    assert on.register("A", "A_0", 0, limiter_config(("R1", 1, False))) is not None


async def test_actor_grants_in_priority_order_and_never_beyond_the_count(
    autojump_clock: trio.testing.MockClock,
):
    limiter = RateLimiter(RateLimitMode.EXEC_COUNT, [RateLimiterResource("R1", 1)])
    a = limiter.register("A", "A_0", 0, limiter_config(("R1", 1, False), priority=1))
    b = limiter.register("B", "B_0", 0, limiter_config(("R1", 1, False), priority=2))
    assert a is not None and b is not None
    order: list[str] = []
    running = 0

    async def instance(s: InstanceSlot, runs: int) -> None:
        nonlocal running
        for _ in range(runs):
            async with limiter.execution(s):
                running += 1
                assert running == 1, "two executions hold the one R1"
                order.append(s.model)
                await trio.sleep(1)
                running -= 1

    async with trio.open_nursery() as nursery:
        await nursery.start(limiter.run)
        async with trio.open_nursery() as instances:
            instances.start_soon(instance, a, 6)
            await trio.testing.wait_all_tasks_blocked()
            instances.start_soon(instance, b, 3)
        nursery.cancel_scope.cancel()
    assert order == list("ABAABAABA")
    assert limiter.table.allocated == {0: {"R1": 0}}


async def test_a_cancelled_waiter_leaves_and_a_granted_one_gives_back(autojump_clock):
    limiter = RateLimiter(RateLimitMode.EXEC_COUNT)
    a = limiter.register("A", "A_0", 0, limiter_config(("R1", 1, False)))
    b = limiter.register("B", "B_0", 0, limiter_config(("R1", 1, False)))
    assert a is not None and b is not None
    async with trio.open_nursery() as nursery:
        await nursery.start(limiter.run)
        await limiter.acquire(a)
        with trio.move_on_after(5):  # b waits for R1 and is cancelled
            await limiter.acquire(b)
        assert limiter.queue.waiters == []
        limiter.release(a)
        # Granted between the grant and the wake-up: the resources go back.
        with trio.CancelScope() as scope:
            scope.cancel()
            await limiter.acquire(b)
        assert limiter.table.allocated == {0: {"R1": 0}}
        await limiter.acquire(a)  # nothing leaked: a runs again
        limiter.release(a)
        nursery.cancel_scope.cancel()


async def test_an_unregistered_instances_waiters_leave_with_unavailable(autojump_clock):
    limiter = RateLimiter(RateLimitMode.EXEC_COUNT)
    a = limiter.register("A", "A_0", 0, limiter_config(("R1", 1, False)))
    b = limiter.register("B", "B_0", 0, limiter_config(("R1", 1, False)))
    assert a is not None and b is not None
    outcome: list[BaseException] = []

    async def wait_b() -> None:
        try:
            await limiter.acquire(b)
        except Unavailable as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(limiter.run)
        await limiter.acquire(a)
        nursery.start_soon(wait_b)
        await trio.testing.wait_all_tasks_blocked()
        limiter.unregister(b)
        await trio.testing.wait_all_tasks_blocked()
        assert len(outcome) == 1 and "model 'B' was unloaded" in str(outcome[0])
        with pytest.raises(Unavailable):
            await limiter.acquire(b)
        limiter.release(a)
        nursery.cancel_scope.cancel()


async def test_waiters_leave_when_the_actor_stops(autojump_clock):
    limiter = RateLimiter(RateLimitMode.EXEC_COUNT)
    a = limiter.register("A", "A_0", 0, limiter_config(("R1", 1, False)))
    assert a is not None
    errors: list[BaseException] = []

    async def wait_a() -> None:
        try:
            await limiter.acquire(a)
        except Unavailable as exc:
            errors.append(exc)

    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as actor:
            await actor.start(limiter.run)
            await limiter.acquire(a)
            outer.start_soon(wait_a)
            await trio.testing.wait_all_tasks_blocked()
            actor.cancel_scope.cancel()
    assert len(errors) == 1 and "shutting down" in str(errors[0])
