"""GPU paths: TensorRT plans, ONNX Runtime on CUDA (and its TensorRT provider),
PyTorch on CUDA. Tests that need a GPU or a GPU library skip with the reason; the
config handling around them is unit-tested here on any host."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import onnxruntime
import pytest
import trio
import tritonclient.http as httpclient
from google.protobuf import text_format
from onnx import TensorProto, helper

from tests.repository import write_model
from tests.serverproc import EXAMPLES, ServerProcess, scrape_metrics, serving
from trionserve._generated.model_config_pb2 import TYPE_FP32, ModelConfig
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.cuda.devices import gpu_count
from trionserve.backends.onnxruntime.backend import OnnxRuntimeBackend
from trionserve.backends.onnxruntime.providers import execution_providers
from trionserve.backends.tensorrt import backend as trt_backend
from trionserve.backends.tensorrt import engine as trt_engine
from trionserve.core.errors import InvalidArgument, Unavailable
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.server import Server, ServerOptions

GPUS = gpu_count()
ORT_PROVIDERS = onnxruntime.get_available_providers()


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_gpu = pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU is visible on this host")
needs_tensorrt = pytest.mark.skipif(
    not has("tensorrt") or not (has("cupy") or has("torch")),
    reason="tensorrt, and cupy or torch for GPU buffers, are not installed",
)
needs_ort_cuda = pytest.mark.skipif(
    "CUDAExecutionProvider" not in ORT_PROVIDERS,
    reason="onnxruntime has no CUDA execution provider (onnxruntime-gpu not installed)",
)
needs_ort_tensorrt = pytest.mark.skipif(
    "TensorrtExecutionProvider" not in ORT_PROVIDERS,
    reason="onnxruntime has no TensorRT execution provider",
)
needs_torch = pytest.mark.skipif(not has("torch"), reason="torch is not installed")


def add_sub_onnx() -> bytes:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 over FP32 [batch, 16]."""

    def fp32(name: str):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 16])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "add_sub",
        [fp32("INPUT0"), fp32("INPUT1")],
        [fp32("OUTPUT0"), fp32("OUTPUT1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def parse_config(text: str) -> ModelConfig:
    return text_format.Parse(text, ModelConfig())


def write(repository, name: str, filename: str, content: bytes, config: str) -> None:
    write_model(repository, name, config, {f"1/{filename}": content})


def check_add_sub(client, model: str) -> None:
    for batch in (1, 8):
        rng = np.random.default_rng(batch)
        a = rng.standard_normal((batch, 16), dtype=np.float32)
        b = rng.standard_normal((batch, 16), dtype=np.float32)
        inputs = [
            httpclient.InferInput("INPUT0", [batch, 16], "FP32"),
            httpclient.InferInput("INPUT1", [batch, 16], "FP32"),
        ]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        result = client.infer(model, inputs)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-5)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-5)


@pytest.fixture
def serve(tmp_path):
    """Start a real server on tmp_path once the test has written its models."""
    started = []

    def start() -> httpclient.InferenceServerClient:
        proc = ServerProcess(tmp_path)
        started.append(proc)
        proc.wait_ready(timeout=300)  # TensorRT builds engines at load
        return httpclient.InferenceServerClient(proc.http_url, network_timeout=300)

    yield start
    for proc in started:
        try:
            assert proc.stop() == 0, proc.output()
        finally:
            proc.close()


# -- ONNX Runtime execution accelerators (no GPU needed) -----------------------------

GPU_SPEC = InstanceSpec("m_0_0", "m_0", "KIND_GPU", 1)
CPU_SPEC = InstanceSpec("m_0_0", "m_0", "KIND_CPU", 0)
ALL_PROVIDERS = [
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "OpenVINOExecutionProvider",
    "CPUExecutionProvider",
]


