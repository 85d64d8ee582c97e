"""The ensemble's plan and scheduler over a stand-in inference path.

Composing models are played by async functions, so the tests see exactly what each
step was asked and control when it answers: order and concurrency come from
events on Trio's virtual clock (a step that never gets its event deadlocks the run,
and the autojump clock turns that into a fast ``fail_after`` failure).
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from google.protobuf import text_format

from trionserve._generated import model_config_pb2 as mc
from trionserve.backends.ensemble import plan_ensemble
from trionserve.core.errors import InvalidArgument, NotFound, Status, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from trionserve.core.validation import ModelSignature
from trionserve.schedulers.ensemble import EnsembleScheduler


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def vector_model(name: str, in_type="TYPE_FP32", in_dims="-1", extra="") -> mc.ModelConfig:
    """A composing model: one vector IN, one FP32 vector OUT."""
    return parse(
        f'name: "{name}" backend: "test" max_batch_size: 0 '
        f'input [ {{ name: "IN" data_type: {in_type} dims: [ {in_dims} ] }} ] '
        f'output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }} ] {extra}'
    )


def ensemble_config(steps: list[tuple[str, str, str]], outputs=("OUTPUT",)) -> mc.ModelConfig:
    """An ensemble with FP32 vector INPUT; ``steps`` are (model, reads, writes)."""
    step_text = ",".join(
        f'{{ model_name: "{model}" model_version: -1 '
        f'input_map {{ key: "IN" value: "{reads}" }} '
        f'output_map {{ key: "OUT" value: "{writes}" }} }}'
        for model, reads, writes in steps
    )
    output_text = ",".join(
        f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ -1 ] }}' for name in outputs
    )
    return parse(
        f'name: "ens" platform: "ensemble" max_batch_size: 0 '
        f'input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] }} ] '
        f"output [ {output_text} ] "
        f"ensemble_scheduling {{ step [ {step_text} ] }}"
    )


class Model:
    """What the plan reads of a composing model: its config and signature."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.config = config
        self.signature = ModelSignature.from_config(config)


class StandIn:
    """The inference path: routes to models played by ``behaviours[name]``."""

    def __init__(self, behaviours: dict, decoupled: tuple[str, ...] = ()) -> None:
        self.behaviours = behaviours
        self.models = {
            name: Model(
                vector_model(
                    name,
                    extra="model_transaction_policy { decoupled: true }"
                    if name in decoupled
                    else "",
                )
            )
            for name in behaviours
        }
        self.requests: list[InferenceRequest] = []

    def model(self, name: str, version: int | None, namespace: str | None = None) -> Model:
        if name not in self.models:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        return self.models[name]

    async def infer_stream(self, request: InferenceRequest, deliver, queued=None) -> None:
        self.requests.append(request)
        if queued is not None:
            queued.set()
        await self.behaviours[request.model_name](request, deliver)


def respond(name: str, value: np.ndarray) -> InferenceResponse:
    return InferenceResponse(name, "1", outputs=[Tensor("OUT", "FP32", value)])


def add(amount: float):
    async def behaviour(request, deliver):
        await deliver(respond(request.model_name, request.inputs["IN"].data + amount), True)

    return behaviour


async def run_ensemble(config, service, request: InferenceRequest) -> list[tuple]:
    """Serve ``request`` through an EnsembleScheduler: its (response, final) pairs,
    or the request's error raised."""
    plan = plan_ensemble(config, 1, service.model)
    scheduler = EnsembleScheduler(plan, service)
    received: list[tuple] = []
    error: TritonError | None = None
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            await scheduler.submit(request)
            try:
                async for response, final in request.stream():
                    received.append((response, final))
            except TritonError as exc:
                error = exc
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return received


async def only_response(config, service, request: InferenceRequest) -> InferenceResponse:
    [(response, final)] = await run_ensemble(config, service, request)
    assert final
    return response


def request_for(value: np.ndarray, **fields) -> InferenceRequest:
    return InferenceRequest("ens", inputs={"INPUT": Tensor("INPUT", "FP32", value)}, **fields)


