"""SequenceStateManager: the live sequences of a stateful model, their implicit state
and their release when idle.

A sequence is the run of requests that share a correlation id, from the request with
the START flag to the one with the END flag; a START for a sequence in progress
restarts it, as in Triton. The manager admits each request into its sequence (or
refuses it with INVALID_ARGUMENT), keeps the implicit state tensors of
``sequence_batching.state`` between the requests of a sequence, and releases a
sequence that has had no request for ``max_sequence_idle_microseconds``. Time comes
from Trio's clock only, so idle release runs on a virtual clock in tests.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import structlog
import trio

from trionserve.core import datatypes
from trionserve.core.errors import InvalidArgument, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.core.tensor_files import read_model_file, tensor_from_bytes, zeros

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelSequenceBatching
    from trionserve.schedulers.sequence_slots import Instance

log = structlog.get_logger(__name__)

CorrelationId = int | str

# Released correlation ids remembered to explain why a late request is refused.
RELEASED_MEMORY = 1024

INITIAL_STATE_FOLDER = "initial_state"


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One implicit state tensor: fed as ``input_name``, read back from ``output_name``."""

    input_name: str
    output_name: str
    datatype: str  # wire name
    initial: np.ndarray  # the value a sequence starts with, without a batch dimension


def load_sequence_states(config: ModelConfig, model_dir: Path) -> list[StateSpec]:
    """The implicit states of a ``sequence_batching`` model, initial values read.

    Blocking (reads ``<model>/initial_state/<data_file>``); call it from a worker
    thread while the model loads. Raises InvalidArgument naming the model and the
    state for a configuration Triton would refuse.
    """
    batching = config.sequence_batching
    specs: list[StateSpec] = []
    seen: set[str] = set()
    for state in batching.state:
        where = f"model '{config.name}' sequence_batching.state '{state.input_name}'"
        if state.input_name in seen:
            raise InvalidArgument(f"{where}: state input name specified more than once")
        seen.add(state.input_name)
        datatype = datatypes.BY_CONFIG[_type_name(state.data_type)]
        if len(state.initial_state) > 1:
            raise InvalidArgument(
                f"{where}: initial_state must contain exactly one or zero element, "
                f"found {len(state.initial_state)}"
            )
        if state.initial_state:
            initial = _initial_value(state, state.initial_state[0], datatype, model_dir, where)
        else:
            # Triton leaves the first input state uninitialized, with 1 for every
            # variable dimension; zeros make that deterministic.
            shape = tuple(1 if d == -1 else d for d in state.dims)
            initial = zeros(shape, datatype)
        initial.setflags(write=False)
        specs.append(StateSpec(state.input_name, state.output_name, datatype.wire, initial))
    return specs


def _initial_value(
    state: ModelSequenceBatching.State,
    initial: ModelSequenceBatching.InitialState,
    datatype: datatypes.DataType,
    model_dir: Path,
    where: str,
) -> np.ndarray:
    if initial.data_type != state.data_type:
        raise InvalidArgument(
            f"{where}: initial_state data_type {_type_name(initial.data_type)} does not "
            f"match the state data_type {_type_name(state.data_type)}"
        )
    if not initial.name:
        raise InvalidArgument(f"{where}: initial_state must have a name")
    if len(initial.dims) != len(state.dims):
        raise InvalidArgument(
            f"{where}: initial_state has {len(initial.dims)} dims but the state has "
            f"{len(state.dims)}"
        )
    for got, want in zip(initial.dims, state.dims):
        if got < 1 or (want != -1 and got != want):
            raise InvalidArgument(
                f"{where}: initial_state dims {list(initial.dims)} do not match the "
                f"state dims {list(state.dims)}"
            )
    shape = tuple(initial.dims)
    if initial.WhichOneof("state_data") == "zero_data":
        return zeros(shape, datatype)
    data = read_model_file(model_dir, INITIAL_STATE_FOLDER, initial.data_file, where)
    return tensor_from_bytes(datatype, data, shape, where)


def _type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


def describe(correlation_id: CorrelationId) -> str:
    """A correlation id as Triton's messages show it."""
    return correlation_id if isinstance(correlation_id, str) else str(correlation_id)


class Sequence:
    """One sequence: its requests not yet batched and the state it carries.

    ``instance`` and ``slot`` say where the scheduler bound it (None while it waits
    in the backlog); ``pending`` counts its requests queued or executing; ``open``
    is False once its END request arrived or it was released.
    """

    __slots__ = (
        "id",
        "queue",
        "state",
        "instance",
        "slot",
        "pending",
        "open",
        "released",
        "idle_deadline",
        "backlog_deadline",
        "enqueued_at",
    )

    def __init__(self, correlation_id: CorrelationId) -> None:
        self.id = correlation_id
        self.queue: deque[InferenceRequest] = deque()
        # state input name -> the state fed to the next request; None: initial.
        self.state: dict[str, np.ndarray] | None = None
        self.instance: Instance | None = None
        self.slot = -1
        self.pending = 0
        self.open = True
        self.released = False
        self.idle_deadline: float | None = None
        self.backlog_deadline = math.inf
        self.enqueued_at = -math.inf  # when its latest request arrived

    def __repr__(self) -> str:
        return f"Sequence({self.id!r}, slot={self.slot}, queued={len(self.queue)})"


