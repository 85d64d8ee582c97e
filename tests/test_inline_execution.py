"""Tiny CPU batches run inline on the event loop; anything else in a worker thread."""

from __future__ import annotations

import threading

import numpy as np
import trio

from tests.serverproc import free_port
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.registry import register_backend
from trionserve.core.batching import build_responses, gather_inputs
from trionserve.core.types import InferenceRequest, Tensor
from trionserve.observability.statistics import ComputeTimes
from trionserve.server import Server, ServerOptions

THREADS: list[bool] = []  # per execution: True when it ran on the event loop's thread
COST_NS = [0]  # what the next execution reports as its own cost


class _Instance:
    inline_budget_ns = 100_000

    def __init__(self, context: ModelContext) -> None:
        self.name, self.version = context.name, str(context.version)
        self.compute_times = None

    def execute(self, requests):
        THREADS.append(threading.current_thread() is threading.main_thread())
        self.compute_times = ComputeTimes(0, COST_NS[0], 0)
        outputs = {"OUTPUT0": gather_inputs(requests)["INPUT0"]}
        return build_responses(requests, self.name, self.version, outputs, {"OUTPUT0": "FP32"})

    def close(self) -> None:
        pass


class _Model:
    def __init__(self, context):
        self.context = context

    def create_instance(self, spec: InstanceSpec):
        return _Instance(self.context)

    def unload(self):
        pass


class InlineBackend:
    name = "test_inline"

    def default_model_filename(self):
        return "model.txt"

    def auto_complete_config(self, config, model_path, max_batch_size_set):
        pass

    def load(self, context):
        return _Model(context)


register_backend("test_inline", InlineBackend)


async def test_inline_only_while_the_measured_cost_is_within_budget(tmp_path):
    model = tmp_path / "tiny"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.txt").write_text("tiny\n")
    (model / "config.pbtxt").write_text(
        'name: "tiny"\nbackend: "test_inline"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    )
    server = Server(
        ServerOptions(
            model_repositories=[tmp_path], allow_http=False, allow_grpc=False,
            allow_metrics=False, http_port=free_port(),
        )
    )
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
