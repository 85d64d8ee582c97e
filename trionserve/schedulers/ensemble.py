"""EnsembleScheduler: runs each request of an ensemble as a graph of step requests.

Each step is an ordinary request to a composing model, sent through the server's
one inference path (routing, validation, that model's scheduler and statistics),
so an ensemble adds no second way to run a model. A step starts as soon as every
tensor it reads exists; steps whose inputs are ready run at once, in one nursery
per ensemble request. Tensors move between steps as the same numpy arrays: a
step's inputs are the arrays its producers returned, never copies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

import structlog
import trio

from trionserve.backends.ensemble import ENSEMBLE_INPUTS, EnsemblePlan, Step
from trionserve.core.errors import (
    Cancelled,
    InternalError,
    TritonError,
    Unavailable,
    as_triton_error,
)
from trionserve.core.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from trionserve.observability.statistics import FailureReason, ModelStatistics, to_ns
from trionserve.schedulers.scheduler import QUEUE_CAPACITY

log = structlog.get_logger(__name__)

Deliver = Callable[[InferenceResponse | None, bool], Awaitable[None]]


class StepService(Protocol):
    """The inference path the steps go through (the DataPlane implements it)."""

    async def infer_stream(self, request: InferenceRequest, deliver: Deliver) -> None: ...


class EnsembleScheduler:
    """The scheduler of an ensemble's ModelVersion, which has no instances.

    Owns one task per ensemble request in flight (children of its nursery), at most
    ``capacity`` of them: beyond that ``submit`` waits (backpressure, cancellable).
    Each request task runs the request's steps in a nursery of its own and answers
    the request exactly once. ``close`` refuses new requests; when the model is
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
        self._running: set[InferenceRequest] = set()
        self._nursery: trio.Nursery | None = None
        self._closed = False

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def submit(self, request: InferenceRequest) -> None:
        request.arrival_time = trio.current_time()
        await self._slots.acquire()
        if self._closed or self._nursery is None:
            self._slots.release()
            raise trio.ClosedResourceError
        self._running.add(request)
        self._nursery.start_soon(self._serve, request)

    async def _serve(self, request: InferenceRequest) -> None:
        succeeded = False
        try:
            succeeded = await EnsembleRun(self.plan, self._service, request).run()
        finally:
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
        else:
            reason = FailureReason.CANCELED if request.cancelled else FailureReason.BACKEND
            self._statistics.record_failure(elapsed, reason)

    def outlet(self):
        raise InternalError(f"ensemble '{self.plan.name}' has no instances to feed")

    def close(self) -> None:
        self._closed = True

    def abort(self, error: TritonError) -> None:
        self._closed = True
        for request in list(self._running):
            request.fail(error)


