"""CUDA graphs of the TensorRT backend on a host without a GPU or TensorRT: the
real instance code around stand-ins for the engine, its execution context and the
device (trionserve.backends.cuda.buffers' API over numpy).

The stand-ins behave as CUDA and TensorRT document: a captured graph records the
kernels with the tensor addresses and shapes bound at capture and replays exactly
those; an execution context defers work that depends on new input shapes to its
next ``execute_async_v3``, which a capture cannot record; device memory that was
freed can no longer be read.
"""

from __future__ import annotations

import functools
import gc
import math
import weakref
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import structlog
from google.protobuf import text_format
from structlog.testing import capture_logs

from trionserve._generated.model_config_pb2 import ModelConfig
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.cuda import graphs as cuda_graphs
from trionserve.backends.cuda.graphs import GraphShape, tensorrt_graph_shapes
from trionserve.backends.cuda.pipeline import StagedBackendInstance
from trionserve.backends.tensorrt import backend as trt_backend
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, Tensor


class FakeGraph:
    def __init__(self) -> None:
        self.kernels: list = []
        self.launches = 0


class FakeDevice:
    """device_buffers()'s API over numpy: a device buffer is an array registered
    by its address until it is freed; copies are immediate."""

    def __init__(self) -> None:
        self.memory: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.log: list[tuple] = []
        self.capturing: FakeGraph | None = None

    def view(self, address: int, shape: tuple[int, ...]) -> np.ndarray:
        base = self.memory[address]  # KeyError: the buffer was freed
        return base.reshape(-1)[: math.prod(shape)].reshape(shape)

    def _register(self, buffer: np.ndarray):
        self.memory[buffer.ctypes.data] = buffer
        return buffer, buffer.ctypes.data

    def device(self, index: int):
        return nullcontext()

    def stream(self):
        return "stream", 1

    def to_device(self, array: np.ndarray, stream):
        return self._register(np.array(array, copy=True))

    def empty(self, shape, dtype):
        return self._register(np.full(tuple(shape), np.nan, dtype))  # uninitialised

    def upload(self, buffer: np.ndarray, array: np.ndarray, stream) -> None:
        if buffer.shape != array.shape:  # cupy's set() asks for the same shape
            raise ValueError(f"copy of {array.shape} into {buffer.shape}")
        buffer[...] = array

    def to_host(self, buffer: np.ndarray, stream) -> np.ndarray:
        return buffer.copy()

    def synchronize(self, stream) -> None:
        pass

    def capture(self, stream, enqueue):
        self.capturing = FakeGraph()
        self.log.append(("begin_capture",))
        try:
            enqueue()
        finally:
            graph, self.capturing = self.capturing, None
            self.log.append(("end_capture",))
        return graph

    def launch(self, graph: FakeGraph, stream) -> None:
        graph.launches += 1
        for kernel in graph.kernels:
            kernel()


