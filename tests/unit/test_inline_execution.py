"""Tiny CPU batches run inline on the event loop; anything else in a worker thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio
import trio.testing

from tests.fake_backend import echo_responses, instance_backend
from tests.repository import echo_model
from tests.serverproc import free_port
from trionserve.backends.base import ModelContext
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.observability.statistics import ComputeTimes
from trionserve.server import Server, ServerOptions

THREADS: list[bool] = []  # per execution: True when it ran on the event loop's thread
TASKS: list[object] = []  # per execution on the event loop: the Trio task that ran it
FIRST: list[float] = []  # per request executed: its input's first element
STEPS: list[int] = []  # per execution on the event loop: Trio task steps before it
RAN_ON: list[object] = []  # per execution: the instance that ran it
GATE: list[threading.Event] = []  # if set up: what an execution in a thread waits for
COST_NS = [0]  # what the next execution reports as its own cost


class _Instance:
    inline_budget_ns = 100_000

    def __init__(self, context: ModelContext) -> None:
        self.name, self.version = context.name, str(context.version)
        self.compute_times = None

    def execute(self, requests):
        THREADS.append(threading.current_thread() is threading.main_thread())
        if GATE and not THREADS[-1]:
            GATE[0].wait(10)
        if THREADS[-1]:
            TASKS.append(trio.lowlevel.current_task())
            STEPS.append(_STEPS.count)
        self.compute_times = ComputeTimes(0, COST_NS[0], 0)
        FIRST.extend(float(request.inputs["INPUT0"].data.flat[0]) for request in requests)
        RAN_ON.append(self)
        return echo_responses(requests, self.name, self.version)

    def close(self) -> None:
        pass


class _StepCounter(trio.abc.Instrument):
    count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


_STEPS = _StepCounter()


BACKENDS = instance_backend("test_inline", lambda context, spec: _Instance(context))


def _server(tmp_path, instances: int = 1, batching: str = "") -> Server:
    echo_model(
        tmp_path,
        "tiny",
        "test_inline",
        f"instance_group [ {{ kind: KIND_CPU, count: {instances} }} ] {batching}",
    )
    return Server(
        ServerOptions(
            model_repositories=[tmp_path],
            allow_http=False,
            allow_grpc=False,
            allow_metrics=False,
            http_port=free_port(),
        ),
        backends=BACKENDS,
    )


@pytest.mark.parametrize("batching", ["", "dynamic_batching { }"])
async def test_inline_only_while_the_measured_cost_is_within_budget(tmp_path, batching):
    """The same with the dynamic batcher, whose hand-over to an idle instance's
    thread leaves a batch that runs inline to the executor's feeder."""
    server = _server(tmp_path, batching=batching)
    THREADS.clear()

    async def infer(size: int = 4) -> None:
        data = np.ones((1, size), dtype=np.float32)
        request = InferenceRequest("tiny", inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})
        response = await server.dataplane.infer(request)
        np.testing.assert_array_equal(response.outputs[0].data, data)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        COST_NS[0] = 10_000
        await infer()  # first batch: measured in a thread
        await infer()  # cheap: inline
        COST_NS[0] = 5_000_000
        await infer()  # still inline (the previous run was cheap), reports it was costly
        await infer()  # over budget: back to a thread
        COST_NS[0] = 10_000
        await infer(size=100_000)  # cheap, but its input is too large to run inline
        server.shutdown()
    assert THREADS == [False, True, True, False, False]


@pytest.mark.parametrize("batching", ["", "dynamic_batching { }"])
async def test_an_idle_instance_runs_a_cheap_request_in_the_submitting_task(tmp_path, batching):
    """Nothing queued and the instance idle, with nothing in flight: the request
    runs in the task that submitted it, with no hop to the executor's task. With
    the dynamic batcher too (no delay: it would send that batch at once), so
    the request is answered before its submit returns (a gRPC call stays in
    its reader's task)."""
    server = _server(tmp_path, batching=batching)
    THREADS.clear()
    TASKS.clear()
    submitted: list[object] = []

    async def infer() -> None:
        data = np.ones((1, 4), dtype=np.float32)
        request = InferenceRequest("tiny", inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})
        submitted.append(trio.lowlevel.current_task())
        response = await server.dataplane.infer(request)
        np.testing.assert_array_equal(response.outputs[0].data, data)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        COST_NS[0] = 10_000
        await infer()  # first batch: measured in a thread, through the queue
        await infer()  # may be taken by the executor's task as it comes back
        async with trio.open_nursery() as clients:
            for _ in range(3):
                clients.start_soon(infer)
        server.shutdown()
    assert THREADS == [False, True, True, True, True]
    assert TASKS[1:] == submitted[2:]


