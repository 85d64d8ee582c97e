"""EnsembleScheduler: runs each request of an ensemble as a graph of step requests.

Each step is an ordinary request to a composing model, sent through the server's
one inference path (routing, validation, that model's scheduler and statistics),
so an ensemble adds no second way to run a model. The execution follows Triton
core's EnsembleScheduler (src/ensemble_scheduler/ensemble_scheduler.cc): steps no
requested output needs are pruned, a step runs once for each response number at
which all its tensors have a value, its runs overlap (one task each, in one
nursery per ensemble request), ``max_inflight_requests`` holds back producers,
and responses carry the request's sequence settings. Tensors move between steps
as the same numpy arrays, never copies (reshaped views where a tensor crosses
between a batching and a non-batching model).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import numpy as np
import structlog
import trio

from trionserve.backends.ensemble import DEFAULT_MAX_INFLIGHT, EnsemblePlan, Step
from trionserve.core.errors import (
    Cancelled,
    InternalError,
    InvalidArgument,
    TritonError,
    Unavailable,
    as_triton_error,
)
from trionserve.core.inference import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from trionserve.observability.logging import verbose
from trionserve.observability.statistics import FailureReason, ModelStatistics, to_ns
from trionserve.schedulers.ensemble_order import ResponseOrder, StepRequest
from trionserve.schedulers.scheduler import QUEUE_CAPACITY, BatchOutlet

# A step's sequence settings: (sequence_id, sequence_start, sequence_end).
SequenceFlags = tuple[int | str, bool, bool]

log = structlog.get_logger(__name__)

Deliver = Callable[[InferenceResponse | None, bool], Awaitable[None]]


class StepService(Protocol):
    """The inference path the steps go through (the DataPlane implements it):
    ``queued`` is set once the step's model holds the request."""

    async def infer_stream(
        self, request: InferenceRequest, deliver: Deliver, *, queued: trio.Event | None = None
    ) -> None: ...


class EnsembleScheduler:
    """The scheduler of an ensemble's ModelVersion, which has no instances.

    Owns one task per ensemble request in flight (children of its nursery), at most
    ``capacity`` of them: beyond that ``submit`` waits (backpressure, cancellable);
    ``submit`` returns once the request's first steps are queued at their models.
    Each request task runs the request's steps in a nursery of its own and answers
    the request exactly once. With ``max_inflight_requests`` it owns one
    semaphore per step, shared by every request. ``close`` refuses new requests; when the model is
    unloaded the nursery is cancelled, ``abort`` answers what is still running, and
    each step in flight is flagged cancelled so its model drops it.
    """

    def __init__(
        self,
        plan: EnsemblePlan,
        service: StepService,
        statistics: ModelStatistics | None = None,
        capacity: int = QUEUE_CAPACITY,
    ) -> None:
        self.plan = plan
        self._service = service
        self._statistics = statistics
        self._slots = trio.Semaphore(capacity)
        # max_inflight_requests: each step's runs in flight, over every request
        # of the ensemble (core ensemble_scheduler.cc StepInflightRequestLimiter).
        self._limiters: list[trio.Semaphore] | None = None
        if plan.max_inflight_requests > 0:
            self._limiters = [trio.Semaphore(plan.max_inflight_requests) for _ in plan.steps]
            log.info(
                f"Ensemble model '{plan.name}' configured with max_inflight_requests: "
                f"{plan.max_inflight_requests}"
            )
        self._running: set[InferenceRequest] = set()
        self._nursery: trio.Nursery | None = None
        self._closed = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def submit(self, request: InferenceRequest) -> None:
        """Take the request; returns once its first steps are queued at their
        models (or it failed), so requests submitted in turn start in turn."""
        request.arrival_time = trio.current_time()
        await self._slots.acquire()
        if self._closed or self._nursery is None:
            self._slots.release()
            raise trio.ClosedResourceError
        self._running.add(request)
        started = trio.Event()
        self._nursery.start_soon(self._serve, request, started)
        await started.wait()

    async def _serve(self, request: InferenceRequest, started: trio.Event) -> None:
        succeeded = False
        try:
            run = EnsembleRun(self.plan, self._service, request, self._limiters)
            succeeded = await run.run(started)
        finally:
            started.set()
            self._running.discard(request)
            self._slots.release()
            request.fail(
                Unavailable(f"ensemble '{self.plan.name}' was stopped before it finished")
            )  # does nothing when the request has its outcome
            self._record(request, succeeded)

    def _record(self, request: InferenceRequest, succeeded: bool) -> None:
        if self._statistics is None:
            return
        elapsed = to_ns(trio.current_time() - request.arrival_time)
        if succeeded:
            self._statistics.record_success(request.batch_size or 1, elapsed, 0, 0, 0, 0)
        elif request.cancelled:
            self._statistics.record_failure(elapsed, FailureReason.CANCELED)
        else:
            # Triton counts a failed ensemble request twice, both OTHER: when its
            # error is answered (core ensemble_scheduler.cc EnsembleContext's
            # RequestTracker::RespondIfError -> InferenceRequest::RespondIfError ->
            # ReportErrorStatistics(OTHER)) and when the request is released
            # (RequestTracker::DecrementCounter -> ReportStatisticsWithDuration,
            # success false -> UpdateFailure(OTHER)); qa/L0_model_queue
            # test_policy_reject counts on it ("Ensemble failure metrics will
            # reflect the failure counts of their composing models as well as the
            # parent model ... and will default to the OTHER reason").
            self._statistics.record_failure(elapsed, FailureReason.OTHER)
            self._statistics.record_failure(elapsed, FailureReason.OTHER)

    def outlet(self) -> BatchOutlet:
        raise InternalError(f"ensemble '{self.plan.name}' has no instances to feed")

    def close(self) -> None:
        self._closed = True

    def abort(self, error: TritonError) -> None:
        self._closed = True
        for request in list(self._running):
            request.fail(error)


