"""Schedulers: how a model version's requests become batches for its executors.

A scheduler owns the model's request queue. ``submit`` puts one validated request in;
executors take batches out of the channel the scheduler feeds. The dynamic,
sequence and ensemble schedulers implement the same two methods.
"""

from __future__ import annotations

from typing import Protocol

import trio

from trionserve.core.types import InferenceRequest


class Scheduler(Protocol):
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or closed."""

    async def submit(self, request: InferenceRequest) -> None:
        """Queue a request; waits while the queue is full (backpressure)."""

    def close(self) -> None:
        """Accept no more requests; executors finish what is queued, then stop."""


class DefaultScheduler:
    """Each request is its own batch, taken by the next idle instance.

    Owns the send side of the model's batch channel; the queue bound is the
    channel's capacity, so a burst beyond it waits in ``submit`` (cancellable by the
    client) instead of growing memory without bound.
    """

    def __init__(self, batches: trio.MemorySendChannel[list[InferenceRequest]]) -> None:
        self._batches = batches

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def submit(self, request: InferenceRequest) -> None:
        request.arrival_time = trio.current_time()
        try:
            self._batches.send_nowait([request])
        except trio.WouldBlock:
            await self._batches.send([request])

    def close(self) -> None:
        self._batches.close()