class SequenceStateManager:
    """Owns the correlation id -> sequence table and the sequences' implicit state.

    Inbox: plain methods called by its scheduler on the Trio thread, none of which
    checkpoints, so the table has one writer at a time. Its one task (``run``) is
    the idle reaper: it sleeps until the earliest idle deadline on Trio's clock and
    hands each sequence idle for ``max_sequence_idle_microseconds`` to
    ``on_release``. A sequence counts as idle only while none of its requests is
    queued or executing. A request arriving at or after its sequence's deadline
    finds the sequence released, whichever of the two runs first, so the outcome
    never depends on task order. Memory is bounded by the scheduler: sequences
    exist only in its slots and its bounded backlog; state is freed on END and on
    release.
    """

    def __init__(
        self,
        model_name: str,
        config: ModelConfig,
        states: list[StateSpec],
        on_release: Callable[[Sequence], None],
    ) -> None:
        self.model_name = model_name
        self.states = states
        self._idle_us = config.sequence_batching.max_sequence_idle_microseconds or 1_000_000
        self._idle = self._idle_us / 1e6
        self._batched = config.max_batch_size > 0
        self._state_outputs = {s.output_name: s for s in states}
        self._listed_outputs = frozenset(o.name for o in config.output)
        self._on_release = on_release
        self.open: dict[CorrelationId, Sequence] = {}
        # Set while no sequence is open: what a server draining for shutdown waits for.
        self._none_open = trio.Event()
        self._none_open.set()
        self._released: OrderedDict[CorrelationId, str] = OrderedDict()
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._counter = itertools.count()
        self._wakeup = trio.Event()
        self._wake_at = math.inf  # when the reaper looks next

    # -- admission ----------------------------------------------------------------

    def admit(self, request: InferenceRequest, now: float) -> tuple[Sequence, bool]:
        """The sequence a request belongs to, and whether the request began it (a
        new sequence for the scheduler to place); raises InvalidArgument.

        A START for a sequence already in progress restarts it, as in Triton: the
        request joins that sequence's queue (same slot, after its queued requests)
        and, executed with the START flag, gets the initial state.
        """
        correlation_id = request.sequence_id
        model = self.model_name
        if correlation_id == 0 or correlation_id == "":
            raise InvalidArgument(
                f"inference request to model '{model}' must specify a non-zero or "
                "non-empty correlation ID"
            )
        if request.batch_size > 1:
            raise InvalidArgument(
                f"inference request to model '{model}' must specify batch-size 1 due "
                "to requirements of sequence batcher"
            )
        sequence = self.open.get(correlation_id)
        if sequence is not None and sequence.idle_deadline is not None:
            if now >= sequence.idle_deadline:
                self.release(sequence, self._idle_reason())
                sequence = None
        name = describe(correlation_id)
        new = False
        if request.sequence_start and sequence is not None:
            log.warning(
                f"sequence {name} for model '{model}' has a conflict. The previous "
                "sequence did not end before this sequence start. Previous sequence "
                "will be terminated early."
            )
        elif request.sequence_start:
            self._released.pop(correlation_id, None)
            sequence = Sequence(correlation_id)
            new = True
            self.open[correlation_id] = sequence
            if self._none_open.is_set():
                self._none_open = trio.Event()
        elif sequence is None:
            raise self.not_started(correlation_id)
        if request.sequence_end:
            # A later START with this id begins a new sequence; this one finishes.
            sequence.open = False
            del self.open[correlation_id]
            self._check_none_open()
        sequence.pending += 1
        sequence.idle_deadline = None
        sequence.enqueued_at = now
        return sequence, new

    def not_started(self, correlation_id: CorrelationId) -> InvalidArgument:
        """A request without START for a sequence that is not open (core
        sequence_batch_scheduler.cc Enqueue: INVALID_ARG), with why it was
        released when it was."""
        name = describe(correlation_id)
        reason = self._released.get(correlation_id)
        return InvalidArgument(
            f"inference request for sequence {name} to model '{self.model_name}' must "
            "specify the START flag on the first request of the sequence"
            + (f"; sequence {name} {reason}" if reason else "")
        )

    def requeue(self, sequence: Sequence, now: float) -> bool:
        """An iterative sequence's request handed back by its model enters again;
        False (the sequence released) when no request entered for longer than
        ``max_sequence_idle_microseconds``.

        Triton's reaper measures a sequence's idle time from its latest enqueued
        request, executing or not (core sequence_batch_scheduler.cc ReaperThread,
        ``correlation_id_timestamps_``), so a model that holds a request longer
        than that loses the sequence under it and the request's re-enqueue fails.
        Here the idle clock otherwise starts once nothing is pending; a request
        coming back from its model is where the two meet.
        """
        if sequence.released:
            return False
        if now - sequence.enqueued_at >= self._idle:
            self.release(sequence, self._idle_reason())
            return False
        sequence.enqueued_at = now
        return True

    def _idle_reason(self) -> str:
        return (
            "was released after it was idle for more than "
            f"{self._idle_us} us (max_sequence_idle_microseconds)"
        )

    # -- progress and release ---------------------------------------------------------

    def request_done(self, sequence: Sequence, now: float) -> None:
        """One of the sequence's requests left (answered, or given up)."""
        sequence.pending -= 1
        if sequence.pending == 0 and sequence.open and not sequence.released:
            deadline = now + self._idle
            sequence.idle_deadline = deadline
            heapq.heappush(self._deadlines, (deadline, next(self._counter), sequence))
            if len(self._deadlines) > 2 * len(self.open) + 64:
                self._deadlines = [e for e in self._deadlines if e[0] == e[2].idle_deadline]
                heapq.heapify(self._deadlines)
            if deadline < self._wake_at:
                self._wakeup.set()

    def release(self, sequence: Sequence, reason: str) -> None:
        """Forget a sequence and its state; later requests for it are refused with
        ``reason``. The scheduler is told through ``on_release``."""
        if sequence.released:
            return
        sequence.released = True
        sequence.idle_deadline = None
        sequence.state = None
        if sequence.open:
            sequence.open = False
            if self.open.get(sequence.id) is sequence:
                del self.open[sequence.id]
                self._released[sequence.id] = reason
                while len(self._released) > RELEASED_MEMORY:
                    self._released.popitem(last=False)
                self._check_none_open()
        self._on_release(sequence)

    def finish(self, sequence: Sequence) -> None:
        """The sequence's END request was executed: free its state."""
        sequence.state = None

    def clear(self) -> None:
        for sequence in list(self.open.values()):
            sequence.open = False
            sequence.released = True
            sequence.state = None
        self.open.clear()
        self._deadlines.clear()
        self._none_open.set()

    # -- open sequences, for a draining server ----------------------------------------

    def is_open(self, correlation_id: CorrelationId, now: float) -> bool:
        """Whether a sequence with this correlation id is in progress: started, not
        ended, and not idle past ``max_sequence_idle_microseconds`` at ``now``."""
        sequence = self.open.get(correlation_id)
        if sequence is None:
            return False
        return sequence.idle_deadline is None or now < sequence.idle_deadline

    async def wait_none_open(self) -> None:
        """Return once no sequence is open (each ended, or was released when idle)."""
        await self._none_open.wait()

    def _check_none_open(self) -> None:
        if not self.open:
            self._none_open.set()

    # -- implicit state ---------------------------------------------------------------

    def state_inputs(self, sequence: Sequence, start: bool) -> dict[str, Tensor]:
        """The state tensors to feed with the sequence's next request."""
        current = None if start else sequence.state
        tensors = {}
        for spec in self.states:
            value = spec.initial if current is None else current[spec.input_name]
            if self._batched:
                value = value[np.newaxis]
            tensors[spec.input_name] = Tensor(spec.input_name, spec.datatype, value)
        return tensors

    def store_state(
        self,
        sequence: Sequence,
        request: InferenceRequest,
        response: InferenceResponse,
        client_outputs: list | None,
    ) -> None:
        """Keep the state outputs of a response for the sequence's next request and
        take out those the client did not ask for.

        A state the model did not produce keeps its value (the initial one after a
        START): Triton swaps a state in only when the backend updates it (core
        sequence_state.cc, the update callback of SequenceStates::OutputState), and
        a Python model that never writes its state output is served."""
        if not self.states:
            return
        produced = {tensor.name: tensor for tensor in response.outputs}
        previous = None if request.sequence_start else sequence.state
        state: dict[str, np.ndarray] = {}
        for spec in self.states:
            tensor = produced.get(spec.output_name)
            if tensor is None:
                state[spec.input_name] = (
                    spec.initial if previous is None else previous[spec.input_name]
                )
                continue
            value = tensor.data[0] if self._batched and tensor.data.ndim else tensor.data
            # A copy: the response's array is a view of the whole batch's output.
            state[spec.input_name] = np.array(value, copy=True)
        if not sequence.released:
            sequence.state = state
        wanted: Set[str]
        if client_outputs is None:
            wanted = self._listed_outputs
        else:
            wanted = {output.name for output in client_outputs}
        response.outputs = [
            t for t in response.outputs if t.name not in self._state_outputs or t.name in wanted
        ]

    # -- the idle reaper ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            now = trio.current_time()
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                deadline, _, sequence = heapq.heappop(heap)
                if deadline == sequence.idle_deadline and sequence.open:
                    self.release(sequence, self._idle_reason())
            self._wake_at = heap[0][0] if heap else math.inf
            self._wakeup = trio.Event()
            with trio.move_on_at(self._wake_at):
                await self._wakeup.wait()


def backlog_timeout_error(model_name: str, sequence: Sequence) -> Unavailable:
    return Unavailable(
        f"timeout of the corresponding sequence has been expired: sequence "
        f"{describe(sequence.id)} of model '{model_name}' waited in the backlog for a "
        "free sequence slot longer than its request timeout"
    )
