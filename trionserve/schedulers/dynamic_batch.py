"""DynamicBatchScheduler: Triton's dynamic batcher as one Trio actor.

Requests wait in per-priority-level queues; whenever an executor is idle the
batcher forms the best batch the queue allows, with the rules of Triton's
``DynamicBatchScheduler::GetDynamicBatch``:

- requests are taken in priority order (level 1 first), within a level oldest
  first, and requests delayed by a DELAY timeout after the level's others;
- a batch grows while its total batch size stays within ``max_batch_size`` and the
  next request's shapes match (inputs with a variable shape must be equal unless
  ``allow_ragged_batch``; shape tensors must hold the same values; with optional
  inputs, the same inputs must be present); it never skips a request to find a
  better fit, so requests of one level leave in order;
- reaching a ``preferred_batch_size`` marks a candidate; so does the request that
  would take the batch past the largest preferred size. The largest candidate is
  sent unless the oldest request of the batch has waited
  ``max_queue_delay_microseconds``, in which case everything gathered is sent; with
  no candidate the batch is sent when it can grow no more, when the delay has
  passed, or at once when the delay is 0; otherwise the batcher waits for more
  requests until the delay passes. The delay is kept to the microsecond on the
  real clock (:mod:`trionserve.schedulers.timer`), not to Trio's millisecond;
  a batch that waits for it with an idle instance taking hand-overs waits in
  that instance's thread instead, where the requests that come meanwhile join
  it (``_hold_in_thread``), so the event loop does not wake at its end.

Batches are formed only when an executor asks for one, so under load requests
accumulate while every instance is busy even with a delay of 0, exactly as in
Triton.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from time import perf_counter
from typing import TYPE_CHECKING

import structlog
import trio

from trionserve.core.clocks import clock_offset
from trionserve.core.deferred import sweep_idle
from trionserve.core.errors import Cancelled, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest
from trionserve.observability.logging import verbose
from trionserve.observability.statistics import FailureReason, ModelStatistics, to_ns
from trionserve.schedulers.batch_queue import DELAYED, GONE, QUEUED, Entry, Level, OpenBatch
from trionserve.schedulers.batcher_outlet import BatcherOutlet
from trionserve.schedulers.held_batch import HeldBatches
from trionserve.schedulers.scheduler import QUEUE_CAPACITY, BatchOutlet, Outcome, deliver_outcomes
from trionserve.schedulers.testing_hooks import count_from_environment
from trionserve.schedulers.timer import PreciseWakeup

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

log = structlog.get_logger(__name__)


class DynamicBatchScheduler(HeldBatches):
    """Owns the queues of a model with ``dynamic_batching`` and forms its batches.

    Inbox: ``submit`` (synchronous admission: a full level rejects at once with
    UNAVAILABLE "Exceeds maximum queue size"; with no ``max_queue_size`` the queue
    holds at most ``capacity`` requests and submit waits for room) and the outlets
    of its executors. These are plain methods called on the Trio thread, each
    finishing without a checkpoint, so the batcher's state has one writer at a time.
    Its one task waits for work, an idle executor, the batching delay or the next
    queue timeout, all on Trio's clock.

    Guarantees: each queued request leaves exactly once — in a batch, rejected when
    its queue timeout expires (UNAVAILABLE "Request timeout expired"), answered
    ``Cancelled`` when its client went away, or answered by ``abort`` at unload.
    With ``preserve_ordering``, outcomes are delivered in the order batches were
    formed, whatever order the instances finish in.
    """

    def __init__(
        self,
        config: ModelConfig,
        statistics: ModelStatistics | None = None,
        *,
        capacity: int = QUEUE_CAPACITY,
    ) -> None:
        batching = config.dynamic_batching
        self.model_name = config.name
        self._statistics = statistics
        self._capacity = capacity
        self._max_batch = max(1, config.max_batch_size)
        preferred = sorted(set(batching.preferred_batch_size))
        self._preferred = frozenset(preferred)
        self._max_preferred = preferred[-1] if preferred else self._max_batch
        self._delay = batching.max_queue_delay_microseconds / 1e6
        self._preserve_ordering = batching.preserve_ordering
        self._priority_levels = batching.priority_levels
        self._default_level = batching.default_priority_level if self._priority_levels else 0
        self._default_policy = batching.default_queue_policy
        self._policies = dict(batching.priority_queue_policy)

        # What makes two requests batchable (Triton's enforce_equal_shape_tensors).
        self._skip = 1 if config.max_batch_size > 0 else 0
        self._equal_shape = tuple(
            i.name
            for i in config.input
            if not i.is_shape_tensor and not i.allow_ragged_batch and -1 in i.dims
        )
        self._equal_value = tuple(i.name for i in config.input if i.is_shape_tensor)
        self._has_optional = any(i.optional for i in config.input)
        self._check_shapes = bool(self._equal_shape or self._equal_value or self._has_optional)

        self._levels: dict[int, Level] = {}
        self._order: list[int] = []  # level numbers, highest priority first
        self._queued = 0
        # Triton's testing hook (core dynamic_batch_scheduler.cc BatcherThread):
        # with TRITONSERVER_DELAY_SCHEDULER=N in the environment no batch forms
        # until N requests are queued; once they are, batching never holds again.
        self._hold = count_from_environment("TRITONSERVER_DELAY_SCHEDULER")
        self._deadlines: list[tuple[float, int, Entry]] = []
        self._sequence = itertools.count()
        self._ready: deque[BatcherOutlet] = deque()
        self._outlets: set[BatcherOutlet] = set()
        self._wakeup = trio.Event()
        self._space = trio.Event()
        self._closed = False
        self._finished = False
        # preserve_ordering: tickets in formation order, outcomes held until due.
        self._next_ticket = 0
        self._next_delivery = 0
        self._held: dict[int, tuple[Sequence[InferenceRequest], Sequence[Outcome]]] = {}
        # The real-clock wake-up of the delay's end (made by run).
        self._timer: PreciseWakeup | None = None
        # The run's clock as each submit reads it: Trio's own is
        # ``perf_counter()`` plus this (clock_offset: no call of the clock's
        # method per request); None on a virtual clock, read through
        # ``_clock`` then. Set as the batcher starts.
        self._offset: float | None = None
        self._clock: trio.abc.Clock | None = None
        # Whether a batch waiting for the delay may wait in the thread of the
        # instance it goes to (see _hold_in_thread): only where that cannot
        # change which requests it takes, nor when, nor what is refused
        # meanwhile: one priority level, no queue timeouts and no queue size
        # bound (a request held there is no longer queued here).
        policy = self._policies.get(0, self._default_policy)
        self._holds = bool(
            self._delay
            and not self._priority_levels
            and not policy.default_timeout_microseconds
            and not policy.allow_timeout_override
            and not policy.max_queue_size
        )
        self._open: OpenBatch | None = None  # the batch so held, until it starts
        self._opened: OpenBatch | None = None  # (made once, re-armed: see _hold_with)

    # -- the actor ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Trio's timers round up to whole milliseconds; the wake-up keeps
        # microsecond delays on the real clock (see schedulers/timer.py).
        timer = self._timer = PreciseWakeup(self._timer_fired)
        self._clock = trio.lowlevel.current_clock()
        self._offset = clock_offset()
        if verbose():
            # Triton's line (core dynamic_batch_scheduler.cc BatcherThread).
            log.debug(f"Starting dynamic-batcher thread for {self.model_name} at nice 0...")
        async with trio.open_nursery() as nursery:
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

    def _timer_fired(self) -> None:
        """The real-clock timer reached the deadline last armed: the batches that
        can go now are formed and handed over in the timer's task, which arms
        the timer again for the next look (:meth:`_look_again`), so the
        batcher's own task takes no step (at c=1 with a delay that is two passes
        of the run loop and two task steps fewer per batch, benchmarks/README.md
        issue 39's eighth round). Once closed, the batcher's task looks."""
        if self._closed:
            self._wakeup.set()
            return
        self._look_again(self._dispatch_ready(trio.current_time()))

    def _timed(self) -> bool:
        """Whether the real-clock timer runs (not on a virtual clock) and the
        batcher takes new work: then whoever changes the queue arms it itself
        instead of waking the batcher's task to (:meth:`_look_again`)."""
        timer = self._timer
        return timer is not None and timer.live and not self._closed

    def _look_again(self, wake_at: float) -> None:
        """Arm the real-clock timer for the next look: ``wake_at`` (what
        :meth:`_dispatch_ready` returned) or the next queue timeout, whichever
        first (what the batcher's task would arm, see :meth:`_step`). The
        task's own fallback deadline stays as it was: a stale one only makes it
        look again."""
        assert self._timer is not None
        self._timer.arm(min(wake_at, self._next_deadline()))

    def _step(self, now: float) -> float | None:
        """Expire, dispatch what can go; return when to look again (None: done)."""
        wake_at = self._dispatch_ready(now)
        if self._closed and not self._queued:
            self._finish()
            return None
        return min(wake_at, self._next_deadline())

    def _dispatch_ready(self, now: float) -> float:
        """Expire, then give each idle executor the batch that can go now; when
        to look again for the next one (inf: none waits for a delay)."""
        self._expire(now)
        if self._hold and not self._closed:
            if self._queued < self._hold:
                if verbose():
                    log.debug(
                        f"Delaying batcher thread {self.model_name} until {self._hold} "
                        f"queued requests, current total = {self._queued}"
                    )
                return math.inf  # a submission wakes the batcher
            self._hold = 0
        ready = self._ready
        while ready and self._queued:
            entries, go_at = self._form(now)
            if entries is None:
                return go_at
            if go_at > now:  # it waits for the delay
                if self._hold_in_thread(ready[0], entries, go_at):
                    ready.popleft()
                    continue
                return go_at
            self._dispatch(ready.popleft(), entries)
        return math.inf

    # -- admission -------------------------------------------------------------------

    async def submit(self, request: InferenceRequest) -> None:
        waited = False
        while not self.submit_now(request, waited):  # the queue is full: wait for space
            waited = True
            await self._space.wait()

    def submit_now(self, request: InferenceRequest, waited: bool = False) -> bool:
        """:meth:`submit` as a plain call: False, the request not queued, where it
        would wait for the queue's space; ``waited``: it waited, try again."""
        if self._closed:
            raise trio.ClosedResourceError
        if waited:  # (no straight hand-over, no max_queue_size check again)
            now = trio.current_time()
            level = self._level_for(request.priority)
        else:
            offset = self._offset
            if offset is not None:
                now = perf_counter() + offset
            else:
                clock = self._clock
                now = clock.current_time() if clock is not None else trio.current_time()
            request.arrival_time = now
            ready = self._ready
            if ready and not self._queued and self._open is None and not self._hold:
                # Straight: nothing queued, an executor ready: the batch _form would make
                # of ``request`` alone, to the first ready executor that takes hand-overs
                # (issue 39's tenth round): now, or held by its thread for the delay.
                outlet = ready[0]
                if outlet._handover is not None:
                    size = request.batch_size or 1
                    delay = self._delay
                    if delay and size < self._max_preferred and size not in self._preferred:
                        if self._hold_with(outlet, [request], size, now + delay):
                            ready.popleft()
                            return True
                    elif not delay or self._timed():  # (else the batcher's task sends it)
                        self._send(ready.popleft(), [request])
                        return True
            level = self._level_for(request.priority)
            if level.max_queue_size and level.count >= level.max_queue_size:
                self._purge_cancelled(level)
                if level.count >= level.max_queue_size:
                    self._record_failure(request, now, FailureReason.REJECTED)
                    prefix = f"[request id: {request.id}] " if request.id else ""
                    raise Unavailable(
                        f"{prefix}Exceeds maximum queue size: model '{self.model_name}' "
                        f"already queues {level.count} requests"
                        + (f" at priority level {level.number}" if level.number else "")
                        + f" (max_queue_size {level.max_queue_size})"
                    )
        if self._queued >= self._capacity:
            for other in self._levels.values():
                self._purge_cancelled(other)
            if self._queued >= self._capacity:
                return False
        if self._open is not None and self._join(request):
            return True
        entry = Entry(request, level.number, request.batch_size or 1)
        level.queue.append(entry)
        level.count += 1
        self._queued += 1
        if not self._ready:
            # An idle instance whose thread wrote its last answers may wait for
            # their report to be swept before it asks for work (core/deferred.py):
            # swept now, so that this request does not wait for another sweep.
            sweep_idle()
        timeout_us = level.timeout_for(request)
        if timeout_us:
            deadline = now + timeout_us / 1e6
            heapq.heappush(self._deadlines, (deadline, next(self._sequence), entry))
        elif not self._ready:
            # Every executor is busy: nothing goes before one asks (it forms its batch then),
            # so this actor is not woken, as Triton's Enqueue wakes its batcher thread only
            # with a payload slot free (core src/dynamic_batch_scheduler.cc).
            return True
        elif self._ready[0]._handover is not None and (not self._delay or self._timed()):
            # An idle instance that takes batches straight: without a delay the batch goes
            # now, from this task (what arrives while it runs gathers for the next batch);
            # with one, on the real clock, the timer is armed for the delay's end.
            wake_at = self._dispatch_ready(now)
            if not self._queued:
                return True
            if self._timed():
                self._look_again(wake_at)
                return True
        self._wakeup.set()
        return True

    def _level_for(self, priority: int) -> Level:
        """Triton's rule: priority 0 or beyond the levels means the default level."""
        levels = self._priority_levels
        if not levels:
            number = 0
        elif priority == 0 or priority > levels:
            number = self._default_level
        else:
            number = priority
        level = self._levels.get(number)
        if level is None:
            policy = self._policies.get(number, self._default_policy)
            level = self._levels[number] = Level(number, policy)
            bisect.insort(self._order, number)
        return level

    @property
    def pending(self) -> int:
        """Requests waiting in the queues (cancelled ones not yet noticed included)."""
        return self._queued

    # -- timeouts and cancellation -----------------------------------------------------

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        rejected = False
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)[2]
            if entry.state != QUEUED:
                continue
            level = self._levels[entry.level]
            if level.delay_on_timeout:
                entry.state = DELAYED
                level.delayed.append(entry)
            else:
                self._remove(entry, level)
                request = entry.request
                # Triton's words exactly (core dynamic_batch_scheduler.cc:71,
                # FinishRejectedCancelledRequests); clients and qa/L0_batcher's
                # queue_timeout_test compare the message whole.
                request.fail(Unavailable("Request timeout expired"))
                self._record_failure(request, now, FailureReason.REJECTED)
                rejected = True
            level.trim()
        if len(heap) > 2 * self._queued + 64:
            self._deadlines = [item for item in heap if item[2].state == QUEUED]
            heapq.heapify(self._deadlines)
        if rejected:
            self._signal_space()

    def _next_deadline(self) -> float:
        heap = self._deadlines
        while heap and heap[0][2].state != QUEUED:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def _purge_cancelled(self, level: Level) -> None:
        """Answer and drop the level's requests whose clients went away."""
        now = None
        for entry in list(level.entries()):
            if entry.request.cancelled:
                now = now if now is not None else trio.current_time()
                self._drop_cancelled(entry, level, now)
        if now is not None:
            level.trim()

    def _drop_cancelled(self, entry: Entry, level: Level, now: float) -> None:
        self._remove(entry, level)
        request = entry.request
        request.fail(
            Cancelled(
                f"request '{request.id}' for model '{self.model_name}' was cancelled while queued"
            )
        )
        self._record_failure(request, now, FailureReason.CANCELED)

    def _remove(self, entry: Entry, level: Level) -> None:
        entry.state = GONE
        level.count -= 1
        self._queued -= 1

    # -- batch formation -------------------------------------------------------------

    def _form(self, now: float) -> tuple[list[Entry] | None, float]:
        """The batch to send and when it goes: ``now``, or later (the delay's
        end) if nothing comes meanwhile; or None and ``math.inf``: none."""
        pending: list[Entry] = []
        size = 0
        best: int | None = None  # number of entries in the best candidate
        send_now = False
        key = None
        dropped: list[Level] = []
        max_batch, max_preferred, preferred = self._max_batch, self._max_preferred, self._preferred
        for number in self._order:
            level = self._levels[number]
            if not level.count:
                continue
            for entry in level.entries():
                request = entry.request
                if request.cancelled or request.done:
                    if request.done:
                        self._remove(entry, level)
                    else:
                        self._drop_cancelled(entry, level, now)
                    dropped.append(level)
                    continue
                n = entry.size
                if not pending:
                    if self._check_shapes:
                        key = self._shape_key(request)
                else:
                    if size + n > max_preferred and best is None:
                        best = len(pending)
                    if size + n > max_batch:
                        send_now = True
                        break
                    if self._check_shapes and self._shape_key(request) != key:
                        send_now = True
                        break
                pending.append(entry)
                size += n
                if size in preferred:
                    best = len(pending)
            if send_now:
                break
        for level in dropped:
            level.trim()
        if not pending:
            return None, math.inf

        oldest = min(entry.request.arrival_time for entry in pending)
        delay = self._delay
        # Compared with the same sum the wake-up time below is, so that waking at
        # that time always finds the delay passed (``now - oldest >= delay`` can be
        # False there by float rounding, and the batcher would spin without end).
        delay_exceeded = delay > 0 and now >= oldest + delay
        if best is not None and not delay_exceeded:
            return pending[:best], now
        # Once closed (unloading) nothing more will come, so waiting is pointless.
        if send_now or size >= max_preferred or delay_exceeded or delay == 0 or self._closed:
            return pending, now
        return pending, oldest + delay

    def _shape_key(self, request: InferenceRequest) -> tuple:
        inputs = request.inputs
        key: list = [tuple(sorted(inputs))] if self._has_optional else []
        skip = self._skip
        for name in self._equal_shape:
            tensor = inputs.get(name)
            key.append(None if tensor is None else tensor.data.shape[skip:])
        for name in self._equal_value:
            tensor = inputs.get(name)
            key.append(None if tensor is None else tensor.data.tobytes())
        return tuple(key)

    def _dispatch(self, outlet: BatcherOutlet, entries: list[Entry]) -> None:
        self._send(outlet, self._take(entries))
        self._signal_space()

    def _send(self, outlet: BatcherOutlet, requests: list[InferenceRequest]) -> None:
        ticket = self._ticket() if self._preserve_ordering else None
        handover = outlet._handover
        if handover is not None:
            # Straight to the instance's thread, in this task; ordered delivery
            # counts it as received. Refused: it goes through the channel.
            outlet._tickets.append(ticket)
            if not handover(requests):
                outlet._tickets.pop()
                outlet.put(requests, ticket)
        else:
            outlet.put(requests, ticket)

    def _take(self, entries: list[Entry]) -> list[InferenceRequest]:
        """Take a batch's entries out of the queues: its requests."""
        requests = []
        levels = set()
        for entry in entries:
            level = self._levels[entry.level]
            self._remove(entry, level)
            levels.add(level)
            requests.append(entry.request)
        for level in levels:
            level.trim()
        return requests

    def _ticket(self) -> int | None:
        """The next batch's place in the delivery order (None: any order)."""
        if not self._preserve_ordering:
            return None
        ticket = self._next_ticket
        self._next_ticket += 1
        return ticket

    def _signal_space(self) -> None:
        if self._queued < self._capacity or self._closed:
            self._space.set()
            self._space = trio.Event()

    # -- executors ------------------------------------------------------------------

    def outlet(self) -> BatchOutlet:
        outlet = BatcherOutlet(self)
        self._outlets.add(outlet)
        if self._finished:
            outlet.finish()
        return outlet

    def _outlet_ready(self, outlet: BatcherOutlet) -> None:
        """An executor asks for its next batch: one that can go now is formed at
        once, in the executor's task, so that its instance starts it without
        waiting for this actor's task (nor for the responses of the batch it
        just finished, woken in the same pass: batches back to back). The
        actor is woken for what is left, to look again when the delay ends;
        with nothing queued it has nothing to look at (a submit wakes it)."""
        if self._open is not None and self._open.outlet is outlet:
            self._open = None  # (its batch ended)
        self._ready.append(outlet)
        if self._queued and not self._closed:
            wake_at = self._dispatch_ready(trio.current_time())
            if self._queued and self._timed():
                self._look_again(wake_at)  # (the delay's end, on the real clock)
                return
        if self._queued:
            self._wakeup.set()

    def _outlet_gone(
        self, outlet: BatcherOutlet, untaken: tuple[list[InferenceRequest], int | None] | None
    ) -> None:
        self._outlets.discard(outlet)
        if self._open is not None and self._open.outlet is outlet:
            self._release_held()  # its executor stops: the batch goes now
        try:
            self._ready.remove(outlet)
        except ValueError:
            pass
        if untaken is not None:
            self._give_back(*untaken)

    def _give_back(self, requests: list[InferenceRequest], ticket: int | None) -> None:
        """Requeue a batch an executor never took, at the front of its levels."""
        for request in reversed(requests):
            level = self._level_for(request.priority)
            entry = Entry(request, level.number, request.batch_size or 1)
            level.queue.appendleft(entry)
            level.count += 1
            self._queued += 1
        if ticket is not None:
            self._complete(ticket, (), ())
        self._wakeup.set()

    def _complete(
        self,
        ticket: int | None,
        requests: Sequence[InferenceRequest],
        outcomes: Sequence[Outcome],
    ) -> None:
        if ticket is None:
            deliver_outcomes(requests, outcomes)
            return
        held = self._held
        held[ticket] = (requests, outcomes)
        while self._next_delivery in held:
            due_requests, due_outcomes = held.pop(self._next_delivery)
            self._next_delivery += 1
            deliver_outcomes(due_requests, due_outcomes)

    def _finish(self) -> None:
        self._finished = True
        for outlet in self._outlets:
            outlet.finish()

    # -- shutdown ---------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        self._release_held()  # nothing more will come: it goes now
        self._wakeup.set()
        self._signal_space()

    def abort(self, error: TritonError) -> None:
        self.close()
        now = trio.current_time()
        for number in self._order:
            level = self._levels[number]
            for entry in list(level.entries()):
                self._remove(entry, level)
                entry.request.fail(error)
                self._record_failure(entry.request, now, FailureReason.OTHER)
            level.queue.clear()
            level.delayed.clear()
        self._deadlines.clear()
        # Outcomes held for an earlier batch that will never complete: deliver them.
        for ticket in sorted(self._held):
            deliver_outcomes(*self._held.pop(ticket))

    def _record_failure(self, request: InferenceRequest, now: float, reason: FailureReason) -> None:
        if self._statistics is not None:
            self._statistics.record_failure(to_ns(now - request.arrival_time), reason)
