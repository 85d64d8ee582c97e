"""SequenceBatchScheduler: Triton's sequence batcher for stateful models, as one Trio actor.

Every request of a sequence (the requests sharing a correlation id, from START to
END) runs on the instance its sequence is bound to, one at a time and in arrival
order. Each instance has sequence slots: ``max_batch_size`` of them (1 without
batching) with the ``direct`` strategy, ``max_candidate_sequences`` with
``oldest``. A START takes the free slot with the lowest index, spreading sequences
over instances; when every slot is taken the sequence waits in the backlog, and
the slot an ended or idle-released sequence leaves goes to the oldest backlogged
sequence.

- ``direct``: a batch holds, for every slot up to the highest one with a request
  ready, that slot's next request, or a null request (zeros, READY false) for an
  empty slot, so each sequence keeps its batch position. With
  ``max_queue_delay_microseconds`` and ``minimum_slot_utilization`` set, the batch
  waits for enough ready slots until the oldest ready request has waited the delay.
- ``oldest``: a batch holds the oldest next requests of the instance's candidate
  sequences, at most one per sequence, formed like the dynamic batcher's
  (``preferred_batch_size``, ``max_queue_delay_microseconds``).

Each request reaches the model with the control inputs of
``sequence_batching.control_input`` (START, END, READY, CORRID) and the implicit
state tensors of its sequence (see :mod:`trionserve.schedulers.sequence_state`); the
state outputs are kept for the next request and are returned to the client only
when the configuration lists them as outputs and the client asks for them.

Triton core ``sequence_batch_scheduler/sequence_batch_scheduler.cc``
(SequenceBatchScheduler: slots, backlog, Enqueue, ReleaseSequenceSlot). The
strategies' choice of a batch is in :mod:`.sequence_strategies`, the control
tensors and null requests in :mod:`.sequence_controls`, each executor's slots and
outlet in :mod:`.sequence_slots`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from functools import partial
from typing import TYPE_CHECKING

import trio

from trionserve.core.errors import Cancelled, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from trionserve.observability.statistics import FailureReason, ModelStatistics, to_ns
from trionserve.schedulers.scheduler import QUEUE_CAPACITY, BatchOutlet, Outcome
from trionserve.schedulers.sequence_controls import NullRequest, SequenceControls, zeros_like
from trionserve.schedulers.sequence_slots import Instance, Outlet, Row
from trionserve.schedulers.sequence_state import (
    Sequence,
    SequenceStateManager,
    StateSpec,
    backlog_timeout_error,
    describe,
)
from trionserve.schedulers.sequence_strategies import DirectStrategy, OldestStrategy
from trionserve.schedulers.testing_hooks import count_from_environment
from trionserve.schedulers.timer import PreciseWakeup

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig


class SequenceBatchScheduler:
    """Owns the sequence slots, the backlog and the queued requests of a model with
    ``sequence_batching``; its child, the :class:`SequenceStateManager`, owns the
    sequences, their state and their idle release.

    Inbox: ``submit`` (synchronous: admits the request into its sequence or raises
    INVALID_ARGUMENT; with ``capacity`` requests queued it raises UNAVAILABLE rather
    than wait, so a stream carrying several sequences never blocks on one) and the
    outlets of its executors; plain methods on the Trio thread that never
    checkpoint. Its task forms a batch whenever an executor is idle and work is
    ready, and wakes for batching delays and backlog timeouts on Trio's clock.

    Guarantees: each accepted request gets exactly one outcome; a sequence's
    requests execute in order, one at a time, on one instance (when an instance is
    removed its sequences move, with their state, to another); a sequence waiting
    in the backlog whose request has a ``timeout`` gives up with UNAVAILABLE when
    it expires; a cancelled request ends its sequence: every request queued for
    it is answered CANCELLED and its slot is freed (as in Triton), in the backlog
    at once, so a sequence nobody waits for never takes a slot. On ``abort`` every queued request is
    answered with the error and all state is dropped.
    """

    def __init__(
        self,
        config: ModelConfig,
        statistics: ModelStatistics | None = None,
        *,
        states: Iterable[StateSpec] = (),
        capacity: int = QUEUE_CAPACITY,
    ) -> None:
        batching = config.sequence_batching
        self.model_name = config.name
        self._statistics = statistics
        self._capacity = capacity
        self._max_batch = max(1, config.max_batch_size)
        self._skip = 1 if config.max_batch_size > 0 else 0
        self._strategy: DirectStrategy | OldestStrategy
        if batching.HasField("oldest"):
            self._strategy = OldestStrategy(batching.oldest, self._max_batch)
        else:
            self._strategy = DirectStrategy(batching.direct, self._max_batch)
        self._slot_count = self._strategy.slot_count
        # iterative_sequence: a request without a correlation id starts a sequence
        # of its own, and the backend may hand it back to be executed again
        # (core sequence_batch_scheduler/sequence_utils.h IterativeSequencer).
        self._iterative = batching.iterative_sequence
        self._iterative_ids = itertools.count(1)
        self._controls = SequenceControls(config)
        self._states = SequenceStateManager(config.name, config, list(states), self._on_release)
        self._state_outputs = [s.output_name for s in self._states.states]
        self._variable_state = any(-1 in s.dims for s in batching.state)
        self._ragged = frozenset(i.name for i in config.input if i.allow_ragged_batch)

        self._instances: list[Instance] = []
        self._numbers = itertools.count()
        self._free: list[tuple[int, int, Instance]] = []  # (slot, instance number, instance)
        self._backlog: deque[Sequence] = deque()
        self._released_in_backlog = 0  # cancelled ones not yet removed from it
        self._backlog_deadlines: list[tuple[float, int, Sequence]] = []
        self._counter = itertools.count()
        self._queued = 0
        self._rescan = False  # a slot was freed while batching: look again at once
        self._wakeup = trio.Event()
        self._closed = False
        self._finished = False
        # Triton's testing hooks, read from the environment as Triton reads them:
        # no batch forms until the slots' queues together hold
        # TRITONSERVER_DELAY_SCHEDULER requests and the backlog holds
        # TRITONSERVER_BACKLOG_DELAY_SCHEDULER (core sequence_batch_scheduler.cc
        # Create, DelayScheduler and DirectSequenceBatch::BatcherThread).
        self._hold_queued = count_from_environment("TRITONSERVER_DELAY_SCHEDULER")
        self._hold_backlog = count_from_environment("TRITONSERVER_BACKLOG_DELAY_SCHEDULER")

    @property
    def pending(self) -> int:
        """Requests queued and not yet batched."""
        return self._queued

    @property
    def sequences(self) -> SequenceStateManager:
        return self._states

    # -- the actor -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Trio's timers round up to whole milliseconds; the wake-up keeps
        # microsecond delays on the real clock (see schedulers/timer.py).
        timer = PreciseWakeup(self._wake)
        async with trio.open_nursery() as nursery:
            await nursery.start(self._states.run)
            await nursery.start(timer.run)
            task_status.started()
            while True:
                wake_at = self._step(trio.current_time())
                if wake_at is None:
                    break
                self._wakeup = trio.Event()
                with trio.move_on_at(timer.arm(wake_at)):
                    await self._wakeup.wait()
            nursery.cancel_scope.cancel()

    def _wake(self) -> None:
        self._wakeup.set()

    def _step(self, now: float) -> float | None:
        """Expire backlog timeouts, batch for every idle instance; when to look again."""
        self._expire_backlog(now)
        wake_at = math.inf
        holding = self._holding()
        for instance in self._instances:
            if instance.waiting and not instance.rows and not holding:
                rows, at = self._form(instance, now)
                if rows:
                    self._dispatch(instance, rows)
                else:
                    wake_at = min(wake_at, at)
        # A batch of an iterative sequence may still hand requests back.
        rescheduling = self._iterative and any(instance.rows for instance in self._instances)
        if self._closed and not self._queued and not rescheduling:
            self._finished = True
            for instance in self._instances:
                if instance.outlet is not None:
                    instance.outlet.finish()
            return None
        if self._rescan:
            self._rescan = False
            wake_at = now
        heap = self._backlog_deadlines
        return min(wake_at, heap[0][0] if heap else math.inf)

    def _holding(self) -> bool:
        """Whether the testing hooks still hold batching back; once they let go,
        they never hold again (Triton's batcher thread zeroes its count)."""
        if not self._hold_queued or self._closed:
            return False
        bound = sum(
            len(sequence.queue)
            for instance in self._instances
            for sequence in instance.slots
            if sequence is not None
        )
        if bound < self._hold_queued:
            return True
        if self._hold_backlog:
            backlogged = sum(len(s.queue) for s in self._backlog if not s.released)
            if backlogged < self._hold_backlog:
                return True
        self._hold_queued = 0
        return False

    # -- admission -------------------------------------------------------------------

    async def submit(self, request: InferenceRequest) -> None:
        if self._closed:
            raise trio.ClosedResourceError
        now = trio.current_time()
        request.arrival_time = now
        if self._iterative and request.sequence_id in (0, ""):
            # IterativeSequencer::SetupSequenceRequest: a new sequence, START set;
            # ids of sequences open now are skipped.
            sequence_id = next(self._iterative_ids)
            while sequence_id in self._states.open:
                sequence_id = next(self._iterative_ids)
            request.sequence_id = sequence_id
            request.sequence_start = True
        self._controls.check(request.sequence_id, self.model_name)
        if self._queued >= self._capacity:
            self._purge_backlog(now)
        if self._queued >= self._capacity:
            self._record_failure(request, now, FailureReason.REJECTED)
            raise Unavailable(
                f"Exceeds maximum queue size: model '{self.model_name}' already queues "
                f"{self._queued} requests of its sequences (max {self._capacity})"
            )
        sequence, new = self._states.admit(request, now)
        sequence.queue.append(request)
        self._queued += 1
        if new:
            self._place(sequence)
        if sequence.instance is None:
            # Backlogged: a client that goes away gives the sequence up at once.
            request.on_cancel(partial(self._backlogged_request_cancelled, sequence))
        if request.timeout_us and sequence.instance is None:
            deadline = now + request.timeout_us / 1e6
            if deadline < sequence.backlog_deadline:
                sequence.backlog_deadline = deadline
                heapq.heappush(self._backlog_deadlines, (deadline, next(self._counter), sequence))
        self._wakeup.set()

    # -- slots and backlog -----------------------------------------------------------

    def _place(self, sequence: Sequence) -> None:
        """Bind a new sequence to the lowest free slot, or queue it in the backlog."""
        free = self._pop_free()
        if free is None:
            self._backlog.append(sequence)
        else:
            self._bind(sequence, *free)

    def _pop_free(self) -> tuple[Instance, int] | None:
        heap = self._free
        while heap:
            slot, _, instance = heapq.heappop(heap)
            if instance.alive and instance.slots[slot] is None:
                return instance, slot
        return None

    def _pop_free_peek(self) -> tuple[Instance, int] | None:
        """The free slot :meth:`_pop_free` would return, left free."""
        heap = self._free
        while heap:
            slot, _, instance = heap[0]
            if instance.alive and instance.slots[slot] is None:
                return instance, slot
            heapq.heappop(heap)
        return None

    def _bind(self, sequence: Sequence, instance: Instance, slot: int) -> None:
        for request in sequence.queue:
            request.on_cancel(None)  # the backend's to set from now on
        instance.slots[slot] = sequence
        sequence.instance = instance
        sequence.slot = slot
        sequence.backlog_deadline = math.inf

    def _free_slot(self, sequence: Sequence) -> None:
        """The sequence leaves its slot; the oldest backlogged sequence takes it."""
        instance = sequence.instance
        sequence.instance = None
        if instance is None or instance.slots[sequence.slot] is not sequence:
            return
        instance.slots[sequence.slot] = None
        if instance.alive:
            heapq.heappush(self._free, (sequence.slot, instance.number, instance))
        self._fill_from_backlog()

    def _fill_from_backlog(self) -> None:
        """Free slots go to the oldest backlogged sequences. One with a cancelled
        request (its client gone) never takes a slot: it is answered CANCELLED and
        released, as Triton's ReleaseSequenceSlot skips a backlogged sequence for
        which IsAnyRequestCancelled holds (core sequence_batch_scheduler.cc)."""
        backlog = self._backlog
        self._wakeup.set()
        while backlog:
            if backlog[0].released:
                backlog.popleft()
                continue
            if self._pop_free_peek() is None:
                return
            sequence = backlog.popleft()
            if any(request.cancelled for request in sequence.queue):
                self._cancel_backlogged(sequence, trio.current_time())
                continue
            free = self._pop_free()
            assert free is not None
            self._bind(sequence, *free)

    def _on_release(self, sequence: Sequence) -> None:
        """The state manager released a sequence (idle, or expired in the backlog)."""
        self._free_slot(sequence)
        self._wakeup.set()

    def _expire_backlog(self, now: float) -> None:
        heap = self._backlog_deadlines
        expired = False
        while heap and heap[0][0] <= now:
            deadline, _, sequence = heapq.heappop(heap)
            if sequence.instance is not None or sequence.released:
                continue
            if deadline != sequence.backlog_deadline:
                continue
            error = backlog_timeout_error(self.model_name, sequence)
            self._drop_backlogged(sequence, error, now, FailureReason.REJECTED)
            self._states.release(sequence, "timed out waiting in the backlog")
            expired = True
        if expired:
            self._backlog = deque(s for s in self._backlog if not s.released)

    def _purge_backlog(self, now: float) -> None:
        """Drop backlogged sequences whose every queued request was cancelled."""
        purged = False
        for sequence in self._backlog:
            if sequence.released or not sequence.queue:
                continue
            if all(request.cancelled or request.done for request in sequence.queue):
                self._cancel_backlogged(sequence, now)
                purged = True
        if purged:
            self._backlog = deque(s for s in self._backlog if not s.released)

    def _backlogged_request_cancelled(self, sequence: Sequence) -> None:
        """A request of a backlogged sequence was cancelled (its client is gone):
        the sequence leaves the backlog at once, all its requests answered
        CANCELLED, so it neither takes a slot nor counts against the queue."""
        if sequence.released or sequence.instance is not None:
            return
        self._cancel_backlogged(sequence, trio.current_time())
        self._released_in_backlog += 1
        if self._released_in_backlog > len(self._backlog) // 2:
            self._backlog = deque(s for s in self._backlog if not s.released)
            self._released_in_backlog = 0
        self._wakeup.set()

    def _cancel_backlogged(self, sequence: Sequence, now: float) -> None:
        error = Cancelled(
            f"sequence {describe(sequence.id)} of model '{self.model_name}' was "
            "cancelled while waiting in the backlog"
        )
        self._drop_backlogged(sequence, error, now, FailureReason.CANCELED)
        self._states.release(sequence, "was cancelled while waiting in the backlog")

    def _drop_backlogged(
        self, sequence: Sequence, error: TritonError, now: float, reason: FailureReason
    ) -> None:
        for request in sequence.queue:
            if request.fail(error):
                self._record_failure(request, now, reason)
        self._queued -= len(sequence.queue)
        sequence.pending -= len(sequence.queue)
        sequence.queue.clear()

    # -- batch formation -------------------------------------------------------------

    def _head(self, sequence: Sequence, now: float) -> InferenceRequest | None:
        """The sequence's next request. One answered already (done) is skipped; a
        cancelled one ends its sequence, as in Triton's sequence batcher (core
        sequence_batch_scheduler.cc:1644-1652: a cancelled request at the front of
        a slot's queue releases the slot, and ReleaseSequenceSlot :884-908 cancels
        every request still queued for it and forgets the correlation id)."""
        queue = sequence.queue
        while queue:
            request = queue[0]
            if request.cancelled:
                error = Cancelled(
                    f"request '{request.id}' of sequence {describe(sequence.id)} for "
                    f"model '{self.model_name}' was cancelled while queued, which "
                    "cancels its sequence"
                )
                self._drop_backlogged(sequence, error, now, FailureReason.CANCELED)
                self._states.release(sequence, "was cancelled")
                self._rescan = True  # the freed slot may have a sequence to run now
                return None
            if not request.done:
                return request
            queue.popleft()
            self._queued -= 1
            if request.sequence_end:
                self._free_slot(sequence)
                self._states.finish(sequence)
            self._states.request_done(sequence, now)
        return None

    def _form(self, instance: Instance, now: float) -> tuple[list[Row] | None, float]:
        """The instance's next batch as its strategy chooses it; else None and when
        to look again."""
        ready: dict[int, tuple[Sequence, InferenceRequest]] = {}
        for slot, sequence in enumerate(instance.slots):
            if sequence is not None:
                request = self._head(sequence, now)
                if request is not None:
                    ready[slot] = (sequence, request)
        if not ready:
            return None, math.inf
        chosen, at = self._strategy.choose(ready, self._shape_key, now, self._closed)
        if chosen is None:
            return None, at
        rows = [None if sequence is None else self._take(sequence) for sequence in chosen]
        representative = next(row.request for row in rows if row is not None)
        return [row or self._null_row(representative, now) for row in rows], at

    def _shape_key(self, request: InferenceRequest, sequence: Sequence) -> tuple:
        """What must be equal for two requests to share a batch."""
        skip = self._skip
        key = tuple(
            sorted(
                (name, tensor.data.shape[skip:])
                for name, tensor in request.inputs.items()
                if name not in self._ragged
            )
        )
        if self._variable_state:
            state = None if request.sequence_start else sequence.state
            if state is not None:
                key += tuple(array.shape for array in state.values())
        return key

    def _take(self, sequence: Sequence) -> Row:
        """Pop the sequence's next request with its control and state inputs added."""
        request = sequence.queue.popleft()
        self._queued -= 1
        own_inputs, own_outputs = request.inputs, request.requested_outputs
        inputs = dict(own_inputs)
        inputs.update(
            self._controls.tensors(
                start=request.sequence_start,
                end=request.sequence_end,
                ready=True,
                correlation_id=sequence.id,
            )
        )
        inputs.update(self._states.state_inputs(sequence, request.sequence_start))
        request.inputs = inputs
        if own_outputs is not None and self._state_outputs:
            asked = {output.name for output in own_outputs}
            request.requested_outputs = own_outputs + [
                RequestedOutput(name) for name in self._state_outputs if name not in asked
            ]
        if request.sequence_end:
            # As in Triton the slot is free for the next sequence at once; that
            # sequence's first batch on this instance runs after this one.
            self._free_slot(sequence)
        return Row(request, sequence, own_inputs, own_outputs)

    def _null_row(self, representative: InferenceRequest, now: float) -> Row:
        inputs = {
            name: Tensor(name, tensor.datatype, zeros_like(tensor.data))
            for name, tensor in representative.inputs.items()
        }
        inputs.update(
            self._controls.tensors(start=False, end=False, ready=False, correlation_id=None)
        )
        null = NullRequest(
            self.model_name,
            representative.model_version,
            inputs=inputs,
            requested_outputs=representative.requested_outputs,
        )
        null.batch_size = representative.batch_size
        null.arrival_time = now
        return Row(null, None, {}, None)

    def _dispatch(self, instance: Instance, rows: list[Row]) -> None:
        instance.waiting = False
        instance.rows = rows
        assert instance.outlet is not None
        instance.outlet.put([row.request for row in rows])

    # -- executors -------------------------------------------------------------------

    def outlet(self) -> BatchOutlet:
        instance = Instance(next(self._numbers), self._slot_count)
        outlet = Outlet(self, instance)
        instance.outlet = outlet
        self._instances.append(instance)
        for slot in range(self._slot_count):
            heapq.heappush(self._free, (slot, instance.number, instance))
        if self._finished:
            outlet.finish()
        self._fill_from_backlog()
        return outlet

    def _outlet_ready(self, instance: Instance) -> None:
        instance.waiting = True
        self._wakeup.set()

    def _complete(
        self,
        instance: Instance,
        requests: Seq[InferenceRequest],
        outcomes: Seq[Outcome],
    ) -> None:
        """Outcomes of the instance's batch: keep state, answer, free finished slots.

        ``requests`` may be fewer than the batch: the executor answers requests
        cancelled before execution itself.
        """
        rows, instance.rows = instance.rows, []
        results = {id(request): outcome for request, outcome in zip(requests, outcomes)}
        now = trio.current_time()
        for row in rows:
            sequence = row.sequence
            if sequence is None:
                continue
            request = row.request
            request.inputs, request.requested_outputs = row.inputs, row.outputs
            if request.rescheduled:
                self._requeue(sequence, request)
                continue
            outcome = results.get(id(request))
            if isinstance(outcome, InferenceResponse):
                self._states.store_state(sequence, request, outcome, row.outputs)
                request.respond(outcome)
            elif outcome is not None:
                request.fail(outcome)
            if request.sequence_end:
                self._states.finish(sequence)
            self._states.request_done(sequence, now)
            if self._iterative and not request.sequence_end:
                # Released without RESCHEDULE: the iteration is over, and so is
                # its sequence (IterativeSequencer::RescheduleRequest ends it with
                # a cancelled null END request).
                self._states.release(sequence, "ended when its request was released")
        if not instance.alive:
            self._evict(instance)
        self._wakeup.set()

    def _requeue(self, sequence: Sequence, request: InferenceRequest) -> None:
        """A rescheduled request goes to the back of its sequence's queue with no
        START or END flag (IterativeSequencer::RescheduleRequest); it stays one of
        the sequence's pending requests.

        It is enqueued again as a request without START (core sequence_utils.cc
        RescheduleRequest calls SequenceBatchScheduler::Enqueue), so a sequence
        released meanwhile (idle for longer than ``max_sequence_idle_microseconds``)
        fails it with Enqueue's INVALID_ARG "... must specify the START flag on the
        first request of the sequence" (sequence_batch_scheduler.cc 720-740).
        """
        request.rescheduled = False
        request.sequence_start = request.sequence_end = False
        now = trio.current_time()
        if self._finished:
            request.fail(
                Unavailable(f"model '{self.model_name}' could not execute a rescheduled request")
            )
            self._states.request_done(sequence, now)
            return
        if not self._states.requeue(sequence, now):
            request.fail(self._states.not_started(sequence.id))
            self._states.request_done(sequence, now)
            return
        sequence.queue.append(request)
        self._queued += 1

    def _outlet_gone(self, instance: Instance, untaken: bool) -> None:
        instance.alive = False
        instance.waiting = False
        if instance in self._instances:
            self._instances.remove(instance)
        if untaken:
            rows, instance.rows = instance.rows, []
            self._give_back(rows)
        if not instance.rows:
            self._evict(instance)
        self._wakeup.set()

    def _give_back(self, rows: list[Row]) -> None:
        """Requeue a batch an executor never took, each request first in its sequence."""
        homeless = []
        for row in reversed(rows):
            sequence = row.sequence
            if sequence is None:
                continue
            request = row.request
            request.inputs, request.requested_outputs = row.inputs, row.outputs
            sequence.queue.appendleft(request)
            self._queued += 1
            if sequence.instance is None and not sequence.released:
                homeless.append(sequence)  # its END freed the slot at dispatch
        self._backlog.extendleft(homeless)

    def _evict(self, instance: Instance) -> None:
        """Move a removed instance's sequences to the front of the backlog."""
        moved = []
        for slot, sequence in enumerate(instance.slots):
            if sequence is not None:
                instance.slots[slot] = None
                sequence.instance = None
                moved.append(sequence)
        self._backlog.extendleft(reversed(moved))
        self._fill_from_backlog()

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    def abort(self, error: TritonError) -> None:
        self.close()
        now = trio.current_time()
        sequences = [s for i in self._instances for s in i.slots if s is not None]
        sequences.extend(self._backlog)
        for sequence in sequences:
            for request in sequence.queue:
                if request.fail(error):
                    self._record_failure(request, now, FailureReason.OTHER)
            sequence.queue.clear()
        self._backlog.clear()
        self._backlog_deadlines.clear()
        self._queued = 0
        self._states.clear()

    def _record_failure(self, request: InferenceRequest, now: float, reason: FailureReason) -> None:
        if self._statistics is not None:
            self._statistics.record_failure(to_ns(now - request.arrival_time), reason)
