"""RateLimiter: the actor that decides which model instance executes next, across models.

Triton's rate limiter (core ``src/rate_limiter.cc``, server
``docs/user_guide/rate_limiter.md``). With ``--rate-limit=execution_count`` an
instance whose instance group has a ``rate_limiter`` block executes a batch only
once every resource it lists is free, on its device or, for a ``global`` resource,
across the server; it holds them until the batch has executed. Instances that wait
are woken in the order of their scaled priority, ``execution count * max(priority,
1)`` (an instance with priority 2 gets half the executions of one with priority 1),
on a tie the higher priority first, then in the order they began to wait. The
first instance in that order that cannot get its resources blocks the ones behind
it, as in Triton, so a large request is never starved by small ones. With
``--rate-limit=off`` (the default), and for instance groups without a
``rate_limiter`` block, execution is not limited at all.

The decisions are made by :class:`ResourceTable` and :class:`WaitQueue`, plain data
with no I/O; :class:`RateLimiter` is the actor around them.
"""

from __future__ import annotations

import enum
import re
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
import trio

from trionserve.core.errors import InternalError, InvalidArgument, Unavailable

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelRateLimiter

log = structlog.get_logger(__name__)

# Triton's keys of its resource map (rate_limiter.h RESOURCE_KIND_KEY): a global
# resource, and a count given for every device (--rate-limit-resource without a
# device). Other keys are device ids.
GLOBAL_RESOURCE_KEY = -2
PER_DEVICE_RESOURCE_KEY = -1

# An executor waits for at most this many batches of one instance at once.
MAX_WAITING_PER_INSTANCE = 2
# Scheduling rounds the actor lets pass between the event that woke it and its
# grant: an executor that has just released its resources and has its next batch at
# hand stages again within them, and so competes with the instances already waiting
# (Triton re-stages such an instance inside its release, rate_limiter.cc OnRelease).
# Granting at once would give the resources to whoever waited, whatever the priorities.
SETTLE_ROUNDS = 2

ResourceMap = dict[int, dict[str, int]]


class RateLimitMode(enum.Enum):
    """``--rate-limit``; Triton's Python package names the values OFF and EXEC_COUNT."""

    OFF = "off"
    EXEC_COUNT = "execution_count"


@dataclass(frozen=True)
class RateLimiterResource:
    """One ``--rate-limit-resource``: ``count`` copies of ``name`` on ``device``
    (-1: on every device), as Triton's ``tritonserver.RateLimiterResource``."""

    name: str
    count: int
    device: int = PER_DEVICE_RESOURCE_KEY


_RESOURCE = re.compile(r"([^:]*):([^:]*)(?::([^:]*))?")


def parse_resource(text: str) -> RateLimiterResource:
    """``<name>:<count>[:<device>]``, checked as Triton's command line does
    (server ``src/command_line_parser.cc`` ParseRateLimiterResourceOption)."""
    form = (
        "--rate-limit-resource option format is '<resource_name>:<count>:<device>' or "
        f"'<resource_name>:<count>'. Got {text}"
    )
    match = _RESOURCE.fullmatch(text)
    if match is None:
        raise ValueError(form)
    name, count, device = match.groups()
    try:
        count_value = int(count)
        device_value = int(device) if device is not None else PER_DEVICE_RESOURCE_KEY
    except ValueError:
        raise ValueError(form) from None
    if not name or count_value < 0 or (device is not None and device_value < 0):
        raise ValueError(form)
    return RateLimiterResource(name, count_value, device_value)


def explicit_resources(resources: Iterable[RateLimiterResource]) -> ResourceMap:
    """The counts given on the command line, by device; a resource given twice for
    one device keeps the smaller count (core ``tritonserver.cc``
    AddRateLimiterResource)."""
    table: ResourceMap = {}
    for resource in resources:
        counts = table.setdefault(resource.device, {})
        previous = counts.get(resource.name)
        counts[resource.name] = (
            resource.count if previous is None else min(previous, resource.count)
        )
    return table


@dataclass(eq=False)
class InstanceSlot:
    """One registered instance: what it needs to execute, and how often it has.

    ``needs`` maps GLOBAL_RESOURCE_KEY or the instance's device to resource counts.
    """

    model: str
    instance: str
    device: int
    priority: int
    needs: ResourceMap
    executions: int = 0
    registered: bool = True

    @property
    def scaled_priority(self) -> int:
        # rate_limiter.cc ScaledPriority: priority 0 counts as 1.
        return self.executions * max(self.priority, 1)


def instance_needs(config: ModelRateLimiter, device: int) -> ResourceMap:
    """The resources of a ``ModelRateLimiter`` message, keyed as Triton keys them."""
    needs: ResourceMap = {}
    for resource in config.resources:
        key = GLOBAL_RESOURCE_KEY if getattr(resource, "global") else device
        needs.setdefault(key, {})[resource.name] = resource.count
    return needs


