"""The GPU paths on a host without one: stand-ins for CUDA's streams, events and
graphs (and for cupy) that behave as CUDA documents them, around real code.

A stand-in event records when the host waits for it; a stand-in graph replays
forward() on its static inputs into its static outputs (what a replay does); a
stand-in ``cudaMemcpy`` from pageable memory returns before the bytes reach the
device, as CUDA's "API synchronization behavior" allows.
"""

from __future__ import annotations

import ctypes
import sys
import types
from contextlib import nullcontext

import numpy as np
import pytest
from google.protobuf import text_format

from trionserve._generated.model_config_pb2 import ModelConfig
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.cuda import graphs as cuda_graphs
from trionserve.backends.cuda.pipeline import HostBuffers
from trionserve.core import cuda_shared_memory
from trionserve.core.inference import InferenceRequest, Tensor

torch = pytest.importorskip("torch")

from trionserve.backends.cuda.graphs import cuda_graph_shapes  # noqa: E402
from trionserve.backends.pytorch import instance as pytorch_instance  # noqa: E402


class FakeEvent:
    def __init__(self, log: list) -> None:
        self._log = log

    def record(self, stream=None) -> None:
        self._log.append(("record", self))

    def synchronize(self) -> None:
        self._log.append(("sync", self))


class FakeStream:
    def __init__(self, *args) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeGraph:
    """Replays what the test wires into it (forward() on the static inputs)."""

    def __init__(self) -> None:
        self.replay_fn = None

    def replay(self) -> None:
        self.replay_fn()


class FakeCuda:
    def __init__(self) -> None:
        self.log: list = []
        self.captures: list[tuple[str, bool]] = []  # (capture_error_mode, lock held)
        self.Stream = FakeStream
        self.CUDAGraph = FakeGraph

    def Event(self) -> FakeEvent:
        return FakeEvent(self.log)

    def stream(self, stream):
        return nullcontext()

    def device(self, device):
        return nullcontext()

    def graph_pool_handle(self):
        return object()

    def graph(self, graph, pool=None, stream=None, capture_error_mode="global"):
        lock = cuda_graphs.CAPTURE_LOCK
        self.captures.append((capture_error_mode, lock is not None and lock.locked()))
        return nullcontext()


class FakeTorch:
    """torch, with ``torch.cuda`` replaced by the stand-ins."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str):
        return getattr(torch, name)


class LoggedBuffers(HostBuffers):
    def __init__(self, log: list, slot: int) -> None:
        super().__init__()
        self._log, self._slot = log, slot

    def gather(self, name, parts):
        self._log.append(("gather", self._slot))
        return super().gather(name, parts)


def gpu_instance(monkeypatch, module, config_text: str):
    """A TorchScript instance driven through its GPU code path: CPU tensors, the
    instance's streams and events stand-ins."""
    config = text_format.Parse(config_text, ModelConfig())
    context = ModelContext(config.name, 1, config, None, None)
    cuda = FakeCuda()
    spec = InstanceSpec(f"{config.name}_0", config.name, "KIND_GPU", 1)
    instance = pytorch_instance.TorchScriptInstance(
        context, spec, FakeTorch(cuda), torch.jit.script(module), torch.device("cpu")
    )
    instance._stream, instance._copy_stream = FakeStream(), FakeStream()
    instance.overlaps = True
    instance._buffers = (LoggedBuffers(cuda.log, 0), LoggedBuffers(cuda.log, 1))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    shapes = cuda_graph_shapes(config)
    if shapes is not None:
        instance.capture_graphs(shapes)
        for captured in instance._graphs:
            captured.graph.replay_fn = _replayer(instance, captured)
    return instance, cuda


def _replayer(instance, captured):
    def replay() -> None:
        result = instance._forward(captured.inputs)
        for name, static in captured.outputs.items():
            static.copy_(instance._output(name, result))

    return replay


def request(model: str, **inputs: np.ndarray) -> list[InferenceRequest]:
    r = InferenceRequest(
        model, inputs={name: Tensor(name, "FP32", data) for name, data in inputs.items()}
    )
    r.batch_size = next(iter(inputs.values())).shape[0]
    return [r]


class Checked(torch.nn.Module):
    def forward(self, x):
        if bool((x < 0).any()):
            raise RuntimeError("negative input")
        return x * 2


