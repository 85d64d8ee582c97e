"""DefaultScheduler: each request is its own batch (no batching configured)."""

from __future__ import annotations

import trio

from trionserve.core.errors import TritonError
from trionserve.core.types import InferenceRequest
from trionserve.observability.statistics import FailureReason, ModelStatistics, to_ns
from trionserve.schedulers.scheduler import QUEUE_CAPACITY, BatchOutlet, deliver_outcomes


class _ChannelOutlet:
    """An outlet over a clone of the shared batch channel: no ordering to keep."""

    __slots__ = ("receive", "close", "complete")

    def __init__(self, channel: trio.MemoryReceiveChannel) -> None:
        self.receive = channel.receive
        self.close = channel.close
        self.complete = deliver_outcomes


class DefaultScheduler:
    """Each request is its own batch, taken by the next idle instance.

    Owns the model's batch channel; the queue bound is the channel's capacity, so
    a burst beyond it waits in ``submit`` (cancellable by the client) instead of
    growing memory without bound. Executors share the channel, so whichever is idle
    takes the next request, and no task stands between a request and its executor.
    """

    def __init__(
        self, capacity: int = QUEUE_CAPACITY, statistics: ModelStatistics | None = None
    ) -> None:
        self._send, self._receive = trio.open_memory_channel[list[InferenceRequest]](capacity)
        self._statistics = statistics

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def submit(self, request: InferenceRequest) -> None:
        request.arrival_time = trio.current_time()
        try:
            self._send.send_nowait([request])
        except trio.WouldBlock:
            await self._send.send([request])

    @property
    def pending(self) -> int:
        """Requests queued (or waiting for room) and not yet taken by an instance."""
        statistics = self._send.statistics()
        return statistics.current_buffer_used + statistics.tasks_waiting_send

    def outlet(self) -> BatchOutlet:
        return _ChannelOutlet(self._receive.clone())

    def close(self) -> None:
        self._send.close()

    def abort(self, error: TritonError) -> None:
        self._send.close()
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
