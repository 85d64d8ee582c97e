"""InstanceExecutor with a blocking instance: one long-lived thread, two batches in flight.

A fake outlet hands out numbered batches and notes when each is taken and
completed; the backend instance blocks inside ``execute`` until the test lets it
go (threading events, no sleeps), so the test sees what the executor does while a
batch computes.
"""

from __future__ import annotations

import threading

import numpy as np
import trio
import trio.testing

from trionserve.actors.executor import InstanceExecutor
from trionserve.backends.base import InstanceSpec
from trionserve.backends.batch_tensors import gather_inputs
from trionserve.backends.cuda.pipeline import PIPELINE_DEPTH, HostBuffers
from trionserve.core.errors import InternalError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.observability.statistics import ComputeTimes, ModelStatistics

SPEC = InstanceSpec("m_0_0", "m_0", "KIND_CPU", 0)


def make_request(index: int) -> InferenceRequest:
    data = np.full((1, 4), index, dtype=np.float32)
    r = InferenceRequest("m", id=str(index), inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})
    r.batch_size = 1
    r.arrival_time = trio.current_time()
    return r


class Outlet:
    """Hands out ``count`` batches of one request; records takes and completions."""

    def __init__(self, count: int) -> None:
        self.batches = [[make_request(i)] for i in range(count)]
        self.taken = 0
        self.completed: list[tuple[list, list]] = []
        self.changed = trio.Event()
        self.closed = False

    async def receive(self):
        await trio.lowlevel.checkpoint()
        if self.taken == len(self.batches):
            await self.until(lambda: self.closed)
        if self.closed:
            raise trio.EndOfChannel
        batch = self.batches[self.taken]
        self.taken += 1
        self._changed()
        return batch

    async def receive_direct(self, run, handover=None, delayed=None):
        return await self.receive()  # no request is handed straight over

    def offer_again(self) -> None:
        pass

    def complete(self, requests, outcomes) -> None:
        self.completed.append((list(requests), list(outcomes)))
        for request, outcome in zip(requests, outcomes):
            if isinstance(outcome, InferenceResponse):
                request.respond(outcome)
            else:
                request.fail(outcome)
        self._changed()

    def close(self) -> None:
        self.closed = True
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def until(self, predicate) -> None:
        with trio.fail_after(10):
            while not predicate():
                await self.changed.wait()


class Blocking:
    """A device-like staged instance (``overlaps``): each launch waits for its own
    release; notes the thread it ran on."""

    overlaps = True
    compute_times = None

    def __init__(self, fail: set[int] = frozenset()) -> None:
        self.threads: list[int] = []
        self.entered = [threading.Event() for _ in range(8)]
        self.release = [threading.Event() for _ in range(8)]
        self.running = 0
        self.overlapped = False
        self.fail = fail
        self.closed = False

    def execute(self, requests):
        return self.finish(requests, self.launch(requests, self.stage(requests)))

    def stage(self, requests):
        return None

    def finish(self, requests, launched):
        return [InferenceResponse("m", "1", r.id) for r in requests]

    def launch(self, requests, staged):
        index = int(requests[0].id)
        self.running += 1
        self.overlapped |= self.running > 1
        self.threads.append(threading.get_ident())
        self.entered[index].set()
        self.release[index].wait(10)
        self.running -= 1
        if index in self.fail:
            raise RuntimeError(f"batch {index} broke")
        return None

    def close(self) -> None:
        self.closed = True


class BlockingCpu(Blocking):
    """The same as a plain blocking instance, without a device to overlap."""

    overlaps = False


async def entered(instance: Blocking, index: int) -> None:
    assert await trio.to_thread.run_sync(instance.entered[index].wait, 10)


async def test_the_next_batch_is_taken_while_one_computes_and_no_more():
    instance, outlet = Blocking(), Outlet(4)
    executor = InstanceExecutor(SPEC, instance, outlet, ModelStatistics("m", "1"))
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        await entered(instance, 0)
        # Batch 0 computes: batch 1 is taken meanwhile, batch 2 is not (two in flight).
        await outlet.until(lambda: outlet.taken == PIPELINE_DEPTH)
        await trio.testing.wait_all_tasks_blocked()
        assert outlet.taken == 2 and not outlet.completed
        instance.release[0].set()
        await entered(instance, 1)  # straight after 0, from the batch already taken
        await outlet.until(lambda: len(outlet.completed) == 1 and outlet.taken == 3)
        for index in (1, 2, 3):
            instance.release[index].set()
        await outlet.until(lambda: len(outlet.completed) == 4)
        executor.stop()
    ids = [[r.id for r in requests] for requests, _ in outlet.completed]
    assert ids == [["0"], ["1"], ["2"], ["3"]]  # in the order taken
    # One long-lived thread, not the event loop's, never two executes at once.
    assert len(set(instance.threads)) == 1
    assert instance.threads[0] != threading.get_ident()
    assert not instance.overlapped
    assert executor.finished.is_set()


