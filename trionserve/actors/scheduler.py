"""Schedulers: how a model version's requests become batches for its executors.

A scheduler owns the model's request queue. ``submit`` puts one validated request
in; each executor takes batches through its own :class:`BatchOutlet` and hands the
outcomes back through it, which lets a scheduler deliver them in order. The
dynamic, sequence and ensemble schedulers implement the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import trio

from trionserve.core.errors import TritonError
from trionserve.core.types import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import FailureReason, to_ns

# Bound of a model's request queue when its config sets none: requests beyond it
# wait in submit() (backpressure, cancellable by the client).
QUEUE_CAPACITY = 1024

Outcome = InferenceResponse | TritonError


class BatchOutlet(Protocol):
    """One executor's end of its scheduler.

    ``receive`` waits for the next batch (raises EndOfChannel or
    ClosedResourceError when the scheduler has no more work for this executor);
    ``complete`` is called exactly once per received batch with one outcome per
    request passed; ``close`` says the executor takes no more batches.
    """

    async def receive(self) -> list[InferenceRequest]: ...

    def complete(self, requests: Sequence[InferenceRequest], outcomes: Sequence[Outcome]) -> None: ...

    def close(self) -> None: ...


class Scheduler(Protocol):
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, or until closed and drained."""

    async def submit(self, request: InferenceRequest) -> None:
        """Queue a request; waits while the queue is full (backpressure), or raises
        Unavailable where the configuration says to reject."""

    def outlet(self) -> BatchOutlet:
        """A new outlet for one executor."""

    def close(self) -> None:
        """Accept no more requests; executors finish what is queued, then stop."""

    def abort(self, error: TritonError) -> None:
        """Answer every request still queued with ``error`` (after the executors
        are gone)."""


def deliver_outcomes(
    requests: Sequence[InferenceRequest], outcomes: Sequence[Outcome]
) -> None:
    """Answer each request with its outcome, on the Trio thread."""
    for request, outcome in zip(requests, outcomes):
        if isinstance(outcome, InferenceResponse):
            request.respond(outcome)
        else:
            request.fail(outcome)


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

    def __init__(self, capacity: int = QUEUE_CAPACITY, statistics=None) -> None:
        self._send, self._receive = trio.open_memory_channel[list[InferenceRequest]](capacity)
        self._statistics = statistics

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
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


def create_scheduler(config, statistics) -> Scheduler:
    """The scheduler a model configuration asks for."""
    if config.HasField("dynamic_batching"):
        from trionserve.actors.batcher import DynamicBatchScheduler

        return DynamicBatchScheduler(config, statistics)
    return DefaultScheduler(statistics=statistics)