class _Entry:
    """One value of an ensemble tensor: its data (None: the producing step left
    the output out), the batch size of the request that made it (0 when made
    without a batch dimension), the sequence settings it carries on (None for the
    ensemble's own inputs), and how many readers have yet to take it."""

    __slots__ = ("tensor", "batch_size", "sequence", "readers")

    def __init__(
        self, tensor: Tensor | None, batch_size: int, sequence: SequenceFlags | None, readers: int
    ) -> None:
        self.tensor = tensor
        self.batch_size = batch_size
        self.sequence = sequence
        self.readers = readers


class EnsembleRun:
    """One ensemble request on its way through the steps, as Triton's
    EnsembleContext runs it (core src/ensemble_scheduler/ensemble_scheduler.cc).

    Steps the request does not need are pruned first: a step runs only if one of
    its outputs is a requested ensemble output or an input of a step that runs.
    Every value a step writes gets the next iteration number of its tensor (a
    decoupled step writes one per response); a step runs once for each iteration
    number at which all the tensors it reads have a value, each run a task of its
    own, so the runs of a step overlap and its model may batch them. A value is
    dropped once every reader took it. A response goes out for each iteration at
    which every requested output has a value. Before a step run is queued it takes
    a slot of that step's ``max_inflight_requests`` (shared by every request of
    the ensemble; without it, ``DEFAULT_MAX_INFLIGHT`` per request), holding back
    the response of the step that produced its inputs: backpressure. The first
    error ends the run: the other steps are cancelled and the request fails with
    that error, naming the step.
    """

    def __init__(
        self,
        plan: EnsemblePlan,
        service: StepService,
        request: InferenceRequest,
        limiters: list[trio.Semaphore] | None = None,
    ):
        self.plan = plan
        self.service = service
        self.request = request
        wanted = request.requested_outputs
        self.wanted = plan.outputs if wanted is None else tuple(o.name for o in wanted)
        self.needed = _needed_steps(plan, self.wanted)
        # tensor -> the steps that run and read it
        self.readers: dict[str, list[int]] = {}
        for index in self.needed:
            for name in plan.steps[index].input_map.values():
                self.readers.setdefault(name, []).append(index)
        self.values: dict[str, dict[int, _Entry]] = {}
        self._iterations: dict[str, int] = {}
        if limiters is None:
            limiters = [trio.Semaphore(DEFAULT_MAX_INFLIGHT) for _ in plan.steps]
        self._limiters = limiters
        self.error: TritonError | None = None
        self.response: InferenceResponse | None = None
        self._nursery: trio.Nursery | None = None
        self._inflight = 0  # step runs started or about to start, not yet final
        # Each step's responses in the order its model sent them, by step index: each
        # is passed on in its turn (see ensemble_order).
        self._orders: dict[int, ResponseOrder] = {}

    async def run(self, started: trio.Event | None = None) -> bool:
        """Run the steps and answer the request; True when it succeeded.
        ``started`` is set once the first steps are queued at their models."""
        request = self.request
        batch = request.batch_size if self.plan.batching else 0
        updated = []
        reshape = self.plan.input_reshape
        for name in self.plan.inputs:
            tensor = request.inputs.get(name)  # None: an optional input left out
            if tensor is not None and name in reshape:
                tensor = Tensor(
                    name, tensor.datatype, _to_dims(tensor.data, reshape[name], batch != 0)
                )
            updated.append(self._add(name, tensor, batch, None))
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._advance(updated)
            if started is not None:
                started.set()
        if self.error is not None:
            request.fail(self.error)
            return False
        if self.plan.streaming:
            request.send(None, final=True)
            return True
        if self.response is None:
            # Triton's words (EnsembleContext::FinishEnsemble).
            request.fail(
                InvalidArgument(
                    f"in ensemble '{self.plan.name}', unexpected deadlock, at least one "
                    "output is not set while no more ensemble steps can be made"
                )
            )
            return False
        return request.respond(self.response)

    def _add(
        self, name: str, tensor: Tensor | None, batch: int, sequence: SequenceFlags | None
    ) -> tuple[str, int]:
        """A new value of tensor ``name``: its (name, iteration)."""
        iteration = self._iterations.get(name, 0)
        self._iterations[name] = iteration + 1
        readers = len(self.readers.get(name, ())) + (name in self.wanted)
        if readers:
            self.values.setdefault(name, {})[iteration] = _Entry(tensor, batch, sequence, readers)
        return name, iteration

    def _take(self, name: str, iteration: int) -> _Entry:
        values = self.values[name]
        entry = values[iteration]
        entry.readers -= 1
        if entry.readers == 0:
            del values[iteration]
        return entry

    async def _advance(self, updated: list[tuple[str, int]]) -> None:
        """After new values: queue every step run whose inputs are all there, and
        answer what is complete (Triton's GetNextSteps and
        CheckAndSetEnsembleOutput). A streaming ensemble's answer is its last when
        no step run is in flight or about to start (FinishEnsemble's final flag)."""
        if self.error is not None or self.request.done:
            return
        ready: list[tuple[int, int]] = []
        for name, iteration in updated:
            for index in self.readers.get(name, ()):
                step = self.plan.steps[index]
                if (index, iteration) not in ready and self._complete(
                    step.input_map.values(), iteration
                ):
                    ready.append((index, iteration))
        self._inflight += len(ready)
        answered = set()
        for name, iteration in updated:
            if (
                name in self.wanted
                and iteration not in answered
                and self._complete(self.wanted, iteration)
            ):
                answered.add(iteration)
                self._answer(iteration)
        for index, iteration in ready:
            await self._start(self.plan.steps[index], iteration)

    def _complete(self, names: Iterable[str], iteration: int) -> bool:
        return all(iteration in self.values.get(name, ()) for name in names)

    async def _start(self, step: Step, iteration: int) -> None:
        """Start one step run, counted in flight by the caller."""
        if self.request.cancelled:
            self._inflight -= 1
            self._stop(
                Cancelled(
                    f"ensemble '{self.plan.name}' request '{self.request.id}' was "
                    f"cancelled before {step} ran"
                )
            )
            return
        step_request = self._step_request(step, iteration)
        limiter = self._limiters[step.index]
        try:
            await limiter.acquire()  # backpressure: holds back the producer's response
        except BaseException:
            self._inflight -= 1
            raise
        if self.error is not None or self._nursery is None:
            self._inflight -= 1
            limiter.release()
            return
        # Returns once the step's model holds the request: step requests reach
        # their models in the order they were made, as Triton enqueues them from
        # one thread (a stream's requests to a FIFO model are answered in order).
        queued = trio.Event()
        # The slot is given back once the model sent its final response, before
        # it is passed on (its turn may come after a response that needs the slot).
        step_request.on_end = limiter.release
        self._nursery.start_soon(self._run_step, step, step_request, queued)
        await queued.wait()

    async def _run_step(self, step: Step, request: StepRequest, queued: trio.Event) -> None:
        ended = False
        order = request.order

        async def deliver(response: InferenceResponse | None, final: bool) -> None:
            nonlocal ended
            await order.turn(request)
            try:
                if final and not ended:
                    ended = True
                    self._inflight -= 1
                await self._deliver(step, request, response)
            finally:
                order.passed_on(request)

        try:
            await self.service.infer_stream(request, deliver, queued=queued)
        except TritonError as exc:
            self._stop(_step_error(self.plan, step, exc))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # another step failed; its error is recorded
        except Exception as exc:
            log.exception("ensemble step failed", ensemble=self.plan.name, step=step.index)
            self._stop(_step_error(self.plan, step, as_triton_error(exc)))
        finally:
            queued.set()  # a request its model never took
            if not ended:
                self._inflight -= 1
            order.forget(request)
            request.ended()  # the slot, if the request never had its final outcome

    def _order_of(self, step: Step) -> ResponseOrder:
        order = self._orders.get(step.index)
        if order is None:
            order = self._orders[step.index] = ResponseOrder()
        return order

    def _step_request(self, step: Step, iteration: int) -> StepRequest:
        """The request of one step run: its inputs at ``iteration``, reshaped where
        a tensor crosses between a batching and a non-batching model, and the
        sequence settings its inputs carry (the ensemble request's by default)."""
        request = self.request
        sequence = (request.sequence_id, request.sequence_start, request.sequence_end)
        inputs: dict[str, Tensor] = {}
        carried = None
        for model_input, name in step.input_map.items():
            entry = self._take(name, iteration)
            if carried is None and entry.sequence is not None:
                carried = entry.sequence
            if entry.tensor is None:
                continue  # an optional input nobody gave
            data = _reshape(
                entry.tensor.data, step.input_dims[model_input], step.batching, entry.batch_size
            )
            inputs[model_input] = Tensor(model_input, entry.tensor.datatype, data)
        sequence_id, start, end = carried or sequence
        step_request = StepRequest(
            step.model_name,
            step.model_version,
            order=self._order_of(step),
            model_namespace=step.model_namespace,
            id=request.id,
            inputs=inputs,
            requested_outputs=[RequestedOutput(name) for name in step.output_map],
            parameters=dict(request.parameters),
            priority=request.priority,
            timeout_us=request.timeout_us,
            sequence_id=sequence_id,
            sequence_start=start,
            sequence_end=end,
        )
        # A traced ensemble request's steps are traced as its children.
        step_request.trace_context = request.trace
        return step_request

    async def _deliver(
        self, step: Step, step_request: InferenceRequest, response: InferenceResponse | None
    ) -> None:
        if response is None or self.error is not None:
            return
        sequence = _sequence_of(response, step_request)
        batch = 0
        if step.batching:
            first = next(iter(step_request.inputs.values()), None)
            batch = first.data.shape[0] if first is not None and first.data.ndim else 1
        returned = {tensor.name: tensor for tensor in response.outputs}
        updated = []
        for output, name in step.output_map.items():
            tensor = returned.get(output)
            if tensor is not None:
                tensor = Tensor(name, tensor.datatype, tensor.data)
            # A missing output is a value too: a later step may take it as an
            # optional input (Triton's placeholder tensor).
            updated.append(self._add(name, tensor, batch, sequence))
        await self._advance(updated)

    def _answer(self, iteration: int) -> None:
        outputs = []
        parameters: dict = {}
        for name in self.plan.outputs:
            if name not in self.wanted:
                continue
            entry = self._take(name, iteration)
            if entry.tensor is None:
                if verbose():
                    log.info(f"Composing models did not output tensor {name}")
                continue
            data = _reshape(
                entry.tensor.data, self.plan.output_dims[name], self.plan.batching, entry.batch_size
            )
            client_dims = self.plan.output_client_dims.get(name)
            if client_dims is not None:
                data = _to_dims(data, client_dims, self.plan.batching and data.ndim > 0)
            outputs.append(Tensor(name, entry.tensor.datatype, data))
            if entry.sequence is not None and not parameters:
                sequence_id, start, end = entry.sequence
                parameters = {
                    "sequence_id": sequence_id,
                    "sequence_start": start,
                    "sequence_end": end,
                }
        response = InferenceResponse(
            model_name=self.plan.name,
            model_version=str(self.plan.version),
            id=self.request.id,
            outputs=outputs,
            parameters=parameters,
        )
        if self.plan.streaming:
            self.request.send(response, final=self._inflight == 0)
        elif self.response is None:
            self.response = response

    def _stop(self, error: TritonError) -> None:
        if self.error is None:
            self.error = error
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()