CHECKED = """
name: "checked" platform: "pytorch_libtorch" max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def test_a_pinned_slot_is_rewritten_only_after_its_copy_even_when_forward_failed(
    monkeypatch,
):
    """Batch 1's forward() fails, so its outputs' event is never waited for; the
    slot it was staged in is the third batch's, whose gather must wait for batch
    1's copy to be done (stream order on another stream is no promise to the host)."""
    instance, cuda = gpu_instance(monkeypatch, Checked(), CHECKED)
    first = request("checked", INPUT__0=-np.ones((2, 4), np.float32))
    second = request("checked", INPUT__0=np.ones((2, 4), np.float32))
    third = request("checked", INPUT__0=np.full((2, 4), 3, np.float32))
    # In the order an instance's thread runs two batches in flight.
    staged1 = instance.stage(first)
    copied1 = staged1.copied
    staged1 = instance.launch(first, staged1)
    staged2 = instance.stage(second)
    [error] = instance.finish(first, staged1)
    assert "negative input" in str(error)
    staged2 = instance.launch(second, staged2)
    cuda.log.clear()
    staged3 = instance.stage(third)
    assert cuda.log.index(("sync", copied1)) < cuda.log.index(("gather", 1)), cuda.log
    [ok2] = instance.finish(second, staged2)
    np.testing.assert_array_equal(ok2.outputs[0].data, np.full((2, 4), 2))
    [ok3] = instance.finish(third, instance.launch(third, staged3))
    np.testing.assert_array_equal(ok3.outputs[0].data, np.full((2, 4), 6))


class SumRows(torch.nn.Module):
    """An output that is not batch-major: one row whatever the batch."""

    def forward(self, x):
        return x.sum(0, keepdim=True)


SUM_ROWS = """
name: "sum_rows" platform: "pytorch_libtorch" max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
optimization { cuda { graphs: true } }
"""


def test_a_graph_whose_outputs_are_not_batch_major_is_not_padded(monkeypatch):
    instance, cuda = gpu_instance(monkeypatch, SumRows(), SUM_ROWS)
    [full] = instance.execute(request("sum_rows", INPUT__0=np.full((4, 4), 5, np.float32)))
    np.testing.assert_array_equal(full.outputs[0].data, np.full((1, 4), 20))
    # Padded to the graph of 4, the fourth row (the batch before's) would be summed too.
    [three] = instance.execute(request("sum_rows", INPUT__0=np.ones((3, 4), np.float32)))
    np.testing.assert_array_equal(three.outputs[0].data, np.full((1, 4), 3))
    # Each graph serves its own batch size only (1 is batch-major by coincidence).
    assert [(g.shape.lower, g.shape.batch_size) for g in instance._graphs] == [
        (1, 1),
        (2, 2),
        (4, 4),
    ]


class AddMul(torch.nn.Module):
    def forward(self, a, b):
        return a + b, a * b


ADD_MUL = """
name: "add_mul" platform: "pytorch_libtorch" max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 4 ] } ]
optimization { cuda { graphs: true } }
"""


def test_graphs_are_captured_one_at_a_time_in_thread_local_mode(monkeypatch):
    """torch's default "global" mode fails other threads' CUDA calls (a pinned
    buffer allocated by an instance serving meanwhile) and breaks the capture."""
    instance, cuda = gpu_instance(monkeypatch, AddMul(), ADD_MUL)
    assert len(instance._graphs) == 3
    assert cuda.captures == [("thread_local", True)] * 3


def test_padded_batches_replay_and_slice_back(monkeypatch):
    instance, _ = gpu_instance(monkeypatch, AddMul(), ADD_MUL)
    for rows in (4, 3, 1, 2):
        a = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        b = np.full((rows, 4), 2, np.float32)
        [response] = instance.execute(request("add_mul", INPUT__0=a, INPUT__1=b))
        sums, products = (t.data for t in response.outputs)
        np.testing.assert_array_equal(sums, a + b)
        np.testing.assert_array_equal(products, a * b)


def test_close_releases_the_graphs_and_pinned_buffers(monkeypatch):
    instance, _ = gpu_instance(monkeypatch, AddMul(), ADD_MUL)
    instance.execute(request("add_mul", INPUT__0=np.ones((2, 4), np.float32),
                             INPUT__1=np.ones((2, 4), np.float32)))  # fmt: skip
    pinned = instance._buffers
    instance.close()
    assert instance._graphs == []
    assert all(buffers is not old for buffers, old in zip(instance._buffers, pinned))