async def test_requests_queued_behind_a_batch_in_the_thread_run_after_it_in_order(tmp_path):
    """The first batch runs in the thread; the three submitted meanwhile wait in
    the queue and then run inline, in the order they came, in the executor's task,
    in one task step (no task switch between cheap queued batches)."""
    server = _server(tmp_path)
    THREADS.clear()
    TASKS.clear()
    FIRST.clear()
    COST_NS[0] = 10_000

    async def infer(value: float) -> None:
        data = np.full((1, 4), value, dtype=np.float32)
        request = InferenceRequest("tiny", inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})
        response = await server.dataplane.infer(request)
        np.testing.assert_array_equal(response.outputs[0].data, data)

    STEPS.clear()
    gate = threading.Event()
    GATE.append(gate)
    trio.lowlevel.add_instrument(_STEPS)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            async with trio.open_nursery() as clients:
                for value in range(4):
                    clients.start_soon(infer, float(value))
                    await trio.testing.wait_all_tasks_blocked()
                gate.set()  # the thread finishes the first; the queued ones follow
            server.shutdown()
    finally:
        trio.lowlevel.remove_instrument(_STEPS)
        GATE.clear()
    assert FIRST == [0.0, 1.0, 2.0, 3.0]
    assert THREADS == [False, True, True, True]
    assert len(set(TASKS)) == 1
    assert len(set(STEPS)) == 1


async def test_a_stopped_executor_takes_no_request_handed_straight_over(tmp_path):
    """An instance being removed (its executor stopped, not yet out of its wait)
    runs nothing more: the request goes through the queue to the other one."""
    server = _server(tmp_path, instances=2)
    COST_NS[0] = 10_000

    async def infer() -> None:
        data = np.ones((1, 4), dtype=np.float32)
        request = InferenceRequest("tiny", inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})
        await server.dataplane.infer(request)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        for _ in range(4):  # each instance measured once in its thread, then inline
            await infer()
            await trio.testing.wait_all_tasks_blocked()
        executors = server.registry.route("tiny", None)._executors
        RAN_ON.clear()
        await infer()
        offered = next(e for e in executors if e.instance is RAN_ON[-1])
        offered.stop()  # in the same step as the next request: still offered
        await infer()
        assert RAN_ON[-1] is not offered.instance
        server.shutdown()


async def test_a_grpc_call_to_an_idle_batched_model_runs_in_one_step_of_the_reader(tmp_path):
    """A unary gRPC ModelInfer to a model with the dynamic batcher (no delay)
    whose idle instance runs the batch inline: the batch runs in the task that
    submitted it, the connection's reader, so the call is answered in that one
    task step, as over HTTP (before: the call waited for the executor's feeder,
    kept the reader's task, and a new reader task was spawned per call)."""
    from tests.unit.test_grpc_transport import RawClient, frame
    from trionserve._generated import grpc_service_pb2 as pb

    echo_model(tmp_path, "tiny", "test_inline", "dynamic_batching { }")
    server = Server(
        ServerOptions(
            model_repositories=[tmp_path],
            allow_http=False,
            allow_metrics=False,
            grpc_address="127.0.0.1",
            grpc_port=free_port(),
        ),
        backends=BACKENDS,
    )
    data = np.arange(4, dtype=np.float32).reshape(1, 4)
    message = pb.ModelInferRequest(model_name="tiny")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    message.raw_input_contents.append(data.tobytes())
    body = frame(message.SerializeToString())
    steps: list[str] = []

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            steps.append(task.name)

    THREADS.clear()
    COST_NS[0] = 10_000
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with RawClient.connect(server.options.grpc_port) as client:
            for _ in range(2):  # the first measured in the thread, the next inline
                warm = await client.call("/inference.GRPCInferenceService/ModelInfer", body)
                await client.until(lambda c, s=warm: c.ended(s))
                await trio.testing.wait_all_tasks_blocked()
            instrument = Steps()
            trio.lowlevel.add_instrument(instrument)
            try:
                call = await client.call("/inference.GRPCInferenceService/ModelInfer", body)
                await client.until(lambda c: c.ended(call))
                await trio.testing.wait_all_tasks_blocked()
            finally:
                trio.lowlevel.remove_instrument(instrument)
            assert client.status(call) == (0, "")
            response = pb.ModelInferResponse.FromString(client.data[call][5:])
            assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [
                0.0,
                1.0,
                2.0,
                3.0,
            ]
        server.shutdown()
    assert THREADS[-1]  # ran inline on the event loop
    served = [name for name in steps if name.startswith("trionserve.")]
    assert len(served) == 1, steps
