"""The scheduler interface: how a model version's requests become batches for its
executors (Triton core's ``Scheduler``).

A scheduler owns the model's request queue. ``submit`` puts one validated request
in; each executor takes batches through its own :class:`BatchOutlet` and hands the
outcomes back through it, which lets a scheduler deliver them in order. The
default, dynamic-batch, sequence-batch and ensemble schedulers implement the same
interface; :func:`trionserve.schedulers.factory.create_scheduler` picks one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import trio

from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse

# Bound of a model's request queue when its config sets none: requests beyond it
# wait in submit() (backpressure, cancellable by the client).
QUEUE_CAPACITY = 1024

Outcome = InferenceResponse | TritonError

# Runs a batch at once on the event loop or gives it to the instance's thread,
# or says no (False) and leaves it alone.
DirectRun = Callable[[list[InferenceRequest]], bool]
# Runs a batch in the submitting task, awaiting its end (an instance in a stub
# process), or says no (False) and leaves it alone.
DirectRunAsync = Callable[[list[InferenceRequest]], Awaitable[bool]]


class HeldBatch(Protocol):
    """A batch given to an instance's thread before its batching delay ended:
    the thread starts it at the delay's end (see ``DelayedRun``). On the Trio
    thread, ``join`` adds a request to it unless the thread has started it
    (False: the request goes to a later batch); ``release`` lets the thread
    start it now (the batch is full, or the batcher closes)."""

    def join(self, request: InferenceRequest) -> bool: ...

    def release(self) -> None: ...


# Gives a batch to the instance's thread to start at a time on Trio's clock (the
# batching delay's end), the thread sleeping out the rest itself; None when it
# cannot (the batch then waits in the scheduler's queue as usual).
DelayedRun = Callable[[list[InferenceRequest], float], HeldBatch | None]


class BatchOutlet(Protocol):
    """One executor's end of its scheduler.

    ``receive`` waits for the next batch (raises EndOfChannel or
    ClosedResourceError when the scheduler has no more work for this executor);
    ``receive_direct(run, handover, delayed)`` is ``receive`` for an executor that waits
    with nothing in flight: a scheduler that can may meanwhile give a batch
    straight to one of them, in the task that formed it, instead of queueing it
    for the executor's task (no channel hop, no task switch): the default one
    hands a submitted request to ``run`` (which runs it inline), the dynamic
    batcher each batch it forms to ``handover`` (which gives it to the
    instance's thread, or runs it inline as ``run`` does); either returns
    False to leave the batch to ``receive``. The dynamic batcher gives a batch
    that waits for its delay to ``delayed``, if offered, with the delay's end
    (the requests that come meanwhile join it while the thread holds it). An
    executor that took a batch through ``handover`` (or ``delayed``) calls
    ``offer_again`` once it waits with nothing in flight again (its task still
    waits in ``receive_direct``), so that the scheduler gives it the next batch
    (the others ignore it).
    ``receive_direct_async`` is the same for an executor whose instance
    computes elsewhere (a stub process): the submitting task runs the batch
    and waits for it itself, as Triton's model instance thread waits on its
    stub. ``complete`` is called exactly once per
    batch received, run or handed over, with one outcome per request passed;
    ``close`` says the executor takes no more batches.
    """

    async def receive(self) -> list[InferenceRequest]: ...

    async def receive_direct(
        self, run: DirectRun, handover: DirectRun | None = None, delayed: DelayedRun | None = None
    ) -> list[InferenceRequest]: ...

    def offer_again(self) -> None: ...

    async def receive_direct_async(self, run: DirectRunAsync) -> list[InferenceRequest]: ...

    def complete(
        self, requests: Sequence[InferenceRequest], outcomes: Sequence[Outcome]
    ) -> None: ...

    def close(self) -> None: ...


class Scheduler(Protocol):
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
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


def deliver_outcomes(requests: Sequence[InferenceRequest], outcomes: Sequence[Outcome]) -> None:
    """Answer each request with its outcome, on the Trio thread."""
    for request, outcome in zip(requests, outcomes):
        if isinstance(outcome, InferenceResponse):
            request.respond(outcome)
        else:
            request.fail(outcome)
