"""DynamicBatchScheduler batch formation, on virtual time.

Every test runs under ``trio.testing.MockClock(autojump_threshold=0)``: time moves
only when every task is blocked, so the batcher's delays and timeouts are checked to
the exact virtual microsecond, and the tests take no real time. Fake executors are
Trio tasks that take batches from outlets and record when they got what.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from google.protobuf import text_format

from trionserve._generated import model_config_pb2 as mc
from trionserve.core.errors import Cancelled, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.observability.statistics import FailureReason, ModelStatistics
from trionserve.repository.config import normalize_model_config
from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler

# Virtual seconds after which a wait counts as a hang (instant in real time).
GIVE_UP = 60


def make_config(
    batching: str, *, max_batch_size: int = 8, dims: str = "[ 4 ]", ragged: bool = False
) -> mc.ModelConfig:
    text = f"""
        name: "m"
        max_batch_size: {max_batch_size}
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: {dims}
                   allow_ragged_batch: {str(ragged).lower()} }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: {dims} }} ]
        dynamic_batching {{ {batching} }}
    """
    config = text_format.Parse(text, mc.ModelConfig())
    normalize_model_config(config)
    return config


def request(
    id: str, *, batch: int = 1, width: int = 4, priority: int = 0, timeout_us: int = 0
) -> InferenceRequest:
    data = np.zeros((batch, width), dtype=np.float32)
    r = InferenceRequest(
        "m",
        id=id,
        inputs={"INPUT0": Tensor("INPUT0", "FP32", data)},
        priority=priority,
        timeout_us=timeout_us,
    )
    r.batch_size = batch  # as validation sets it
    return r


def response(r: InferenceRequest) -> InferenceResponse:
    return InferenceResponse("m", "1", r.id)


class Executors:
    """Fake executors: each takes a batch, records it, holds it, completes it.

    ``hold`` is the virtual time each batch takes, or None to hold until the test
    sets ``release`` (a fresh Event per batch, so batches can be let go one by one).
    """

    def __init__(self, batcher: DynamicBatchScheduler, hold: float | None = 0.0) -> None:
        self.batcher = batcher
        self.hold = hold
        self.batches: list[tuple[float, list[str]]] = []
        self.releases: list[trio.Event] = []
        self.taken = trio.Event()

    async def run_one(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        outlet = self.batcher.outlet()
        task_status.started()
        try:
            while True:
                try:
                    batch = await outlet.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                self.batches.append((trio.current_time(), [r.id for r in batch]))
                self.taken.set()
                self.taken = trio.Event()
                if self.hold is None:
                    release = trio.Event()
                    self.releases.append(release)
                    await release.wait()
                else:
                    await trio.sleep(self.hold)
                outlet.complete(batch, [response(r) for r in batch])
        finally:
            outlet.close()

    async def next_batch(self) -> None:
        """Wait until an executor takes a batch; fail (not hang) if none comes."""
        with trio.fail_after(GIVE_UP):
            await self.taken.wait()

    def sizes(self) -> list[list[str]]:
        return [ids for _, ids in self.batches]


async def start(
    nursery,
    config,
    *,
    executors: int = 1,
    hold: float | None = 0.0,
    statistics: ModelStatistics | None = None,
    capacity: int = 1024,
):
    batcher = DynamicBatchScheduler(config, statistics, capacity=capacity)
    await nursery.start(batcher.run)
    fake = Executors(batcher, hold)
    for _ in range(executors):
        await nursery.start(fake.run_one)
    return batcher, fake


async def submit_all(batcher, requests) -> None:
    for r in requests:
        await batcher.submit(r)


async def outcome(r: InferenceRequest):
    """The request's response or error; fails (not hangs) if none comes."""
    with trio.fail_after(GIVE_UP):
        try:
            return await r.wait()
        except TritonError as error:
            return error


async def test_preferred_size_is_sent_at_once_and_the_rest_after_the_delay(autojump_clock):
    config = make_config("preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100000")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config)
        t0 = trio.current_time()
        await submit_all(batcher, [request(str(i)) for i in range(5)])
        await trio.sleep(1)
        # Four make a preferred size: sent at once. The fifth waits the full delay.
        assert fake.batches[0] == (t0, ["0", "1", "2", "3"])
        assert fake.batches[1][1] == ["4"]
        assert fake.batches[1][0] == pytest.approx(t0 + 0.1)
        nursery.cancel_scope.cancel()


