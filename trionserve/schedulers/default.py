"""DefaultScheduler: each request is its own batch (no batching configured)."""

from __future__ import annotations

import trio

from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest
from trionserve.observability.statistics import FailureReason, ModelStatistics, to_ns
from trionserve.schedulers.scheduler import (
    QUEUE_CAPACITY,
    BatchOutlet,
    DelayedRun,
    DirectRun,
    DirectRunAsync,
    deliver_outcomes,
)

# Queued batches an executor that runs them inline takes in a row without a task
# switch (so at most 16 x its inline budget, 2.4 ms for ONNX Runtime's, before the
# other tasks run again).
EAGER_BATCHES = 16


class _ChannelOutlet:
    """An outlet over a clone of the shared batch channel: no ordering to keep."""

    __slots__ = (
        "_channel",
        "_eager",
        "_scheduler",
        "close",
        "complete",
        "held",
        "in_flight",
        "offered",
        "receive",
    )

    def __init__(self, scheduler: DefaultScheduler, channel: trio.MemoryReceiveChannel) -> None:
        self._scheduler = scheduler
        self._channel = channel
        self._eager = 0  # batches taken in a row without a checkpoint
        # The run this outlet's executor offers while it waits in
        # receive_direct_async (None otherwise).
        self.offered: DirectRunAsync | None = None
        # True while a submitting task runs a batch with this outlet's executor
        # (see DefaultScheduler.submit), and the requests its executor took from
        # the channel meanwhile: they wait for that run to end, still pending.
        self.in_flight = False
        self.held = 0
        self.receive = channel.receive
        self.close = channel.close
        self.complete = deliver_outcomes

    async def _receive_queued(self) -> list[InferenceRequest]:
        """The next queued batch, in order, without a task switch for up to
        EAGER_BATCHES in a row (each runs inline or waits for its stub anyway),
        then with one so the other tasks run."""
        if self._eager < EAGER_BATCHES:
            self._eager += 1
            return self._channel.receive_nowait()
        self._eager = 0
        return await self.receive()

    def take_nowait(self) -> list[InferenceRequest] | None:
        """The next queued batch if there is one (taken to be posted behind the
        batch an instance runs: see PipelinedAsyncBackendInstance)."""
        try:
            return self._channel.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return None

    async def receive_direct(
        self, run: DirectRun, handover: DirectRun | None = None, delayed: DelayedRun | None = None
    ) -> list[InferenceRequest]:
        """``receive``, offering ``run`` meanwhile: while this executor waits here
        with nothing queued, ``submit`` may hand a request straight to it (the
        offer stands until a request goes through the channel)."""
        if self._channel.statistics().current_buffer_used:
            return await self._receive_queued()
        self._eager = 0
        direct = self._scheduler._direct
        direct.append(run)
        try:
            return await self.receive()
        finally:
            if run in direct:
                direct.remove(run)

    async def receive_direct_async(self, run: DirectRunAsync) -> list[InferenceRequest]:
        """``receive``, offering ``run`` meanwhile: while this executor waits here
        with nothing queued, ``submit`` may run a request with it in the
        submitting task (see DefaultScheduler.submit)."""
        # A queued batch is taken at once (no task switch for EAGER_BATCHES in
        # a row, then one), found by trying to take it: the channel's
        # statistics() builds an object on every call of a busy stub's executor.
        if self._eager >= EAGER_BATCHES:
            self._eager = 0
            await trio.lowlevel.checkpoint()
        try:
            batch = self._channel.receive_nowait()
        except trio.WouldBlock:
            pass
        else:
            self._eager += 1
            return batch
        self._eager = 0
        offers = self._scheduler._direct_async
        self.offered = run
        offers.append(self)
        try:
            batch = await self.receive()
        finally:
            self.offered = None
            if self in offers:
                offers.remove(self)
        if self.in_flight:
            # The executor waits for the run in the submitting task to end
            # before it takes this batch to its instance: pending until then, as
            # Triton counts a request pending until an instance takes it.
            self.held += len(batch)
            self._scheduler._held += len(batch)
        return batch

    def offer_again(self) -> None:
        pass  # hands nothing over (``run`` runs inline, and its offer stands)


