"""An ensemble hands its steps' responses on in the order their models sent them.

The steps' models here answer through the request itself (``send`` / ``respond``)
and each step run consumes its responses from ``request.stream()``, as the data
plane's ``infer_stream`` does, so the runs woken by answers of one turn of the
event loop are the ones Trio may run in any order.
"""

from __future__ import annotations

import numpy as np
import trio
import trio.testing

from trionserve.backends.ensemble import plan_ensemble
from trionserve.core.inference import InferenceRequest
from trionserve.schedulers.ensemble import EnsembleScheduler

from .test_ensemble_units import StandIn, ensemble_config, request_for, respond, run_ensemble


class Answered(StandIn):
    """Models that answer on the request; each run's responses are read from its
    stream and handed to ``deliver``."""

    async def infer_stream(self, request: InferenceRequest, deliver, queued=None) -> None:
        self.requests.append(request)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.behaviours[request.model_name], request)
            if queued is not None:
                queued.set()
            async for response, final in request.stream():
                await deliver(response, final)


async def burst(request: InferenceRequest) -> None:
    """A decoupled model: three values in one turn, then the final flag."""
    for index in range(3):
        request.send(respond("burst", request.inputs["IN"].data + index), final=False)
    request.send(None, final=True)


def squares_in_one_turn(waiting: list[InferenceRequest], gate: trio.Event):
    """A model that answers the three requests it holds in one turn, in order."""

    async def square(request: InferenceRequest) -> None:
        waiting.append(request)
        if len(waiting) == 3:
            gate.set()
        await gate.wait()
        if request is waiting[0]:
            for each in waiting:
                each.respond(respond("square", each.inputs["IN"].data ** 2))

    return square


def burst_into_one_slot(name: str, behaviour) -> tuple[EnsembleScheduler, InferenceRequest]:
    """An ensemble of ``burst`` feeding model ``name`` (played by ``behaviour``)
    with max_inflight_requests: 1, and a request for it."""
    service = Answered({"burst": burst, name: behaviour}, decoupled=("burst",))
    config = ensemble_config([("burst", "INPUT", "b"), (name, "b", "OUTPUT")])
    config.ensemble_scheduling.max_inflight_requests = 1
    plan = plan_ensemble(config, 1, service.model)
    return EnsembleScheduler(plan, service), request_for(np.ones(1, np.float32))


async def test_answers_of_one_turn_are_passed_on_in_the_order_they_were_sent(autojump_clock):
    # Trio may run a batch of woken tasks reversed; twenty rounds in a row in order
    # happen by chance once in a million without the ordering.
    for _ in range(20):
        waiting: list[InferenceRequest] = []
        service = Answered(
            {"burst": burst, "square": squares_in_one_turn(waiting, trio.Event())},
            decoupled=("burst",),
        )
        config = ensemble_config([("burst", "INPUT", "b"), ("square", "b", "OUTPUT")])
        pairs = await run_ensemble(config, service, request_for(np.ones(1, np.float32)))
        values = [r.outputs[0].data.tolist() for r, _ in pairs if r is not None]
        assert values == [[1.0], [4.0], [9.0]]
        assert pairs[-1][1] and not any(final for _, final in pairs[:-1])


async def test_a_response_waiting_for_its_turn_does_not_hold_a_slot_back(autojump_clock):
    """max_inflight_requests: 1 on the second step. Its first run's answer is
    sent while the burst's second value waits for the step's slot, and is passed
    on after it: the slot is given back when the model answers, or neither would
    move (Triton's limiter counts a step's request until its final response,
    core ensemble_scheduler.cc StepInflightRequestLimiter)."""
    held: list[InferenceRequest] = []
    release = trio.Event()

    async def slow(request: InferenceRequest) -> None:
        held.append(request)
        if len(held) == 1:
            await release.wait()
        request.respond(respond("slow", request.inputs["IN"].data * 10))

    scheduler, request = burst_into_one_slot("slow", slow)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            await scheduler.submit(request)
            await trio.testing.wait_all_tasks_blocked()
            assert len(held) == 1  # the second value waits for the slot
            release.set()
            values = [r.outputs[0].data.tolist() async for r, _ in request.stream() if r]
            nursery.cancel_scope.cancel()
    assert values == [[10.0], [20.0], [30.0]]


async def test_a_steps_answer_does_not_wait_for_an_earlier_steps_values(autojump_clock):
    """Each step's responses keep their order, not all steps' together: with
    max_inflight_requests: 1 on the second step, its first answer goes out while
    the burst's later values wait for the step's slot, held by its second run
    (Triton passes a response on from the thread of the model that sent it, core
    ensemble_scheduler.cc ResponseComplete; qa/L0_simple_ensemble's
    test_request_cancellation_under_backpressure waits 5 s for the first answer)."""
    first_run, other_runs = trio.Event(), trio.Event()
    runs: list[InferenceRequest] = []

    async def held(request: InferenceRequest) -> None:
        runs.append(request)
        await (first_run if len(runs) == 1 else other_runs).wait()
        request.respond(respond("held", request.inputs["IN"].data * 10))

    scheduler, request = burst_into_one_slot("held", held)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await scheduler.submit(request)
        answers = request.stream().__aiter__()
        await trio.testing.wait_all_tasks_blocked()
        first_run.set()
        with trio.fail_after(5):
            first, _ = await answers.__anext__()
        assert first is not None and first.outputs[0].data.tolist() == [10.0]
        await trio.testing.wait_all_tasks_blocked()
        assert len(runs) == 2  # the second run holds the slot
        values = [[10.0]]
        other_runs.set()
        with trio.fail_after(5):
            while len(values) < 3:
                response, _ = await answers.__anext__()
                if response is not None:
                    values.append(response.outputs[0].data.tolist())
        nursery.cancel_scope.cancel()
    assert values == [[10.0], [20.0], [30.0]]
