"""SequenceBatchScheduler and SequenceStateManager, on virtual time.

Every test runs under ``trio.testing.MockClock(autojump_threshold=0)`` (pytest-trio's
``autojump_clock``): idle timeouts and batching delays are checked to the virtual
microsecond and take no real time. A fake executor plays an accumulator model with
implicit state (OUTPUT = INPUT + INPUT_STATE, OUTPUT_STATE = OUTPUT) and records
every batch it is given, control tensors included.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
from google.protobuf import text_format

from trionserve._generated import model_config_pb2 as mc
from trionserve.actors.executor import InstanceExecutor
from trionserve.backends.base import InstanceSpec
from trionserve.core.errors import Cancelled, InvalidArgument, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from trionserve.observability.statistics import ModelStatistics
from trionserve.observability.trace.manager import TraceManager
from trionserve.repository.config import normalize_model_config
from trionserve.schedulers.sequence_batch import SequenceBatchScheduler
from trionserve.schedulers.sequence_controls import NullRequest
from trionserve.schedulers.sequence_state import load_sequence_states

GIVE_UP = 60  # virtual seconds after which a wait counts as a hang

CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: %s } ] }
  ]
"""

STATE = """
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32
            dims: [ 1 ] %s } ]
"""
ZERO_INITIAL = 'initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "z" }'


def make_config(
    strategy: str = "direct { }",
    *,
    max_batch_size: int = 4,
    idle_us: int = 1_000_000,
    corrid: str = "TYPE_UINT64",
    initial: str = ZERO_INITIAL,
    outputs: str = "",
) -> mc.ModelConfig:
    text = f"""
        name: "acc"
        max_batch_size: {max_batch_size}
        input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} {outputs} ]
        sequence_batching {{
          max_sequence_idle_microseconds: {idle_us}
          {strategy}
          {CONTROLS % corrid}
          {STATE % initial}
        }}
    """
    config = text_format.Parse(text, mc.ModelConfig())
    normalize_model_config(config)
    return config


def request(
    seq,
    value: int = 1,
    *,
    start: bool = False,
    end: bool = False,
    id: str = "",
    timeout_us: int = 0,
    outputs=None,
) -> InferenceRequest:
    data = np.array([[value]], dtype=np.int32)
    r = InferenceRequest(
        "acc",
        id=id or f"{seq}:{value}",
        inputs={"INPUT": Tensor("INPUT", "INT32", data)},
        sequence_id=seq,
        sequence_start=start,
        sequence_end=end,
        timeout_us=timeout_us,
        requested_outputs=outputs,
    )
    r.batch_size = 1  # as validation sets it
    return r


def scalar(request: InferenceRequest, name: str):
    value = request.inputs[name].data.reshape(-1)[0]
    return value.item() if hasattr(value, "item") else value


class Accumulator:
    """A fake executor: records each batch, then answers as the accumulator would."""

    def __init__(self, scheduler: SequenceBatchScheduler, hold: float | None = 0.0) -> None:
        self.scheduler = scheduler
        self.hold = hold
        self.batches: list[tuple[float, list[dict]]] = []
        self.releases: list[trio.Event] = []
        self.taken = trio.Event()
        self.outlet = None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        outlet = self.outlet = self.scheduler.outlet()
        task_status.started()
        try:
            while True:
                try:
                    batch = await outlet.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                self.batches.append((trio.current_time(), [self.row(r) for r in batch]))
                self.taken.set()
                self.taken = trio.Event()
                if self.hold is None:
                    release = trio.Event()
                    self.releases.append(release)
                    await release.wait()
                else:
                    await trio.sleep(self.hold)
                outlet.complete(batch, [self.answer(r) for r in batch])
        finally:
            outlet.close()

    @staticmethod
    def row(r: InferenceRequest) -> dict:
        return {
            "id": None if isinstance(r, NullRequest) else r.id,
            "START": scalar(r, "START"),
            "END": scalar(r, "END"),
            "READY": scalar(r, "READY"),
            "CORRID": scalar(r, "CORRID"),
            "INPUT": scalar(r, "INPUT"),
            "STATE": scalar(r, "INPUT_STATE"),
        }

    @staticmethod
    def answer(r: InferenceRequest) -> InferenceResponse:
        total = r.inputs["INPUT"].data + r.inputs["INPUT_STATE"].data
        names = ["OUTPUT", "OUTPUT_STATE"]
        if r.requested_outputs is not None:
            names = [o.name for o in r.requested_outputs]
        return InferenceResponse(
            "acc", "1", r.id, [Tensor(name, "INT32", total.copy()) for name in names]
        )

    async def taken_batches(self, count: int) -> None:
        """Wait until ``count`` batches were taken; fail (not hang) if they never are."""
        with trio.fail_after(GIVE_UP):
            while len(self.batches) < count:
                await self.taken.wait()

    def ids(self) -> list[list]:
        return [[row["id"] for row in rows] for _, rows in self.batches]