class ResourceTable:
    """Resources available and allocated, and the needs of every registered instance.

    Available counts are Triton's (rate_limiter.cc ResourceManager): what
    ``--rate-limit-resource`` gives, or, with none given, the largest count any
    registered instance needs, so that every instance can run.
    """

    def __init__(self, explicit: ResourceMap | None = None) -> None:
        self.explicit: ResourceMap = explicit or {}
        self.slots: list[InstanceSlot] = []
        self.available: ResourceMap = {}
        self.allocated: ResourceMap = {}

    def add(self, slot: InstanceSlot) -> None:
        """Register ``slot``; raises InvalidArgument, changing nothing, when the
        resources could never let it (or another instance) run."""
        available = self._compute([*self.slots, slot])
        self.slots.append(slot)
        self.available = available

    def remove(self, slot: InstanceSlot) -> None:
        if slot in self.slots:
            self.slots.remove(slot)
            self.available = self._compute(self.slots)

    def fits(self, slot: InstanceSlot) -> bool:
        for key, needs in slot.needs.items():
            available = self.available.get(key, {})
            allocated = self.allocated.get(key, {})
            for name, count in needs.items():
                if allocated.get(name, 0) + count > available.get(name, 0):
                    return False
        return True

    def allocate(self, slot: InstanceSlot) -> None:
        for key, needs in slot.needs.items():
            allocated = self.allocated.setdefault(key, {})
            for name, count in needs.items():
                allocated[name] = allocated.get(name, 0) + count

    def release(self, slot: InstanceSlot) -> None:
        for key, needs in slot.needs.items():
            allocated = self.allocated[key]
            for name, count in needs.items():
                allocated[name] -= count

    def _compute(self, slots: list[InstanceSlot]) -> ResourceMap:
        # The largest need of each resource on each device (UpdateMaxResource).
        needed: ResourceMap = {}
        for slot in slots:
            for key, needs in slot.needs.items():
                counts = needed.setdefault(key, {})
                for name, count in needs.items():
                    counts[name] = max(counts.get(name, 0), count)
        available = needed
        if self.explicit:
            available = {key: dict(counts) for key, counts in needed.items()}
            for key, counts in available.items():
                for name, need in counts.items():
                    given = self._explicit_count(key, name)
                    if given < need:
                        raise InvalidArgument(
                            f'Resource count for "{name}" is limited to {given} which will '
                            "prevent scheduling of one or more model instances, the minimum "
                            f"required count is {need}"
                        )
                    counts[name] = given
        for name in available.get(GLOBAL_RESOURCE_KEY, {}):
            for key, counts in available.items():
                if key != GLOBAL_RESOURCE_KEY and name in counts:
                    raise InvalidArgument(
                        f'Resource "{name}" is present as both global and device-specific '
                        "resource in the model configuration."
                    )
        return available

    def _explicit_count(self, key: int, name: str) -> int:
        """ParseAndValidateExplicitResources: a global resource takes the largest
        count given for it on any device; a device's resource the larger of the
        count given for that device and the one given for every device; 0 when
        none is given."""
        if key == GLOBAL_RESOURCE_KEY:
            return max((c.get(name, 0) for c in self.explicit.values()), default=0)
        return max(
            self.explicit.get(key, {}).get(name, 0),
            self.explicit.get(PER_DEVICE_RESOURCE_KEY, {}).get(name, 0),
        )


@dataclass(eq=False)
class Waiter:
    """One batch of one instance waiting for its resources."""

    slot: InstanceSlot
    order: int
    event: trio.Event = field(default_factory=trio.Event)
    granted: bool = False
    error: Unavailable | None = None


class WaitQueue:
    """The instances waiting to execute, bounded by MAX_WAITING_PER_INSTANCE each.

    ``grant`` allocates in order (scaled priority, priority, arrival) for as long as the
    first waiter's resources are free, and returns the waiters it granted.
    """

    def __init__(self, table: ResourceTable) -> None:
        self.table = table
        self.waiters: list[Waiter] = []
        self._arrivals = 0

    def stage(self, slot: InstanceSlot) -> Waiter:
        if not slot.registered:
            raise Unavailable(
                f"model instance '{slot.instance}' of model '{slot.model}' was unloaded"
            )
        if sum(1 for w in self.waiters if w.slot is slot) >= MAX_WAITING_PER_INSTANCE:
            raise InternalError(
                f"model instance '{slot.instance}' of model '{slot.model}' already waits "
                f"for {MAX_WAITING_PER_INSTANCE} executions"
            )
        self._arrivals += 1
        waiter = Waiter(slot, self._arrivals)
        self.waiters.append(waiter)
        return waiter

    def withdraw(self, waiter: Waiter) -> None:
        if waiter in self.waiters:
            self.waiters.remove(waiter)

    def release(self, slot: InstanceSlot) -> None:
        """An execution of ``slot`` ended (rate_limiter.cc Release: counted then)."""
        slot.executions += 1
        self.table.release(slot)

    def grant(self) -> list[Waiter]:
        granted = []
        while self.waiters:
            first = min(self.waiters, key=_grant_order)
            if not self.table.fits(first.slot):
                break
            self.waiters.remove(first)
            self.table.allocate(first.slot)
            first.granted = True
            granted.append(first)
        return granted

    def evict(self, slot: InstanceSlot, error: Unavailable) -> list[Waiter]:
        """Take ``slot``'s waiters out of the queue, each with ``error``."""
        evicted = [w for w in self.waiters if w.slot is slot]
        for waiter in evicted:
            self.waiters.remove(waiter)
            waiter.error = error
        return evicted


