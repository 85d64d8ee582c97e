"""InstanceExecutor: one actor per model instance, running its batches on the
instance's own thread, the next one taken while the current one computes.

Triton core's ``TritonModelInstance`` (src/backend_model_instance.cc) with the
backend's instance it drives (:class:`~trionserve.backends.base.BackendInstance`,
Triton's ``TRITONBACKEND_ModelInstance``). A process-backed instance's batches are
served by the base class, :mod:`trionserve.actors.executor_async`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import structlog
import trio

from trionserve.actors.batch_record import (
    checked_outcomes,
    drop_finished,
    record_batch,
    record_failures,
)
from trionserve.actors.executor_async import AsyncInstanceServing
from trionserve.actors.rate_limiter import InstanceSlot, RateLimiter
from trionserve.backends.base import (
    AsyncBackendInstance,
    BackendInstance,
    DirectAsyncBackendInstance,
    InlineAsyncBackendInstance,
    InlineBackendInstance,
    InstanceSpec,
    PipelinedAsyncBackendInstance,
    TimedBackendInstance,
)
from trionserve.backends.cuda.pipeline import PIPELINE_DEPTH, StagedBackendInstance
from trionserve.backends.instance_thread import (
    Abandoned,
    HeldJob,
    InstanceThread,
    Job,
)
from trionserve.core.clocks import clock_offset
from trionserve.core.deferred import sweep_deferred
from trionserve.core.errors import InternalError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import FailureReason, ModelStatistics
from trionserve.schedulers.scheduler import BatchOutlet, Outcome

log = structlog.get_logger(__name__)

# Batches with more input bytes than this always run in the instance's thread.
INLINE_MAX_INPUT_BYTES = 64 * 1024
# Off: with requests waiting, the thread writing a batch's answers before its next
# batch cost 9-12% of throughput at c=8 on two cores (benchmarks/README.md, fifth round).
FREE_EARLY = False


class InstanceExecutor(AsyncInstanceServing):
    """Owns one backend instance and runs its batches.

    Inbox: its scheduler's outlet. A blocking instance runs on a long-lived thread
    of its own (:class:`~trionserve.backends.instance_thread.InstanceThread`). For
    an instance that computes on a device of its own (a ``StagedBackendInstance``
    that ``overlaps``: a GPU), the executor takes the next batch while the current
    one computes, so at most ``PIPELINE_DEPTH`` batches are in flight and the
    device never waits for the event loop between batches; a CPU instance takes
    one batch at a time. A process-backed instance
    (``AsyncBackendInstance``) is awaited one batch at a time on the Trio thread;
    one that runs batches on the event loop itself (``InlineAsyncBackendInstance``:
    an in-process Python model with ``INPROCESS_EXECUTE_ON`` ``event_loop``) is
    also handed a request straight from the scheduler while it waits with
    nothing in flight, as an inline instance is. Two executors of one model run
    two batches at once.

    Guarantees: every request of a batch it took gets exactly one outcome — the
    backend's result, an error for that batch only when the backend raises,
    ``Cancelled`` for a request whose client went away before execution, or an
    error when the executor is cancelled (after the batches the thread was given
    have finished) — and the outcomes go back through the outlet exactly once per
    batch, in the order the batches were taken. The backend instance is never
    called from two threads at once: a batch runs inline on the event loop only
    while none is in flight on the instance's thread.

    Each batch is recorded in the model's statistics: queue time, compute time
    (split into input / infer / output when the backend instance reports
    ``compute_times``, see :class:`~trionserve.observability.statistics.ComputeTimes`),
    batch size, success or failure.

    With a rate limiter slot, each batch waits for the instance's resources before
    it executes and gives them back after (see :mod:`trionserve.actors.rate_limiter`),
    so such an instance has one batch in flight at a time; a batch whose wait
    fails or is cancelled is answered with an error.
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
        # Resources are held per execution: with a limiter, one batch at a time.
        overlaps = isinstance(instance, StagedBackendInstance) and instance.overlaps
        self._depth = PIPELINE_DEPTH if overlaps and self._rate_limiter is None else 1
        # One of the two is set: the instance, as the kind it is.
        self._async: AsyncBackendInstance | None = None
        self._sync: BackendInstance | None = None
        if isinstance(instance, AsyncBackendInstance):
            self._async = instance
        else:
            self._sync = instance
        # Inline execution: a backend may declare that batches whose previous run
        # took at most ``inline_budget_ns`` are cheaper on the event loop than the
        # hand-off to its thread (about 30% of the server's CPU for tiny models).
        # The first batch always runs in the thread, to measure it.
        self._timed = instance if isinstance(instance, TimedBackendInstance) else None
        self._inline_budget = (
            instance.inline_budget_ns if isinstance(instance, InlineBackendInstance) else 0
        )
        self._last_ns = self._inline_budget + 1
        # An async instance that runs batches on the event loop (in-process Python).
        self._inline_async = (
            instance
            if isinstance(instance, InlineAsyncBackendInstance) and instance.inline
            else None
        )
        # An async instance that the submitting task may run a batch on and
        # await (a stub process: see _run_direct_awaited).
        self._direct_async = instance if isinstance(instance, DirectAsyncBackendInstance) else None
        # The next queued batch, posted behind the one such an instance runs (a
        # DefaultScheduler's outlet; see PipelinedAsyncBackendInstance).
        self._pipelined = (
            instance
            if isinstance(instance, PipelinedAsyncBackendInstance)
            and hasattr(outlet, "take_nowait")
            and rate_limiter is None
            else None
        )
        # Set while a batch runs in a submitting task; this executor's own task
        # waits for it before it executes a batch of its own.
        self._direct_running: trio.Event | None = None
        self._nursery: trio.Nursery | None = None  # an async instance's
        # Set by stop(): no batch handed straight over is taken any more.
        self._stopped = False
        # Set when a job given to the thread finishes: wakes _deliver.
        self._delivery = trio.Event()
        # A CPU instance's thread, given batches straight by the scheduler while
        # the executor's task waits with nothing in flight (see _handover).
        self._thread: InstanceThread | None = None
        self._hands_over = self._depth == 1 and self._rate_limiter is None
        # The batch handed over and running, and how many jobs the feeder gave
        # the thread that are not delivered yet.
        self._handed: Job | None = None
        self._undelivered = 0
        # True while _handover runs a batch inline in the task that formed it.
        self._inline_handover = False
        # Whether a batch handed over may free the instance before its report
        # (_handed_free; not with ordered outcomes), and those freed, unreported.
        self._frees = FREE_EARLY and self._hands_over and not getattr(outlet, "ordered", True)
        self._freed: set[Job] = set()
        # The outlet's ``complete`` for outcomes known to be responses, where it
        # has one (the dynamic batcher's: HandedJob.finished's written-out way).
        self._respond = getattr(outlet, "respond", None)
        # Trio's clock less the thread's perf_counter() (see clock_offset);
        # None: a MockClock's, read per batch (InstanceThread.span).
        self._offset: float | None = None
        # The statistics a batch handed over may be counted in by the thread
        # that writes its answers (Job.statistics), once the thread started.
        self._records: ModelStatistics | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            if self._async is not None:
                # A process-backed instance serves its process in a child task; if
                # it gives up, its error ends this executor (and the model).
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await nursery.start(self._async.run)
                    await self._serve_async(task_status)
                    nursery.cancel_scope.cancel()
            else:
                await self._serve_threaded(task_status)
        finally:
            self._outlet.close()
            self.finished.set()

    def stop(self) -> None:
        """Take no more batches; the batches in progress finish and are delivered."""
        self._stopped = True
        self._outlet.close()

    # -- blocking instances: the instance's thread ------------------------------------

    async def _serve_threaded(self, task_status: trio.TaskStatus[None]) -> None:
        assert self._sync is not None
        thread = self._thread = InstanceThread(self.spec.name, self._sync)
        if self._hands_over:
            # A scheduler that can tell nothing waits for the instance lets its
            # thread write a finished batch's answers and defer the report.
            thread.quiet = getattr(self._outlet, "quiet", None)
        thread.start()
        self._offset = clock_offset()
        if self._respond is not None and self._statistics is not None and self._offset is not None:
            # A batch handed over whose answers the thread writes is counted
            # there too (Job.statistics; HandedJob.finished's common way).
            self._records = self._statistics
        # Jobs given to the thread, in order, for _deliver; slots bound how many.
        send, receive = trio.open_memory_channel[Job](math.inf)
        slots = trio.Semaphore(self._depth)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._deliver, thread, receive, slots)
                task_status.started()
                async with send:
                    await self._feed(thread, send, slots)
                self._wake_delivery()  # the channel is closed: _deliver ends
        finally:
            thread.stop()

    async def _feed(
        self, thread: InstanceThread, jobs: trio.MemorySendChannel[Job], slots: trio.Semaphore
    ) -> None:
        """Take batches from the outlet while a slot is free; give them to the thread."""
        # While nothing is in flight, the scheduler may hand a batch straight to
        # _run_direct (DefaultScheduler does) or _handover (the dynamic batcher).
        direct = (bool(self._inline_budget) or self._hands_over) and self._rate_limiter is None
        while True:
            try:
                slots.acquire_nowait()  # no task switch while a slot is free
            except trio.WouldBlock:
                await slots.acquire()
            try:
                if direct and slots.value == self._depth - 1:
                    batch = await self._outlet.receive_direct(
                        self._run_direct, self._handover, self._handover_held
                    )
                else:
                    batch = await self._outlet.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return
            live = self._live(batch)
            if live and not await self._acquire_resources(live):
                slots.release()
                continue
            idle = slots.value == self._depth - 1 and self._handed is None
            if live and idle and self._runs_inline(live):
                self._execute_inline(live)  # nothing in flight: the thread is idle
                self._release_resources()
                slots.release()
                continue
            job = Job(live, self._wake_delivery)
            self._undelivered += 1
            jobs.send_nowait(job)
            if live:
                thread.submit(job)
            else:
                job.finished()

    async def _deliver(
        self, thread: InstanceThread, jobs: trio.MemoryReceiveChannel[Job], slots: trio.Semaphore
    ) -> None:
        """Hand each job's outcomes back through the outlet, in the order taken.

        Woken when a job finishes (or the feeder ends), not when one is given:
        one task step per batch, not two."""
        job: Job | None = None
        try:
            while True:
                try:
                    job = jobs.receive_nowait()
                except trio.WouldBlock:
                    await self._delivery.wait()  # a job finished, or the feeder ended
                    self._delivery = trio.Event()
                    continue
                except trio.EndOfChannel:
                    await self._handed_delivered()
                    return
                if not job.over:  # (Event.wait checkpoints even when set)
                    await thread.wait(job)
                done, job = job, None
                if done.requests or done.cancelled:
                    self._release_resources()
                slots.release()
                if len(done.requests) > 1:
                    # Batches back to back: the feeder takes the next batch (and
                    # the thread starts it) before this one's responses are woken
                    # to be encoded and sent, not after them in the same pass.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                self._undelivered -= 1
                self._complete(done, thread)
        except BaseException:
            # Cancelled (unload deadline or shutdown): the thread finishes the
            # batch it is running and skips the others, so the instance is idle
            # before it is closed; their requests are answered here (a batch
            # handed over as it finishes, see HandedJob).
            self._stopped = True
            thread.abandon()  # (a job it defers from now on wakes the loop)
            sweep_deferred()  # a job whose answers the thread wrote, delivered
            with trio.CancelScope(shield=True):
                await self._handed_delivered()
                await self._stop_jobs(thread, job, jobs)
            raise

    async def _handed_delivered(self) -> None:
        """Wait until the batches handed over are delivered: those freed, whose
        reports wait for a sweep, now; the one running as it finishes."""
        while self._handed is not None or self._freed:
            sweep_deferred()  # (each freed one was appended before it was freed)
            if self._handed is not None:
                await self._handed.done.wait()

    async def _stop_jobs(
        self, thread: InstanceThread, job: Job | None, jobs: trio.MemoryReceiveChannel[Job]
    ) -> None:
        """Answer the job being waited for and every later one (the feeder closes
        the channel as it ends), once the thread is done with it: a batch the thread
        ran gets its results, one it skipped UNAVAILABLE."""
        stopped = Unavailable(f"model instance '{self.spec.name}' was stopped")
        while True:
            if job is not None:
                await thread.wait(job)
                if job.requests or job.cancelled:
                    self._release_resources()
                drop_finished(self._statistics, job.cancelled)
                if job.requests and not isinstance(job.error, Abandoned):
                    self._complete(job, thread)  # it ran: its results were produced
                else:
                    record_failures(self._statistics, job.requests, FailureReason.OTHER)
                    self._outlet.complete(job.requests, [stopped] * len(job.requests))
            try:
                job = await jobs.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return

    def _complete(self, job: Job, thread: InstanceThread) -> None:
        """Deliver a job the thread ran: its statistics, then its outcomes.
        Written out for the common batch (every result a response: statistics
        told so, no per-request check), as it runs once per batch on the loop."""
        if job.cancelled:  # cancelled while waiting for the thread
            drop_finished(self._statistics, job.cancelled)
        live = job.requests
        if not live:
            self._outlet.complete(live, ())
            return
        if job.error is not None:
            self._fail(live, job.error)
            return
        times = job.times
        if self._inline_budget:
            self._last_ns = (
                times[0] + times[1] + times[2] if times is not None else self._inline_budget + 1
            )
        outcomes: Sequence[Outcome] = job.results  # type: ignore[assignment]  # checked:
        # A response each? (Known when the thread wrote their answers.)
        every = job.responses or (type(outcomes) is list and len(outcomes) == len(live))
        if every and not job.responses:
            for result in outcomes:
                if not isinstance(result, InferenceResponse):
                    every = False
                    break
        if not every:
            outcomes = checked_outcomes(self.spec.name, live, outcomes)
        statistics = self._statistics
        if statistics is not None:
            start, end = thread.span(job)
            if times is not None and not statistics.traces:  # (record_batch's work: none)
                statistics.record_batch(live, None if every else outcomes, start, end, *times)
            else:
                record_batch(statistics, live, None if every else outcomes, start, end, times)
        self._outlet.complete(live, outcomes)

    def _wake_delivery(self) -> None:
        self._delivery.set()

    def _handover(self, batch: list[InferenceRequest]) -> bool:
        """Give a batch handed straight over by the scheduler (in the task that
        formed it) to the instance's thread, while this executor's task waits
        for one with nothing in flight: no pass of the run loop between the
        batch and the thread, none for the feeder. False (the scheduler queues
        it for the feeder) when stopped, busy, or a request of it is finished.
        The batch is delivered as the thread reports it (HandedJob.finished).

        A batch that would run inline (cheaper on the loop than the thread) is
        run here, in the task that formed it, as ``_run_direct`` runs a request
        the default scheduler hands over: a submit that finds the instance idle
        with no delay to wait (Triton's batcher would send that batch at once)
        has its answer before ``submit`` returns, with no step of the feeder's
        task nor of the submitter's wake-up. One formed while such a run
        delivers (from ``offer_again``) goes through the queue to the feeder:
        runs never nest."""
        thread = self._idle_thread(batch)
        if thread is None:
            return False
        if self._last_ns <= self._inline_budget and self._runs_inline(batch):
            if self._inline_handover:
                return False  # the feeder runs it (no nested run)
            self._inline_handover = True
            try:
                self._execute_inline(batch)
                self._outlet.offer_again()  # the scheduler's next batch, if one waits
            finally:
                self._inline_handover = False
            return True
        thread.submit(self._handed_job(batch))
        return True

    def _handover_held(self, batch: list[InferenceRequest], start_at: float) -> HeldJob | None:
        """``_handover`` for a batch that waits for the batching delay until
        ``start_at``: the thread holds it until then (requests that come
        meanwhile may join it, see HeldJob), so the loop need not wake at the
        delay's end. None (the batch waits at the scheduler) when the
        executor would not take it straight, or would run it inline."""
        # _idle_thread and _handed_job, written out (once per request at c=1
        # with a batching delay).
        thread = self._thread
        if (
            not self._hands_over
            or self._stopped
            or thread is None
            or self._handed is not None
            or self._undelivered
        ):
            return None
        for request in batch:
            if request.done or request._cancelled:  # (the property's field: no call)
                return None  # the feeder answers those
        if self._last_ns <= self._inline_budget and self._runs_inline(batch):
            return None
        job = self._handed = HandedJob(batch)
        job.executor = self
        job.statistics = self._records
        if self._frees:
            job.on_free = partial(self._handed_free, job)
        return thread.submit_held(job, start_at)

    def _idle_thread(self, batch: list[InferenceRequest]) -> InstanceThread | None:
        """The instance's thread, if a batch may be handed to it straight: the
        executor waits with nothing in flight, and every request still waits."""
        thread = self._thread
        if (
            not self._hands_over
            or self._stopped
            or thread is None
            or self._handed is not None
            or self._undelivered
        ):
            return None
        for request in batch:
            if request._cancelled or request.done:  # (the property's field: no call)
                return None  # the feeder answers those
        return thread

    def _handed_job(self, batch: list[InferenceRequest]) -> Job:
        """The job of a batch handed over, delivered as the thread reports it."""
        job = self._handed = HandedJob(batch)
        job.executor = self
        job.statistics = self._records
        if self._frees:
            job.on_free = partial(self._handed_free, job)
        return job

    def _handed_free(self, job: Job) -> None:
        """The instance's thread is done computing the batch handed over and
        writes its answers itself, its report left for the loop's sweep (see
        InstanceThread._answered): the scheduler is offered this executor
        again now, so the next batch starts while the answers are written."""
        if self._handed is not job:
            return  # (delivered already: the sweep came first)
        self._handed = None
        self._freed.add(job)
        if self._stopped:
            sweep_deferred()  # delivered now: _handed_delivered waits for it
        else:
            self._outlet.offer_again()

    def _deliver_handed(self, job: Job) -> None:
        """The outcomes of a batch handed over (its instance offered again: see
        HandedJob.finished, which writes out the commonest batch's way)."""
        assert self._thread is not None
        if job.error is not None and isinstance(job.error, Abandoned):  # stopping
            drop_finished(self._statistics, job.cancelled)
            stopped = Unavailable(f"model instance '{self.spec.name}' was stopped")
            record_failures(self._statistics, job.requests, FailureReason.OTHER)
            self._outlet.complete(job.requests, [stopped] * len(job.requests))
        else:
            self._complete(job, self._thread)

    def _undeliverable(self, job: Job, exc: Exception) -> None:
        """Delivering a batch handed over raised (a bug): this batch fails, not
        the event loop."""
        log.exception("delivering a batch failed", instance=self.spec.name)
        error = InternalError(f"instance '{self.spec.name}' failed to deliver: {exc!r}")
        for request in job.requests:
            request.fail(error)

    def _run_direct(self, batch: list[InferenceRequest]) -> bool:
        """Run a batch handed straight over by the scheduler while this executor
        waits for one with nothing in flight (its thread idle), if it would run
        inline when taken; False leaves it to the scheduler's queue."""
        if self._stopped or not self._runs_inline(batch):
            return False
        live = self._live(batch)
        if live:
            self._execute_inline(live)
        else:
            self._outlet.complete(live, ())
        return True

    def _execute_inline(self, live: list[InferenceRequest]) -> None:
        sync = self._sync
        assert sync is not None
        start = trio.current_time()
        try:
            results = sync.execute(live)
        except Exception as exc:
            self._fail(live, exc)
            return
        end = trio.current_time()
        times = self._timed.compute_times if self._timed is not None else None
        self._last_ns = sum(times) if times is not None else self._inline_budget + 1
        outcomes = checked_outcomes(self.spec.name, live, results)
        if self._statistics is not None:
            record_batch(self._statistics, live, outcomes, start, end, times)
        self._outlet.complete(live, outcomes)

    def _runs_inline(self, batch: list[InferenceRequest]) -> bool:
        if not self._inline_budget or self._last_ns > self._inline_budget:
            return False
        size = 0
        for request in batch:
            for tensor in request.inputs.values():
                size += tensor.data.nbytes
        return size <= INLINE_MAX_INPUT_BYTES


