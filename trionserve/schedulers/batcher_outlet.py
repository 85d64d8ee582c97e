"""BatcherOutlet: one executor's mailbox at the dynamic batcher
(:mod:`trionserve.schedulers.dynamic_batch`), through which it takes the batches
the batcher forms for it and hands their outcomes back."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.schedulers.scheduler import (
    DelayedRun,
    DirectRun,
    DirectRunAsync,
    Outcome,
    deliver_outcomes,
)

if TYPE_CHECKING:
    from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler

# Batches an executor takes in a row without a checkpoint when each is formed the
# moment it asks (so at most 16 batches before the other tasks run again).
EAGER_BATCHES = 16


class BatcherOutlet:
    """One executor's mailbox at the batcher.

    ``receive`` registers the executor as idle (once) and waits for the batch the
    batcher forms for it; ``complete`` hands the outcomes back for (ordered)
    delivery, one call per batch received, in the order received (an executor may
    take its next batch before it completes the current one); ``close`` withdraws
    the executor and gives back a batch it was sent but never took, so no request
    is lost when an executor stops. ``receive_direct`` also offers the
    executor's ``handover``: while it waits, the batcher gives it a batch by
    calling that in the task that formed it (a submit, the executor's own
    ``offer_again`` as its last batch finished, the batcher's task after a
    delay), so the batch reaches the instance's thread without a pass of the
    run loop; the executor says when it waits with nothing in flight again
    (``offer_again``). With ``delayed`` too, a batch that waits for the
    batching delay goes to the thread at once, which holds it until the delay's
    end (see DynamicBatchScheduler._hold_in_thread).
    """

    __slots__ = (
        "_batcher",
        "_delayed",
        "_eager",
        "_handover",
        "_send",
        "_receive",
        "_tickets",
        "_posted",
        "closed",
    )

    def __init__(self, batcher: DynamicBatchScheduler) -> None:
        self._batcher = batcher
        self._send, self._receive = trio.open_memory_channel[
            tuple[list[InferenceRequest], int | None]
        ](1)
        self._tickets: deque[int | None] = deque()  # of batches received, not completed
        self._posted = False
        self._eager = 0  # batches taken in a row without a checkpoint
        # The executor's hand-over while it waits in receive_direct.
        self._handover: DirectRun | None = None
        # ... and its hand-over of a batch that waits for the batching delay.
        self._delayed: DelayedRun | None = None
        self.closed = False

    async def receive(self) -> list[InferenceRequest]:
        if self.closed:
            raise trio.ClosedResourceError
        if not self._posted:
            self._posted = True
            self._batcher._outlet_ready(self)
        # A batch formed the moment this executor asked (see _outlet_ready) is
        # taken without a pass of the run loop, up to EAGER_BATCHES in a row.
        try:
            if self._eager >= EAGER_BATCHES:
                raise trio.WouldBlock
            requests, ticket = self._receive.receive_nowait()
            self._eager += 1
        except trio.WouldBlock:
            self._eager = 0
            requests, ticket = await self._receive.receive()
        self._posted = False
        self._tickets.append(ticket)
        return requests

    async def receive_direct(
        self, run: DirectRun, handover: DirectRun | None = None, delayed: DelayedRun | None = None
    ) -> list[InferenceRequest]:
        self._handover = handover
        self._delayed = delayed
        try:
            return await self.receive()
        finally:
            self._handover = None
            self._delayed = None

    def offer_again(self) -> None:
        """The executor took a batch through its hand-over and waits with nothing
        in flight again (still in ``receive_direct``): ready for the next."""
        if self._posted and not self.closed:
            self._batcher._outlet_ready(self)

    async def receive_direct_async(self, run: DirectRunAsync) -> list[InferenceRequest]:
        return await self.receive()  # the batcher forms every batch

    def complete(self, requests: Sequence[InferenceRequest], outcomes: Sequence[Outcome]) -> None:
        ticket = self._tickets.popleft()
        if ticket is not None:  # delivered in the order the batches were formed
            self._batcher._complete(ticket, requests, outcomes)
        else:
            deliver_outcomes(requests, outcomes)

    def respond(
        self,
        requests: Sequence[InferenceRequest],
        responses: Sequence[InferenceResponse],
        again: bool = False,
    ) -> None:
        """``complete`` for outcomes known to be one response per request (the
        instance's thread checked them): no look at each. ``again``: the
        executor waits with nothing in flight again (``offer_again``, written
        out first: the next batch reaches the instance before these requests'
        waiters run)."""
        if again and self._posted and not self.closed:
            self._batcher._outlet_ready(self)
        ticket = self._tickets.popleft()
        if ticket is not None:
            self._batcher._complete(ticket, requests, responses)
        else:
            for request, response in zip(requests, responses):
                request.respond(response)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            untaken = self._receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            untaken = None
        self._send.close()
        self._receive.close()
        self._batcher._outlet_gone(self, untaken)

    def quiet(self) -> bool:
        """Whether nothing waits for this executor: no request queued at the
        batcher, outcomes not held for ordering (read on the instance's thread,
        see :class:`~trionserve.backends.instance_thread.Deferred`)."""
        batcher = self._batcher
        return not (self.closed or batcher._queued or batcher._preserve_ordering)

    @property
    def ordered(self) -> bool:
        """Whether outcomes are delivered in the order the batches were formed
        (``preserve_ordering``): then an executor reports each batch whole, in
        turn (it never frees its instance before a batch's report, see
        executor.py)."""
        return self._batcher._preserve_ordering

    def put(self, requests: list[InferenceRequest], ticket: int | None) -> None:
        self._send.send_nowait((requests, ticket))

    def finish(self) -> None:
        """No more batches: the executor ends after the one it holds, if any."""
        self._send.close()