async def test_delay_counts_from_the_oldest_request(autojump_clock):
    config = make_config("preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100000")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config)
        t0 = trio.current_time()
        await batcher.submit(request("a"))
        await trio.sleep(0.03)
        await batcher.submit(request("b"))
        await trio.sleep(0.069)
        assert fake.batches == []  # 99 ms: still waiting for a preferred size
        await trio.sleep(0.5)
        assert fake.batches == [(pytest.approx(t0 + 0.1), ["a", "b"])]
        nursery.cancel_scope.cancel()


async def test_preferred_size_reached_before_the_delay_goes_early(autojump_clock):
    config = make_config("preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 1000000")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config)
        t0 = trio.current_time()
        for i in range(3):
            await batcher.submit(request(str(i)))
            await trio.sleep(0.01)
        assert fake.batches == [(pytest.approx(t0 + 0.02), ["0", "1", "2"])]
        nursery.cancel_scope.cancel()


async def test_without_delay_requests_gather_while_the_instance_is_busy(autojump_clock):
    config = make_config("preferred_batch_size: [ 4 ]")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None)
        await batcher.submit(request("first"))
        await fake.next_batch()
        await submit_all(batcher, [request(str(i)) for i in range(6)])
        fake.releases[0].set()
        await fake.next_batch()
        fake.releases[1].set()
        await fake.next_batch()
        fake.releases[2].set()
        # Alone, "first" went at once (delay 0); then the best preferred size (4),
        # then what was left.
        assert fake.sizes() == [["first"], ["0", "1", "2", "3"], ["4", "5"]]
        nursery.cancel_scope.cancel()


async def test_batch_sizes_add_up_to_at_most_max_batch_size(autojump_clock):
    config = make_config("max_queue_delay_microseconds: 1000", max_batch_size=8)
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        sizes = {"a": 3, "b": 4, "c": 2, "d": 5}
        await submit_all(batcher, [request(k, batch=v) for k, v in sizes.items()])
        for _ in range(2):
            fake.releases[-1].set()
            await fake.next_batch()
        fake.releases[-1].set()
        # 3+4 = 7; adding c (2) would exceed 8; c+d = 7.
        assert fake.sizes()[1:] == [["a", "b"], ["c", "d"]]
        nursery.cancel_scope.cancel()


async def test_higher_priority_requests_go_first(autojump_clock):
    config = make_config(
        "preferred_batch_size: [ 2 ] priority_levels: 2 default_priority_level: 2",
        max_batch_size=2,
    )
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        await submit_all(
            batcher,
            [
                request("low1"),  # priority 0: the default level, 2
                request("low2", priority=2),
                request("high", priority=1),
                request("beyond", priority=7),  # beyond the levels: the default level
            ],
        )
        for _ in range(2):
            fake.releases[-1].set()
            await fake.next_batch()
        fake.releases[-1].set()
        assert fake.sizes()[1:] == [["high", "low1"], ["low2", "beyond"]]
        nursery.cancel_scope.cancel()


async def test_reject_timeout_answers_the_request_when_it_expires(autojump_clock):
    config = make_config("""
        default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 50000
                               allow_timeout_override: true }""")
    statistics = ModelStatistics("m", 1)
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None, statistics=statistics)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        t0 = trio.current_time()
        default, shorter, longer = (
            request("default"),
            request("shorter", timeout_us=10000),
            request("longer", timeout_us=90000),
        )
        await submit_all(batcher, [default, shorter, longer])
        ended = {}

        async def watch(r):
            ended[r.id] = (await outcome(r), trio.current_time() - t0)

        async with trio.open_nursery() as watchers:
            for r in (default, shorter, longer):
                watchers.start_soon(watch, r)
        for name, expected in (("shorter", 0.01), ("default", 0.05), ("longer", 0.05)):
            error, at = ended[name]
            assert isinstance(error, Unavailable), error
            # Triton's words exactly (core dynamic_batch_scheduler.cc), which
            # qa/L0_batcher's queue_timeout_test compares whole.
            assert error.message == "Request timeout expired", error.message
            assert at == pytest.approx(expected), name  # an override only shortens
        assert fake.sizes() == [["busy"]]
        assert statistics.failures[FailureReason.REJECTED] == 3
        assert statistics.fail.count == 3
        fake.releases[0].set()
        nursery.cancel_scope.cancel()