class FakeContext:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 at the bound shapes and
    addresses, on the stand-in device."""

    def __init__(self, engine: FakeEngine, device: FakeDevice) -> None:
        self.engine, self.device = engine, device
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.pending = True  # work deferred until the next execute_async_v3

    def set_input_shape(self, name: str, shape) -> bool:
        low, _, high = self.engine.get_tensor_profile_shape(name, 0)
        shape = tuple(shape)
        if len(shape) != len(low) or not all(
            lo <= d <= hi for lo, d, hi in zip(low, shape, high, strict=True)
        ):
            return False
        if self.shapes.get(name) != shape:
            self.pending = True
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str):
        return self.shapes["INPUT0" if name.startswith("OUTPUT") else name]

    def set_tensor_address(self, name: str, address: int) -> None:
        self.addresses[name] = address

    def execute_async_v3(self, stream_handle: int) -> bool:
        graph = self.device.capturing
        batch = self.shapes["INPUT0"][0]
        self.device.log.append(("execute", self.shapes["INPUT0"], graph is not None))
        if graph is not None and (self.pending or batch in self.engine.uncapturable):
            return False  # an allocation, say, which a capture cannot record
        kernel = functools.partial(self._kernel, dict(self.addresses), dict(self.shapes))
        if graph is None:
            kernel()
            self.pending = False
        else:
            graph.kernels.append(kernel)
        return True

    def _kernel(self, addresses: dict, shapes: dict) -> None:
        view = self.device.view
        a = view(addresses["INPUT0"], shapes["INPUT0"])
        b = view(addresses["INPUT1"], shapes["INPUT1"])
        view(addresses["OUTPUT0"], shapes["INPUT0"])[...] = a + b
        view(addresses["OUTPUT1"], shapes["INPUT0"])[...] = a - b


class FakeEngine:
    """An ICudaEngine for add/sub over FP32 [batch, item]: profile 0 takes batches
    1..8 (opt 4) and items of ``low``..``high`` elements (opt 16)."""

    class _Named:
        def __init__(self, name: str) -> None:
            self.name = name

    def __init__(self, device: FakeDevice, low: int = 16, high: int = 16) -> None:
        self.device = device
        item = 16 if low == high else -1
        self.names = ["INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"]
        self.shape = (-1, item)
        self.profile = [(1, low), (4, 16), (8, high)]
        self.num_io_tensors = 4
        self.num_optimization_profiles = 1
        self.uncapturable: set[int] = set()
        self.contexts: list[FakeContext] = []

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str):
        return self._Named("INPUT" if name.startswith("INPUT") else "OUTPUT")

    def get_tensor_shape(self, name: str):
        return self.shape

    def get_tensor_dtype(self, name: str):
        return self._Named("FLOAT")

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_profile_shape(self, name: str, profile: int):
        return self.profile

    def create_execution_context(self) -> FakeContext:
        self.contexts.append(FakeContext(self, self.device))
        return self.contexts[-1]


def plan_config(optimization: str, dims: str = "16", extra: str = "") -> ModelConfig:
    text = f"""
    name: "plan" platform: "tensorrt_plan" max_batch_size: 8 {extra}
    input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }},
            {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
    output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }},
             {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
    optimization {{ cuda {{ graphs: true {optimization} }} }}
    """
    return text_format.Parse(text, ModelConfig())


def load(monkeypatch, config: ModelConfig, low: int = 16, high: int = 16, uncapturable=()):
    """An instance created as the backend creates one at load, on the stand-ins."""
    device = FakeDevice()
    engine = FakeEngine(device, low, high)
    engine.uncapturable.update(uncapturable)
    monkeypatch.setattr(trt_backend, "device_buffers", lambda: device)
    monkeypatch.setattr(trt_backend, "deserialize", lambda model, path: engine)
    context = ModelContext(config.name, 1, config, Path("plan"), Path("plan/1"))
    model = trt_backend.TensorRTModel(context, Path("plan/1/model.plan"))
    instance = model.create_instance(InstanceSpec("plan_0", "plan_0", "KIND_GPU", 0))
    return instance, device


def infer(instance, **inputs: np.ndarray):
    """The outputs of one request, and the batch size of the graph that served it
    (None: execute_async_v3 did)."""
    request = InferenceRequest(
        "plan", inputs={name: Tensor(name, "FP32", data) for name, data in inputs.items()}
    )
    request.batch_size = next(iter(inputs.values())).shape[0]
    before = {g.shape.batch_size: g.graph.launches for g in instance._graphs}
    [response] = instance.execute([request])
    replayed = [
        g.shape.batch_size
        for g in instance._graphs
        if g.graph.launches != before[g.shape.batch_size]
    ]
    assert len(replayed) <= 1
    return response, (replayed[0] if replayed else None)


def check_add_sub(instance, rows: int, item: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, item), dtype=np.float32)
    b = rng.standard_normal((rows, item), dtype=np.float32)
    response, graph = infer(instance, INPUT0=a, INPUT1=b)
    total, difference = (t.data for t in response.outputs)
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(difference, a - b)
    return graph


# -- which graphs a config asks for -------------------------------------------------------

OPT = {"INPUT0": (16,), "INPUT1": (16,)}


def sizes(config: ModelConfig) -> list[tuple[int, int]]:
    shapes = tensorrt_graph_shapes(config, OPT)
    assert shapes is not None
    assert all(s.inputs == OPT for s in shapes)
    return [(s.lower, s.batch_size) for s in shapes]


def test_without_graph_spec_each_batch_size_triton_captures_serves_only_itself():
    """InitializeGraphSpecs: 1, 2, 3, 4, 6, 8 for max_batch_size 8 without a batcher
    (qa/L0_cuda_graph test_fixed_shape: 6 graphs, batch 5 runs without one)."""
    assert sizes(plan_config("")) == [(1, 1), (2, 2), (3, 3), (4, 4), (6, 6), (8, 8)]
    big = plan_config("").__class__()
    big.CopyFrom(plan_config(""))
    big.max_batch_size = 32
    assert [b for _, b in sizes(big)] == [1, 2, 3, 4, 6, 8, 12, 16, 32]
    batcher = plan_config("", extra="dynamic_batching { preferred_batch_size: [ 4 ] }")
    assert sizes(batcher) == [(1, 1), (4, 4), (8, 8)]
    oldest = plan_config("", extra="sequence_batching { oldest { preferred_batch_size: [ 2 ] } }")
    assert sizes(oldest) == [(1, 1), (2, 2), (8, 8)]
    nobatch = plan_config("")
    nobatch.max_batch_size = 0
    assert sizes(nobatch) == [(0, 0)]
    assert tensorrt_graph_shapes(text_format.Parse('name: "p"', ModelConfig()), OPT) is None


def test_graph_spec_is_read_and_checked_as_triton_reads_it():
    ranged = plan_config("graph_spec [ { batch_size: 4 graph_lower_bound { batch_size: 2 } } ]")
    assert tensorrt_graph_shapes(ranged, OPT) == [GraphShape(4, 2, OPT)]
    shaped = plan_config(
        'graph_spec [ { batch_size: 4 input { key: "INPUT0" value { dim: [ 8 ] } } '
        'input { key: "INPUT1" value { dim: [ 8 ] } } } ]',
        dims="-1",
    )
    assert tensorrt_graph_shapes(shaped, OPT) == [
        GraphShape(4, 4, {"INPUT0": (8,), "INPUT1": (8,)})
    ]
    bad = {
        "batch_size: 9": "to be >= 1 and <= 8",
        "batch_size: 4 graph_lower_bound { batch_size: 0 }": "to be >= 1 and <= 8",
        "batch_size: 2 graph_lower_bound { batch_size: 4 }": "'batch_size' <= 2, got 4",
        'batch_size: 4 input { key: "INPUT0" value { dim: [ 16 ] } } '
        "graph_lower_bound { batch_size: 2 }": "expects a shape for input 'INPUT0'",
        'batch_size: 4 input { key: "INPUT0" value { dim: [ 8 ] } } '
        'graph_lower_bound { batch_size: 2 input { key: "INPUT0" value { dim: [ 9 ] } } }': (
            r"dimensions <= \[8\], got \[9\]"
        ),
        'batch_size: 4 input { key: "INPUT0" value { dim: [ 8 ] } } '
        'graph_lower_bound { batch_size: 2 input { key: "INPUT0" value { dim: [ 8, 1 ] } } }': (
            "to have 1 dimensions, got 2"
        ),
    }
    for spec, error in bad.items():
        with pytest.raises(InvalidArgument, match=error):
            tensorrt_graph_shapes(plan_config(f"graph_spec [ {{ {spec} }} ]"), OPT)
    nobatch = plan_config("graph_spec [ { batch_size: 1 } ]")
    nobatch.max_batch_size = 0
    with pytest.raises(InvalidArgument, match="to be 0 if 'max_batch_size' is 0"):
        tensorrt_graph_shapes(nobatch, OPT)


# -- capture at load, replay per batch ------------------------------------------------------


def test_each_batch_replays_the_smallest_graph_that_serves_it(monkeypatch):
    """Batches between a graph's lower bound and its size replay it, padded; the
    rest run execute_async_v3 (qa/L0_cuda_graph test_range_fixed_shape)."""
    config = plan_config(
        "graph_spec [ { batch_size: 4 graph_lower_bound { batch_size: 2 } }, "
        "{ batch_size: 8 graph_lower_bound { batch_size: 6 } } ]"
    )
    instance, _ = load(monkeypatch, config)
    assert [g.shape.batch_size for g in instance._graphs] == [4, 8]
    served = {rows: check_add_sub(instance, rows, seed=rows) for rows in range(1, 9)}
    assert served == {1: None, 2: 4, 3: 4, 4: 4, 5: None, 6: 8, 7: 8, 8: 8}


def test_default_graphs_serve_only_their_own_batch_size(monkeypatch):
    instance, _ = load(monkeypatch, plan_config(""))
    served = {rows: check_add_sub(instance, rows, seed=rows) for rows in range(1, 9)}
    assert served == {1: 1, 2: 2, 3: 3, 4: 4, 5: None, 6: 6, 7: None, 8: 8}


def test_a_padded_batch_gets_only_its_own_rows_back(monkeypatch):
    """The rows past a batch hold an earlier batch's data; they are never returned."""
    config = plan_config("graph_spec [ { batch_size: 4 graph_lower_bound { batch_size: 2 } } ]")
    instance, _ = load(monkeypatch, config)
    big = np.full((4, 16), 100, np.float32)
    infer(instance, INPUT0=big, INPUT1=big)
    a, b = np.ones((2, 16), np.float32), np.full((2, 16), 3, np.float32)
    response, graph = infer(instance, INPUT0=a, INPUT1=b)
    assert graph == 4
    total, difference = (t.data for t in response.outputs)
    assert total.shape == difference.shape == (2, 16)
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(difference, a - b)
    [captured] = instance._graphs
    np.testing.assert_array_equal(captured.inputs["INPUT0"][2:], big[2:])  # padding rows


def test_a_batch_with_another_item_shape_or_without_an_input_runs_execute(monkeypatch):
    """The graph's kernels read its own shapes; a missing input would leave an
    earlier batch's data in the graph's buffer (qa/L0_cuda_graph
    test_range_dynamic_shape: other shapes run without the graph)."""
    config = plan_config(
        'graph_spec [ { batch_size: 4 input { key: "INPUT0" value { dim: [ 16 ] } } '
        'input { key: "INPUT1" value { dim: [ 16 ] } } graph_lower_bound { batch_size: 2 '
        'input { key: "INPUT0" value { dim: [ 8 ] } } '
        'input { key: "INPUT1" value { dim: [ 8 ] } } } } ]',
        dims="-1",
    )
    instance, _ = load(monkeypatch, config, low=1, high=32)
    assert check_add_sub(instance, 3, item=16) == 4
    assert check_add_sub(instance, 3, item=10) is None
    assert check_add_sub(instance, 3, item=30) is None
    response, graph = infer(instance, INPUT0=np.ones((3, 16), np.float32))
    assert graph is None
    assert isinstance(response, InvalidArgument) and "needs input 'INPUT1'" in str(response)


def test_execute_runs_once_at_a_graphs_shapes_before_its_capture(monkeypatch):
    """TensorRT's first enqueue after a shape change does work a capture cannot
    record (the stand-in context fails such a capture, as it would break)."""
    config = plan_config("graph_spec [ { batch_size: 2 }, { batch_size: 4 } ]")
    instance, device = load(monkeypatch, config)
    assert [g.shape.batch_size for g in instance._graphs] == [2, 4]
    assert device.log == [
        ("execute", (2, 16), False),
        ("begin_capture",),
        ("execute", (2, 16), True),
        ("end_capture",),
        ("execute", (4, 16), False),
        ("begin_capture",),
        ("execute", (4, 16), True),
        ("end_capture",),
    ]


def test_a_graph_that_cannot_be_captured_leaves_its_batches_to_execute(monkeypatch):
    config = plan_config("graph_spec [ { batch_size: 2 }, { batch_size: 4 } ]")
    # The module's logger is cached with the configuration current at its first
    # use (cache_logger_on_first_use): after an earlier test's server configured
    # logging without warnings, capture_logs saw none. A fresh one is first used
    # inside capture_logs.
    monkeypatch.setattr(cuda_graphs, "log", structlog.get_logger(cuda_graphs.__name__))
    with capture_logs() as logs:
        instance, _ = load(monkeypatch, config, uncapturable={4})
    [warning] = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warning["batch_size"] == 4 and "execute_async_v3 returned false" in warning["error"]
    assert [g.shape.batch_size for g in instance._graphs] == [2]
    assert check_add_sub(instance, 4) is None
    assert check_add_sub(instance, 2) == 2


def test_close_frees_the_graphs_and_their_buffers(monkeypatch):
    instance, device = load(monkeypatch, plan_config("graph_spec [ { batch_size: 2 } ]"))
    check_add_sub(instance, 2)
    [captured] = instance._graphs
    held = [weakref.ref(captured.graph)]
    held += [weakref.ref(b) for b in (*captured.inputs.values(), *captured.outputs.values())]
    del captured
    instance.close()
    gc.collect()
    assert instance._graphs == [] and instance._context is None
    assert [ref() for ref in held] == [None] * len(held)
    assert len(device.memory) == 0


def test_a_model_without_batching_replays_its_graph_for_the_graphs_shape(monkeypatch):
    """qa/L0_cuda_graph test_nobatch_fixed_shape / test_nobatch_dynamic_shape: one
    graph (batch size 0) at the "opt" shape or graph_spec's, other shapes execute."""
    default = plan_config("", dims="-1, 16")
    default.max_batch_size = 0
    instance, _ = load(monkeypatch, default)
    assert [(g.shape.batch_size, g.shape.inputs["INPUT0"]) for g in instance._graphs] == [
        (0, (4, 16))
    ]
    assert check_add_sub(instance, 4) == 0
    assert check_add_sub(instance, 3) is None
    spec = plan_config(
        'graph_spec [ { batch_size: 0 input { key: "INPUT0" value { dim: [ 2, 16 ] } } '
        'input { key: "INPUT1" value { dim: [ 2, 16 ] } } } ]',
        dims="-1, 16",
    )
    spec.max_batch_size = 0
    instance, _ = load(monkeypatch, spec)
    assert check_add_sub(instance, 2) == 0
    assert check_add_sub(instance, 4) is None


def _request(rows: int, seed: int) -> tuple[InferenceRequest, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, 16), dtype=np.float32)
    b = rng.standard_normal((rows, 16), dtype=np.float32)
    request = InferenceRequest(
        "plan",
        inputs={"INPUT0": Tensor("INPUT0", "FP32", a), "INPUT1": Tensor("INPUT1", "FP32", b)},
    )
    request.batch_size = rows
    return request, a, b