def test_tensorrt_and_cuda_accelerators_map_to_provider_options():
    config = parse_config(
        """
        name: "m"
        parameters { key: "cudnn_conv_algo_search" value: { string_value: "1" } }
        optimization { execution_accelerators {
          gpu_execution_accelerator [
            { name: "tensorrt"
              parameters { key: "precision_mode" value: "FP16" }
              parameters { key: "max_workspace_size_bytes" value: "1073741824" }
              parameters { key: "trt_engine_cache_enable" value: "true" } },
            { name: "cuda"
              parameters { key: "use_ep_level_unified_stream" value: "1" } }
          ]
          cpu_execution_accelerator [ { name: "openvino" } ]
        } }
        """
    )
    providers = execution_providers(config, GPU_SPEC, ALL_PROVIDERS)
    assert providers == [
        (
            "TensorrtExecutionProvider",
            {
                "trt_fp16_enable": "1",
                "trt_max_workspace_size": "1073741824",
                "trt_engine_cache_enable": "1",
                "device_id": "1",
            },
        ),
        (
            "CUDAExecutionProvider",
            {
                "cudnn_conv_algo_search": "HEURISTIC",
                "use_ep_level_unified_stream": "1",
                "device_id": "1",
            },
        ),
        ("OpenVINOExecutionProvider", {"device_type": "CPU"}),
        "CPUExecutionProvider",
    ]
    # KIND_CPU instances use only the CPU accelerators, as in Triton.
    assert execution_providers(config, CPU_SPEC, ALL_PROVIDERS) == [
        ("OpenVINOExecutionProvider", {"device_type": "CPU"}),
        "CPUExecutionProvider",
    ]


@pytest.mark.parametrize(
    "accelerators, error, message",
    [
        (
            'gpu_execution_accelerator [ { name: "tensorrt" parameters { key: "bogus" '
            'value: "1" } } ]',
            InvalidArgument,
            "unknown parameter 'bogus'",
        ),
        (
            'gpu_execution_accelerator [ { name: "tensorrt" parameters { key: '
            '"precision_mode" value: "FP8" } } ]',
            InvalidArgument,
            "precision mode 'FP8'",
        ),
        (
            'gpu_execution_accelerator [ { name: "tensorrt" parameters { key: '
            '"trt_dla_core" value: "x" } } ]',
            InvalidArgument,
            "must be an integer",
        ),
        (
            'gpu_execution_accelerator [ { name: "rocm" } ]',
            InvalidArgument,
            "unknown Execution Accelerator 'rocm'",
        ),
        (
            'cpu_execution_accelerator [ { name: "dnnl" } ]',
            InvalidArgument,
            "unknown Execution Accelerator 'dnnl'",
        ),
    ],
)
def test_bad_accelerator_settings_are_rejected(accelerators, error, message):
    config = parse_config(
        f'name: "m" optimization {{ execution_accelerators {{ {accelerators} }} }}'
    )
    with pytest.raises(error, match=message):
        execution_providers(config, GPU_SPEC, ALL_PROVIDERS)


def test_missing_providers_are_named():
    config = parse_config(
        'name: "m" optimization { execution_accelerators { gpu_execution_accelerator '
        '[ { name: "tensorrt" } ] } }'
    )
    with pytest.raises(Unavailable, match="no CUDA execution provider"):
        execution_providers(config, GPU_SPEC, ["CPUExecutionProvider"])
    cuda_only = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(Unavailable, match="no TensorRT execution provider"):
        execution_providers(config, GPU_SPEC, cuda_only)


@pytest.mark.skipif(
    "OpenVINOExecutionProvider" in ORT_PROVIDERS, reason="this onnxruntime has OpenVINO"
)
def test_openvino_without_the_provider_fails_the_instance(tmp_path):
    write(tmp_path, "m", "model.onnx", add_sub_onnx(), "")
    config = parse_config(
        'name: "m" platform: "onnxruntime_onnx" optimization { execution_accelerators '
        '{ cpu_execution_accelerator [ { name: "openvino" } ] } }'
    )
    context = ModelContext("m", 1, config, tmp_path / "m", tmp_path / "m" / "1")
    loaded = OnnxRuntimeBackend().load(context)
    with pytest.raises(Unavailable, match="no OpenVINO execution provider"):
        loaded.create_instance(CPU_SPEC)


