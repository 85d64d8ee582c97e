"""compute_input / compute_infer / compute_output as the statistics extension reports
them, for the PyTorch and ONNX Runtime backends: each phase measured by the backend
itself (gather and copy in, the framework's forward, outputs into responses), not
the whole execution counted as compute_infer."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from tests.repository import write_model
from tests.serverproc import ServerProcess

HAS_TORCH = importlib.util.find_spec("torch") is not None
WIDTH = 512  # a forward of milliseconds: far above a phase stretched by a busy host
LAYERS = 24

BATCHING = "dynamic_batching { max_queue_delay_microseconds: 20000 }"


def config(name: str, platform: str, inp: str, out: str, dtype: str = "TYPE_FP32") -> str:
    return (
        f'name: "{name}"\nplatform: "{platform}"\nmax_batch_size: 8\n'
        f'input [ {{ name: "{inp}" data_type: {dtype} dims: [ {WIDTH} ] }} ]\n'
        f'output [ {{ name: "{out}" data_type: {dtype} dims: [ {WIDTH} ] }} ]\n{BATCHING}\n'
    )


def heavy_onnx() -> bytes:
    """LAYERS x (MatMul WIDTH x WIDTH, Tanh): a forward far longer than its I/O."""
    rng = np.random.default_rng(0)
    nodes, inits, previous = [], [], "INPUT0"
    for layer in range(LAYERS):
        weight = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        inits.append(numpy_helper.from_array(weight, f"w{layer}"))
        nodes.append(helper.make_node("MatMul", [previous, f"w{layer}"], [f"m{layer}"]))
        out = "OUTPUT0" if layer == LAYERS - 1 else f"t{layer}"
        nodes.append(helper.make_node("Tanh", [f"m{layer}"], [out]))
        previous = out
    graph = helper.make_graph(
        nodes,
        "heavy",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", WIDTH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def write(repository, name: str, filename: str, content: bytes, text: str) -> None:
    write_model(repository, name, text, {f"1/{filename}": content})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("phases")
    write(
        repository,
        "ort_heavy",
        "model.onnx",
        heavy_onnx(),
        config("ort_heavy", "onnxruntime_onnx", "INPUT0", "OUTPUT0"),
    )
    if HAS_TORCH:
        import io

        import torch

        class Heavy(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

            def forward(self, x):
                for _ in range(24):  # LAYERS (TorchScript needs the literal)
                    x = torch.tanh(x @ self.weight)
                return x

        for name, module in (("pt_heavy", Heavy()),):
            buffer = io.BytesIO()
            torch.jit.save(torch.jit.script(module), buffer)
            write(
                repository,
                name,
                "model.pt",
                buffer.getvalue(),
                config(name, "pytorch_libtorch", "INPUT__0", "OUTPUT__0"),
            )
    proc = ServerProcess(repository)
    try:
        proc.wait_ready()
        client = httpclient.InferenceServerClient(proc.http_url, concurrency=8)
        yield client
        client.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def concurrently(client, model: str, inp: str, out: str, count: int) -> list:
    """``count`` requests at once (the batcher gathers them): (input, output) pairs."""
    arrays = [np.full((1, WIDTH), i / count, dtype=np.float32) for i in range(count)]
    pending = []
    for array in arrays:
        item = httpclient.InferInput(inp, list(array.shape), "FP32")
        item.set_data_from_numpy(array)
        pending.append(client.async_infer(model, [item]))
    return [(a, p.get_result().as_numpy(out)) for a, p in zip(arrays, pending)]


def phases(client, model: str) -> dict[str, int]:
    stats = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    return {
        name: int(stats[name]["ns"])
        for name in ("compute_input", "compute_infer", "compute_output")
    }


def check_phases(client, model: str, inp: str, out: str) -> None:
    for _ in range(3):
        concurrently(client, model, inp, out, 8)
    measured = phases(client, model)
    assert measured["compute_input"] > 0, measured
    assert measured["compute_output"] > 0, measured
    # The forward is LAYERS matrix products: far longer than gathering the inputs
    # or building the responses (the whole execution is no longer one phase).
    assert measured["compute_infer"] > measured["compute_input"] + measured["compute_output"]


def test_onnxruntime_reports_each_phase(server):
    check_phases(server, "ort_heavy", "INPUT0", "OUTPUT0")


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_pytorch_reports_each_phase(server):
    check_phases(server, "pt_heavy", "INPUT__0", "OUTPUT__0")
