"""InstanceThread: the one long-lived thread that runs a backend instance's batches.

A blocking backend instance gets one thread of its own for its lifetime, instead of
a ``trio.to_thread`` hop (a thread taken from Trio's cache and handed back) per
batch. Its executor hands it :class:`Job` objects in the order the scheduler formed
the batches; the thread runs them one after the other, in that order, and finishes
each job on the Trio thread when its results are in. Only this thread
ever calls the instance while it runs.

An instance that implements
:class:`~trionserve.backends.cuda.pipeline.StagedBackendInstance` is driven in three
steps per batch (:class:`~trionserve.backends.cuda.pipeline.Pipeline`): ``stage``
(gather the inputs into its reusable host buffers and start their copy to the
device), ``launch`` (start the computation) and ``finish`` (wait for it and build
the responses). When its ``launch`` returns before the device is done (``overlaps``:
a GPU instance), the thread stages the next batch, if one is waiting, before it
finishes the current one, so the next batch's gather and copy overlap the current
batch's compute. An executor gives such a thread at most two batches at once (one
computing, one being staged), so the overlap is bounded.

Jobs reach the thread through a deque and an eventfd "doorbell" rung only when
the thread sleeps: ringing and sleeping release the GIL during their system call,
so the Trio thread never holds the GIL while the kernel wakes the instance's
thread (which would then wait for it).

A batch whose every request's answer the thread may write itself (an HTTP/1.1
client waiting on a plain socket, see :mod:`trionserve.protocol.http.answer`),
finished while nothing else waits for the instance (its scheduler ``quiet``: no
request queued, no job given to the thread), is answered from this thread, and its
report does not wake the event loop: the job waits in the run's
:class:`~trionserve.core.deferred.Deferred` reports until the loop next sweeps them
(as the client's next request arrives, or at the HTTP server's 0.25 s tick), which
delivers it as the report would have (outcomes, statistics, in-flight counts). At
c=1 that is one wake-up of the loop per request instead of two
(benchmarks/README.md, issue 39's fourth round).

A batch the dynamic batcher would hold for its batching delay while the instance
is idle comes before the delay ends, as a :class:`HeldJob`: the thread sleeps out
the rest of the delay (a timed wait, the GIL released) and starts it then, or
when the batcher releases it (the batch is full, the batcher closes); requests
submitted meanwhile join it. At c=1 the event loop thus does not wake at the
delay's end (one wake-up per request, not two; benchmarks/README.md, issue 39's
ninth round).

An instance whose own code must run on one thread from start to end (an
in-process Python model: ``initialize``, every ``execute``, ``finalize``) also
hands the thread plain calls with :meth:`InstanceThread.call`, from a worker
thread, between its jobs.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import trio

from trionserve.backends.base import BackendInstance, TimedBackendInstance
from trionserve.backends.cuda.pipeline import Pipeline, StagedBackendInstance
from trionserve.core.clocks import clock_offset
from trionserve.core.deferred import Deferred, deferred_jobs
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import ComputeTimes, ModelStatistics


class Job:
    """One batch on its way through an instance's thread.

    ``results`` (one response or error per request) or ``error`` (the exception
    the backend raised) is set once ``over`` is (and ``done``, the event to
    wait for it); ``started`` and ``ended`` are ``time.perf_counter()``
    readings of the thread; ``times`` is how the backend split the batch's
    time, if it says.
    """

    __slots__ = (
        "requests",
        "cancelled",
        "results",
        "error",
        "started",
        "ended",
        "times",
        "staged",
        "over",
        "_done",
        "on_done",
        "on_free",
        "held",
        "responses",
        "unread",
        "statistics",
        "recorded",
    )

    def __init__(self, requests: list, on_done: Callable[[], None] | None = None) -> None:
        self.requests = requests
        # Requests whose client went away while the batch waited for the thread:
        # taken out of ``requests`` before it runs, answered by the executor.
        self.cancelled: list = []
        self.results: list | None = None
        self.error: Exception | None = None
        self.started = 0.0
        self.ended = 0.0
        self.times: ComputeTimes | None = None
        self.staged: object = None  # the instance's handle between its steps
        # Set on the Trio thread as the job is finished; ``done`` is made only
        # for a task that waits for it (most jobs are delivered by ``on_done``,
        # waited on by nobody: no event made and set per batch).
        self.over = False
        self._done: trio.Event | None = None
        # Called on the Trio thread as the job is finished (the executor's delivery
        # task waits for any job to finish, not for each to be given).
        self.on_done = on_done
        # Called on the Trio thread when the instance is done computing the job
        # while its report waits for the loop's sweep (its answers being written
        # by the instance's thread, see InstanceThread._answered): the instance
        # may take its next batch. None: the job's report is never split so.
        self.on_free: Callable[[], None] | None = None
        # Set for a batch given before its batching delay ended: the thread
        # starts it at the delay's end (see HeldJob).
        self.held: HeldJob | None = None
        # Set by the thread that found ``results`` one response per request
        # (as it wrote their answers): the loop need not look again.
        self.responses = False
        # Requests whose body the thread failed to read (see _take_bodies), with
        # their errors: out of the batch, given back with them as it ends.
        self.unread: list[tuple[InferenceRequest, InvalidArgument]] | None = None
        # Where the thread that writes the batch's answers counts it (set by an
        # executor that delivers such a batch without counting it again when
        # ``recorded``; None: counted on the Trio thread as it is delivered).
        self.statistics: ModelStatistics | None = None
        self.recorded = False

    @property
    def done(self) -> trio.Event:
        """Set once the job is finished (on the Trio thread; made on demand)."""
        done = self._done
        if done is None:
            done = self._done = trio.Event()
            if self.over:
                done.set()
        return done

    def finished(self) -> None:
        """The job is done (on the Trio thread): ``over`` (and ``done``) set,
        ``on_done`` called. Both callbacks are let go first: an executor's hold
        the job (a ``partial`` of it), a cycle that kept the batch's requests,
        tensors and responses alive until the collector's next run, about 20
        objects a request that made it run every 30 requests (issue 39, sixth
        round)."""
        self.over = True
        if self._done is not None:
            self._done.set()
        on_done, self.on_done, self.on_free = self.on_done, None, None
        if on_done is not None:
            on_done()

    def freed(self) -> None:
        """The instance is done with the job, whose report comes later (on the
        Trio thread): ``on_free`` called."""
        if self.on_free is not None:
            self.on_free()

    def drop_cancelled(self) -> None:
        """Take the requests cancelled so far out of the batch, before it runs."""
        for request in self.requests:  # a loop, not any(): no generator per batch
            if request.cancelled:
                break
        else:
            return
        self.cancelled = [request for request in self.requests if request.cancelled]
        self.requests = [request for request in self.requests if not request.cancelled]


class HeldJob:
    """A job given to the thread before its batching delay ended (the dynamic
    batcher's :class:`~trionserve.schedulers.scheduler.HeldBatch`): the thread
    sleeps out the rest of the delay itself, with the GIL released, then starts
    it, so the event loop does not wake at the delay's end. Until the thread
    starts it, ``join`` (on the Trio thread) adds a request to it; ``release``
    lets it start at once. The thread's lock makes the two sides agree on
    whether a request joined: one that comes after the start is refused (it
    goes to a later batch), never lost nor run twice. The thread sleeps in a
    timed acquire of the job's gate, a lock held until ``release`` (no
    ``threading.Condition``: its wait is about ten Python calls, issue 39's
    twelfth round).

    A thread holds its jobs one after the other, through one HeldJob re-armed
    for each by :meth:`InstanceThread.submit_held` once the last one's
    ``wait_out`` closed it: no object and no lock made per batch. Its gate is
    held whenever it is not released for the job it holds: ``wait_out``
    takes it back where a ``release`` came after the delay's end."""

    __slots__ = ("_job", "_until", "_lock", "_gate", "_released")

    def __init__(self, job: Job, until: float, lock: threading.Lock) -> None:
        self._job: Job | None = job
        self._until = until  # time.perf_counter() at the delay's end
        # The thread's lock, shared by the jobs it holds one after the other.
        self._lock = lock
        self._gate = threading.Lock()
        self._gate.acquire()  # (released by release: the thread's wait ends)
        self._released = False

    def join(self, request: InferenceRequest) -> bool:
        with self._lock:
            if self._job is None:
                return False
            self._job.requests.append(request)
            return True

    def release(self) -> None:
        with self._lock:
            if self._job is not None and not self._released:
                self._released = True
                self._gate.release()

    def wait_out(self) -> None:
        """On the instance's thread: wait until the delay's end or ``release``,
        then close the batch to ``join``."""
        remaining = self._until - time.perf_counter()
        taken = False
        if remaining > 0:
            # (True: released; False: the delay's end. A wait the kernel ends
            # early, EINTR, is resumed for what is left by the lock itself.)
            taken = self._gate.acquire(timeout=remaining)
        with self._lock:
            if self._released and not taken:
                # Released after the delay's end: the gate is held again for the
                # next job (it is free now, nothing else takes it).
                self._gate.acquire()
            self._job = None  # closed (and no cycle with the job: see Job.finished)