async def test_tensors_pass_between_steps_as_the_same_arrays(autojump_clock):
    produced: dict[str, np.ndarray] = {}

    def keep(amount: float):
        async def behaviour(request, deliver):
            produced[request.model_name] = out = request.inputs["IN"].data + amount
            await deliver(respond(request.model_name, out), True)

        return behaviour

    service = StandIn({"a": keep(1), "b": keep(10)})
    config = ensemble_config([("a", "INPUT", "t"), ("b", "t", "OUTPUT")])
    client_array = np.array([1.0, 2.0], np.float32)
    request = request_for(client_array)
    response = await only_response(config, service, request)
    step_a, step_b = service.requests
    assert step_a.inputs["IN"].data is client_array
    assert step_b.inputs["IN"].data is produced["a"]
    assert response.outputs[0].name == "OUTPUT"
    assert response.outputs[0].data is produced["b"]
    np.testing.assert_array_equal(response.outputs[0].data, [12.0, 13.0])


async def test_parallel_branches_run_at_once_and_join(autojump_clock):
    started = {"left": trio.Event(), "right": trio.Event()}
    joined_after: list[str] = []

    def branch(name: str, other: str, amount: float):
        async def behaviour(request, deliver):
            started[name].set()
            # Answers only once the other branch has started: run one after the
            # other, the two would wait for each other until fail_after.
            await started[other].wait()
            joined_after.append(name)
            await deliver(respond(name, request.inputs["IN"].data + amount), True)

        return behaviour

    async def join(request, deliver):
        await deliver(respond("join", request.inputs["IN"].data * 2), True)

    service = StandIn(
        {"left": branch("left", "right", 1), "right": branch("right", "left", 2), "join": join}
    )
    config = ensemble_config(
        [("left", "INPUT", "L"), ("right", "INPUT", "R"), ("join", "L", "OUTPUT")],
        outputs=("OUTPUT", "R"),
    )
    request = request_for(np.array([1.0], np.float32))
    response = await only_response(config, service, request)
    assert sorted(joined_after) == ["left", "right"]
    assert [r.model_name for r in service.requests][-1] == "join"
    outputs = {t.name: t.data.tolist() for t in response.outputs}
    assert outputs == {"OUTPUT": [4.0], "R": [3.0]}


async def test_a_step_error_ends_the_request_and_cancels_the_other_steps(autojump_clock):
    cancelled = trio.Event()

    async def fails(request, deliver):
        raise InvalidArgument("unexpected shape for input 'IN' for model 'bad'")

    async def slow(request, deliver):
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    service = StandIn({"bad": fails, "slow": slow, "after": add(1)})
    config = ensemble_config(
        [("slow", "INPUT", "S"), ("bad", "INPUT", "B"), ("after", "B", "OUTPUT")],
        outputs=("OUTPUT", "S"),
    )
    request = request_for(np.array([1.0], np.float32))
    with pytest.raises(InvalidArgument) as caught:
        await run_ensemble(config, service, request)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert "unexpected shape for input 'IN' for model 'bad'" in caught.value.message
    assert "ensemble 'ens', step 1 (model 'bad')" in caught.value.message
    assert cancelled.is_set()
    assert "after" not in [r.model_name for r in service.requests]


async def test_each_response_of_a_decoupled_step_runs_the_next_step(autojump_clock):
    async def repeat(request, deliver):
        for index in range(3):
            await deliver(respond("repeat", request.inputs["IN"].data + index), False)
        await deliver(None, True)

    async def square(request, deliver):
        await deliver(respond("square", request.inputs["IN"].data ** 2), True)

    service = StandIn({"repeat": repeat, "square": square}, decoupled=("repeat",))
    config = ensemble_config([("repeat", "INPUT", "r"), ("square", "r", "OUTPUT")])
    assert plan_ensemble(config, 1, service.model).streaming
    pairs = await run_ensemble(config, service, request_for(np.ones(1, np.float32)))
    received = [
        (None if response is None else response.outputs[0].data.tolist(), final)
        for response, final in pairs
    ]
    values = [data for data, _ in received if data is not None]
    assert values == [[1.0], [4.0], [9.0]]
    # Only the last is final: the last response if nothing was in flight after it
    # (Triton's EnsembleContext::FinishEnsemble), else a bare final flag once the
    # decoupled step ends.
    assert [final for _, final in received] == [False] * (len(received) - 1) + [True]