async def test_a_cpu_instance_takes_one_batch_at_a_time():
    """Its thread could not start the next batch sooner; left with the batcher, the
    next batch goes on gathering requests while this one runs."""
    instance, outlet = BlockingCpu(), Outlet(2)
    executor = InstanceExecutor(SPEC, instance, outlet)
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        await entered(instance, 0)
        await trio.testing.wait_all_tasks_blocked()
        assert outlet.taken == 1
        instance.release[0].set()
        await outlet.until(lambda: outlet.taken == 2)
        instance.release[1].set()
        await outlet.until(lambda: len(outlet.completed) == 2)
        executor.stop()
    assert len(set(instance.threads)) == 1


async def test_a_failing_batch_fails_alone():
    instance, outlet = Blocking(fail={1}), Outlet(3)
    executor = InstanceExecutor(SPEC, instance, outlet)
    for release in instance.release:
        release.set()
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        await outlet.until(lambda: len(outlet.completed) == 3)
        executor.stop()
    outcomes = [outcomes[0] for _, outcomes in outlet.completed]
    assert isinstance(outcomes[0], InferenceResponse)
    assert isinstance(outcomes[1], InternalError) and "batch 1 broke" in str(outcomes[1])
    assert isinstance(outcomes[2], InferenceResponse)


