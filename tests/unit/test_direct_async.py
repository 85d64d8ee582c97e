"""An executor of a stub-process instance offers itself to the default scheduler:
a request that finds it idle runs in the submitting task, awaited there; one
that comes while it is busy goes through the channel, and the executor is not
offered again before it looked at the channel."""

from __future__ import annotations

import trio
import trio.testing

from trionserve.actors.executor import InstanceExecutor
from trionserve.backends.base import DirectAsyncBackendInstance, InstanceSpec
from trionserve.core.errors import Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import ModelStatistics
from trionserve.schedulers.default import DefaultScheduler


def _request(name: str) -> InferenceRequest:
    return InferenceRequest("m", id=name)


class _Executor:
    """Waits in receive_direct_async like InstanceExecutor._serve_async."""

    def __init__(self, scheduler: DefaultScheduler) -> None:
        self.outlet = scheduler.outlet()
        self.direct: list[tuple[str, object]] = []  # (request id, task that ran it)
        self.channel: list[str] = []  # request ids taken from the channel
        self.refuse = False
        self.gate: trio.Event | None = None

    async def run_direct(self, batch: list[InferenceRequest]) -> bool:
        if self.refuse:
            return False
        self.direct.append((batch[0].id, trio.lowlevel.current_task()))
        if self.gate is not None:
            await self.gate.wait()
        return True

    async def serve(self) -> None:
        while True:
            try:
                batch = await self.outlet.receive_direct_async(self.run_direct)
            except trio.EndOfChannel:
                return
            self.channel.append(batch[0].id)


async def test_an_idle_executor_runs_the_request_in_the_submitting_task():
    scheduler = DefaultScheduler()
    executor = _Executor(scheduler)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.serve)
        await trio.testing.wait_all_tasks_blocked()
        await scheduler.submit(_request("a"))
        await scheduler.submit(_request("b"))  # offered again after its run
        me = trio.lowlevel.current_task()
        assert executor.direct == [("a", me), ("b", me)]
        assert executor.channel == []
        nursery.cancel_scope.cancel()


async def test_a_refused_request_goes_through_the_channel():
    scheduler = DefaultScheduler()
    executor = _Executor(scheduler)
    executor.refuse = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.serve)
        await trio.testing.wait_all_tasks_blocked()
        await scheduler.submit(_request("a"))
        await trio.testing.wait_all_tasks_blocked()
        assert executor.direct == []
        assert executor.channel == ["a"]
        nursery.cancel_scope.cancel()