@pytest.mark.parametrize("graphs", [True, False])
def test_the_next_batch_is_staged_on_the_host_while_the_device_computes(monkeypatch, graphs):
    """The GPU pipeline (trionserve.backends.cuda.pipeline) drives a TensorRT instance
    as the instance's thread does: stage the next batch, then finish the current one,
    then launch the next. Staging touches neither the device nor the execution
    context the launched batch is bound to, and both batches' outputs are their own
    (a graph's static outputs are read back before the next batch replays it)."""
    config = plan_config("")
    config.optimization.cuda.graphs = graphs
    instance, device = load(monkeypatch, config)
    assert isinstance(instance, StagedBackendInstance) and instance.overlaps
    first, a1, b1 = _request(4, seed=1)
    second, a2, b2 = _request(4, seed=2)

    launched = instance.launch([first], instance.stage([first]))
    device_log = list(device.log)
    memory = {address: buffer.copy() for address, buffer in device.memory.items()}
    context = instance._context
    bound = (dict(context.shapes), dict(context.addresses))
    staged = instance.stage([second])  # while the first batch computes
    assert device.log == device_log
    # No device buffer made or written (a graph's static inputs included), the
    # execution context still bound to the first batch.
    assert set(device.memory.keys()) == set(memory)
    for address, before in memory.items():
        np.testing.assert_array_equal(device.memory[address], before)
    assert (context.shapes, context.addresses) == bound
    [one] = instance.finish([first], launched)
    [two] = instance.finish([second], instance.launch([second], staged))

    for response, a, b in ((one, a1, b1), (two, a2, b2)):
        total, difference = (t.data for t in response.outputs)
        np.testing.assert_array_equal(total, a + b)
        np.testing.assert_array_equal(difference, a - b)
    assert instance.compute_times is not None
    replays = sum(g.graph.launches for g in instance._graphs)
    assert replays == (2 if graphs else 0)