_STOP = None


class _Doorbell:
    """One thread sleeps until another rings, neither holding the GIL meanwhile
    (an eventfd; a pipe where there is none). A ring after ``close`` does
    nothing: a producer that saw the thread asleep may ring just after the thread
    woke for its last job and closed the bell (the descriptor's number may by then
    belong to another file)."""

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self._read = self._write = os.eventfd(0)
        else:  # pragma: no cover - not Linux
            self._read, self._write = os.pipe()
        self._lock = threading.Lock()  # ring against close; only taken to ring
        self._closed = False

    def ring(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._read == self._write:
                os.eventfd_write(self._write, 1)
            else:  # pragma: no cover - not Linux
                os.write(self._write, b"\0")

    def wait(self) -> None:
        if self._read == self._write:
            os.eventfd_read(self._read)
        else:  # pragma: no cover - not Linux
            os.read(self._read, 64)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self._read)
            if self._write != self._read:  # pragma: no cover - not Linux
                os.close(self._write)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` where the OS shows it (``top -H``,
    ``/proc/PID/task/TID/comm``, py-spy; 15 bytes on Linux), so that a profile
    or a per-thread CPU reading tells an instance's thread from the event loop
    and a framework's own threads. Nothing where the OS has no such name."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode("utf-8", "replace")[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def wait_to_the_microsecond() -> None:
    """Let the calling thread's timed waits (a :class:`HeldJob`'s delay) end to
    the microsecond: Linux lets them run up to the thread's timer slack late,
    50 µs by default, where a batching delay of 100 µs must take 100 µs (as the
    batcher's ``timerfd`` keeps it, schedulers/timer.py). Nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
    except (OSError, AttributeError):
        pass


class Abandoned(RuntimeError):
    """A job the thread skipped: the executor stopped before the batch ran."""


class InstanceThread:
    """Runs one instance's batches, in order, on one thread of its own.

    ``start`` on the Trio thread before the first ``submit``; ``wait(job)`` returns
    once the job's results are in; ``abandon`` makes the thread skip the jobs it
    has not started (their results are not wanted: the executor is stopping);
    ``stop`` lets the thread end after the jobs it was given. ``span(job)`` is when
    the job ran, on Trio's clock.
    """

    def __init__(self, name: str, instance: BackendInstance) -> None:
        self._name = name
        self._instance = instance
        self._pipeline = Pipeline(instance) if isinstance(instance, StagedBackendInstance) else None
        self._overlaps = bool(self._pipeline is not None and self._pipeline.overlaps)
        self._timed = instance if isinstance(instance, TimedBackendInstance) else None
        self._jobs: deque[Job | Callable[[], None] | None] = deque()
        # The thread sleeps in a read of an eventfd when it has nothing to do, and
        # ``_put`` wakes it with a write. Both release the GIL during the system
        # call: a wake-up through a lock (queue.SimpleQueue) holds the GIL on the
        # Trio thread while the kernel wakes the other thread, which then waits
        # for that GIL (most of an in-process Python model's hand-off, measured
        # with py-spy --gil).
        self._wake = _Doorbell()
        self._sleeping = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._abandoned = False
        self._thread: threading.Thread | None = None
        # Whether nothing waits for the instance (read on its thread; set by the
        # executor whose scheduler can tell): a finished job whose answers this
        # thread writes then defers its report (see Deferred).
        self.quiet: Callable[[], bool] | None = None
        self._deferred: Deferred | None = None
        self._held: HeldJob | None = None  # the last job given held
        self._hold = threading.Lock()  # its join against its start (see HeldJob)
        # Trio's clock less perf_counter(), where that is a constant (see span).
        self._offset: float | None = None

    def start(self, token: trio.lowlevel.TrioToken | None = None) -> None:
        """Start the thread; on the Trio thread, or anywhere given the run's ``token``."""
        self._token = token or trio.lowlevel.current_trio_token()
        if token is None:
            self._deferred = deferred_jobs()
            self._offset = clock_offset()
        self._thread = threading.Thread(
            target=self._work, name=f"instance {self._name}", daemon=True
        )
        self._thread.start()

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the instance's thread after the jobs given so far, and
        return what it returned (or raise what it raised). Blocking: not on the
        Trio thread. TimeoutError after ``timeout`` seconds (``fn`` still runs)."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._put(run)
        return future.result(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end after ``stop``; whether it ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def submit_held(self, job: Job, start_at: float) -> HeldJob:
        """Give the thread a job to start at ``start_at`` (Trio's clock), or
        when released (see :class:`HeldJob`)."""
        offset = self._offset
        if offset is None:  # (a MockClock's virtual time: read now)
            offset = trio.current_time() - time.perf_counter()
        held = self._held
        if held is None or held._job is not None:
            held = self._held = HeldJob(job, start_at - offset, self._hold)
        else:
            # The last one held is closed: re-armed as __init__ would arm it. No
            # lock: once closed, the thread does not look at it again until the
            # job's ring (``wait_out`` closes it last, its gate held again).
            held._job = job
            held._until = start_at - offset
            held._released = False
        job.held = held
        # _put and the doorbell's ring, written out.
        self._jobs.append(job)
        if self._sleeping:
            self._sleeping = False
            wake = self._wake
            if wake._read == wake._write:
                with wake._lock:
                    if not wake._closed:
                        os.eventfd_write(wake._write, 1)
            else:  # pragma: no cover - not Linux
                wake.ring()
        return held

    async def wait(self, job: Job) -> None:
        await job.done.wait()

    def abandon(self) -> None:
        self._abandoned = True
        if self._held is not None:
            self._held.release()  # skipped at once, not at its delay's end

    def stop(self) -> None:
        self._put(_STOP)

    def _put(self, item: Job | Callable[[], None] | None) -> None:
        self._jobs.append(item)
        # The thread says it sleeps before it looks at the jobs a last time, and
        # this looks after appending: one of the two sees the other (the GIL
        # orders them), so a job never waits for a wake-up that does not come.
        if self._sleeping:
            self._sleeping = False
            self._wake.ring()

    submit = _put  # a job (one call: on every request's way)

    def _next(self) -> Job | Callable[[], None] | None:
        """The next job, sleeping until there is one."""
        jobs = self._jobs
        while True:
            if jobs:
                return jobs.popleft()
            self._sleeping = True
            if jobs:
                self._sleeping = False
                continue
            self._wake.wait()  # a stale ring only makes it look again

    def span(self, job: Job) -> tuple[float, float]:
        """The job's start and end on Trio's clock (the thread reads perf_counter)."""
        offset = self._offset
        if offset is not None:
            return job.started + offset, job.ended + offset
        end = trio.current_time() - (time.perf_counter() - job.ended)
        return end - (job.ended - job.started), end

    # -- on the instance's thread ------------------------------------------------------

    def _work(self) -> None:
        name_os_thread(f"instance {self._name}")
        wait_to_the_microsecond()
        launched: Job | None = None  # computing on the device, not finished
        while True:
            if launched is not None and not (self._overlaps and self._jobs):
                self._finish(launched)
                launched = None
                continue
            job = self._next()
            if job is _STOP:
                if launched is not None:
                    self._finish(launched)
                self._wake.close()  # nothing rings it any more: it does not sleep again
                return
            if not isinstance(job, Job):
                job()  # a call (see call): after the batches before it
                continue
            if job.held is not None:
                job.held.wait_out()
                job.held = None
            self._stage(job)  # overlaps the launched batch's compute, if any
            if launched is not None:
                self._finish(launched)
            launched = self._launch(job)

    def _stage(self, job: Job) -> None:
        job.started = time.perf_counter()
        if self._abandoned:
            job.error = Abandoned("the executor stopped before the batch ran")
            return
        job.drop_cancelled()
        for request in job.requests:  # (no generator per batch)
            answer = request.answer
            if answer is not None and getattr(answer, "later", None) is not None:
                self._take_bodies(job)
                break
        if self._pipeline is not None and job.requests:
            self._pipeline.stage(job)

    @staticmethod
    def _take_bodies(job: Job) -> None:
        """Read the binary tensors its connection left in the socket for this thread
        (:mod:`trionserve.protocol.http.later`), for each request of the batch that has
        some, before the backend reads them; a request whose read fails leaves the batch
        and fails alone (``Job.unread``, given back by :meth:`_report`)."""
        unread = None
        for request in job.requests:
            later = getattr(request.answer, "later", None)
            if later is not None and later.pending and not later.take():
                if unread is None:
                    unread = []
                unread.append((request, InvalidArgument(later.broken)))
        if unread is not None:
            job.unread = unread
            failed = {id(request) for request, _ in unread}
            job.requests = [request for request in job.requests if id(request) not in failed]

    def _launch(self, job: Job) -> Job | None:
        """Start the job; the job if it still has to be finished, else None."""
        if not job.requests:
            job.results = []  # every request was cancelled: nothing to run
        elif job.error is None:
            if self._pipeline is not None:
                self._pipeline.launch(job)
                if job.error is None:
                    return job
            else:
                try:
                    job.results = self._instance.execute(job.requests)
                except Exception as exc:
                    job.error = exc
        self._report(job)
        return None

    def _finish(self, job: Job) -> None:
        assert self._pipeline is not None  # only staged jobs are launched unfinished
        self._pipeline.finish(job)
        self._report(job)

    def _report(self, job: Job) -> None:
        job.ended = time.perf_counter()
        if job.unread is not None:  # (after the rest of the batch ran: back in, failed)
            job.requests = job.requests + [request for request, _ in job.unread]
            if job.results is not None:
                job.results = list(job.results) + [error for _, error in job.unread]
            job.unread = None
        job.staged = None
        if self._timed is not None and job.error is None:
            job.times = self._timed.compute_times
        if self._deferred is not None and self._answered(job, self._deferred):
            return
        assert self._token is not None
        try:
            self._token.run_sync_soon(job.finished)
        except trio.RunFinishedError:
            pass  # the run ended (the executor was torn down with it)

    def _answered(self, job: Job, deferred: Deferred) -> bool:
        """Write the job's answers here and defer its report, if every request
        of it has an armed answer and a response, and either nothing waits for
        the instance or the executor can be told the instance is free apart
        from the report (``on_free``); False: reported to the loop as usual.

        With requests waiting (c>1: the batcher has the next batch), the loop
        is told first that the instance is free (``Job.freed``, one wake-up as
        the report's was), so it forms the next batch and hands it over while
        this thread writes this batch's answers: the next batch is not delayed
        by them, and, given to a thread that does not sleep yet, needs no ring
        of the doorbell. The loop then does none of the batch's per-request
        work (waking each request's task, encoding, writing); the sweep
        delivers the report as the clients' next requests come."""
        requests, results = job.requests, job.results
        if (
            job.error is not None
            or job.cancelled
            or not requests
            or results is None
            or len(results) != len(requests)
            or self._jobs
            or self.quiet is None
        ):
            return False
        busy = not self.quiet()
        if busy and job.on_free is None:
            return False
        answers = []
        for request, result in zip(requests, results):
            answer = request.answer
            if answer is None or not answer.armed or not isinstance(result, InferenceResponse):
                return False
            answers.append(answer)
        job.responses = True  # (one response per request: checked above)
        statistics, times, offset = job.statistics, job.times, self._offset
        if (
            statistics is not None
            and times is not None
            and offset is not None
            and statistics.summaries is None  # (they read Trio's clock)
            and not statistics.traces
        ):
            # Counted here, before a client can see its answer (and before the
            # report a statistics read sweeps first is deferred), not on the loop.
            statistics.record_batch(
                requests, None, job.started + offset, job.ended + offset, *times
            )
            job.recorded = True
        deferred.append(job, idle=not busy)  # before any answer is written (see Deferred)
        # A request submitted as the job was deferred saw no idle job, or this
        # sees it queued (the GIL orders the two): then the loop is told now.
        if busy or not self.quiet():
            assert self._token is not None
            try:
                self._token.run_sync_soon(job.freed if job.on_free is not None else deferred.sweep)
            except trio.RunFinishedError:
                pass
        whole = True
        for answer, request, result in zip(answers, requests, results):
            if not answer.write(request, result):
                whole = False
        if not whole or self._abandoned:
            deferred.wake()  # the loop writes what is left, or waits for the job: now
        return True