class HandedJob(Job):
    """The job of a batch handed straight over to the instance's thread
    (``InstanceExecutor._handover``), whose report is its delivery.

    ``finished`` (on the Trio thread: the run's Deferred sweep, or the thread's
    wake-up) is ``Job.finished`` and the executor's delivery in one function.
    The scheduler is offered the executor again first, so the next batch
    reaches the thread before this one's waiters run (batches back to back);
    then the outcomes are delivered. The commonest batch (every result a
    response the thread checked as it wrote the answers, the backend's compute
    times, no trace) is written out: its statistics in one call, each request
    answered through the outlet (issue 39, eleventh round). Where the thread
    counted it already (``recorded``, see ``Job.statistics``), the outlet is
    offered the executor again and answers the requests in one call
    (fifteenth round).
    """

    __slots__ = ("executor",)

    executor: InstanceExecutor | None

    def finished(self) -> None:
        self.over = True
        if self._done is not None:
            self._done.set()
        executor = self.executor
        if executor is None:
            return  # (delivered already)
        self.executor = self.on_free = None  # (no cycle with its executor)
        try:
            again = False
            if executor._handed is self:
                executor._handed = None
                again = not executor._stopped
            else:  # freed before (_handed_free): offered then
                executor._freed.discard(self)
            times = self.times
            respond = executor._respond
            if self.recorded:
                # Counted by the thread as it wrote the answers: one response
                # each, the compute times known (InstanceThread._answered).
                assert times is not None and respond is not None
                if executor._inline_budget:
                    executor._last_ns = times[0] + times[1] + times[2]
                respond(self.requests, self.results, again)
                return
            if again:
                executor._outlet.offer_again()
            statistics = executor._statistics
            offset = executor._offset
            if (
                self.responses  # (no error, none cancelled: see InstanceThread._answered)
                and times is not None
                and statistics is not None
                and not statistics.traces
                and offset is not None
                and respond is not None
            ):
                if executor._inline_budget:
                    executor._last_ns = times[0] + times[1] + times[2]
                requests = self.requests
                statistics.record_batch(
                    requests, None, self.started + offset, self.ended + offset, *times
                )
                respond(requests, self.results)
            else:
                executor._deliver_handed(self)
        except Exception as exc:  # a bug: this batch fails, not the event loop
            executor._undeliverable(self, exc)