# -- TensorRT auto-complete from the engine (a stand-in engine, no GPU needed) ---------


class FakeEngine:
    """Answers the ICudaEngine calls the backend makes, for two inputs, one output."""

    class _Named:
        def __init__(self, name: str) -> None:
            self.name = name

    def __init__(self, shape: tuple[int, ...], max_batch: int) -> None:
        self.shapes = {"INPUT0": shape, "INPUT1": shape, "OUTPUT0": shape}
        self.max_batch = max_batch
        self.num_io_tensors = 3
        self.num_optimization_profiles = 1

    def get_tensor_name(self, index: int) -> str:
        return list(self.shapes)[index]

    def get_tensor_mode(self, name: str):
        return self._Named("INPUT" if name.startswith("INPUT") else "OUTPUT")

    def get_tensor_shape(self, name: str):
        return self.shapes[name]

    def get_tensor_dtype(self, name: str):
        return self._Named("FLOAT")

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_profile_shape(self, name: str, profile: int):
        shape = self.shapes[name]
        return [(1, *shape[1:]), (1, *shape[1:]), (self.max_batch, *shape[1:])]


def test_tensorrt_auto_complete_reads_the_engine():
    config = parse_config('name: "plan" platform: "tensorrt_plan"')
    tensors = trt_engine.engine_tensors(FakeEngine((-1, 16), 8))
    trt_engine.complete_config(config, tensors, max_batch_size_set=False)
    assert config.max_batch_size == 8
    assert [(i.name, list(i.dims)) for i in config.input] == [
        ("INPUT0", [16]),
        ("INPUT1", [16]),
    ]
    assert [o.name for o in config.output] == ["OUTPUT0"]
    assert config.output[0].data_type == TYPE_FP32
    assert config.HasField("dynamic_batching")  # Triton enables it for batching engines

    fixed = parse_config('name: "plan" platform: "tensorrt_plan"')
    trt_engine.complete_config(
        fixed, trt_engine.engine_tensors(FakeEngine((4, 16), 8)), max_batch_size_set=False
    )
    assert fixed.max_batch_size == 0
    assert list(fixed.input[0].dims) == [4, 16]
    assert not fixed.HasField("dynamic_batching")

    too_big = parse_config('name: "plan" platform: "tensorrt_plan" max_batch_size: 16')
    with pytest.raises(InvalidArgument, match="only supports max-batch 8"):
        trt_engine.complete_config(too_big, tensors, max_batch_size_set=True)


@pytest.mark.skipif(
    not trt_engine.missing_requirements(), reason="this host can run TensorRT plans"
)
async def test_tensorrt_plan_is_unavailable_without_gpu_or_tensorrt(tmp_path):
    write(tmp_path, "plan", "model.plan", b"not an engine", 'platform: "tensorrt_plan"')
    options = ServerOptions(
        model_repositories=[tmp_path],
        allow_http=False,
        allow_grpc=False,
        allow_metrics=False,
        exit_on_error=False,
    )
    server = Server(options)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        rows = [r for r in server.registry.index() if r["name"] == "plan"]
        server.shutdown()
    assert rows and all(r["state"] == "UNAVAILABLE" for r in rows)
    for missing in trt_engine.missing_requirements():
        assert missing in rows[0]["reason"]


# -- on a GPU --------------------------------------------------------------------------