async def test_a_request_while_it_runs_one_goes_through_the_channel():
    scheduler = DefaultScheduler()
    executor = _Executor(scheduler)
    executor.gate = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.serve)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(scheduler.submit, _request("a"))
        await trio.testing.wait_all_tasks_blocked()
        assert [name for name, _ in executor.direct] == ["a"]
        # Busy: the next one is queued (its executor's task has it) ...
        await scheduler.submit(_request("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert executor.channel == ["b"]
        executor.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        # ... and the run that ended does not offer the executor again: it
        # offers itself when it waits next (here at once: it took "b").
        executor.gate = None
        await scheduler.submit(_request("c"))
        assert [name for name, _ in executor.direct] == ["a", "c"]
        assert executor.channel == ["b"]
        nursery.cancel_scope.cancel()


async def test_a_closed_scheduler_offers_nothing():
    scheduler = DefaultScheduler()
    executor = _Executor(scheduler)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.serve)
        await trio.testing.wait_all_tasks_blocked()
        scheduler.close()
        try:
            await scheduler.submit(_request("a"))
        except trio.ClosedResourceError:
            pass
        assert executor.direct == []
        nursery.cancel_scope.cancel()


async def test_two_idle_executors_run_two_requests_at_once():
    """count: 2: two submitting tasks each run their request with an executor of
    its own, at the same time (no lock shared between the instances)."""
    scheduler = DefaultScheduler()
    executors = [_Executor(scheduler), _Executor(scheduler)]
    gate = trio.Event()
    for executor in executors:
        executor.gate = gate
    async with trio.open_nursery() as nursery:
        for executor in executors:
            nursery.start_soon(executor.serve)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(scheduler.submit, _request("a"))
        nursery.start_soon(scheduler.submit, _request("b"))
        await trio.testing.wait_all_tasks_blocked()
        # Both are in their runs before either finished.
        assert sorted(name for e in executors for name, _ in e.direct) == ["a", "b"]
        assert all(len(e.direct) == 1 for e in executors)
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert all(e.channel == [] for e in executors)
        nursery.cancel_scope.cancel()


class _StubLike:
    """A DirectAsyncBackendInstance whose execute waits for a gate."""

    def __init__(self) -> None:
        self.gate = trio.Event()
        self.busy = 0
        self.executed: list[str] = []
        self.abandoned: list[str] = []  # waited for by a cancelled task: still running

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    def runs_direct(self) -> bool:
        return self.busy == 0

    async def wait_idle(self) -> None:
        await self.gate.wait()  # the process finishes what it was running
        self.executed.extend(self.abandoned)
        self.busy -= len(self.abandoned)
        self.abandoned.clear()

    async def execute_async(self, requests):
        self.busy += 1
        try:
            await self.gate.wait()
        except trio.Cancelled:
            self.abandoned.extend(r.id for r in requests)
            raise
        self.busy -= 1
        self.executed.extend(r.id for r in requests)
        return [InferenceResponse("m", "1", r.id, []) for r in requests]

    def close(self) -> None:
        pass


def _executor(
    scheduler: DefaultScheduler, instance: _StubLike, statistics: ModelStatistics | None = None
):
    spec = InstanceSpec("m_0_0", "m_0", "KIND_CPU", 0)
    return InstanceExecutor(spec, instance, scheduler.outlet(), statistics)


async def test_a_stopped_executor_lets_the_direct_batch_finish():
    """stop() (unload, drain) while a batch runs in its submitting task: the
    batch gets its real answer, then the executor ends."""
    scheduler = DefaultScheduler()
    instance = _StubLike()
    executor = _executor(scheduler, instance)
    request = _request("a")
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(scheduler.submit, request)
        await trio.testing.wait_all_tasks_blocked()
        assert instance.busy == 1  # in the submitting task
        executor.stop()
        await trio.testing.wait_all_tasks_blocked()
        assert not executor.finished.is_set()
        instance.gate.set()
        await executor.finished.wait()
    assert instance.executed == ["a"]
    assert (await request.wait()).id == "a"


async def test_a_cancelled_submitter_holds_the_executor_until_the_instance_is_idle():
    """The submitter gives up while its batch executes: its request is
    cancelled (the model is told) and answered, and the executor runs the next
    batch only once the instance finished the first."""
    scheduler = DefaultScheduler()
    instance = _StubLike()
    executor = _executor(scheduler, instance)
    first, second = _request("a"), _request("b")
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        await trio.testing.wait_all_tasks_blocked()
        scope = trio.CancelScope()

        async def submit_first() -> None:
            with scope:
                await scheduler.submit(first)

        nursery.start_soon(submit_first)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert first.cancelled and first.done
        nursery.start_soon(scheduler.submit, second)
        await trio.testing.wait_all_tasks_blocked()
        assert instance.busy == 1  # still the first: the second waits
        instance.gate.set()
        response = await second.wait()
        assert response.id == "b"
        assert instance.executed == ["a", "b"]
        executor.stop()


async def test_a_request_taken_while_one_runs_in_a_submitting_task_stays_pending():
    """The executor's task takes the next request from the channel while the
    first runs in its submitter, and waits for that run to end: the request is
    pending until then (nv_inference_pending_request_count), as in Triton."""
    scheduler = DefaultScheduler()
    executor = _Executor(scheduler)
    executor.gate = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.serve)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(scheduler.submit, _request("a"))
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.pending == 0  # "a" runs
        await scheduler.submit(_request("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert executor.channel == ["b"]  # taken by the executor's task ...
        assert scheduler.pending == 1  # ... which waits for "a": still pending
        executor.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.pending == 0
        nursery.cancel_scope.cancel()


async def test_an_executor_stopped_while_it_holds_a_request_answers_it():
    """The executor holds "b" while "a" runs in its submitter; stopped then
    (unload deadline, shutdown), it answers "b" UNAVAILABLE instead of
    dropping it: every accepted request gets exactly one outcome."""
    scheduler = DefaultScheduler()
    instance = _StubLike()
    assert isinstance(instance, DirectAsyncBackendInstance)
    executor = _executor(scheduler, instance, ModelStatistics("m", "1"))
    executor_scope = trio.CancelScope()

    async def run_executor(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with executor_scope:
            await executor.run(task_status=task_status)

    a, b = _request("a"), _request("b")
    async with trio.open_nursery() as nursery:
        await nursery.start(run_executor)
        nursery.start_soon(scheduler.submit, a)
        await trio.testing.wait_all_tasks_blocked()
        assert instance.busy == 1  # "a" runs in its submitting task
        await scheduler.submit(b)
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.pending == 1  # held by the executor's task
        executor_scope.cancel()
        with trio.fail_after(5):
            try:
                await b.wait()
            except Unavailable as error:
                assert "was stopped" in str(error)
            else:
                raise AssertionError("the held request was answered with a response")
        instance.gate.set()
        assert isinstance(await a.wait(), InferenceResponse)


async def test_queued_requests_are_taken_in_order_sixteen_without_a_task_switch():
    """An executor whose stub is busy finds requests queued: it takes them in
    order, EAGER_BATCHES in a row without a checkpoint, then one with a
    checkpoint (no offer to the submitters while any is queued)."""
    from trionserve.schedulers.default import EAGER_BATCHES

    scheduler = DefaultScheduler()
    for i in range(EAGER_BATCHES + 2):
        await scheduler.submit(_request(str(i)))  # no executor offered: all queued
    outlet = scheduler.outlet()

    async def run_direct(batch: list[InferenceRequest]) -> bool:
        raise AssertionError("offered while requests were queued")

    taken = []
    with trio.testing.assert_no_checkpoints():
        for _ in range(EAGER_BATCHES):
            taken.append((await outlet.receive_direct_async(run_direct))[0].id)
    with trio.testing.assert_checkpoints():
        taken.append((await outlet.receive_direct_async(run_direct))[0].id)
    with trio.testing.assert_no_checkpoints():
        taken.append((await outlet.receive_direct_async(run_direct))[0].id)
    assert taken == [str(i) for i in range(EAGER_BATCHES + 2)]
    assert scheduler.pending == 0


async def test_a_run_in_the_submitting_task_counts_as_held_before_it_ends():
    """The data plane's ``queued`` (what an ensemble's next step run and a gRPC
    stream's next request wait for) is set as the run begins, not once the model
    answered: an ensemble whose decoupled step feeds a stub model held its
    producer's final flag behind the whole run, so the last answer went out
    without the flag and the flag alone after it, which a gRPC client does not
    get (qa/L0_simple_ensemble EnsembleStepMaxQueueSizeTest waited 60 s)."""
    scheduler = DefaultScheduler()
    instance = _StubLike()
    executor = _executor(scheduler, instance)
    request = _request("a")
    request.queued = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(scheduler.submit, request)
        await trio.testing.wait_all_tasks_blocked()
        assert instance.busy == 1  # running, in the submitting task
        assert request.queued.is_set()
        instance.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert instance.executed == ["a"]
        executor.stop()