class DefaultScheduler:
    """Each request is its own batch, taken by the next idle instance.

    Owns the model's batch channel; the queue bound is the channel's capacity, so
    a burst beyond it waits in ``submit`` (cancellable by the client) instead of
    growing memory without bound. Executors share the channel, so whichever is idle
    takes the next request, and no task stands between a request and its executor.

    A request that finds nothing queued and an executor waiting with nothing in
    flight is run by that executor at once, in the submitting task, when the
    executor says it runs that batch inline (see ``receive_direct``): no channel
    hop and no task switch. As Triton core without dynamic batching hands a
    request straight to the model's instances, not through a batcher thread
    (src/dynamic_batch_scheduler.cc Enqueue, ``!dynamic_batching_enabled_``).
    An executor whose instance computes in another process offers itself the
    same way (``receive_direct_async``): the submitting task sends the request
    to the process and waits for the answer itself, so a call crosses no
    executor task (two task steps and a channel hop fewer), as Triton's
    instance thread waits on its stub itself (python_be.cc ProcessRequests).
    While one runs so, the next request goes through the channel; the executor
    offers itself again only after that channel was used, once it looked at it.
    """

    def __init__(
        self, capacity: int = QUEUE_CAPACITY, statistics: ModelStatistics | None = None
    ) -> None:
        self._send, self._receive = trio.open_memory_channel[list[InferenceRequest]](capacity)
        self._statistics = statistics
        # Executors waiting in receive_direct with nothing in flight, the latest
        # last. Emptied whenever a batch goes through the channel (one of them
        # takes it): each offers itself again when it waits next.
        self._direct: list[DirectRun] = []
        # Outlets whose executors wait in receive_direct_async, the latest last,
        # and how many batches went through the channel so far: an outlet whose
        # run ended offers itself again only if none did meanwhile (its executor
        # may have been handed one).
        self._direct_async: list[_ChannelOutlet] = []
        self._channelled = 0
        # Requests held by executors until a run in a submitting task ends (see
        # _ChannelOutlet.receive_direct_async): still pending.
        self._held = 0
        self._closed = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def submit(self, request: InferenceRequest) -> None:
        request.arrival_time = trio.current_time()
        batch = [request]
        direct = self._direct
        if direct and not self._closed and direct[-1](batch):
            return
        direct.clear()
        offers = self._direct_async
        if offers and not self._closed:
            outlet = offers.pop()
            run, channelled = outlet.offered, self._channelled
            assert run is not None  # set while it is offered
            outlet.in_flight = True
            try:
                taken = await run(batch)
            finally:
                outlet.in_flight = False
                self._held -= outlet.held
                outlet.held = 0
                if outlet.offered is run and channelled == self._channelled and not self._closed:
                    offers.append(outlet)
            if taken:
                return
        offers.clear()
        self._channelled += 1
        try:
            self._send.send_nowait(batch)
        except trio.WouldBlock:
            await self._send.send(batch)

    @property
    def pending(self) -> int:
        """Requests queued (or waiting for room) and not yet taken by an instance."""
        statistics = self._send.statistics()
        return statistics.current_buffer_used + statistics.tasks_waiting_send + self._held

    def outlet(self) -> BatchOutlet:
        return _ChannelOutlet(self, self._receive.clone())

    def close(self) -> None:
        self._closed = True
        self._direct.clear()
        self._direct_async.clear()
        self._send.close()

    def abort(self, error: TritonError) -> None:
        self.close()
        while True:
            try:
                batch = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            for request in batch:
                # Counted as a failure, as the dynamic batcher counts its aborts
                # (the simulations found these missing from the statistics).
                if request.fail(error) and self._statistics is not None:
                    self._statistics.record_failure(
                        to_ns(trio.current_time() - request.arrival_time), FailureReason.OTHER
                    )
        self._receive.close()