def build_engine(onnx_bytes: bytes) -> bytes:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(onnx_bytes), [parser.get_error(i) for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name in ("INPUT0", "INPUT1"):
        profile.set_shape(name, (1, 16), (4, 16), (8, 16))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "TensorRT could not build the engine"
    return bytes(plan)


@needs_tensorrt
@needs_gpu
def test_tensorrt_plan_serves_add_sub(tmp_path, serve):
    plan = build_engine(add_sub_onnx())
    write(tmp_path, "plan", "model.plan", plan, 'platform: "tensorrt_plan"')
    client = serve()
    config = client.get_model_config("plan")
    assert config["max_batch_size"] == 8  # auto-completed from the engine's profile
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    check_add_sub(client, "plan")


TRT_GRAPHS = """
name: "plan" platform: "tensorrt_plan" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
instance_group [ { kind: KIND_GPU count: 1 } ]
optimization { cuda { graphs: true graph_spec [
  { batch_size: 4 graph_lower_bound { batch_size: 2 } }, { batch_size: 8 } ] } }
"""


@needs_tensorrt
@needs_gpu
def test_tensorrt_cuda_graphs_replay_the_batches_they_serve(tmp_path, monkeypatch):
    """Graphs of a real engine captured at load; batches 2-4 replay the graph of 4
    (padded), 8 its own, the others run execute_async_v3; every answer is exact."""
    write(tmp_path, "plan", "model.plan", build_engine(add_sub_onnx()), TRT_GRAPHS)
    config = parse_config(TRT_GRAPHS)
    context = ModelContext("plan", 1, config, tmp_path / "plan", tmp_path / "plan" / "1")
    model = trt_backend.TensorRTBackend().load(context)
    instance = model.create_instance(InstanceSpec("plan_0", "plan_0", "KIND_GPU", 0))
    try:
        assert [(g.shape.lower, g.shape.batch_size) for g in instance._graphs] == [(2, 4), (8, 8)]
        launched = []
        launch = instance._buffers.launch
        monkeypatch.setattr(
            instance._buffers, "launch", lambda g, s: (launched.append(g), launch(g, s))
        )
        served = {}
        for rows in (4, 1, 2, 3, 5, 8, 3):
            rng = np.random.default_rng(rows)
            a = rng.standard_normal((rows, 16), dtype=np.float32)
            b = rng.standard_normal((rows, 16), dtype=np.float32)
            request = InferenceRequest(
                "plan", inputs={"INPUT0": Tensor("INPUT0", "FP32", a),
                                "INPUT1": Tensor("INPUT1", "FP32", b)}
            )  # fmt: skip
            request.batch_size = rows
            launched.clear()
            [response] = instance.execute([request])
            total, difference = (t.data for t in response.outputs)
            np.testing.assert_allclose(total, a + b, rtol=1e-5)
            np.testing.assert_allclose(difference, a - b, rtol=1e-5)
            by_graph = {id(g.graph): g.shape.batch_size for g in instance._graphs}
            served[rows] = by_graph[id(launched[0])] if launched else None
        assert served == {4: 4, 1: None, 2: 4, 3: 4, 5: None, 8: 8}
    finally:
        instance.close()
    assert instance._graphs == []


@needs_tensorrt
@needs_gpu
def test_tensorrt_cuda_graphs_served(tmp_path, serve):
    write(tmp_path, "plan", "model.plan", build_engine(add_sub_onnx()), TRT_GRAPHS)
    check_add_sub(serve(), "plan")


@needs_ort_cuda
@needs_gpu
def test_onnxruntime_kind_gpu_uses_cuda(tmp_path, serve):
    write(
        tmp_path,
        "ort_gpu",
        "model.onnx",
        add_sub_onnx(),
        'platform: "onnxruntime_onnx" max_batch_size: 8 '
        "instance_group [ { kind: KIND_GPU count: 1 } ]",
    )
    client = serve()
    config = client.get_model_config("ort_gpu")
    assert config["instance_group"][0]["kind"] == "KIND_GPU"
    check_add_sub(client, "ort_gpu")


@needs_ort_tensorrt
@needs_gpu
def test_onnxruntime_tensorrt_accelerator(tmp_path, serve):
    write(
        tmp_path,
        "ort_trt",
        "model.onnx",
        add_sub_onnx(),
        'platform: "onnxruntime_onnx" max_batch_size: 8 '
        "instance_group [ { kind: KIND_GPU count: 1 } ] "
        "optimization { execution_accelerators { gpu_execution_accelerator [ "
        '{ name: "tensorrt" parameters { key: "precision_mode" value: "FP32" } } ] } }',
    )
    check_add_sub(serve(), "ort_trt")


@needs_torch
@needs_gpu
def test_pytorch_kind_gpu(tmp_path, serve):
    import torch

    from tests.e2e.test_pytorch_backend import AddMul

    module = AddMul()
    version = tmp_path / "pt_gpu" / "1"
    version.mkdir(parents=True)
    torch.jit.script(module).save(str(version / "model.pt"))
    (tmp_path / "pt_gpu" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch" max_batch_size: 8 '
        "instance_group [ { kind: KIND_GPU count: 1 } ] "
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }, '
        '{ name: "INPUT__1" data_type: TYPE_FP32 dims: [ 16 ] } ] '
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }, '
        '{ name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 16 ] } ]'
    )
    client = serve()
    for batch in (1, 8):
        x = np.random.default_rng(batch).standard_normal((batch, 16), dtype=np.float32)
        y = np.full((batch, 16), 0.5, dtype=np.float32)
        inputs = [
            httpclient.InferInput("INPUT__0", [batch, 16], "FP32"),
            httpclient.InferInput("INPUT__1", [batch, 16], "FP32"),
        ]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(y)
        result = client.infer("pt_gpu", inputs)
        with torch.inference_mode():
            want0, want1 = module(torch.from_numpy(x), torch.from_numpy(y))
        np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), want0.numpy(), rtol=1e-5)
        np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), want1.numpy(), rtol=1e-5)


