"""The dynamic batcher's queues (:mod:`trionserve.schedulers.dynamic_batch`): a
queued request's entry and one priority level's policy with its two queues (the
requests in arrival order, and those delayed by a DELAY queue timeout), as
Triton core's ``PriorityQueue`` keeps them (src/scheduler_utils.cc); and the
batch an instance's thread holds for its delay, which requests may still join."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from trionserve.core.inference import InferenceRequest

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelQueuePolicy
    from trionserve.schedulers.batcher_outlet import BatcherOutlet
    from trionserve.schedulers.scheduler import HeldBatch

# Entry states. An entry leaves its deque lazily (when it reaches the front or the
# deque is compacted); its state says whether it still counts.
QUEUED = 0
DELAYED = 1
GONE = 2

DELAY_ACTION = 1  # ModelQueuePolicy.TimeoutAction.DELAY


class Entry:
    __slots__ = ("request", "level", "size", "state")

    def __init__(self, request: InferenceRequest, level: int, size: int) -> None:
        self.request = request
        self.level = level
        self.size = size
        self.state = QUEUED


class Level:
    """One priority level's queue policy and its two queues."""

    __slots__ = (
        "number",
        "delay_on_timeout",
        "timeout_us",
        "allow_override",
        "max_queue_size",
        "queue",
        "delayed",
        "count",
    )

    def __init__(self, number: int, policy: ModelQueuePolicy) -> None:
        self.number = number
        self.delay_on_timeout = policy.timeout_action == DELAY_ACTION
        self.timeout_us = policy.default_timeout_microseconds
        self.allow_override = policy.allow_timeout_override
        self.max_queue_size = policy.max_queue_size
        self.queue: deque[Entry] = deque()  # state QUEUED entries, oldest first
        self.delayed: deque[Entry] = deque()  # state DELAYED entries
        self.count = 0  # entries still queued or delayed

    def timeout_for(self, request: InferenceRequest) -> int:
        """The request's queue timeout in microseconds (0: none).

        A request may shorten the default timeout when the policy allows overrides
        (and, with no default timeout, set one), never lengthen it.
        """
        timeout = self.timeout_us
        override = request.timeout_us
        if self.allow_override and override and (timeout == 0 or override < timeout):
            timeout = override
        return timeout

    def trim(self) -> None:
        """Drop entries that left the queues from the fronts; compact if needed."""
        queue, delayed = self.queue, self.delayed
        while queue and queue[0].state != QUEUED:
            queue.popleft()
        while delayed and delayed[0].state != DELAYED:
            delayed.popleft()
        if len(queue) + len(delayed) > 2 * self.count + 64:
            self.queue = deque(e for e in queue if e.state == QUEUED)
            self.delayed = deque(e for e in delayed if e.state == DELAYED)

    def entries(self) -> Iterator[Entry]:
        """Live entries in the order they are batched."""
        for entry in self.queue:
            if entry.state == QUEUED:
                yield entry
        for entry in self.delayed:
            if entry.state == DELAYED:
                yield entry


class OpenBatch:
    """The batch an instance's thread holds until its delay ends (see
    :meth:`~trionserve.schedulers.dynamic_batch.DynamicBatchScheduler._hold_in_thread`):
    what a request must match to join it."""

    __slots__ = ("batch", "outlet", "size", "key")

    def __init__(self, batch: HeldBatch, outlet: BatcherOutlet, size: int, key: tuple | None):
        self.batch = batch
        self.outlet = outlet
        self.size = size  # its total batch size
        self.key = key  # its shapes (see _shape_key), when they must match