async def start(
    nursery,
    config,
    *,
    executors: int = 1,
    hold: float | None = 0.0,
    capacity: int = 1024,
    statistics=None,
    tmp_path=None,
):
    states = load_sequence_states(config, tmp_path or Path("."))
    scheduler = SequenceBatchScheduler(config, statistics, states=states, capacity=capacity)
    await nursery.start(scheduler.run)
    fakes = []
    for _ in range(executors):
        fake = Accumulator(scheduler, hold)
        await nursery.start(fake.run)
        fakes.append(fake)
    return scheduler, fakes


async def outcome(r: InferenceRequest):
    with trio.fail_after(GIVE_UP):
        try:
            return await r.wait()
        except TritonError as error:
            return error


async def infer(scheduler, r: InferenceRequest):
    """Submit and wait: the response, or the error (refused or failed)."""
    try:
        await scheduler.submit(r)
    except TritonError as error:
        return error
    return await outcome(r)


def total(response: InferenceResponse) -> int:
    return int(response.outputs[0].data.reshape(-1)[0])


# -- slots and control tensors -----------------------------------------------------------


async def test_slots_keep_their_batch_position_and_empty_slots_are_not_ready(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, make_config(), hold=None)
        a = request(11, 1, start=True)
        await scheduler.submit(a)
        await fake.taken_batches(1)
        # While slot 0 executes, sequences 22 and 33 start: slots 1 and 2.
        b, c = request(22, 5, start=True), request(33, 7, start=True)
        await scheduler.submit(b)
        await scheduler.submit(c)
        fake.releases[0].set()
        await fake.taken_batches(2)
        # Now only slots 0 and 2 have a request: slot 1 gets a null request.
        a2, c2 = request(11, 2), request(33, 3, end=True)
        await scheduler.submit(a2)
        await scheduler.submit(c2)
        fake.releases[1].set()
        await fake.taken_batches(3)
        fake.releases[2].set()
        assert total(await outcome(c2)) == 10

        first, second, third = (rows for _, rows in fake.batches)
        assert first == [
            {
                "id": "11:1",
                "START": 1,
                "END": 0.0,
                "READY": True,
                "CORRID": 11,
                "INPUT": 1,
                "STATE": 0,
            }
        ]
        assert [r["id"] for r in second] == [None, "22:5", "33:7"]
        assert second[0]["READY"] is False and second[0]["CORRID"] == 0
        assert [r["START"] for r in second] == [0, 1, 1]
        assert third == [
            {
                "id": "11:2",
                "START": 0,
                "END": 0.0,
                "READY": True,
                "CORRID": 11,
                "INPUT": 2,
                "STATE": 1,
            },
            {
                "id": None,
                "START": 0,
                "END": 0.0,
                "READY": False,
                "CORRID": 0,
                "INPUT": 0,
                "STATE": 0,
            },
            {
                "id": "33:3",
                "START": 0,
                "END": 1.0,
                "READY": True,
                "CORRID": 33,
                "INPUT": 3,
                "STATE": 7,
            },
        ]
        nursery.cancel_scope.cancel()