def test_a_graph_is_not_used_for_a_batch_without_one_of_its_inputs(monkeypatch):
    """The missing input's static tensor would hold an earlier batch's data."""
    instance, _ = gpu_instance(monkeypatch, AddMul(), ADD_MUL)
    both = {"INPUT__0": torch.ones(2, 4), "INPUT__1": torch.ones(2, 4)}
    assert instance._graph_for(2, both) is not None
    assert instance._graph_for(2, {"INPUT__0": torch.ones(2, 4)}) is None


# -- CUDA shared memory ----------------------------------------------------------------


class FakeCupy(types.ModuleType):
    """cudaMemcpy from pageable memory returns once the bytes are staged; they reach
    the device when the default stream is synchronized."""

    def __init__(self) -> None:
        super().__init__("cupy")
        self.device_memory = bytearray(64)
        self.pending: list[tuple[int, bytes]] = []
        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: 1,
            ipcOpenMemHandle=lambda handle: 0,
            ipcCloseMemHandle=lambda pointer: None,
            memcpy=self._memcpy,
            streamSynchronize=self._synchronize,
            deviceSynchronize=lambda: self._synchronize(0),
        )
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda index: nullcontext())

    def _memcpy(self, dst: int, src: int, size: int, kind: int) -> None:
        assert kind == 1  # host to device: staged now, on the device later
        self.pending.append((dst, ctypes.string_at(src, size)))

    def _synchronize(self, stream: int) -> None:
        for offset, data in self.pending:
            self.device_memory[offset : offset + len(data)] = data
        self.pending.clear()


def test_an_output_written_to_cuda_shared_memory_is_on_the_device_before_the_reply(
    monkeypatch,
):
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(cuda_shared_memory, "cuda_unavailable_reason", lambda: None)
    regions = cuda_shared_memory.CudaSharedMemory()
    regions.register("out", bytes(64), 0, 64)
    data = np.arange(4, dtype=np.float32)
    assert regions.write("out", 16, 16, data.tobytes(), "output 'OUTPUT0'") == 16
    assert bytes(cupy.device_memory[16:32]) == data.tobytes()


# -- NVML ------------------------------------------------------------------------------


class FakeNvml(types.ModuleType):
    """Two GPUs, as NVML lists them (every GPU of the host)."""

    class NVMLError(Exception):
        pass

    BUS_IDS = ("00000000:3B:00.0", "00000000:AF:00.0")

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.nvmlInit = self.nvmlShutdown = lambda: None
        self.nvmlDeviceGetCount = lambda: len(self.BUS_IDS)
        self.nvmlDeviceGetHandleByIndex = lambda index: f"handle{index}"
        self.nvmlDeviceGetPciInfo = lambda handle: types.SimpleNamespace(
            busId=self.BUS_IDS[int(handle[-1])].encode()
        )


def test_gpu_metrics_cover_the_gpus_cuda_sees(monkeypatch):
    """Triton's core (src/metrics.cc) keeps the GPUs whose PCI bus id a CUDA device
    has; with CUDA_VISIBLE_DEVICES=1 the other GPU is not this server's."""
    from trionserve.observability.gpu_metrics import GpuMetricsCollector

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=types.SimpleNamespace(
            getDeviceCount=lambda: 1, deviceGetPCIBusId=lambda index: "0000:AF:00.0"
        )
    )
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    collector = GpuMetricsCollector.create()
    assert collector is not None and collector._handles == ["handle1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    collector = GpuMetricsCollector.create()
    assert collector is not None and collector._handles == ["handle0", "handle1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GPU device nodes are Linux's")
def test_no_gpu_drivers_device_node_means_no_gpu_and_no_cuda_library_asked(monkeypatch, tmp_path):
    """Where /dev holds no node of a GPU driver, no device is counted and neither
    cupy nor torch is asked (importing torch at each start-up costs seconds of CPU);
    with one (nvidiactl here), the CUDA library counts them."""
    from trionserve.backends.cuda import devices

    asked = []

    def count() -> int:
        asked.append("cupy")
        return 3

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "DEV", str(tmp_path))
    for name in ("null", "tty", "shm"):
        (tmp_path / name).touch()
    assert devices.gpu_count.__wrapped__() == 0 and asked == []
    (tmp_path / "nvidiactl").touch()
    assert devices.gpu_count.__wrapped__() == 3 and asked == ["cupy"]