def _needed_steps(plan: EnsemblePlan, wanted: Iterable[str]) -> frozenset[int]:
    """The steps a request for ``wanted`` outputs runs: those writing a wanted
    output or an input of a step that runs (Triton prunes the rest,
    EnsembleContext::InitContext)."""
    needed: set[int] = set()
    tensors = set(wanted)
    changed = True
    while changed:
        changed = False
        for step in plan.steps:
            if step.index not in needed and tensors.intersection(step.output_map.values()):
                needed.add(step.index)
                tensors.update(step.input_map.values())
                changed = True
    return frozenset(needed)


def _sequence_of(response: InferenceResponse, request: InferenceRequest) -> SequenceFlags:
    """The sequence settings a step's outputs carry on: the step request's, or
    those its model's response sets (parameters sequence_id, sequence_start,
    sequence_end; EnsembleContext::ConsumeResponse)."""
    parameters = response.parameters
    if not parameters or not any(
        key in parameters for key in ("sequence_id", "sequence_start", "sequence_end")
    ):
        return (request.sequence_id, request.sequence_start, request.sequence_end)
    sequence_id = parameters.get("sequence_id", request.sequence_id)
    return (
        sequence_id,
        bool(parameters.get("sequence_start", False)),
        bool(parameters.get("sequence_end", False)),
    )