async def test_delay_timeout_moves_the_request_behind_the_others(autojump_clock):
    config = make_config(
        """preferred_batch_size: [ 1 ]
           default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 50000 }""",
        max_batch_size=1,
    )
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        late = request("expired")
        await batcher.submit(late)
        await trio.sleep(0.1)  # "expired" passes its timeout: delayed, not rejected
        await submit_all(batcher, [request("fresh1"), request("fresh2")])
        for _ in range(3):
            fake.releases[-1].set()
            await fake.next_batch()
        fake.releases[-1].set()
        assert fake.sizes() == [["busy"], ["fresh1"], ["fresh2"], ["expired"]]
        assert isinstance(await outcome(late), InferenceResponse)
        nursery.cancel_scope.cancel()


async def test_only_equal_shapes_batch_together(autojump_clock):
    config = make_config("", dims="[ -1 ]")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        await submit_all(
            batcher,
            [
                request("w4a"),
                request("w4b"),
                request("w3", width=3),
                request("w4c"),
            ],
        )
        for _ in range(3):
            fake.releases[-1].set()
            await fake.next_batch()
        fake.releases[-1].set()
        # A different shape ends the batch; nothing is skipped to find a fit.
        assert fake.sizes()[1:] == [["w4a", "w4b"], ["w3"], ["w4c"]]
        nursery.cancel_scope.cancel()


async def test_ragged_inputs_batch_whatever_their_shapes(autojump_clock):
    config = make_config("", dims="[ -1 ]", ragged=True)
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        await submit_all(
            batcher,
            [
                request("w4a"),
                request("w4b"),
                request("w3", width=3),
                request("w4c"),
            ],
        )
        fake.releases[-1].set()
        await fake.next_batch()
        fake.releases[-1].set()
        assert fake.sizes()[1:] == [["w4a", "w4b", "w3", "w4c"]]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("preserve", [True, False])
async def test_preserve_ordering_holds_responses_of_batches_that_finish_early(
    autojump_clock, preserve
):
    config = make_config(
        f"preferred_batch_size: [ 1 ] preserve_ordering: {str(preserve).lower()}",
        max_batch_size=1,
    )
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, executors=2, hold=None)
        first, second = request("first"), request("second")
        await batcher.submit(first)
        await fake.next_batch()
        await batcher.submit(second)
        await fake.next_batch()
        assert fake.sizes() == [["first"], ["second"]]  # both instances busy
        fake.releases[1].set()  # the second batch finishes first
        await trio.sleep(0.01)
        assert second.done is not preserve
        assert not first.done
        fake.releases[0].set()
        await trio.sleep(0.01)
        assert first.done and second.done
        assert (await outcome(second)).id == "second"
        nursery.cancel_scope.cancel()


async def test_full_queue_rejects_at_once(autojump_clock):
    config = make_config("default_queue_policy { max_queue_size: 2 }")
    statistics = ModelStatistics("m", 1)
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None, statistics=statistics)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        await submit_all(batcher, [request("q1"), request("q2")])
        with pytest.raises(Unavailable, match="Exceeds maximum queue size"):
            await batcher.submit(
                request(
                    "q3",
                )
            )
        assert batcher.pending == 2
        assert statistics.failures[FailureReason.REJECTED] == 1
        fake.releases[0].set()
        nursery.cancel_scope.cancel()


async def test_cancelled_request_leaves_the_queue(autojump_clock):
    """A client gone away frees its place and is never executed."""
    config = make_config("default_queue_policy { max_queue_size: 1 }")
    statistics = ModelStatistics("m", 1)
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None, statistics=statistics)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        gone = request("gone")
        await batcher.submit(gone)
        gone.cancelled = True  # what the DataPlane does when the client's task is cancelled
        stays = request("stays")
        await batcher.submit(stays)  # not "Exceeds maximum queue size"
        assert isinstance(await outcome(gone), Cancelled)
        fake.releases[0].set()
        await fake.next_batch()
        fake.releases[1].set()
        assert fake.sizes() == [["busy"], ["stays"]]
        assert statistics.failures[FailureReason.CANCELED] == 1
        nursery.cancel_scope.cancel()