# -- ragged inputs and batch inputs ------------------------------------------------------


def test_an_engine_input_a_batch_input_feeds_loads_and_is_built_per_batch(monkeypatch):
    """INPUT1 is not a request input but the batch input the config builds
    (BATCH_ELEMENT_COUNT of the ragged INPUT0): the engine's input need not be in
    the config's inputs, and each batch stages it, in the engine's dtype, beside
    INPUT0 concatenated flat."""
    config = text_format.Parse(
        """
        name: "plan" platform: "tensorrt_plan" max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
                 { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1 ] } ]
        batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "INPUT1"
                        data_type: TYPE_FP32 source_input: "INPUT0" } ]
        """,
        ModelConfig(),
    )
    instance, _ = load(monkeypatch, config)
    requests = []
    for length in (3, 5):
        data = np.full((1, length), float(length), dtype=np.float32)
        request = InferenceRequest("plan", inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})
        request.batch_size = 1
        requests.append(request)
    batch = instance.stage(requests)
    assert batch.error is None, batch.error
    assert batch.arrays["INPUT0"].tolist() == [3.0] * 3 + [5.0] * 5
    assert batch.arrays["INPUT1"].dtype == np.float32
    assert batch.arrays["INPUT1"].tolist() == [3.0, 5.0]
    assert batch.graph is None