class AccumulatorInstance:
    """A backend instance for a real InstanceExecutor, on the Trio thread (a worker
    thread would let the virtual clock jump while it runs)."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def execute_async(self, requests):
        return [Accumulator.answer(r) for r in requests]

    def close(self) -> None:
        pass


async def test_null_requests_count_in_the_batch_size_not_as_requests(autojump_clock):
    statistics = ModelStatistics("acc", 1)
    config = make_config()
    scheduler = SequenceBatchScheduler(
        config, statistics, states=load_sequence_states(config, Path("."))
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        spec = InstanceSpec("acc_0_0", "acc_0", "KIND_CPU", 0)
        executor = InstanceExecutor(spec, AccumulatorInstance(), scheduler.outlet(), statistics)
        await nursery.start(executor.run)
        for seq in (1, 2, 3):
            await infer(scheduler, request(seq, seq, start=True))
        # Slots 0 and 2 ready, slot 1 empty: a batch of 3 with one null request.
        first, third = request(1, 10), request(3, 30)
        await scheduler.submit(first)
        await scheduler.submit(third)
        assert [total(await outcome(r)) for r in (first, third)] == [11, 33]
        assert statistics.success.count == 5
        assert statistics.inference_count == 5
        assert sorted(statistics.batch_stats) == [1, 2, 3]  # 1, 2 (null + 2), 3
        nursery.cancel_scope.cancel()


async def test_sequences_spread_over_instances_and_stay_there(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, fakes = await start(nursery, make_config(max_batch_size=2), executors=2)
        for seq in (1, 2, 3):
            assert total(await infer(scheduler, request(seq, seq, start=True))) == seq
        for _ in range(2):
            for seq in (1, 2, 3):
                await infer(scheduler, request(seq, 10))
        per_instance = [
            {row["CORRID"] for _, rows in f.batches for row in rows if row["id"]} for f in fakes
        ]
        # Slot 0 of each instance first, then slot 1: 1 and 3 on one, 2 on the other.
        assert per_instance == [{1, 3}, {2}]
        nursery.cancel_scope.cancel()


# -- backlog, END and idle release --------------------------------------------------------


async def test_a_sequence_beyond_the_slots_waits_in_the_backlog_until_one_ends(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, make_config(max_batch_size=1))
        assert total(await infer(scheduler, request(1, 1, start=True))) == 1
        waiting = request(2, 5, start=True)
        await scheduler.submit(waiting)
        await trio.sleep(0.5)
        assert not waiting.done  # no free slot
        assert total(await infer(scheduler, request(1, 2, end=True))) == 3
        assert total(await outcome(waiting)) == 5
        assert fake.ids() == [["1:1"], ["1:2"], ["2:5"]]
        nursery.cancel_scope.cancel()


async def test_an_idle_sequence_is_released_and_its_slot_reused(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, make_config(max_batch_size=1, idle_us=200_000))
        await infer(scheduler, request(1, 1, start=True))
        idle_since = trio.current_time()
        waiting = request(2, 5, start=True)
        await scheduler.submit(waiting)
        assert total(await outcome(waiting)) == 5
        # The backlogged sequence got the slot exactly when sequence 1 turned idle.
        assert fake.batches[-1][0] == pytest.approx(idle_since + 0.2)
        late = await infer(scheduler, request(1, 2))
        assert isinstance(late, InvalidArgument)
        assert "must specify the START flag" in late.message
        assert "idle for more than 200000 us" in late.message
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("early", [True, False])
async def test_idle_deadline_racing_a_late_request_is_decided_by_the_clock(autojump_clock, early):
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, make_config(idle_us=100_000))
        await infer(scheduler, request(7, 1, start=True))
        deadline = trio.current_time() + 0.1
        # The reaper wakes at the deadline too; whichever task runs first, a request
        # at the deadline is late and one a microsecond before is in time.
        await trio.sleep_until(deadline - 1e-6 if early else deadline)
        result = await infer(scheduler, request(7, 2))
        if early:
            assert total(result) == 3
        else:
            assert isinstance(result, InvalidArgument) and "idle" in result.message
        nursery.cancel_scope.cancel()


async def test_a_sequence_with_a_request_in_flight_is_not_idle(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, make_config(idle_us=100_000), hold=0.5)
        await infer(scheduler, request(7, 1, start=True))  # executes for 0.5 s
        assert total(await infer(scheduler, request(7, 2))) == 3
        nursery.cancel_scope.cancel()


async def test_a_start_for_a_sequence_in_progress_restarts_it_after_its_queued_requests(
    autojump_clock,
):
    """Triton's sequence_batch_scheduler.cc: the START joins the sequence's slot,
    behind the requests it already queued, and runs with the initial state."""
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, make_config(), hold=None)
        first = request(5, 10, start=True)
        await scheduler.submit(first)
        await fake.taken_batches(1)
        second, restart = request(5, 1), request(5, 100, start=True)
        await scheduler.submit(second)  # queued while the first executes
        await scheduler.submit(restart)
        later = request(5, 2, end=True)
        await scheduler.submit(later)
        for index in range(3):
            fake.releases[index].set()
            await fake.taken_batches(index + 2)
        fake.releases[3].set()
        assert [total(await outcome(r)) for r in (first, second, restart, later)] == [
            10,
            11,
            100,
            102,
        ]
        assert fake.ids() == [["5:10"], ["5:1"], ["5:100"], ["5:2"]]
        rows = [rows[0] for _, rows in fake.batches]
        assert [(row["START"], row["STATE"]) for row in rows] == [(1, 0), (0, 10), (1, 0), (0, 100)]
        # One slot throughout: the restarted sequence kept its place.
        assert {len(rows) for _, rows in fake.batches} == {1}
        nursery.cancel_scope.cancel()


# -- admission errors ---------------------------------------------------------------------


async def test_requests_outside_a_sequence_are_refused_without_disturbing_others(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, make_config())
        await infer(scheduler, request(1, 4, start=True))
        with pytest.raises(InvalidArgument, match="must specify the START flag"):
            await scheduler.submit(request(99, 1))
        with pytest.raises(InvalidArgument, match="non-zero or non-empty correlation ID"):
            await scheduler.submit(request(0, 1, start=True))
        with pytest.raises(InvalidArgument, match="string correlation ID"):
            await scheduler.submit(request("abc", 1, start=True))
        big = request(1, 1)
        big.batch_size = 2
        with pytest.raises(InvalidArgument, match="batch-size 1"):
            await scheduler.submit(big)
        assert total(await infer(scheduler, request(1, 1, end=True))) == 5
        # After END the id is free again: a new sequence starts from zero.
        assert total(await infer(scheduler, request(1, 2, start=True))) == 2
        nursery.cancel_scope.cancel()


async def test_string_correlation_ids(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, make_config(corrid="TYPE_STRING"))
        await infer(scheduler, request("alpha", 1, start=True))
        await infer(scheduler, request("beta", 10, start=True))
        assert total(await infer(scheduler, request("alpha", 2))) == 3
        assert total(await infer(scheduler, request("beta", 20, end=True))) == 30
        assert [row["CORRID"] for _, rows in fake.batches for row in rows if row["id"]] == [
            b"alpha",
            b"beta",
            b"alpha",
            b"beta",
        ]
        assert [row["CORRID"] for _, rows in fake.batches for row in rows if not row["id"]] == [
            b"",
            b"",
        ]  # the null requests beside "beta" in slot 1
        nursery.cancel_scope.cancel()


async def test_a_full_queue_rejects(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(
            nursery, make_config(max_batch_size=1), hold=None, capacity=2
        )
        await scheduler.submit(request(1, 1, start=True))
        await fake.taken_batches(1)  # executing: not queued
        await scheduler.submit(request(1, 2))
        await scheduler.submit(request(2, 1, start=True))  # backlog
        with pytest.raises(Unavailable, match="Exceeds maximum queue size"):
            await scheduler.submit(request(3, 1, start=True))
        assert 3 not in scheduler.sequences.open  # a refused START leaves no sequence
        nursery.cancel_scope.cancel()


async def test_a_backlogged_sequence_gives_up_when_its_request_timeout_expires(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, make_config(max_batch_size=1))
        await infer(scheduler, request(1, 1, start=True))
        t0 = trio.current_time()
        waiting = request(2, 1, start=True, timeout_us=300_000)
        result = await infer(scheduler, waiting)
        assert isinstance(result, Unavailable)
        assert "timeout of the corresponding sequence has been expired" in result.message
        assert trio.current_time() == pytest.approx(t0 + 0.3)
        with pytest.raises(InvalidArgument, match="timed out waiting in the backlog"):
            await scheduler.submit(request(2, 2))
        assert total(await infer(scheduler, request(1, 1))) == 2  # sequence 1 unharmed
        nursery.cancel_scope.cancel()


async def test_a_cancelled_queued_request_cancels_its_whole_sequence(autojump_clock):
    """Core sequence_batch_scheduler.cc:1644-1652 and ReleaseSequenceSlot: a
    cancelled request at the front of a slot's queue releases the slot and cancels
    every request queued after it (qa/L0_request_cancellation scheduler_test:
    "Cancelling any queued request cancels the entire sequence")."""
    async with trio.open_nursery() as nursery:
        config = make_config(max_batch_size=1, idle_us=60_000_000)
        scheduler, [fake] = await start(nursery, config, hold=None)
        await scheduler.submit(request(1, 1, start=True))
        await fake.taken_batches(1)
        gone = request(1, 100)
        await scheduler.submit(gone)
        gone.cancelled = True
        after = request(1, 2)
        await scheduler.submit(after)
        waiting = request(2, 5, start=True)  # backlogged: sequence 1 holds the only slot
        await scheduler.submit(waiting)
        fake.releases[0].set()
        assert isinstance(await outcome(gone), Cancelled)
        assert isinstance(await outcome(after), Cancelled)
        await fake.taken_batches(2)  # the freed slot went to sequence 2 at once
        fake.releases[1].set()
        assert total(await outcome(waiting)) == 5
        assert fake.ids() == [["1:1"], ["2:5"]]
        refused = await infer(scheduler, request(1, 3))  # sequence 1 is over
        assert isinstance(refused, InvalidArgument)
        assert "must specify the START flag" in refused.message
        assert refused.message.endswith("sequence 1 was cancelled")
        nursery.cancel_scope.cancel()


async def test_a_backlogged_sequence_whose_client_went_never_takes_a_slot(autojump_clock):
    """Core sequence_batch_scheduler.cc ReleaseSequenceSlot: a backlogged sequence
    with a cancelled request is cancelled whole and skipped. Here it leaves the
    backlog as soon as the request is cancelled."""
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, make_config(max_batch_size=1, idle_us=60_000_000))
        assert total(await infer(scheduler, request(1, 1, start=True))) == 1  # holds the slot
        gone = request(2, 10, start=True)
        await scheduler.submit(gone)
        later = request(2, 20)  # a second request of the abandoned sequence
        await scheduler.submit(later)
        waiting = request(3, 5, start=True)
        await scheduler.submit(waiting)
        assert scheduler.pending == 3
        gone.cancelled = True
        assert isinstance(await outcome(gone), Cancelled)
        assert isinstance(await outcome(later), Cancelled)
        assert scheduler.pending == 1
        assert total(await infer(scheduler, request(1, 1, end=True))) == 2  # frees the slot
        assert total(await outcome(waiting)) == 5  # at once, not after 60 s
        assert trio.current_time() < 1
        nursery.cancel_scope.cancel()


# -- the oldest strategy -------------------------------------------------------------------


async def test_oldest_batches_the_oldest_next_requests_one_per_sequence(autojump_clock):
    config = make_config(
        "oldest { max_candidate_sequences: 4 preferred_batch_size: [ 3 ] "
        "max_queue_delay_microseconds: 100000 }",
        max_batch_size=4,
    )
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, config)
        t0 = trio.current_time()
        starts = [request(seq, 1, start=True) for seq in (1, 2)]
        for r in starts:
            await scheduler.submit(r)
        # Two of a preferred three: the batch waits the delay, then goes.
        for r in starts:
            await outcome(r)
        assert fake.batches[0][0] == pytest.approx(t0 + 0.1)
        # Two requests of sequence 1 and one each of 2 and 3: one per sequence per
        # batch, so the preferred three go at once and 1's second request after.
        t1 = trio.current_time()
        rs = [request(1, 2), request(1, 3), request(2, 2), request(3, 5, start=True)]
        for r in rs:
            await scheduler.submit(r)
        results = [await outcome(r) for r in rs]
        assert [total(r) for r in results] == [3, 6, 3, 5]
        assert fake.ids()[1] == ["1:2", "2:2", "3:5"]
        assert fake.batches[1][0] == pytest.approx(t1)
        assert fake.ids()[2] == ["1:3"]
        assert fake.batches[2][0] == pytest.approx(t1 + 0.1)
        # No null requests with oldest: every row is ready.
        assert all(row["READY"] for _, rows in fake.batches for row in rows)
        nursery.cancel_scope.cancel()


async def test_oldest_candidates_beyond_the_limit_wait_in_the_backlog(autojump_clock):
    config = make_config("oldest { max_candidate_sequences: 2 }", max_batch_size=4)
    async with trio.open_nursery() as nursery:
        scheduler, [fake] = await start(nursery, config)
        for seq in (1, 2):
            await infer(scheduler, request(seq, 1, start=True))
        third = request(3, 1, start=True)
        await scheduler.submit(third)
        await trio.sleep(0.2)
        assert not third.done
        await infer(scheduler, request(2, 1, end=True))
        assert total(await outcome(third)) == 1
        nursery.cancel_scope.cancel()


# -- implicit state ------------------------------------------------------------------------


async def test_state_is_kept_per_sequence_reset_on_start_and_freed_on_end(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, make_config())
        sums = {}
        for seq in (1, 2):
            sums[seq] = [total(await infer(scheduler, request(seq, 10 * seq, start=True)))]
        for value in (1, 2, 3):
            for seq in (1, 2):
                sums[seq].append(total(await infer(scheduler, request(seq, value))))
        assert sums == {1: [10, 11, 13, 16], 2: [20, 21, 23, 26]}
        state = scheduler.sequences.open[1].state["INPUT_STATE"]
        assert state.tolist() == [16]
        ended = scheduler.sequences.open[1]
        assert total(await infer(scheduler, request(1, 4, end=True))) == 20
        assert 1 not in scheduler.sequences.open and ended.state is None
        assert total(await infer(scheduler, request(1, 5, start=True))) == 5
        nursery.cancel_scope.cancel()


async def test_idle_release_frees_the_state(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, make_config(idle_us=100_000))
        await infer(scheduler, request(1, 3, start=True))
        sequence = scheduler.sequences.open[1]
        assert sequence.state is not None
        await trio.sleep(0.2)
        assert sequence.released and sequence.state is None
        assert scheduler.sequences.open == {}
        nursery.cancel_scope.cancel()


async def test_state_outputs_reach_the_client_only_when_listed_and_asked_for(autojump_clock):
    listed = ', { name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] }'
    async with trio.open_nursery() as nursery:
        plain, _ = await start(nursery, make_config())
        response = await infer(plain, request(1, 1, start=True))
        assert [t.name for t in response.outputs] == ["OUTPUT"]
        debug, _ = await start(nursery, make_config(outputs=listed))
        response = await infer(
            debug, request(1, 1, start=True, outputs=[RequestedOutput("OUTPUT")])
        )
        assert [t.name for t in response.outputs] == ["OUTPUT"]
        asked = request(1, 2, outputs=[RequestedOutput("OUTPUT_STATE")])
        response = await infer(debug, asked)
        assert [(t.name, total(response)) for t in response.outputs] == [("OUTPUT_STATE", 3)]
        # The request is given back its own outputs and inputs once answered.
        assert [o.name for o in asked.requested_outputs] == ["OUTPUT_STATE"]
        assert list(asked.inputs) == ["INPUT"]
        nursery.cancel_scope.cancel()


async def test_sequences_move_with_their_state_when_an_instance_goes(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, fakes = await start(nursery, make_config(max_batch_size=2), executors=2)
        await infer(scheduler, request(1, 1, start=True))
        await infer(scheduler, request(2, 2, start=True))
        assert fakes[0].ids() == [["1:1"]] and fakes[1].ids() == [["2:2"]]
        fakes[0].outlet.close()  # the instance holding sequence 1 is removed
        assert total(await infer(scheduler, request(1, 5))) == 6
        assert fakes[1].ids()[-1] == [None, "1:5"]  # now in slot 1 of the other
        assert total(await infer(scheduler, request(2, 5))) == 7
        nursery.cancel_scope.cancel()


# -- initial state and configuration ----------------------------------------------------------


def test_initial_state_from_a_data_file(tmp_path):
    initial = (
        'initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "hundred" '
        'name: "from file" }'
    )
    config = make_config(initial=initial)
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "hundred").write_bytes(np.int32(100).tobytes())
    [spec] = load_sequence_states(config, tmp_path)
    assert spec.initial.tolist() == [100]

    (tmp_path / "initial_state" / "hundred").write_bytes(b"\x01")
    with pytest.raises(InvalidArgument, match="expects 4 bytes"):
        load_sequence_states(config, tmp_path)
    escape = initial.replace('"hundred"', '"../config.pbtxt"')
    with pytest.raises(InvalidArgument, match="initial_state/ directory"):
        load_sequence_states(make_config(initial=escape), tmp_path)


def test_default_initial_state_is_zeros_with_one_for_variable_dims(tmp_path):
    config = make_config(initial="")
    config.sequence_batching.state[0].dims[:] = [-1, 2]
    [spec] = load_sequence_states(config, tmp_path)
    assert spec.initial.shape == (1, 2) and not spec.initial.any()


async def test_an_iterative_sequence_requeues_rescheduled_requests(autojump_clock):
    """core sequence_utils.h IterativeSequencer: a request without a correlation id
    starts a sequence of its own; one handed back (rescheduled) runs again with no
    START flag, in the same slot, and the sequence ends when it is released."""
    config = make_config()
    config.sequence_batching.iterative_sequence = True
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, config, executors=0)
        outlet = scheduler.outlet()
        runs: list[tuple[str, int, int, int]] = []

        async def execute_each_three_times() -> None:
            seen: dict[str, int] = {}
            while True:
                batch = await outlet.receive()
                outcomes = []
                for r in batch:
                    if isinstance(r, NullRequest):
                        outcomes.append(None)
                        continue
                    seen[r.id] = seen.get(r.id, 0) + 1
                    runs.append((r.id, scalar(r, "START"), scalar(r, "CORRID"), seen[r.id]))
                    r.rescheduled = seen[r.id] < 3
                    outcomes.append(None if r.rescheduled else Accumulator.answer(r))
                outlet.complete(batch, outcomes)

        nursery.start_soon(execute_each_three_times)
        a, b = request(0, 1, id="a"), request(0, 2, id="b")
        await scheduler.submit(a)
        await scheduler.submit(b)
        assert (a.sequence_id, b.sequence_id) == (1, 2)
        assert total(await outcome(a)) == 1 and total(await outcome(b)) == 2
        for name, corrid in (("a", 1), ("b", 2)):
            mine = [run for run in runs if run[0] == name]
            assert [run[3] for run in mine] == [1, 2, 3]
            assert [run[1] for run in mine] == [1, 0, 0]  # START only the first time
            assert {run[2] for run in mine} == {corrid}
        assert not scheduler.sequences.open  # released, their slots free
        assert scheduler.pending == 0
        nursery.cancel_scope.cancel()


async def test_a_request_held_past_the_idle_time_loses_its_iterative_sequence(autojump_clock):
    """Triton's reaper measures idle time from a sequence's latest enqueue (core
    sequence_batch_scheduler.cc ReaperThread): a model that holds an iterative
    sequence's request for longer than max_sequence_idle_microseconds finds the
    sequence gone when it hands the request back, and the re-enqueue fails with
    Enqueue's "must specify the START flag" (qa/L0_iterative_sequence
    test_reschedule_error). Held for less, the request runs again."""
    config = make_config(idle_us=200_000)
    config.sequence_batching.iterative_sequence = True
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, config, executors=0)
        outlet = scheduler.outlet()
        hold = {"slow": 0.5, "quick": 0.1}
        runs: dict[str, int] = {}

        async def hold_then_reschedule_once() -> None:
            while True:
                batch = await outlet.receive()
                requests = [r for r in batch if not isinstance(r, NullRequest)]
                await trio.sleep(max(hold[r.id] for r in requests))
                outcomes = []
                for r in batch:
                    if isinstance(r, NullRequest):
                        outcomes.append(None)
                        continue
                    runs[r.id] = runs.get(r.id, 0) + 1
                    r.rescheduled = runs[r.id] == 1
                    outcomes.append(None if r.rescheduled else Accumulator.answer(r))
                outlet.complete(batch, outcomes)

        nursery.start_soon(hold_then_reschedule_once)
        slow = request(0, 1, id="slow")
        await scheduler.submit(slow)
        error = await outcome(slow)
        assert isinstance(error, InvalidArgument)
        assert (
            "inference request for sequence 1 to model 'acc' must specify the START flag "
            "on the first request of the sequence; sequence 1 was released after it was "
            "idle for more than 200000 us"
        ) in error.message
        assert runs["slow"] == 1
        quick = request(0, 2, id="quick")
        await scheduler.submit(quick)
        assert total(await outcome(quick)) == 2 and runs["quick"] == 2
        assert not scheduler.sequences.open
        assert scheduler.pending == 0
        nursery.cancel_scope.cancel()


async def test_initial_state_from_a_file_feeds_the_first_request(autojump_clock, tmp_path):
    initial = 'initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "v" name: "v" }'
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "v").write_bytes(np.int32(100).tobytes())
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, make_config(initial=initial), tmp_path=tmp_path)
        assert total(await infer(scheduler, request(1, 1, start=True))) == 101
        nursery.cancel_scope.cancel()


# -- a gRPC stream queues its requests in order ------------------------------------------------


class StreamCall:
    """The parts of a GrpcCall that ModelStreamInfer uses, with every message ready."""

    method = "ModelStreamInfer"
    metadata: dict = {}
    draining = False

    def __init__(self, messages: list[bytes]) -> None:
        self._messages = list(reversed(messages))
        self.sent: list[bytes] = []
        self.answers = 0

    async def receive(self) -> bytes | None:
        await trio.lowlevel.checkpoint()
        return self._messages.pop() if self._messages else None

    async def send(self, data: bytes) -> None:
        self.sent.append(data)

    def answered(self) -> None:
        """The handler answered one of the messages it took (the connection's budget)."""
        self.answers += 1


class QueueingDataPlane:
    """Records the order in which requests reach their model's queue; decoding and
    routing take a varying number of checkpoints first, as real ones may."""

    shared_memory = None
    shm_resolver = None
    budget = None
    tracing = TraceManager()  # tracing off

    def request_regions(self):
        return None

    def __init__(self) -> None:
        self.order: list[str] = []

    def model(self, name, version, namespace=None):
        from tests.helpers import decoupled_model

        return decoupled_model(name)

    async def infer_stream(self, request, deliver, *, queued=None) -> None:
        for _ in range(int(request.id) % 4):
            await trio.lowlevel.checkpoint()
        self.order.append(request.id)
        if queued is not None:
            queued.set()


async def test_a_grpc_stream_queues_its_requests_in_the_order_they_came():
    from trionserve._generated import grpc_service_pb2 as pb
    from trionserve.protocol.grpc.service import GrpcService

    ids = [str(i) for i in range(40)]
    call = StreamCall(
        [pb.ModelInferRequest(model_name="acc", id=i).SerializeToString() for i in ids]
    )
    dataplane = QueueingDataPlane()
    await GrpcService(dataplane).model_stream_infer(call)
    assert dataplane.order == ids


async def test_a_full_queue_first_drops_backlogged_sequences_whose_clients_left(autojump_clock):
    async with trio.open_nursery() as nursery:
        scheduler, _ = await start(nursery, make_config(max_batch_size=1), capacity=1)
        await infer(scheduler, request(1, 1, start=True))  # holds the only slot
        gone = request(2, 1, start=True)
        await scheduler.submit(gone)
        gone.cancelled = True  # its client went away while it waited for a slot
        kept = request(3, 1, start=True)
        await scheduler.submit(kept)  # fits once the dead sequence is dropped
        assert isinstance(await outcome(gone), Cancelled)
        assert 2 not in scheduler.sequences.open
        await infer(scheduler, request(1, 1, end=True))
        assert total(await outcome(kept)) == 1
        nursery.cancel_scope.cancel()