async def test_backpressure_without_max_queue_size(autojump_clock):
    config = make_config("")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=None, capacity=2)
        await batcher.submit(request("busy"))
        await fake.next_batch()
        await submit_all(batcher, [request("q1"), request("q2")])
        submitted = trio.Event()

        async def third():
            await batcher.submit(request("q3"))
            submitted.set()

        nursery.start_soon(third)
        await trio.sleep(1)
        assert not submitted.is_set()  # waits for room instead of growing the queue
        fake.releases[0].set()
        with trio.fail_after(GIVE_UP):
            await submitted.wait()
        assert fake.sizes()[1] == ["q1", "q2"]
        nursery.cancel_scope.cancel()


async def test_close_drains_the_queue_then_ends_the_executors(autojump_clock):
    config = make_config("preferred_batch_size: [ 2 ]")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config, hold=0.01)
        requests = [request(str(i)) for i in range(5)]
        await submit_all(batcher, requests)
        batcher.close()
        with pytest.raises(trio.ClosedResourceError):
            await batcher.submit(request("late"))
    # The nursery ended by itself: the batcher and the executor stopped when done.
    assert all(isinstance(x, InferenceResponse) for x in [await outcome(r) for r in requests])
    assert fake.sizes() == [["0", "1"], ["2", "3"], ["4"]]


async def test_close_sends_requests_held_by_the_delay_at_once(autojump_clock):
    config = make_config("max_queue_delay_microseconds: 10000000")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config)
        await submit_all(batcher, [request("a"), request("b")])
        await trio.sleep(1)
        assert fake.batches == []  # waiting up to 10 s for more
        batcher.close()  # unloading: nothing more will come
        await fake.next_batch()
        assert fake.batches == [(pytest.approx(trio.current_time()), ["a", "b"])]


async def test_abort_answers_everything_still_queued(autojump_clock):
    config = make_config("max_queue_delay_microseconds: 10000000")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config)
        queued = [request(str(i)) for i in range(3)]
        await submit_all(batcher, queued)
        await trio.sleep(1)  # held back by the 10 s delay
        nursery.cancel_scope.cancel()
    batcher.abort(Unavailable("model 'm' version 1 was unloaded"))
    for r in queued:
        error = await outcome(r)
        assert isinstance(error, Unavailable) and "unloaded" in error.message
    assert fake.batches == []