class EnsembleRun:
    """One ensemble request on its way through the steps.

    ``tensors`` holds every ensemble tensor produced so far. Each step has a worker
    task and a bounded queue of input sets; a producer's response puts an input
    set on the queue of each step that reads its tensors once all of that step's
    tensors exist, so a step runs once per complete set of inputs, in the order
    they were completed (a decoupled step's every response runs its downstream
    steps again, with the other tensors at their latest values). A step's queue
    closes once every producer it reads from has finished; the request is done
    when every worker has. The first error ends the run: the other steps are
    cancelled and the request fails with that error, naming the step.
    """

    def __init__(self, plan: EnsemblePlan, service: StepService, request: InferenceRequest):
        self.plan = plan
        self.service = service
        self.request = request
        self.tensors: dict[str, Tensor] = dict(request.inputs)
        self.absent = plan.optional_inputs - set(request.inputs)
        wanted = request.requested_outputs
        self.wanted = plan.outputs if wanted is None else tuple(o.name for o in wanted)
        self.error: TritonError | None = None
        self._remaining = [len(p) for p in plan.producers]
        self._queues: list[trio.MemorySendChannel] = []
        self._scope = trio.CancelScope()

    async def run(self) -> bool:
        """Run the steps and answer the request; True when it succeeded."""
        request = self.request
        receivers = []
        for _ in self.plan.steps:
            send, receive = trio.open_memory_channel[dict[str, Tensor]](self.plan.max_inflight)
            self._queues.append(send)
            receivers.append(receive)
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            for step, receive in zip(self.plan.steps, receivers):
                nursery.start_soon(self._worker, step, receive)
            try:
                await self._produced(ENSEMBLE_INPUTS)
            except trio.BrokenResourceError:
                pass  # a step failed at once; its error is recorded
            self._finished(ENSEMBLE_INPUTS)
        if self.error is not None:
            request.fail(self.error)
            return False
        if self.plan.streaming:
            request.send(None, final=True)
            return True
        missing = [name for name in self.wanted if name not in self.tensors]
        if missing:
            request.fail(
                InternalError(f"ensemble '{self.plan.name}' did not produce output(s) {missing}")
            )
            return False
        return request.respond(self._response())

    async def _worker(self, step: Step, receive: trio.MemoryReceiveChannel) -> None:
        async with receive:
            async for inputs in receive:
                if self.request.cancelled or self.request.done:
                    self._stop(
                        Cancelled(
                            f"ensemble '{self.plan.name}' request '{self.request.id}' was "
                            f"cancelled before {step} ran"
                        )
                    )
                    return
                try:
                    await self.service.infer_stream(
                        self._step_request(step, inputs), partial(self._deliver, step)
                    )
                except TritonError as exc:
                    self._stop(_step_error(self.plan, step, exc))
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # a downstream step failed; its error is recorded
                except Exception as exc:
                    log.exception("ensemble step failed", ensemble=self.plan.name, step=step.index)
                    self._stop(_step_error(self.plan, step, as_triton_error(exc)))
                    return
        self._finished(step.index)

    def _step_request(self, step: Step, inputs: dict[str, Tensor]) -> InferenceRequest:
        request = self.request
        return InferenceRequest(
            step.model_name,
            step.model_version,
            model_namespace=step.model_namespace,
            id=request.id,
            inputs=inputs,
            requested_outputs=[RequestedOutput(name) for name in step.output_map],
            parameters=dict(request.parameters),
            priority=request.priority,
            timeout_us=request.timeout_us,
            sequence_id=request.sequence_id,
            sequence_start=request.sequence_start,
            sequence_end=request.sequence_end,
        )

    async def _deliver(self, step: Step, response: InferenceResponse | None, final: bool) -> None:
        if response is None:
            return
        returned = {tensor.name: tensor for tensor in response.outputs}
        for output, name in step.output_map.items():
            tensor = returned.get(output)
            if tensor is None:
                raise InternalError(f"{step} returned no output '{output}'")
            self.tensors[name] = Tensor(name, tensor.datatype, tensor.data)
        await self._produced(step.index)
        if self.plan.streaming and any(n in self.wanted for n in step.output_map.values()):
            if all(n in self.tensors for n in self.wanted):
                self.request.send(self._response(), final=False)

    async def _produced(self, producer: int) -> None:
        """Queue an input set for each step reading ``producer``'s tensors that can run."""
        for index in self.plan.consumers[producer]:
            inputs = self._inputs(self.plan.steps[index])
            if inputs is not None:
                await self._queues[index].send(inputs)

    def _inputs(self, step: Step) -> dict[str, Tensor] | None:
        inputs = {}
        for model_input, name in step.input_map.items():
            tensor = self.tensors.get(name)
            if tensor is None:
                if name in self.absent:
                    continue  # an optional ensemble input the client left out
                return None
            inputs[model_input] = Tensor(model_input, tensor.datatype, tensor.data)
        return inputs

    def _finished(self, producer: int) -> None:
        for index in self.plan.consumers[producer]:
            self._remaining[index] -= 1
            if self._remaining[index] == 0:
                self._queues[index].close()

    def _response(self) -> InferenceResponse:
        return InferenceResponse(
            model_name=self.plan.name,
            model_version=str(self.plan.version),
            id=self.request.id,
            outputs=[self.tensors[name] for name in self.wanted],
        )

    def _stop(self, error: TritonError) -> None:
        if self.error is None:
            self.error = error
        self._scope.cancel()


def _step_error(plan: EnsemblePlan, step: Step, error: TritonError) -> TritonError:
    """The step's error with the ensemble and step named, keeping its kind and status."""
    return type(error)(f"in ensemble '{plan.name}', {step}: {error.message}", error.status)
