"""Virtual time for the real runtime: blocking calls run inline, scheduling is seeded.

Worker threads do not advance a ``MockClock``: while the loop waits on a thread, an
autojumping clock leaps to the next deadline, so a run would depend on how fast
the machine is. Inside :func:`virtual_runtime`, ``trio.to_thread.run_sync`` runs
its function on the Trio thread instead, after a virtual delay that the function's
owner may declare with a ``virtual_seconds(method_name, args)`` method (the
simulated backend does, for loading and executing), and an executor's instance
thread runs each batch it is given the same way, in order, in a task of its own
(:class:`InlineInstanceThread`). Like a real worker thread, the call cannot be
interrupted once it has started.

Trio shuffles each batch of runnable tasks with a module-level random generator;
seeding it (and sorting each batch first, as Trio does under Hypothesis) makes the
task interleaving a function of the seed, so a seed replays a run exactly.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import trio
import trio._core._run as _trio_run

from trionserve.actors import executor as _executor
from trionserve.backends.instance_thread import Abandoned, Job


async def inline_run_sync(sync_fn, *args, limiter=None, **_options):
    """``trio.to_thread.run_sync`` on the Trio thread, on the virtual clock."""
    await trio.lowlevel.checkpoint_if_cancelled()
    holder = limiter if limiter is not None else contextlib.nullcontext()
    async with holder:
        owner = getattr(sync_fn, "__self__", None)
        declare = getattr(owner, "virtual_seconds", None)
        seconds = declare(sync_fn.__name__, args) if declare is not None else 0.0
        # A thread that has started cannot be interrupted: neither can this call.
        with trio.CancelScope(shield=True):
            if seconds > 0:
                await trio.sleep(seconds)
            result = sync_fn(*args)
            await trio.lowlevel.cancel_shielded_checkpoint()
    return result


class InlineInstanceThread:
    """An executor's instance thread on the Trio thread: the jobs it is given run
    one after the other, in the order given (through :func:`inline_run_sync`, so
    on the virtual clock), in a system task of their own, as a thread would
    run them; each is reported done as the real thread reports it
    (``Job.finished``)."""

    def __init__(self, name: str, instance) -> None:
        self._instance = instance
        self._spans: dict[int, tuple[float, float]] = {}
        self._abandoned = False
        self._queue: deque[Job] = deque()
        self._running = False

    def start(self) -> None:
        pass

    def submit(self, job: Job) -> None:
        self._queue.append(job)
        if not self._running:
            self._running = True
            trio.lowlevel.spawn_system_task(self._run_queued)

    async def _run_queued(self) -> None:
        try:
            while self._queue:
                await self._run(self._queue.popleft())
        finally:
            self._running = False

    async def _run(self, job: Job) -> None:
        if self._abandoned:  # not started: the executor is stopping
            job.error = Abandoned("the executor stopped before the batch ran")
            job.finished()
            return
        start = trio.current_time()
        job.drop_cancelled()
        try:
            job.results = (
                await inline_run_sync(self._instance.execute, job.requests) if job.requests else []
            )
        except Exception as exc:
            job.error = exc
        job.times = getattr(self._instance, "compute_times", None)
        self._spans[id(job)] = (start, trio.current_time())
        job.finished()

    async def wait(self, job: Job) -> None:
        await job.done.wait()

    def abandon(self) -> None:
        self._abandoned = True

    def stop(self) -> None:
        pass

    def span(self, job: Job) -> tuple[float, float]:
        return self._spans.pop(id(job))


@contextlib.contextmanager
def virtual_runtime(seed: int) -> Iterator[None]:
    """Inline worker threads and seeded scheduling for the runs made inside."""
    saved_run_sync = trio.to_thread.run_sync
    saved_thread = _executor.InstanceThread
    saved_flag = _trio_run._ALLOW_DETERMINISTIC_SCHEDULING
    saved_state = _trio_run._r.getstate()
    trio.to_thread.run_sync = inline_run_sync
    _executor.InstanceThread = InlineInstanceThread  # type: ignore[misc,assignment]
    _trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True
    _trio_run._r.seed(seed)
    try:
        yield
    finally:
        trio.to_thread.run_sync = saved_run_sync
        _executor.InstanceThread = saved_thread  # type: ignore[misc]
        _trio_run._ALLOW_DETERMINISTIC_SCHEDULING = saved_flag
        _trio_run._r.setstate(saved_state)


@contextlib.contextmanager
def seeded_scheduling(seed: int) -> Iterator[None]:
    """Seeded scheduling only, for runs that use real threads and processes."""
    saved_flag = _trio_run._ALLOW_DETERMINISTIC_SCHEDULING
    saved_state = _trio_run._r.getstate()
    _trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True
    _trio_run._r.seed(seed)
    try:
        yield
    finally:
        _trio_run._ALLOW_DETERMINISTIC_SCHEDULING = saved_flag
        _trio_run._r.setstate(saved_state)