# -- CUDA graphs for PyTorch models (optimization { cuda { graphs: true } }) ----------

PT_GRAPH_CONFIG = (
    'platform: "pytorch_libtorch" max_batch_size: 8 '
    "instance_group [ { kind: %s count: 1 } ] "
    'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }, '
    '{ name: "INPUT__1" data_type: TYPE_FP32 dims: [ 16 ] } ] '
    'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }, '
    '{ name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 16 ] } ] '
    "optimization { cuda { graphs: true %s } }"
)


def write_addmul(repository, name: str, config: str):
    import torch

    from tests.e2e.test_pytorch_backend import AddMul

    module = AddMul()
    version = repository / name / "1"
    version.mkdir(parents=True)
    torch.jit.script(module).save(str(version / "model.pt"))
    (repository / name / "config.pbtxt").write_text(config)
    return module


def check_addmul(client, model: str, module, batches) -> None:
    import torch

    for batch in batches:
        x = np.random.default_rng(batch).standard_normal((batch, 16), dtype=np.float32)
        y = np.full((batch, 16), 0.25 * batch, dtype=np.float32)
        inputs = [
            httpclient.InferInput("INPUT__0", [batch, 16], "FP32"),
            httpclient.InferInput("INPUT__1", [batch, 16], "FP32"),
        ]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(y)
        result = client.infer(model, inputs)
        with torch.inference_mode():
            want0, want1 = module(torch.from_numpy(x), torch.from_numpy(y))
        assert result.as_numpy("OUTPUT__0").shape == (batch, 16)
        np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), want0.numpy(), rtol=1e-5)
        np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), want1.numpy(), rtol=1e-5)


