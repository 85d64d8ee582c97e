"""InstanceExecutor: one actor per model instance, executing batches one at a time."""

from __future__ import annotations

from collections.abc import Sequence

import structlog
import trio

from trionserve.actors.rate_limiter import InstanceSlot, RateLimiter
from trionserve.backends.base import (
    AsyncBackendInstance,
    BackendInstance,
    InlineBackendInstance,
    InstanceSpec,
    TimedBackendInstance,
)
from trionserve.core.errors import Cancelled, InternalError, TritonError, Unavailable
from trionserve.core.types import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import FailureReason, ModelStatistics, to_ns
from trionserve.observability.trace.trace_file import record_compute
from trionserve.schedulers.scheduler import BatchOutlet, Outcome

log = structlog.get_logger(__name__)

# The outcomes of a decoupled batch whose execute returned: all successes.
_ALL_SUCCEEDED = (None,)
# Batches with more input bytes than this always run in a worker thread.
INLINE_MAX_INPUT_BYTES = 64 * 1024


class InstanceExecutor:
    """Owns one backend instance and runs its batches in a worker thread.

    Inbox: its scheduler's outlet; the executor asks for the next batch only when it
    is idle, so two executors of one model run two batches at once. Guarantees:
    every request of a batch it took gets exactly one outcome — the backend's
    result, an error for that batch only when the backend raises, ``Cancelled`` for
    a request whose client went away before execution, or an error when the
    executor is cancelled — and the outcomes go back through the outlet exactly once
    per batch. The backend instance is never called from two threads at once.

    Each batch is recorded in the model's statistics: queue time, compute time
    (split into input / infer / output when the backend instance reports
    ``compute_times``, see :class:`~trionserve.observability.statistics.ComputeTimes`),
    batch size, success or failure.

    With a rate limiter slot, each batch waits for the instance's resources before
    it executes and gives them back after (see :mod:`trionserve.actors.rate_limiter`);
    a batch whose wait fails or is cancelled is answered with an error.
    """

    def __init__(
        self,
        spec: InstanceSpec,
        instance: BackendInstance | AsyncBackendInstance,
        outlet: BatchOutlet,
        statistics: ModelStatistics | None = None,
        rate_limiter: RateLimiter | None = None,
        rate_slot: InstanceSlot | None = None,
    ) -> None:
        self.spec = spec
        self.instance = instance
        self.finished = trio.Event()
        self._outlet = outlet
        self._statistics = statistics
        self._rate_limiter = rate_limiter if rate_slot is not None else None
        self._rate_slot = rate_slot
        self._limiter = trio.CapacityLimiter(1)
        # One of the two is set: the instance, as the kind it is.
        self._async: AsyncBackendInstance | None = None
        self._sync: BackendInstance | None = None
        if isinstance(instance, AsyncBackendInstance):
            self._async = instance
        else:
            self._sync = instance
        # Inline execution: a backend may declare that batches whose previous run
        # took at most ``inline_budget_ns`` are cheaper on the event loop than the
        # worker-thread hop (about 30% of the server's CPU for tiny models). The
        # first batch always runs in a thread, to measure it.
        self._timed = instance if isinstance(instance, TimedBackendInstance) else None
        self._inline_budget = (
            instance.inline_budget_ns if isinstance(instance, InlineBackendInstance) else 0
        )
        self._last_ns = self._inline_budget + 1

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self._async is not None:
            # A process-backed instance serves its process in a child task; if it
            # gives up, its error ends this executor (and the model).
            async with trio.open_nursery() as nursery:
                await nursery.start(self._async.run)
                await self._serve(task_status)
                nursery.cancel_scope.cancel()
            return
        await self._serve(task_status)

    async def _serve(self, task_status) -> None:
        outlet = self._outlet
        try:
            task_status.started()
            while True:
                try:
                    batch = await outlet.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                if self._rate_limiter is None:
                    await self._execute(batch)
                else:
                    await self._execute_limited(batch)
        finally:
            outlet.close()
            self.finished.set()

    def stop(self) -> None:
        """Take no more batches; a batch in progress finishes and is delivered."""
        self._outlet.close()

    async def _execute(self, batch: list[InferenceRequest]) -> None:
        outlet = self._outlet
        live = batch
        for request in batch:
            if request.cancelled or request.done:
                live = self._drop_finished(batch)
                break
        if not live:
            outlet.complete(live, ())
            return
        start = trio.current_time()
        try:
            if self._async is not None:
                results = await self._async.execute_async(live)
                if results is None:
                    # Decoupled: the instance answers each request as it goes;
                    # the execution itself succeeded (Triton counts it so).
                    if self._statistics is not None:
                        self._record(live, None, start, trio.current_time())
                    outlet.complete(live, ())
                    return
            else:
                sync = self._sync
                assert sync is not None  # set whenever _async is not
                if self._runs_inline(live):
                    results = sync.execute(live)
                    await trio.lowlevel.checkpoint()
                else:
                    results = await trio.to_thread.run_sync(
                        sync.execute, live, limiter=self._limiter
                    )
            if self._inline_budget:
                times = self._timed.compute_times if self._timed is not None else None
                self._last_ns = sum(times) if times is not None else self._inline_budget + 1
        except Exception as exc:
            log.exception("backend execute raised", instance=self.spec.name)
            error = InternalError(
                f"instance '{self.spec.name}' failed to execute the batch: "
                f"{type(exc).__name__}: {exc}"
            )
            self._record_failures(live, FailureReason.BACKEND)
            outlet.complete(live, [error] * len(live))
            return
        except BaseException:
            # Cancelled (unload deadline or shutdown) once the thread has returned:
            # the batch's results are dropped, so its requests are answered here.
            stopped = Unavailable(f"model instance '{self.spec.name}' was stopped")
            self._record_failures(live, FailureReason.OTHER)
            outlet.complete(live, [stopped] * len(live))
            raise
        end = trio.current_time()
        outcomes = self._outcomes(live, results)
        if self._statistics is not None:
            self._record(live, outcomes, start, end)
        outlet.complete(live, outcomes)

    async def _execute_limited(self, batch: list[InferenceRequest]) -> None:
        """Execute ``batch`` once the rate limiter has given the instance its
        resources; they go back as soon as the execution ends."""
        limiter, slot = self._rate_limiter, self._rate_slot
        assert limiter is not None and slot is not None
        try:
            await limiter.acquire(slot)
        except BaseException as exc:
            error = exc if isinstance(exc, TritonError) else None
            live = [request for request in batch if not request.done]
            stopped = error or Unavailable(f"model instance '{self.spec.name}' was stopped")
            self._record_failures(live, FailureReason.OTHER)
            self._outlet.complete(live, [stopped] * len(live))
            if error is None:
                raise
            return
        try:
            await self._execute(batch)
        finally:
            limiter.release(slot)

    def _runs_inline(self, batch: list[InferenceRequest]) -> bool:
        if not self._inline_budget or self._last_ns > self._inline_budget:
            return False
        size = 0
        for request in batch:
            for tensor in request.inputs.values():
                size += tensor.data.nbytes
        return size <= INLINE_MAX_INPUT_BYTES

    def _drop_finished(self, batch: list[InferenceRequest]) -> list[InferenceRequest]:
        """The requests of a batch still worth executing; the cancelled are answered."""
        live = []
        for request in batch:
            if request.done:
                continue
            if request.cancelled:
                request.fail(
                    Cancelled(
                        f"request '{request.id}' for model '{request.model_name}' was "
                        "cancelled before it executed"
                    )
                )
                self._record_failures([request], FailureReason.CANCELED)
                continue
            live.append(request)
        return live

    def _outcomes(self, requests: list[InferenceRequest], results) -> Sequence[Outcome]:
        """The backend's results checked: one response or error per request."""
        if not isinstance(results, list) or len(results) != len(requests):
            count = len(results) if isinstance(results, list) else type(results).__name__
            error = InternalError(
                f"instance '{self.spec.name}' returned {count} responses for "
                f"{len(requests)} requests"
            )
            return [error] * len(requests)
        for index, result in enumerate(results):
            if not isinstance(result, (InferenceResponse, TritonError)):
                results[index] = InternalError(
                    f"instance '{self.spec.name}' returned {type(result).__name__} "
                    "instead of a response"
                )
        return results

    def _record(
        self,
        requests: list[InferenceRequest],
        outcomes: Sequence[Outcome] | None,
        start: float,
        end: float,
    ) -> None:
        """Record one executed batch; ``outcomes`` None: every request succeeded."""
        statistics = self._statistics
        assert statistics is not None
        total_ns = to_ns(end - start)
        times = self._timed.compute_times if self._timed is not None else None
        if times is not None:
            input_ns, output_ns = times.input_ns, times.output_ns
            infer_ns = max(0, total_ns - input_ns - output_ns)
        else:
            input_ns = output_ns = 0
            infer_ns = total_ns
        if statistics.traces:
            record_compute(statistics.traces, requests, start, end, input_ns, output_ns)
        each: Sequence[Outcome | None] = (
            _ALL_SUCCEEDED * len(requests) if outcomes is None else outcomes
        )
        batch_size = 0
        succeeded = False
        for request, outcome in zip(requests, each):
            size = request.batch_size or 1
            batch_size += size
            if not request.collect_stats:
                continue  # a sequence batcher's null request: in the batch size only
            arrival = request.arrival_time
            if outcome is None or isinstance(outcome, InferenceResponse):
                succeeded = True
                statistics.record_success(
                    size,
                    to_ns(end - arrival),
                    to_ns(start - arrival),
                    input_ns,
                    infer_ns,
                    output_ns,
                )
            else:
                statistics.record_failure(to_ns(end - arrival), FailureReason.BACKEND)
        if succeeded:
            statistics.record_execution(batch_size, input_ns, infer_ns, output_ns, end)

    def _record_failures(self, requests: list[InferenceRequest], reason: FailureReason) -> None:
        if self._statistics is None:
            return
        now = trio.current_time()
        for request in requests:
            if request.collect_stats:
                self._statistics.record_failure(to_ns(now - request.arrival_time), reason)