def _reshape(
    data: np.ndarray, dims: tuple[int, ...], batching: bool, batch_size: int
) -> np.ndarray:
    """A tensor made with (or without) a batch dimension, as a model or output
    that has none (or one) takes it (Triton's EnsembleContext::ReshapeTensorDims):
    a batch of 1 dimension is added where the tensor matches the dims as they
    are, or dropped from a batch of 1 where it does not."""
    if batching == (batch_size != 0):
        return data
    shape = tuple(data.shape)
    if batching:
        if _matches(dims, shape):
            return data.reshape((1, *shape))
    elif batch_size == 1 and not _matches(dims, shape):
        return data.reshape(shape[1:])
    return data


def _to_dims(data: np.ndarray, dims: tuple[int, ...], batched: bool) -> np.ndarray:
    """A tensor in the other of its two shapes (``dims`` and ``reshape``), its
    batch dimension kept; a variable dimension takes what the elements leave
    (one at most, as numpy infers it). A tensor that does not fit is left as it
    is, for the step it reaches to refuse with its shape."""
    target = ((data.shape[0],) if batched and data.ndim else ()) + tuple(dims)
    if sum(1 for d in target if d == -1) > 1:
        return data
    try:
        return data.reshape(target)
    except ValueError:
        return data


def _matches(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return len(dims) == len(shape) and all(d == -1 or d == s for d, s in zip(dims, shape))


def _step_error(plan: EnsemblePlan, step: Step, error: TritonError) -> TritonError:
    """The step's error with the ensemble and step named, keeping its kind and status."""
    return type(error)(f"in ensemble '{plan.name}', {step}: {error.message}", error.status)