def test_cuda_graph_shapes_follow_the_config():
    from trionserve.backends.cuda.graphs import GraphShape, cuda_graph_shapes

    def parsed(text: str) -> ModelConfig:
        config = parse_config(
            'name: "m" max_batch_size: 8 '
            'input [ { name: "A" data_type: TYPE_FP32 dims: [ 16 ] }, '
            '{ name: "B" data_type: TYPE_FP32 dims: [ -1 ] } ] ' + text
        )
        return config

    assert cuda_graph_shapes(parsed("")) is None
    # Without graph_spec: variable dims leave nothing to capture.
    assert cuda_graph_shapes(parsed("optimization { cuda { graphs: true } }")) == []
    spec = parsed(
        "optimization { cuda { graphs: true graph_spec [ "
        '{ batch_size: 4 input { key: "B" value { dim: [ 32 ] } } '
        "graph_lower_bound { batch_size: 2 } }, "
        '{ batch_size: 8 input { key: "B" value { dim: [ 8 ] } } } ] } }'
    )
    assert cuda_graph_shapes(spec) == [
        GraphShape(4, 2, {"A": (16,), "B": (32,)}),
        GraphShape(8, 8, {"A": (16,), "B": (8,)}),
    ]
    missing = parsed("optimization { cuda { graphs: true graph_spec [ { batch_size: 4 } ] } }")
    with pytest.raises(InvalidArgument, match="input 'B'"):
        cuda_graph_shapes(missing)
    fixed = parse_config(
        'name: "m" max_batch_size: 6 input [ { name: "A" data_type: TYPE_FP32 dims: [ 3 ] } ] '
        "optimization { cuda { graphs: true } }"
    )
    # Powers of two and the largest batch, each serving the sizes above the last.
    assert [(g.lower, g.batch_size) for g in cuda_graph_shapes(fixed)] == [
        (1, 1),
        (2, 2),
        (3, 4),
        (5, 6),
    ]


@needs_torch
def test_cuda_graphs_on_a_cpu_instance_are_ignored_with_a_log_line(tmp_path):
    module = write_addmul(tmp_path, "pt_graphs_cpu", PT_GRAPH_CONFIG % ("KIND_CPU", ""))
    proc = ServerProcess(tmp_path)
    try:
        proc.wait_ready()
        client = httpclient.InferenceServerClient(proc.http_url)
        check_addmul(client, "pt_graphs_cpu", module, (1, 3))
        assert proc.stop() == 0, proc.output()
        log = proc.output()
        assert log.count("optimization.cuda.graphs ignored") == 1, log
        assert "captured CUDA graph" not in log
    finally:
        proc.close()


@needs_torch
@needs_gpu
def test_pytorch_cuda_graphs_replay_padded_batches(tmp_path):
    module = write_addmul(tmp_path, "pt_graphs", PT_GRAPH_CONFIG % ("KIND_GPU", ""))
    proc = ServerProcess(tmp_path)
    try:
        proc.wait_ready(timeout=300)
        client = httpclient.InferenceServerClient(proc.http_url)
        # 1, 2, 4, 8 captured; 3 pads to 4, 5..7 to 8; each result sliced back.
        check_addmul(client, "pt_graphs", module, (1, 2, 3, 5, 8, 3, 1))
        stats = client.get_inference_statistics("pt_graphs")["model_stats"][0]
        assert int(stats["inference_count"]) == 23
        assert proc.stop() == 0, proc.output()
        log = proc.output()
        assert log.count("captured CUDA graph") == 4, log
    finally:
        proc.close()


@needs_torch
@needs_gpu
def test_pytorch_cuda_graph_spec_with_a_lower_bound(tmp_path):
    spec = "graph_spec [ { batch_size: 4 graph_lower_bound { batch_size: 2 } } ]"
    module = write_addmul(tmp_path, "pt_graph_spec", PT_GRAPH_CONFIG % ("KIND_GPU", spec))
    proc = ServerProcess(tmp_path)
    try:
        proc.wait_ready(timeout=300)
        client = httpclient.InferenceServerClient(proc.http_url)
        # 2..4 replay the one graph; 1 and 5..8 run without one (qa/L0_cuda_graph's
        # test_range_fixed_shape asks the same of TensorRT).
        check_addmul(client, "pt_graph_spec", module, (1, 2, 3, 4, 6))
        assert proc.stop() == 0, proc.output()
        assert proc.output().count("captured CUDA graph") == 1
    finally:
        proc.close()