async def test_the_last_response_carries_the_final_flag(autojump_clock):
    """A client that waits for triton_final_response sees it on the last response
    when no step is in flight any more, without asking for empty final responses."""

    async def repeat(request, deliver):
        for index in range(2):
            await deliver(respond("repeat", request.inputs["IN"].data + index), False)
        await deliver(None, True)

    gate = trio.Event()

    async def late(request, deliver):
        if request.inputs["IN"].data[0] == 2.0:
            await gate.wait()  # answers after the decoupled step ended
        await deliver(respond("late", request.inputs["IN"].data), True)

    async def opener(request, deliver):
        await repeat(request, deliver)
        gate.set()

    service = StandIn({"repeat": opener, "late": late}, decoupled=("repeat",))
    config = ensemble_config([("repeat", "INPUT", "r"), ("late", "r", "OUTPUT")])
    pairs = await run_ensemble(config, service, request_for(np.ones(1, np.float32)))
    assert [(r.outputs[0].data.tolist(), final) for r, final in pairs] == [
        ([1.0], False),
        ([2.0], True),
    ]


async def test_priority_timeout_sequence_and_parameters_reach_every_step(autojump_clock):
    service = StandIn({"a": add(1), "b": add(1)})
    config = ensemble_config([("a", "INPUT", "t"), ("b", "t", "OUTPUT")])
    request = request_for(
        np.array([1.0], np.float32),
        id="r7",
        priority=2,
        timeout_us=5000,
        sequence_id=42,
        sequence_start=True,
        sequence_end=False,
        parameters={"custom": "x"},
    )
    await only_response(config, service, request)
    for step in service.requests:
        assert (step.id, step.priority, step.timeout_us) == ("r7", 2, 5000)
        assert (step.sequence_id, step.sequence_start, step.sequence_end) == (42, True, False)
        assert step.parameters == {"custom": "x"}
        assert [o.name for o in step.requested_outputs] == ["OUT"]


async def test_a_request_cancelled_by_its_client_starts_no_further_step(autojump_clock):
    gate = trio.Event()

    async def first(request, deliver):
        await gate.wait()
        await deliver(respond("first", request.inputs["IN"].data), True)

    service = StandIn({"first": first, "second": add(1)})
    plan = plan_ensemble(
        ensemble_config([("first", "INPUT", "t"), ("second", "t", "OUTPUT")]), 1, service.model
    )
    scheduler = EnsembleScheduler(plan, service)
    request = request_for(np.array([1.0], np.float32))
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await scheduler.submit(request)
        await trio.testing.wait_all_tasks_blocked()
        request.cancelled = True  # what the DataPlane does when the client goes away
        gate.set()
        with pytest.raises(TritonError) as caught:
            await request.wait()
        nursery.cancel_scope.cancel()
    assert caught.value.status is Status.CANCELLED
    assert [r.model_name for r in service.requests] == ["first"]


async def test_unload_answers_requests_in_flight(autojump_clock):
    async def never(request, deliver):
        await trio.sleep_forever()

    service = StandIn({"never": never})
    plan = plan_ensemble(ensemble_config([("never", "INPUT", "OUTPUT")]), 1, service.model)
    scheduler = EnsembleScheduler(plan, service)
    request = request_for(np.array([1.0], np.float32))
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await scheduler.submit(request)
        await trio.testing.wait_all_tasks_blocked()
        scheduler.close()
        with pytest.raises(trio.ClosedResourceError):
            await scheduler.submit(request_for(np.array([2.0], np.float32)))
        nursery.cancel_scope.cancel()
    scheduler.abort(Unavailable("model 'ens' version 1 was unloaded"))
    with pytest.raises(Unavailable):
        await request.wait()


async def test_steps_whose_outputs_nobody_asked_for_do_not_run(autojump_clock):
    service = StandIn({"left": add(1), "right": add(2), "join": add(0)})
    config = ensemble_config(
        [("left", "INPUT", "L"), ("right", "INPUT", "R"), ("join", "R", "J")],
        outputs=("L", "J"),
    )
    request = request_for(np.array([1.0], np.float32), requested_outputs=[RequestedOutput("L")])
    response = await only_response(config, service, request)
    # Triton prunes every step that writes no requested output and no input of a
    # step that runs (EnsembleContext::InitContext).
    assert [r.model_name for r in service.requests] == ["left"]
    assert [t.name for t in response.outputs] == ["L"]


async def test_responses_carry_the_sequence_flags_of_their_request(autojump_clock):
    service = StandIn({"a": add(1), "b": add(1)})
    config = ensemble_config([("a", "INPUT", "t"), ("b", "t", "OUTPUT")])
    flags = []
    for start, end in ((True, False), (False, False), (False, True)):
        request = request_for(
            np.array([1.0], np.float32), sequence_id=9, sequence_start=start, sequence_end=end
        )
        response = await only_response(config, service, request)
        flags.append(response.parameters)
    assert flags == [
        {"sequence_id": 9, "sequence_start": True, "sequence_end": False},
        {"sequence_id": 9, "sequence_start": False, "sequence_end": False},
        {"sequence_id": 9, "sequence_start": False, "sequence_end": True},
    ]