async def test_cancelled_executor_answers_its_batches_after_the_thread_is_done():
    instance, outlet = Blocking(), Outlet(3)
    executor = InstanceExecutor(SPEC, instance, outlet)
    scope = trio.CancelScope()

    async def run_executor(task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            await executor.run(task_status=task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(run_executor)
        await entered(instance, 0)
        await outlet.until(lambda: outlet.taken == 2)
        scope.cancel()
        # The executor waits (shielded) for the running batch before answering.
        await trio.testing.wait_all_tasks_blocked()
        assert not outlet.completed
        instance.release[0].set()
    # Batch 0 ran: its result is delivered; batch 1 was skipped: "stopped". Each once.
    assert [len(outcomes) for _, outcomes in outlet.completed] == [1, 1]
    (_, ran), (_, skipped) = outlet.completed
    assert isinstance(ran[0], InferenceResponse)
    assert isinstance(skipped[0], Unavailable)
    assert not instance.entered[1].is_set()
    assert len(instance.threads) == 1


class Timed:
    """Reports its own phases; checks the executor records them as given."""

    def __init__(self) -> None:
        self.compute_times: ComputeTimes | None = None

    def execute(self, requests):
        self.compute_times = ComputeTimes(1_000, 2_000, 3_000)
        return [InferenceResponse("m", "1", r.id) for r in requests]

    def close(self) -> None:
        pass


async def test_the_backends_phases_are_recorded_as_reported():
    statistics = ModelStatistics("m", "1")
    outlet = Outlet(2)
    executor = InstanceExecutor(SPEC, Timed(), outlet, statistics)
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        await outlet.until(lambda: len(outlet.completed) == 2)
        executor.stop()
    assert statistics.compute_input.ns == 2 * 1_000
    assert statistics.compute_infer.ns == 2 * 2_000
    assert statistics.compute_output.ns == 2 * 3_000


def test_host_buffers_gather_once_and_are_reused():
    buffers = HostBuffers()
    requests = []
    for index in range(3):
        data = np.full((2, 4), index, dtype=np.float32)
        r = InferenceRequest("m", inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})
        r.batch_size = 2
        requests.append(r)
    first = gather_inputs(requests, buffers=buffers)["INPUT0"]
    np.testing.assert_array_equal(first[:, 0], [0, 0, 1, 1, 2, 2])
    assert buffers.holds(first)
    again = gather_inputs(requests[:2], buffers=buffers)["INPUT0"]
    assert again.shape == (4, 4)
    assert np.shares_memory(first, again)  # the same memory, no new allocation
    # A single request is passed through, unless a staging copy is asked for.
    single = requests[:1]
    assert gather_inputs(single, buffers=buffers)["INPUT0"] is single[0].inputs["INPUT0"].data
    staged = gather_inputs(single, buffers=buffers, always_copy=True)["INPUT0"]
    assert buffers.holds(staged)


class PairsOutlet(Outlet):
    """Batches of two requests; hands a batch over without a checkpoint when one
    is there (as the dynamic batcher does when it can form one at once); logs
    each take."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.batches = [[make_request(i), make_request(i)] for i in range(count)]
        self.log: list[tuple[str, int]] = []

    async def receive(self):
        if self.taken == len(self.batches):
            await self.until(lambda: self.closed)
        if self.closed:
            raise trio.EndOfChannel
        batch = self.batches[self.taken]
        self.log.append(("taken", self.taken))
        self.taken += 1
        self._changed()
        return batch


class Instant:
    """A CPU instance that answers at once."""

    compute_times = None

    def execute(self, requests):
        return [InferenceResponse("m", "1", r.id) for r in requests]

    def close(self) -> None:
        pass


async def test_a_cpu_instance_takes_its_next_batch_before_the_last_ones_answers_go():
    """Batches back to back: once a batch of several is done, the next one is
    taken (and its thread starts it) before the tasks waiting for the done
    batch's responses run to encode and send them."""
    outlet = PairsOutlet(8)
    executor = InstanceExecutor(SPEC, Instant(), outlet)

    async def answered(request: InferenceRequest) -> None:
        await request.wait()
        outlet.log.append(("answered", int(request.id)))

    async with trio.open_nursery() as nursery:
        for batch in outlet.batches:
            for request in batch:
                nursery.start_soon(answered, request)
        await trio.testing.wait_all_tasks_blocked()
        await nursery.start(executor.run)
        await outlet.until(lambda: len(outlet.completed) == 8)
        executor.stop()
    for index in range(7):
        assert outlet.log.index(("taken", index + 1)) < outlet.log.index(("answered", index))


async def test_delivery_wakes_once_per_batch_when_it_finishes():
    """The task that hands outcomes back is woken when a batch finishes, not also
    when the batch is given to the thread: one step per batch (c=1: one step
    fewer per request)."""
    steps: list[str] = []

    class Steps(trio.abc.Instrument):
        def after_task_step(self, task) -> None:
            steps.append(task.name)

    outlet = Outlet(20)
    executor = InstanceExecutor(SPEC, Instant(), outlet)
    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(executor.run)
            await outlet.until(lambda: len(outlet.completed) == 20)
            executor.stop()
    finally:
        trio.lowlevel.remove_instrument(instrument)
    delivery = [name for name in steps if name.endswith("InstanceExecutor._deliver")]
    assert 20 <= len(delivery) <= 23, len(delivery)  # one per batch, and its start and end


async def test_the_dynamic_batcher_hands_batches_to_an_idle_cpu_instance_without_a_task():
    """An idle CPU instance gets its batch from the submitting task (delay 0),
    and its next one as its thread reports the last, before that one's waiters
    run: the executor's own tasks (feeder, delivery) and the batcher's take no
    step for either."""
    from google.protobuf import text_format

    from trionserve._generated import model_config_pb2 as mc
    from trionserve.repository.config import normalize_model_config
    from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler

    config = text_format.Parse(
        'name: "m" max_batch_size: 8 dynamic_batching {} '
        'input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [4] }] '
        'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [4] }]',
        mc.ModelConfig(),
    )
    normalize_model_config(config)
    steps: list[str] = []

    class Steps(trio.abc.Instrument):
        def after_task_step(self, task) -> None:
            steps.append(task.name)

    batcher = DynamicBatchScheduler(config)
    instance = BlockingCpu()
    executor = InstanceExecutor(SPEC, instance, batcher.outlet(), ModelStatistics("m", "1"))
    pending_when_answered: list[int] = []

    async def answered(request: InferenceRequest) -> None:
        await request.wait()
        pending_when_answered.append(batcher.pending)

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        await nursery.start(executor.run)
        await trio.testing.wait_all_tasks_blocked()
        instrument = Steps()
        trio.lowlevel.add_instrument(instrument)
        try:
            first = make_request(0)
            nursery.start_soon(answered, first)
            await batcher.submit(first)
            await entered(instance, 0)
            later = [make_request(1), make_request(2)]
            for request in later:
                await batcher.submit(request)  # the instance is busy: they gather
            instance.release[0].set()
            await entered(instance, 1)  # both, as one batch, right after
            instance.release[1].set()
            for request in later:
                await request.wait()
        finally:
            trio.lowlevel.remove_instrument(instrument)
        executor.stop()
        batcher.close()
    assert not instance.entered[2].is_set()  # 1 and 2 ran as one batch
    assert pending_when_answered == [0]  # the next batch had left when 0 was answered
    ours = [n for n in steps if "InstanceExecutor" in n or "DynamicBatchScheduler.run" in n]
    assert ours == [], ours
