"""The executor's process-backed instances, awaited on the Trio thread, and the
per-batch helpers both kinds of instance share (rate-limiter resources, requests
finished before they run, a backend's error).

:class:`~trionserve.actors.executor.InstanceExecutor` is built on
:class:`AsyncInstanceServing`; the blocking instances' thread and its hand-overs
stay in :mod:`trionserve.actors.executor`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import structlog
import trio

from trionserve.actors.batch_record import (
    checked_outcomes,
    drop_finished,
    record_batch,
    record_failures,
)
from trionserve.actors.rate_limiter import InstanceSlot, RateLimiter
from trionserve.backends.base import (
    AsyncBackendInstance,
    DirectAsyncBackendInstance,
    ExecuteResult,
    InlineAsyncBackendInstance,
    InstanceSpec,
    PipelinedAsyncBackendInstance,
)
from trionserve.core.errors import Cancelled, InternalError, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest
from trionserve.observability.statistics import FailureReason, ModelStatistics
from trionserve.observability.trace.trace_file import hold_running, settle_compute
from trionserve.schedulers.scheduler import BatchOutlet

log = structlog.get_logger(__name__)


class AsyncInstanceServing:
    """An executor's serving of a process-backed instance (``AsyncBackendInstance``):
    its batches awaited one at a time on the Trio thread, or run in the submitting
    task (a stub process, an in-process Python model on the event loop). The
    attributes are set by :class:`~trionserve.actors.executor.InstanceExecutor`."""

    spec: InstanceSpec
    _outlet: BatchOutlet
    _statistics: ModelStatistics | None
    _rate_limiter: RateLimiter | None
    _rate_slot: InstanceSlot | None
    _async: AsyncBackendInstance | None
    _inline_async: InlineAsyncBackendInstance | None
    _direct_async: DirectAsyncBackendInstance | None
    _pipelined: PipelinedAsyncBackendInstance | None
    _direct_running: trio.Event | None
    _nursery: trio.Nursery | None
    _stopped: bool

    # -- process-backed instances: awaited on the Trio thread ----------------------------

    async def _serve_async(self, task_status: trio.TaskStatus[None]) -> None:
        assert self._async is not None
        outlet = self._outlet
        task_status.started()
        # An instance that runs batches on the event loop is offered the
        # requests submitted while it waits here (as _feed offers _run_direct).
        direct = self._inline_async is not None and self._rate_limiter is None
        awaited = self._direct_async is not None and self._rate_limiter is None
        while True:
            try:
                if direct:
                    batch = await outlet.receive_direct(self._run_direct_async)
                elif awaited:
                    batch = await outlet.receive_direct_async(self._run_direct_awaited)
                else:
                    batch = await outlet.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                # Stopped: a batch running in a submitting task finishes first
                # (its process is needed until it answers).
                while self._direct_running is not None:
                    await self._direct_running.wait()
                return
            try:
                while self._direct_running is not None:
                    await self._direct_running.wait()  # one batch at a time
            except BaseException:
                # Cancelled (unload deadline or shutdown) holding a batch taken
                # while a submitting task ran one: answered here, not lost.
                stopped = Unavailable(f"model instance '{self.spec.name}' was stopped")
                record_failures(self._statistics, batch, FailureReason.OTHER)
                outlet.complete(batch, [stopped] * len(batch))
                raise
            live = self._live(batch)
            if not live:
                outlet.complete(live, ())
                continue
            if self._rate_limiter is not None and not await self._acquire_resources(live):
                continue
            start = trio.current_time()
            pipelined = self._pipelined
            try:
                if pipelined is not None:
                    results = await pipelined.execute_ahead(live, self._take_ahead)
                else:
                    results = await self._async.execute_async(live)
            except Exception as exc:
                self._fail(live, exc)
                continue
            except BaseException:
                # Cancelled (unload deadline or shutdown): answered here.
                stopped = Unavailable(f"model instance '{self.spec.name}' was stopped")
                record_failures(self._statistics, live, FailureReason.OTHER)
                outlet.complete(live, [stopped] * len(live))
                raise
            finally:
                self._release_resources()
            self._executed_async(live, results, start)
            if pipelined is not None:
                await pipelined.settle(self._take_ahead)

    def _take_ahead(self) -> tuple[list[InferenceRequest], Callable] | None:
        """The batch to post behind the one the instance runs (an ``Ahead``):
        the next queued, answered through the callback when the stub replies
        (its compute time counted from when the batch before it was answered:
        python_be.cc takes its execution start when ProcessRequests begins)."""
        if self._stopped:
            return None
        batch = self._outlet.take_nowait()  # type: ignore[attr-defined]  # see _pipelined
        if batch is None:
            return None
        live = self._live(batch)
        if not live:
            self._outlet.complete(live, ())
            return None
        return live, partial(self._executed_async, live)

    def _executed_async(
        self, live: list[InferenceRequest], results: ExecuteResult | None, start: float
    ) -> None:
        """Record and hand back a batch an async instance executed."""
        end = trio.current_time()
        if results is None:
            # Decoupled: the instance answers each request as it goes; the
            # execution itself succeeded (Triton counts it so).
            if self._statistics is not None:
                record_batch(self._statistics, live, None, start, end, None)
            self._outlet.complete(live, ())
            return
        outcomes = checked_outcomes(self.spec.name, live, results)
        if self._statistics is not None:
            record_batch(self._statistics, live, outcomes, start, end, None)
        self._outlet.complete(live, outcomes)

    def _run_direct_async(self, batch: list[InferenceRequest]) -> bool:
        """``_run_direct`` for an ``InlineAsyncBackendInstance``: run a batch
        handed straight over while this executor waits with nothing in flight,
        if the instance runs it on the event loop; False leaves it queued."""
        instance = self._inline_async
        assert instance is not None
        if self._stopped or not instance.runs_inline():
            return False
        live = self._live(batch)
        if not live:
            self._outlet.complete(live, ())
            return True
        start = trio.current_time()
        try:
            results = instance.execute_inline(live)
        except Exception as exc:
            self._fail(live, exc)
            return True
        self._executed_async(live, results, start)
        return True

    async def _run_direct_awaited(self, batch: list[InferenceRequest]) -> bool:
        """Run a batch handed over by the scheduler in the submitting task while
        this executor waits with nothing in flight, awaiting the instance's
        answer there (python_be.cc: the instance thread waits on its stub
        itself); False leaves it to the scheduler's queue."""
        instance = self._direct_async
        assert instance is not None
        if self._stopped or self._direct_running is not None or not instance.runs_direct():
            return False
        live = self._live(batch)
        if not live:
            self._outlet.complete(live, ())
            return True
        running = self._direct_running = trio.Event()
        for request in live:
            request.held()  # its caller goes on while the model runs it
        start = trio.current_time()
        settling = False
        try:
            results = await instance.execute_async(live)
        except Exception as exc:
            self._fail(live, exc)
            return True
        except BaseException:
            # The submitting task was cancelled (its client gone, the server
            # stopping): the batch is its own request, answered CANCELLED; this
            # executor takes no other batch until the instance is done with
            # this one (its stub takes one call at a time).
            for request in live:
                request.cancelled = True  # told to the model (is_cancelled)
            traces = self._statistics.traces if self._statistics is not None else {}
            traced = bool(traces) and hold_running(traces, live)
            record_failures(self._statistics, live, FailureReason.CANCELED)
            cancelled = Cancelled("the request was cancelled while it executed")
            self._outlet.complete(live, [cancelled] * len(live))
            if self._nursery is not None:
                try:
                    self._nursery.start_soon(
                        self._settle_direct, instance, running, live if traced else [], start
                    )
                    settling = True
                except RuntimeError:  # the executor is ending
                    pass
            if traced and not settling:
                settle_compute(traces, live, start, None)
            raise
        finally:
            if not settling:
                self._direct_running = None
                running.set()
        self._executed_async(live, results, start)
        return True

    async def _settle_direct(
        self,
        instance: DirectAsyncBackendInstance,
        running: trio.Event,
        traced: list[InferenceRequest],
        start: float,
    ) -> None:
        """After a batch run in a submitting task that was cancelled: free this
        executor once the instance has finished that batch; the ``traced``
        requests' traces get its compute and end then."""
        end = None
        try:
            await instance.wait_idle()
            end = trio.current_time()
        finally:
            self._direct_running = None
            running.set()
            if traced and self._statistics is not None:
                settle_compute(self._statistics.traces, traced, start, end)

    # -- shared -------------------------------------------------------------------------

    async def _acquire_resources(self, live: list[InferenceRequest]) -> bool:
        """Wait for the rate limiter to give the instance its resources (True at
        once without one); False when the wait failed and ``live`` was answered."""
        limiter, slot = self._rate_limiter, self._rate_slot
        if limiter is None or slot is None:
            return True
        try:
            await limiter.acquire(slot)
        except BaseException as exc:
            error = exc if isinstance(exc, TritonError) else None
            live = [request for request in live if not request.done]
            stopped = error or Unavailable(f"model instance '{self.spec.name}' was stopped")
            record_failures(self._statistics, live, FailureReason.OTHER)
            self._outlet.complete(live, [stopped] * len(live))
            if error is None:
                raise
            return False
        return True

    def _release_resources(self) -> None:
        if self._rate_limiter is not None and self._rate_slot is not None:
            self._rate_limiter.release(self._rate_slot)

    def _live(self, batch: list[InferenceRequest]) -> list[InferenceRequest]:
        for request in batch:
            if request.cancelled or request.done:
                return drop_finished(self._statistics, batch)
        return batch

    def _fail(self, live: list[InferenceRequest], exc: Exception) -> None:
        """The backend raised: every request of the batch gets the error."""
        log.error(
            "backend execute raised",
            instance=self.spec.name,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        error = InternalError(
            f"instance '{self.spec.name}' failed to execute the batch: {type(exc).__name__}: {exc}"
        )
        record_failures(self._statistics, live, FailureReason.BACKEND)
        self._outlet.complete(live, [error] * len(live))