async def test_sequence_settings_a_composing_model_returns_carry_on(autojump_clock):
    async def opens(request, deliver):
        response = respond("opens", request.inputs["IN"].data)
        response.parameters = {"sequence_id": 77, "sequence_start": True}
        await deliver(response, True)

    service = StandIn({"opens": opens, "after": add(1)})
    config = ensemble_config([("opens", "INPUT", "t"), ("after", "t", "OUTPUT")])
    response = await only_response(config, service, request_for(np.ones(1, np.float32)))
    after = service.requests[1]
    # EnsembleContext::ConsumeResponse: the next step and the response take them.
    assert (after.sequence_id, after.sequence_start, after.sequence_end) == (77, True, False)
    assert response.parameters == {"sequence_id": 77, "sequence_start": True, "sequence_end": False}


async def test_an_output_a_step_leaves_out_is_left_out_of_the_response(autojump_clock):
    async def partial_outputs(request, deliver):
        await deliver(respond("partial", request.inputs["IN"].data), True)

    service = StandIn({"partial": partial_outputs})
    service.models["partial"] = Model(
        parse(
            'name: "partial" backend: "test" max_batch_size: 0 '
            'input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ] '
            'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }, '
            '{ name: "EXTRA" data_type: TYPE_FP32 dims: [ -1 ] } ]'
        )
    )
    config = ensemble_config([("partial", "INPUT", "OUTPUT")], outputs=("OUTPUT", "SKIPPED"))
    config.ensemble_scheduling.step[0].output_map["EXTRA"] = "SKIPPED"
    response = await only_response(config, service, request_for(np.ones(2, np.float32)))
    assert [t.name for t in response.outputs] == ["OUTPUT"]


async def test_runs_of_one_step_overlap(autojump_clock):
    both = trio.Event()
    running = []

    async def burst(request, deliver):
        for index in range(2):
            await deliver(respond("burst", request.inputs["IN"].data + index), False)
        await deliver(None, True)

    async def meet(request, deliver):
        # Each run waits for the other: one at a time, they would never answer.
        running.append(request)
        if len(running) == 2:
            both.set()
        await both.wait()
        await deliver(respond("meet", request.inputs["IN"].data), True)

    service = StandIn({"burst": burst, "meet": meet}, decoupled=("burst",))
    config = ensemble_config([("burst", "INPUT", "b"), ("meet", "b", "OUTPUT")])
    pairs = await run_ensemble(config, service, request_for(np.zeros(1, np.float32)))
    assert sorted(r.outputs[0].data.tolist() for r, _ in pairs if r is not None) == [[0.0], [1.0]]


async def test_max_inflight_requests_holds_back_the_producer(autojump_clock):
    """With max_inflight_requests: 1 each step has one run in flight over every
    request of the ensemble, and a producer's next response waits for a slot of
    the step it feeds (core ensemble_scheduler.cc StepInflightRequestLimiter)."""
    delivered: list[int] = []
    gates: list[trio.Event] = []
    running = {"burst": 0, "slow": 0}
    most = {"burst": 0, "slow": 0}

    def enter(name: str) -> None:
        running[name] += 1
        most[name] = max(most[name], running[name])

    async def burst(request, deliver):
        enter("burst")
        for index in range(3):
            await deliver(respond("burst", request.inputs["IN"].data + index), False)
            delivered.append(index)
        running["burst"] -= 1
        await deliver(None, True)

    async def slow(request, deliver):
        enter("slow")
        gate = trio.Event()
        gates.append(gate)
        await gate.wait()
        running["slow"] -= 1
        await deliver(respond("slow", request.inputs["IN"].data), True)

    service = StandIn({"burst": burst, "slow": slow}, decoupled=("burst",))
    config = ensemble_config([("burst", "INPUT", "b"), ("slow", "b", "OUTPUT")])
    config.ensemble_scheduling.max_inflight_requests = 1
    plan = plan_ensemble(config, 1, service.model)
    scheduler = EnsembleScheduler(plan, service)
    requests = [request_for(np.zeros(1, np.float32)) for _ in range(2)]
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        for request in requests:
            nursery.start_soon(scheduler.submit, request)
        await trio.testing.wait_all_tasks_blocked()
        # The first burst handed over one response and waits for a slot of
        # 'slow' to hand over the next; the second request waits for 'burst'.
        assert len(gates) == 1 and delivered == [0]
        while not all(request.done for request in requests):
            gates[-1].set()
            await trio.testing.wait_all_tasks_blocked()
        for request in requests:
            responses = [r async for r, _ in request.stream() if r is not None]
            assert len(responses) == 3
        nursery.cancel_scope.cancel()
    assert most == {"burst": 1, "slow": 1}
    assert len(gates) == 6


