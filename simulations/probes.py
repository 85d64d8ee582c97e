"""Probes: what the simulation observes inside the real runtime, without changing it.

``runtime_probes`` wraps two ModelVersion methods for the duration of a run:
``run`` (to list every version and to tell the simulated backend which version
it is loading, through a context variable that the version's tasks inherit) and
``infer``, and the dynamic batcher's ``submit_now`` (the plain queueing a READY
version names, ``ModelVersion.submit_now``, that the data plane's ``begin_now``
calls): ``infer`` and ``submit_now`` attribute each request to the version that
accepted or refused it. :class:`Monitor` is a Trio instrument: it probes each scheduler's outlets
(to see when an executor takes a batch), checks queue lengths against their
bounds after every task step, and tracks which tasks the server started.
Probes read a few runtime internals (``ModelVersion._scheduler``, the queues'
private counters); if those change, the probes fail loudly, not silently.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import trio

from trionserve.actors.model import ModelVersion
from trionserve.schedulers.default import DefaultScheduler
from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler
from trionserve.schedulers.scheduler import QUEUE_CAPACITY
from trionserve.schedulers.sequence_batch import SequenceBatchScheduler

# The ModelVersion whose task (or child task) is running.
CURRENT_VERSION: contextvars.ContextVar = contextvars.ContextVar("simulated_version")
QUEUE_BOUNDS = "queue lengths stay within bounds"
# Task steps at one virtual instant beyond which the run counts as a livelock
# (tasks that keep waking each other, or a loop waiting for a time that has come).
LIVELOCK_STEPS = 200_000


@contextlib.contextmanager
def runtime_probes(world) -> Iterator[None]:
    original_run, original_infer = ModelVersion.run, ModelVersion.infer
    original_submit_now = DynamicBatchScheduler.submit_now

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        CURRENT_VERSION.set(self)
        world.versions.append(self)
        world.live_versions.append(self)
        try:
            return await original_run(self, task_status=task_status)
        finally:
            world.live_versions.remove(self)

    async def infer(self, request):
        record = world.record_for(request)
        if record is not None:
            record.version = self
        try:
            await original_infer(self, request)
        except BaseException as exc:
            if record is not None:
                record.refusal = exc
            raise
        if record is not None:
            record.accepted = True

    def submit_now(self, request, waited=False):  # (False: not queued, it would wait)
        record = world.record_for(request)
        if record is not None:
            # The version whose batcher this is (the one begin_now queues at).
            for version in world.live_versions:
                if version._scheduler is self:
                    record.version = version
        try:
            accepted = original_submit_now(self, request, waited)
        except BaseException as exc:
            if record is not None:
                record.refusal = exc
            raise
        if record is not None and accepted:
            record.accepted = True
        return accepted

    ModelVersion.run, ModelVersion.infer = run, infer
    DynamicBatchScheduler.submit_now = submit_now
    try:
        yield
    finally:
        ModelVersion.run, ModelVersion.infer = original_run, original_infer
        DynamicBatchScheduler.submit_now = original_submit_now


class _ProbedOutlet:
    """An executor's outlet that notes when each request's batch was taken:
    received, or run or handed over straight from the scheduler."""

    def __init__(self, outlet, world) -> None:
        self._outlet = outlet
        self._world = world

    async def receive(self):
        return self._taken(await self._outlet.receive())

    async def receive_direct(self, run, handover=None, delayed=None):
        noted = None if handover is None else self._noting(handover)
        held = None if delayed is None else self._noting_held(delayed)
        return self._taken(await self._outlet.receive_direct(self._noting(run), noted, held))

    def _noting_held(self, delayed):
        def noted(batch, start_at):
            held = delayed(batch, start_at)  # (never on the simulations' virtual clock)
            if held is not None:
                self._taken(batch)
            return held

        return noted

    def _noting(self, run):
        def noted(batch):
            if not run(batch):
                return False
            self._taken(batch)
            return True

        return noted

    def _taken(self, batch):
        now = trio.current_time()
        for request in batch:
            record = self._world.record_for(request)
            if record is not None:
                record.taken_at = now
        return batch

    def __getattr__(self, name):
        return getattr(self._outlet, name)


def _probe_scheduler(scheduler, world) -> None:
    make_outlet = scheduler.outlet
    scheduler.outlet = lambda: _ProbedOutlet(make_outlet(), world)
    scheduler._simulation_probed = True


def queue_lengths(version) -> list[tuple[str, int, int]]:
    """(queue, length, bound) for each queue of a version's scheduler; bound 0: none."""
    scheduler = getattr(version, "_scheduler", None)
    if isinstance(scheduler, DynamicBatchScheduler):
        batching = version.config.dynamic_batching
        rows = [("all levels", scheduler.pending, QUEUE_CAPACITY)]
        for number, level in scheduler._levels.items():
            policy = batching.priority_queue_policy.get(number, batching.default_queue_policy)
            rows.append((f"level {number}", level.count, policy.max_queue_size))
        return rows
    if isinstance(scheduler, DefaultScheduler):
        statistics = scheduler._send.statistics()
        return [("channel", statistics.current_buffer_used, QUEUE_CAPACITY)]
    if isinstance(scheduler, SequenceBatchScheduler):
        return [("sequences", scheduler.pending, QUEUE_CAPACITY)]
    return []


class Monitor(trio.abc.Instrument):
    """Watches the run from inside Trio: queue bounds, outlets, the server's tasks."""

    def __init__(self, world) -> None:
        self.world = world
        self.server_tasks: set = set()  # tasks started (directly or not) by the server
        self.steps = 0
        self._instant = None
        self._steps_at_instant = 0
        self._busiest: dict[str, int] = {}
        self.everything: trio.CancelScope | None = None  # set by the harness

    def task_spawned(self, task) -> None:
        try:
            spawner = trio.lowlevel.current_task()
        except RuntimeError:
            return
        if spawner is self.world.server_task or spawner in self.server_tasks:
            self.server_tasks.add(task)

    def task_exited(self, task) -> None:
        self.server_tasks.discard(task)

    def after_task_step(self, task) -> None:
        self.steps += 1
        world = self.world
        self._watch_livelock(task)
        for version in world.live_versions:
            scheduler = getattr(version, "_scheduler", None)
            if scheduler is None:
                continue
            if not getattr(scheduler, "_simulation_probed", False):
                _probe_scheduler(scheduler, world)
            for queue, length, bound in queue_lengths(version):
                key = f"{version.name}/{version.version} {queue}"
                if length > world.queue_peaks.get(key, -1):
                    world.queue_peaks[key] = length
                    if bound and length > bound:
                        world.violate(
                            QUEUE_BOUNDS, f"{key} held {length} requests; its bound is {bound}"
                        )

    def _watch_livelock(self, task) -> None:
        now = trio.current_time()
        if now != self._instant:
            self._instant, self._steps_at_instant = now, 0
            self._busiest.clear()
            return
        self._steps_at_instant += 1
        if self._steps_at_instant > LIVELOCK_STEPS - 1000:
            self._busiest[task.name] = self._busiest.get(task.name, 0) + 1
        if self._steps_at_instant == LIVELOCK_STEPS and self.everything is not None:
            busiest = sorted(self._busiest.items(), key=lambda item: -item[1])[:3]
            self.world.violate(
                "the run completes",
                f"livelock: {LIVELOCK_STEPS} task steps at "
                f"virtual time {now:.4f}; busiest: {busiest}",
            )
            self.everything.cancel()
