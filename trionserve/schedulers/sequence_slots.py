"""The sequence batcher's bookkeeping per executor: its sequence slots, the batch
it holds, and its outlet (the end its executor takes batches from).

Each executor is an :class:`Instance` with sequence slots, one sequence bound to
each (Triton core ``sequence_batch_scheduler/sequence_batch_scheduler.cc``:
the batcher slots of SequenceBatchScheduler, one SequenceBatch per model
instance); a batch is a list of :class:`Row`, one per batch position. The scheduler
that owns them is
:class:`~trionserve.schedulers.sequence_batch.SequenceBatchScheduler`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import trio

from trionserve.core.inference import InferenceRequest, RequestedOutput, Tensor

if TYPE_CHECKING:
    from trionserve.schedulers.scheduler import DelayedRun, DirectRun, DirectRunAsync, Outcome
    from trionserve.schedulers.sequence_state import Sequence


class SlotOwner(Protocol):
    """What an :class:`Outlet` tells the scheduler that owns its instance."""

    def _outlet_ready(self, instance: Instance) -> None: ...

    def _complete(
        self, instance: Instance, requests: Seq[InferenceRequest], outcomes: Seq[Outcome]
    ) -> None: ...

    def _outlet_gone(self, instance: Instance, untaken: bool) -> None: ...


class Row:
    """One batch position: a sequence's request, or a null request (no sequence).

    ``inputs`` and ``outputs`` are the request's own, given back when it completes.
    """

    __slots__ = ("request", "sequence", "inputs", "outputs")

    def __init__(
        self,
        request: InferenceRequest,
        sequence: Sequence | None,
        inputs: dict[str, Tensor],
        outputs: list[RequestedOutput] | None,
    ) -> None:
        self.request = request
        self.sequence = sequence
        self.inputs = inputs
        self.outputs = outputs


class Instance:
    """One executor as the scheduler sees it: its sequence slots and its mailbox."""

    __slots__ = ("number", "slots", "outlet", "waiting", "rows", "alive")

    def __init__(self, number: int, slot_count: int) -> None:
        self.number = number
        self.slots: list[Sequence | None] = [None] * slot_count
        self.outlet: Outlet | None = None
        self.waiting = False  # its executor waits for a batch
        self.rows: list[Row] = []  # the batch it holds
        self.alive = True


class Outlet:
    """One executor's end: ``receive`` says it is idle and waits for its batch;
    ``close`` withdraws it and gives back a batch it was sent but never took."""

    __slots__ = ("_scheduler", "_instance", "_send", "_receive", "_posted", "closed")

    def __init__(self, scheduler: SlotOwner, instance: Instance) -> None:
        self._scheduler = scheduler
        self._instance = instance
        self._send, self._receive = trio.open_memory_channel[list[InferenceRequest]](1)
        self._posted = False
        self.closed = False

    async def receive(self) -> list[InferenceRequest]:
        if self.closed:
            raise trio.ClosedResourceError
        if not self._posted:
            self._posted = True
            self._scheduler._outlet_ready(self._instance)
        batch = await self._receive.receive()
        self._posted = False
        return batch

    async def receive_direct(
        self, run: DirectRun, handover: DirectRun | None = None, delayed: DelayedRun | None = None
    ) -> list[InferenceRequest]:
        return await self.receive()  # the scheduler forms every batch

    async def receive_direct_async(self, run: DirectRunAsync) -> list[InferenceRequest]:
        return await self.receive()  # the scheduler forms every batch

    def offer_again(self) -> None:
        pass  # never hands a batch over

    def complete(self, requests: Seq[InferenceRequest], outcomes: Seq[Outcome]) -> None:
        self._scheduler._complete(self._instance, requests, outcomes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._receive.receive_nowait()
            untaken = True
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            untaken = False
        self._send.close()
        self._receive.close()
        self._scheduler._outlet_gone(self._instance, untaken)

    def put(self, batch: list[InferenceRequest]) -> None:
        self._send.send_nowait(batch)

    def finish(self) -> None:
        self._send.close()