@needs_gpu
@pytest.mark.skipif(not has("pynvml"), reason="NVML (nvidia-ml-py) is not installed")
def test_gpu_metrics_report_every_gpu():
    import pynvml

    pynvml.nvmlInit()
    try:
        expected = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            expected[uuid] = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    finally:
        pynvml.nvmlShutdown()
    with serving(EXAMPLES, args=["--metrics-interval-ms=100"]) as proc:
        families = scrape_metrics(proc)
    totals = {s.labels["gpu_uuid"]: s.value for s in families["nv_gpu_memory_total_bytes"].samples}
    assert totals == expected
    for name in ("nv_gpu_memory_used_bytes", "nv_gpu_utilization"):
        samples = families[name].samples
        assert {s.labels["gpu_uuid"] for s in samples} == set(expected)
    for sample in families["nv_gpu_utilization"].samples:
        assert 0.0 <= sample.value <= 1.0
    for sample in families["nv_gpu_memory_used_bytes"].samples:
        assert 0 < sample.value <= expected[sample.labels["gpu_uuid"]]


def test_gpu_metrics_can_be_turned_off():
    with serving(EXAMPLES, args=["--allow-gpu-metrics=false"]) as proc:
        families = scrape_metrics(proc)
        log = proc.output()
    assert "nv_inference_count" in families
    assert not [name for name in families if name.startswith("nv_gpu_")]
    # Turned off, NVML is not even looked for (on a host without it the default
    # logs why there are no GPU metrics: see the next test).
    assert "GPU metrics off" not in log


@pytest.mark.skipif(GPUS > 0 and has("pynvml"), reason="this host has GPU metrics")
def test_without_nvml_or_a_gpu_the_log_says_why(server):
    # The session's server (tests/conftest.py): the example repository, default
    # flags; it must stop cleanly at the end.
    families = scrape_metrics(server)
    assert not [name for name in families if name.startswith("nv_gpu_")]
    assert "GPU metrics off" in server.output()


# -- the pipelined GPU executor under load (races show here, if anywhere) --------------

PT_PIPELINE_CONFIG = (
    'platform: "pytorch_libtorch" max_batch_size: 8 '
    "instance_group [ { kind: KIND_GPU count: 1 } ] "
    'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }, '
    '{ name: "INPUT__1" data_type: TYPE_FP32 dims: [ 16 ] } ] '
    'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }, '
    '{ name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 16 ] } ] '
    "dynamic_batching { max_queue_delay_microseconds: 200 } %s"
)


def _addmul_load(url: str, model: str, clients: int, requests: int) -> list[str]:
    """``clients`` threads each sending ``requests`` requests of its own data; the
    mismatches and errors seen (AddMul: x + 2y, x * y - 1)."""
    from concurrent.futures import ThreadPoolExecutor

    def client_loop(seed: int) -> list[str]:
        client = httpclient.InferenceServerClient(url, network_timeout=120)
        problems = []
        rng = np.random.default_rng(seed)
        for index in range(requests):
            rows = 1 + (seed + index) % 3
            x = rng.standard_normal((rows, 16), dtype=np.float32)
            y = rng.standard_normal((rows, 16), dtype=np.float32)
            inputs = [
                httpclient.InferInput("INPUT__0", [rows, 16], "FP32"),
                httpclient.InferInput("INPUT__1", [rows, 16], "FP32"),
            ]
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(y)
            try:
                result = client.infer(model, inputs)
            except Exception as exc:
                problems.append(f"client {seed} request {index}: {exc}")
                continue
            for name, want in (("OUTPUT__0", x + 2 * y), ("OUTPUT__1", x * y - 1)):
                got = result.as_numpy(name)
                if got is None or got.shape != want.shape or not np.allclose(got, want, atol=1e-4):
                    problems.append(f"client {seed} request {index}: {name} is not its own")
        client.close()
        return problems

    with ThreadPoolExecutor(clients) as pool:
        return [p for problems in pool.map(client_loop, range(clients)) for p in problems]