# -- the plan: what loading checks against the composing models ---------------------


def two_step_service(**overrides) -> StandIn:
    service = StandIn({"a": add(0), "b": add(0)})
    for name, config in overrides.items():
        service.models[name] = Model(config)
    return service


@pytest.mark.parametrize(
    "override, steps, expected",
    [
        (
            {},
            [("a", "INPUT", "t"), ("missing", "t", "OUTPUT")],
            # Triton's words (core model_repository_manager.cc CheckNode), the
            # routing error after.
            "ensemble 'ens' depends on 'missing' which has no loaded version. "
            "(Request for unknown model: 'missing' is not found)",
        ),
        (
            {"b": vector_model("b", in_type="TYPE_INT32")},
            [("a", "INPUT", "t"), ("b", "t", "OUTPUT")],
            # core ensemble_utils.cc ValidateTensorConsistency: the model the
            # tensor was first inferred from, then the one that disagrees.
            "in ensemble ens, ensemble tensor t: inconsistent data type: TYPE_FP32 is "
            "inferred from model a while TYPE_INT32 is inferred from model b",
        ),
        (
            {"b": vector_model("b", in_dims="2, 2")},
            [("a", "INPUT", "t"), ("b", "t", "OUTPUT")],
            "in ensemble ens, ensemble tensor t: inconsistent shape: [-1] is inferred from "
            "model a while [2,2] is inferred from model b",
        ),
    ],
    ids=["missing-model", "datatype", "shape"],
)
def test_plan_names_the_ensemble_step_and_tensor(override, steps, expected):
    service = two_step_service(**override)
    with pytest.raises(TritonError) as caught:
        plan_ensemble(ensemble_config(steps), 1, service.model)
    assert caught.value.message == expected


def test_plan_rejects_names_the_model_does_not_have():
    service = two_step_service()
    config = ensemble_config([("a", "INPUT", "OUTPUT")])
    config.ensemble_scheduling.step[0].input_map["IN0"] = "INPUT"
    # Triton's words (core ensemble_utils.cc ValidateTensorMapping), the names after.
    with pytest.raises(
        InvalidArgument,
        match=r"^in ensemble ens, ensemble tensor INPUT is mapping to non-existing input IN0 "
        r"in model a \(its inputs: \['IN'\]\)$",
    ):
        plan_ensemble(config, 1, service.model)
    config = ensemble_config([("a", "INPUT", "OUTPUT")])
    del config.ensemble_scheduling.step[0].input_map["IN"]
    with pytest.raises(
        InvalidArgument,
        match=r"^in ensemble ens, input IN in model a is not mapped to any ensemble tensors",
    ):
        plan_ensemble(config, 1, service.model)
    config = ensemble_config([("a", "INPUT", "OUTPUT")])
    config.ensemble_scheduling.step[0].output_map["NOPE"] = "x"
    with pytest.raises(
        InvalidArgument,
        match="^in ensemble ens, ensemble tensor x is mapped from non-existing output NOPE in model a",
    ):
        plan_ensemble(config, 1, service.model)


def test_plan_edges():
    service = StandIn({"a": add(0), "b": add(0), "c": add(0)})
    config = ensemble_config(
        [("a", "INPUT", "x"), ("b", "INPUT", "y"), ("c", "x", "OUTPUT")], outputs=("OUTPUT", "y")
    )
    plan = plan_ensemble(config, 1, service.model)
    assert plan.consumers == {-1: (0, 1), 0: (2,), 1: (), 2: ()}
    assert not plan.streaming


def test_plan_refuses_a_step_that_batches_less_than_the_ensemble():
    # Triton's words (core ensemble_utils.cc:296).
    small = vector_model("a")
    small.max_batch_size = 2
    config = ensemble_config([("a", "INPUT", "OUTPUT")])
    config.max_batch_size = 3
    with pytest.raises(
        InvalidArgument,
        match="^ensemble ens allows maximum batch size 3, but it contains model a which only "
        "allows maximum batch size to be 2$",
    ):
        plan_ensemble(config, 1, two_step_service(a=small).model)