def _grant_order(waiter: Waiter) -> tuple[int, int, int]:
    """Scaled priority (rate_limiter.cc ScaledPriorityComparator); on a tie the
    higher priority (the smaller number), then the longer wait."""
    slot = waiter.slot
    return (slot.scaled_priority, max(slot.priority, 1), waiter.order)


class RateLimiter:
    """The rate limiter of one server: Triton's ``--rate-limit`` and
    ``--rate-limit-resource``.

    Owns the resource table and the queue of waiting instances. Its task (``run``,
    started in the server's nursery) wakes the waiters that ``grant`` picks each
    time resources are freed or an instance begins to wait. Guarantees: a waiter
    that is cancelled leaves the queue and, if it had been granted meanwhile, gives
    its resources back; ``release`` returns exactly what ``acquire`` took; the
    waiters of an unregistered instance (its model unloads) leave with Unavailable.
    When the actor ends, every waiter leaves with Unavailable and no new one is taken.
    """

    def __init__(
        self,
        mode: RateLimitMode = RateLimitMode.OFF,
        resources: Iterable[RateLimiterResource] = (),
    ) -> None:
        self.mode = RateLimitMode(mode)
        self.table = ResourceTable(explicit_resources(resources))
        self.queue = WaitQueue(self.table)
        self._wakeup = trio.Event()
        self._stopped: Unavailable | None = None

    @property
    def enabled(self) -> bool:
        return self.mode is RateLimitMode.EXEC_COUNT

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await self._wakeup.wait()
                for _ in range(SETTLE_ROUNDS):
                    await trio.lowlevel.cancel_shielded_checkpoint()
                self._wakeup = trio.Event()
                for waiter in self.queue.grant():
                    waiter.event.set()
        finally:
            self._stopped = Unavailable("the rate limiter stopped: the server is shutting down")
            for waiter in list(self.queue.waiters):
                self.queue.withdraw(waiter)
                waiter.error = self._stopped
                waiter.event.set()

    # -- registration (model loads and unloads) --------------------------------

    def register(
        self, model: str, instance: str, device: int, config: ModelRateLimiter | None
    ) -> InstanceSlot | None:
        """Register one instance with its group's ``rate_limiter`` (None when the
        group has none); returns None when its executions are not limited.
        Raises InvalidArgument when the resources could never let it run."""
        if not self.enabled or config is None:
            return None
        slot = InstanceSlot(
            model, instance, device, config.priority, instance_needs(config, device)
        )
        self.table.add(slot)
        self._log_resources()
        self._poke()
        return slot

    def unregister(self, slot: InstanceSlot | None) -> None:
        """The instance is going away: its waiters leave, its resource needs no
        longer count toward the available ones."""
        if slot is None or not slot.registered:
            return
        slot.registered = False
        error = Unavailable(
            f"model instance '{slot.instance}' of model '{slot.model}' was unloaded"
        )
        for waiter in self.queue.evict(slot, error):
            waiter.event.set()
        self.table.remove(slot)
        self._log_resources()
        self._poke()

    # -- execution (the executors) ---------------------------------------------

    async def acquire(self, slot: InstanceSlot) -> None:
        """Wait until ``slot``'s resources are allocated to it."""
        if self._stopped is not None:
            raise self._stopped
        waiter = self.queue.stage(slot)
        self._poke()
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release(slot)
            else:
                self.queue.withdraw(waiter)
                self._poke()  # it may have blocked the ones behind it
            raise
        if waiter.error is not None:
            raise waiter.error

    def release(self, slot: InstanceSlot) -> None:
        self.queue.release(slot)
        self._poke()

    @asynccontextmanager
    async def execution(self, slot: InstanceSlot) -> AsyncIterator[None]:
        """Hold ``slot``'s resources for the body (one execution)."""
        await self.acquire(slot)
        try:
            yield
        finally:
            self.release(slot)

    def _log_resources(self) -> None:
        """The available counts, at verbose level, in Triton's words (rate_limiter.cc
        ParseAndValidateResources), its tabs and newlines escaped as Triton's log
        writes them."""
        lines = ["", "Max Resource Map===>"]
        for key, counts in sorted(self.table.available.items()):
            if counts:
                lines.append(f"\tDevice: {'GLOBAL' if key == GLOBAL_RESOURCE_KEY else key}")
                lines += [f"\t\tResource: {n}\t Count: {c}" for n, c in sorted(counts.items())]
        log.debug("\n".join(lines).encode("unicode_escape").decode("ascii"))

    def _poke(self) -> None:
        self._wakeup.set()