async def test_executor_that_stops_gives_its_batch_back(autojump_clock):
    """A batch sent to an executor that is removed before taking it is not lost."""
    config = make_config("")
    batcher = DynamicBatchScheduler(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        leaving = batcher.outlet()
        with trio.move_on_after(0.1):
            await leaving.receive()  # registers as idle, then gives up waiting
        r = request("r")
        await batcher.submit(r)
        await trio.testing.wait_all_tasks_blocked()
        leaving.close()  # the batch was put in its mailbox; it comes back
        fake = Executors(batcher)
        await nursery.start(fake.run_one)
        assert isinstance(await outcome(r), InferenceResponse)
        assert fake.sizes() == [["r"]]
        nursery.cancel_scope.cancel()


def test_inputs_concatenate_with_one_copy_and_outputs_come_back_as_views():
    from trionserve.backends.batch_tensors import gather_inputs, split_outputs

    requests = [request("a", batch=2), request("b", batch=1), request("c", batch=3)]
    for i, r in enumerate(requests):
        r.inputs["INPUT0"].data[:] = i
    batched = gather_inputs(requests)["INPUT0"]
    assert batched.shape == (6, 4)
    assert batched[:, 0].tolist() == [0, 0, 1, 2, 2, 2]
    assert not any(np.shares_memory(batched, r.inputs["INPUT0"].data) for r in requests)
    alone = gather_inputs(requests[:1])["INPUT0"]
    assert alone is requests[0].inputs["INPUT0"].data  # a batch of one is not copied

    per_request = split_outputs({"OUTPUT0": batched}, requests)
    assert [p["OUTPUT0"].shape[0] for p in per_request] == [2, 1, 3]
    assert all(np.shares_memory(p["OUTPUT0"], batched) for p in per_request)
    assert per_request[2]["OUTPUT0"][:, 0].tolist() == [2, 2, 2]


def test_ragged_inputs_concatenate_flat():
    from trionserve.backends.batch_tensors import gather_inputs

    requests = [request("a", width=3), request("b", batch=2, width=2)]
    requests[0].inputs["INPUT0"].data[:] = 1
    requests[1].inputs["INPUT0"].data[:] = 2
    flat = gather_inputs(requests, ragged={"INPUT0"})["INPUT0"]
    assert flat.tolist() == [1, 1, 1, 2, 2, 2, 2]


async def test_a_batch_that_can_go_is_taken_the_moment_the_executor_asks(autojump_clock):
    """An executor that asks for its next batch while one can go gets it formed
    in its own task, without a pass of the run loop (batches back to back), up
    to EAGER_BATCHES in a row; one held by the delay still waits for it."""
    from trionserve.schedulers.batcher_outlet import EAGER_BATCHES

    async with trio.open_nursery() as nursery:
        batcher = DynamicBatchScheduler(make_config("", max_batch_size=1))
        await nursery.start(batcher.run)
        outlet = batcher.outlet()
        await submit_all(batcher, [request(str(i)) for i in range(EAGER_BATCHES + 1)])
        for i in range(EAGER_BATCHES):
            with trio.testing.assert_no_checkpoints():
                batch = await outlet.receive()
            assert [r.id for r in batch] == [str(i)]
            outlet.complete(batch, [response(r) for r in batch])
        with trio.testing.assert_checkpoints():  # the other tasks' turn
            batch = await outlet.receive()
        assert [r.id for r in batch] == [str(EAGER_BATCHES)]
        outlet.complete(batch, [response(r) for r in batch])
        outlet.close()

        delayed = DynamicBatchScheduler(make_config("max_queue_delay_microseconds: 1000"))
        await nursery.start(delayed.run)
        outlet = delayed.outlet()
        started = trio.current_time()
        await delayed.submit(request("late"))
        batch = await outlet.receive()
        assert [r.id for r in batch] == ["late"]
        assert trio.current_time() - started == pytest.approx(0.001, abs=1e-4)
        outlet.close()
        nursery.cancel_scope.cancel()


async def test_an_executor_asking_with_nothing_queued_leaves_the_batcher_asleep(autojump_clock):
    """Nothing queued, nothing to form: the executor's ask does not wake the
    batcher's task (a step per batch at c=1); the next submit does, and the
    executor gets the request."""
    steps: list[str] = []

    class Steps(trio.abc.Instrument):
        def after_task_step(self, task) -> None:
            steps.append(task.name)

    async with trio.open_nursery() as nursery:
        batcher = DynamicBatchScheduler(make_config(""))
        await nursery.start(batcher.run)
        outlet = batcher.outlet()
        got: list[list[str]] = []

        async def take() -> None:
            got.append([r.id for r in await outlet.receive()])

        await trio.testing.wait_all_tasks_blocked()
        instrument = Steps()
        trio.lowlevel.add_instrument(instrument)
        try:
            nursery.start_soon(take)
            await trio.testing.wait_all_tasks_blocked()
            assert not [name for name in steps if name.endswith("DynamicBatchScheduler.run")]
            await batcher.submit(request("one"))
            await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(instrument)
        assert got == [["one"]]
        outlet.close()
        nursery.cancel_scope.cancel()


async def test_delay_scheduler_holds_batching_until_that_many_are_queued(
    autojump_clock, monkeypatch
):
    # Triton's testing hook (core dynamic_batch_scheduler.cc BatcherThread), which
    # qa/L0_batcher's delay tests set: nothing goes until 3 requests are queued,
    # then they make one batch, and batching never holds again.
    monkeypatch.setenv("TRITONSERVER_DELAY_SCHEDULER", "3")
    config = make_config("preferred_batch_size: [ 2, 6 ] max_queue_delay_microseconds: 100000")
    async with trio.open_nursery() as nursery:
        batcher, fake = await start(nursery, config)
        await submit_all(batcher, [request("a"), request("b")])
        await trio.sleep(10)  # far past the queue delay: still held
        assert fake.batches == []
        t0 = trio.current_time()
        await batcher.submit(request("c"))
        await fake.next_batch()
        await trio.sleep(1)
        # The oldest waited past the delay: everything gathered goes, at once.
        assert fake.batches[0] == (t0, ["a", "b", "c"])
        t1 = trio.current_time()
        await batcher.submit(request("d"))
        await trio.sleep(1)
        assert fake.batches[1] == (pytest.approx(t1 + 0.1), ["d"])
        nursery.cancel_scope.cancel()


class BatcherSteps(trio.abc.Instrument):
    """Counts the task steps of the batcher's own task."""

    def __init__(self) -> None:
        self.steps = 0

    def after_task_step(self, task) -> None:
        if task.name.endswith("DynamicBatchScheduler.run"):
            self.steps += 1


async def test_an_idle_executor_taking_hand_overs_gets_the_request_from_submit(autojump_clock):
    """Without a delay, a submit that finds an executor waiting in receive_direct
    with a hand-over gives it the batch right there: no step of the batcher's
    task. Requests that come while it runs gather, and go as one batch when it
    offers itself again; a submit while it is busy wakes no task either."""
    async with trio.open_nursery() as nursery:
        batcher = DynamicBatchScheduler(make_config(""))
        await nursery.start(batcher.run)
        outlet = batcher.outlet()
        handed: list[list[str]] = []

        def handover(batch) -> bool:
            handed.append([r.id for r in batch])
            return True

        async def wait() -> None:
            with pytest.raises((trio.EndOfChannel, trio.ClosedResourceError)):
                await outlet.receive_direct(lambda batch: False, handover)

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        steps = BatcherSteps()
        trio.lowlevel.add_instrument(steps)
        try:
            await batcher.submit(request("one"))
            assert handed == [["one"]]  # before any other task ran
            await batcher.submit(request("two"))
            await batcher.submit(request("three"))
            await trio.testing.wait_all_tasks_blocked()
            assert handed == [["one"]]  # busy: they wait
            assert steps.steps == 0
        finally:
            trio.lowlevel.remove_instrument(steps)
        outlet.complete([], [])  # "one" answered elsewhere: the ticket goes
        outlet.offer_again()  # idle again: the two queued go at once, together
        assert handed == [["one"], ["two", "three"]]
        outlet.close()
        nursery.cancel_scope.cancel()


async def test_a_refused_hand_over_goes_through_the_channel(autojump_clock):
    """A hand-over that says no (the executor is stopping, or busy) leaves the
    batch to the executor's receive, in order."""
    async with trio.open_nursery() as nursery:
        batcher = DynamicBatchScheduler(make_config(""))
        await nursery.start(batcher.run)
        outlet = batcher.outlet()
        got: list[list[str]] = []

        async def take() -> None:
            batch = await outlet.receive_direct(lambda b: False, lambda b: False)
            got.append([r.id for r in batch])

        nursery.start_soon(take)
        await trio.testing.wait_all_tasks_blocked()
        await batcher.submit(request("one"))
        await trio.testing.wait_all_tasks_blocked()
        assert got == [["one"]]
        outlet.close()
        nursery.cancel_scope.cancel()


async def test_a_submit_with_every_executor_busy_does_not_wake_the_batcher(autojump_clock):
    """With every executor busy nothing can be formed: submits leave the
    batcher's task asleep (as Triton's Enqueue leaves its batcher thread with
    no payload slot free); the executor's next ask forms the batch of all of
    them. A request with a queue timeout still wakes it (to expire it)."""
    async with trio.open_nursery() as nursery:
        config = make_config("default_queue_policy { allow_timeout_override: true }")
        batcher, fake = await start(nursery, config, hold=None)
        await batcher.submit(request("first"))
        await fake.next_batch()
        steps = BatcherSteps()
        trio.lowlevel.add_instrument(steps)
        try:
            for i in range(4):
                await batcher.submit(request(str(i)))
            await trio.testing.wait_all_tasks_blocked()
            assert steps.steps == 0
            fake.releases[0].set()
            await fake.next_batch()
            assert fake.sizes() == [["first"], ["0", "1", "2", "3"]]
            steps.steps = 0
            await batcher.submit(request("timed", timeout_us=1000))
            await trio.testing.wait_all_tasks_blocked()
            assert steps.steps >= 1
        finally:
            trio.lowlevel.remove_instrument(steps)
        nursery.cancel_scope.cancel()