@needs_torch
@needs_gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_pytorch_gpu_pipelined_batches_answer_each_request_with_its_own_data(tmp_path, graphs):
    """16 clients of batches of 1-3 rows: batches are formed, staged in the two
    pinned slots in turn while the one before computes, padded to a graph's size;
    each response must hold its own request's results."""
    extra = "optimization { cuda { graphs: true } }" if graphs else ""
    write_addmul(tmp_path, "pt_pipe", PT_PIPELINE_CONFIG % extra)
    proc = ServerProcess(tmp_path)
    try:
        proc.wait_ready(timeout=300)
        assert _addmul_load(proc.http_url, "pt_pipe", clients=16, requests=40) == []
        client = httpclient.InferenceServerClient(proc.http_url)
        stats = client.get_inference_statistics("pt_pipe")["model_stats"][0]
        # Batches were formed (fewer executions than requests).
        assert int(stats["execution_count"]) < 16 * 40
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


@needs_torch
@needs_gpu
def test_pytorch_cuda_graph_of_a_model_reducing_over_the_batch_is_not_padded(tmp_path):
    import torch

    class SumRows(torch.nn.Module):
        def forward(self, x):
            return x.sum(0, keepdim=True)

    version = tmp_path / "pt_sum" / "1"
    version.mkdir(parents=True)
    torch.jit.script(SumRows()).save(str(version / "model.pt"))
    (tmp_path / "pt_sum" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch" max_batch_size: 4 '
        "instance_group [ { kind: KIND_GPU count: 1 } ] "
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        "optimization { cuda { graphs: true } }"
    )
    proc = ServerProcess(tmp_path)
    try:
        proc.wait_ready(timeout=300)
        client = httpclient.InferenceServerClient(proc.http_url)
        for rows, value in ((4, 5.0), (3, 1.0), (1, 2.0)):
            tensor = httpclient.InferInput("INPUT__0", [rows, 4], "FP32")
            tensor.set_data_from_numpy(np.full((rows, 4), value, dtype=np.float32))
            result = client.infer("pt_sum", [tensor]).as_numpy("OUTPUT__0")
            np.testing.assert_allclose(result, np.full((1, 4), rows * value))
        assert proc.stop() == 0, proc.output()
        assert "outputs are not batch-major" in proc.output()
    finally:
        proc.close()


@needs_torch
@needs_gpu
def test_pytorch_graphs_are_captured_while_another_model_serves(tmp_path):
    """A model loading with CUDA graphs beside one serving on the same GPU: the
    serving one's pinned allocations and event waits neither fail nor break the
    capture (captures are thread-local)."""
    import threading

    write_addmul(tmp_path, "pt_serving", PT_PIPELINE_CONFIG % "")
    write_addmul(tmp_path, "pt_loading", PT_GRAPH_CONFIG % ("KIND_GPU", ""))
    proc = ServerProcess(
        tmp_path, args=["--model-control-mode=explicit", "--load-model=pt_serving"]
    )
    try:
        proc.wait_ready(timeout=300)
        problems: list[str] = []
        done = threading.Event()

        def serve() -> None:
            while not done.is_set():
                problems.extend(_addmul_load(proc.http_url, "pt_serving", clients=8, requests=5))

        loader = threading.Thread(target=serve)
        loader.start()
        try:
            client = httpclient.InferenceServerClient(proc.http_url, network_timeout=300)
            client.load_model("pt_loading")
        finally:
            done.set()
            loader.join()
        assert problems == []
        assert proc.output().count("captured CUDA graph") == 4, proc.output()
        assert "capture failed" not in proc.output()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()
