"""benchmarks.served_vs_direct: the ONNX and TorchScript CNNs it generates are the
same model, and the statistics it reads are turned into per-request phases."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.served_vs_direct import (
    CLASSES,
    IMAGE,
    ModelSpec,
    Row,
    _config,
    build_repository,
    direct_runner,
    format_table,
    new_row,
    stats_delta,
    write_cnn_onnx,
    write_cnn_torchscript,
)


def test_onnx_and_torchscript_cnns_agree(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("torch")
    write_cnn_onnx(tmp_path / "model.onnx")
    write_cnn_torchscript(tmp_path / "model.pt")
    ort = direct_runner(
        ModelSpec("cnn_onnx", "onnxruntime", "model.onnx", "INPUT0", "OUTPUT0"),
        tmp_path / "model.onnx",
    )
    torch = direct_runner(
        ModelSpec("cnn_torch", "torch", "model.pt", "INPUT__0", "OUTPUT__0"),
        tmp_path / "model.pt",
    )
    batch = np.random.default_rng(3).random((2, *IMAGE), dtype=np.float32)
    a, b = ort(batch), torch(batch)
    assert a.shape == b.shape == (2, CLASSES)
    assert np.abs(a).max() > 0
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def _stats(executions: int, inferences: int, queue_ns: int, count: int) -> dict:
    phase = {"count": count, "ns": 0}
    return {
        "execution_count": executions,
        "inference_count": inferences,
        "inference_stats": {
            "queue": {"count": count, "ns": queue_ns},
            "compute_input": phase,
            "compute_infer": phase,
            "compute_output": phase,
        },
    }


def test_stats_delta_is_mean_batch_and_us_per_request():
    batch, phases = stats_delta(_stats(2, 2, 1000, 2), _stats(5, 14, 61000, 14))
    assert batch == 4.0  # 12 inferences in 3 executions
    assert phases["queue"] == 5.0  # 60 us over 12 requests
    assert phases["compute_infer"] == 0.0


def test_served_rows_are_compared_with_direct_at_the_batch_the_server_formed():
    direct = Row("cnn_onnx", 8, "direct", requests=800, seconds=8.0)
    direct_b4 = Row("cnn_onnx", 8, "direct b4", requests=1600, seconds=8.0, direct_batch=4)
    http = Row(
        "cnn_onnx", 8, "http", requests=1200, seconds=8.0, batches=[3.9, 4.2], client_cpu=0.6
    )
    lines = format_table([direct, direct_b4, http]).splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]
    assert all(len(row) == len(header) for row in cells)
    assert [row[:6] for row in cells] == [
        ["cnn_onnx", "8", "direct", "100", "", ""],
        ["cnn_onnx", "8", "direct b4", "200", "", ""],
        ["cnn_onnx", "8", "http", "150", "1.50x", "0.75x"],
    ]
    assert cells[1][8] == "4.0"  # a direct row's batch is its own
    # The load generator's CPU per inference: 0.6 s over 1,200; none for direct.
    client = header.index("client CPU ms/inf")
    assert [row[client] for row in cells] == ["-", "-", "0.50"]
    # No CPU by thread was sampled for these rows.
    loop = header.index("loop ms/inf")
    assert [row[loop] for row in cells] == ["-", "-", "-"]


def test_served_cpu_is_split_by_thread_and_compared_with_direct_at_the_formed_batch():
    """Issue 39's ratio: direct's CPU per inference at the batch the server formed
    over the served row's; ``other`` is what neither the loop nor the instance ran."""
    direct = Row("cnn_onnx", 8, "direct", requests=800, seconds=8.0, cpu=4.0, instance_cpu=3.2)
    direct_b4 = Row(
        "cnn_onnx",
        8,
        "direct b4",
        requests=1000,
        seconds=8.0,
        direct_batch=4,
        cpu=3.6,
        instance_cpu=3.6,
    )
    http = Row(
        "cnn_onnx",
        8,
        "http",
        requests=1000,
        seconds=8.0,
        batches=[3.9, 4.2],
        cpu=4.5,
        loop_cpu=0.4,
        instance_cpu=3.8,
    )
    no_threads = Row("cnn_onnx", 8, "grpc", requests=1000, seconds=8.0, batches=[4.0], cpu=4.0)
    lines = format_table([direct, direct_b4, http, no_threads]).splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]
    assert all(len(row) == len(header) for row in cells)
    other, ratio = header.index("other ms/inf"), header.index("direct / served CPU")
    # direct: 4.0 s of process CPU, 3.2 of it the calling thread, over 800.
    assert [row[other] for row in cells] == ["1.00", "0.00", "0.30", "-"]
    # 3.6 ms (direct at batch 4) over 4.5 and 4.0 ms; direct rows have none.
    assert [row[ratio] for row in cells] == ["-", "-", "0.80", "0.90"]


def test_repository_variants_at_other_delays_and_session_parameters(tmp_path):
    pytest.importorskip("onnx")
    specs = build_repository(
        tmp_path,
        ["cnn_onnx"],
        False,
        print,
        cpu_delays=(500, 0),
        ort_variants={"spin": {"session.intra_op.allow_spinning": "1"}},
    )
    assert [spec.name for spec in specs] == ["cnn_onnx", "cnn_onnx_d0", "cnn_onnx_spin"]
    d0 = (tmp_path / "cnn_onnx_d0" / "config.pbtxt").read_text()
    assert "max_queue_delay_microseconds: 0 " in d0
    spin = (tmp_path / "cnn_onnx_spin" / "config.pbtxt").read_text()
    assert 'key: "session.intra_op.allow_spinning" value: { string_value: "1" }' in spin
    assert "max_queue_delay_microseconds: 500 " in spin
    assert (tmp_path / "cnn_onnx_spin" / "1" / "model.onnx").exists()


def test_direct_above_the_max_batch_is_the_max_batch_and_served_rows_compare_with_it():
    """At c=32 on a model of max batch 16, direct runs batch 16: its row says so,
    and a served row that formed batches of 16 is compared with it."""
    spec = ModelSpec("resnet50_torch", "torch", "model.pt", "INPUT__0", "OUTPUT__0", gpu=True)
    assert new_row(spec, 32, "direct").direct_batch == 16
    assert new_row(spec, 16, "direct").direct_batch == 0  # its concurrency
    assert new_row(spec, 32, "http").direct_batch == 0
    direct = replace(new_row(spec, 32, "direct"), requests=4000, seconds=1.0)
    http = replace(new_row(spec, 32, "http"), requests=3600, seconds=1.0, batches=[15.8])
    lines = format_table([direct, http]).splitlines()
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]
    assert cells[0][8] == "16.0"
    assert cells[1][4:6] == ["0.90x", "0.90x"]


def test_a_model_whose_framework_is_missing_leaves_no_folder(tmp_path, monkeypatch):
    """A host without torch serves the ONNX model alone: the TorchScript model's
    folder is gone, not left without its file (the server refuses a repository
    holding a model it cannot name the backend of)."""
    pytest.importorskip("onnx")
    import benchmarks.served_vs_direct as svd

    def no_torch(path):
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(svd, "write_cnn_torchscript", no_torch)
    logged: list[str] = []
    specs = build_repository(tmp_path, ["cnn_onnx", "cnn_torch"], False, logged.append)
    assert [spec.name for spec in specs] == ["cnn_onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn_onnx"]
    assert logged == ["cnn_torch: skipped (No module named 'torch')"]


def test_cuda_shm_regions_are_made_and_filled_under_one_lock(monkeypatch):
    """tritonclient makes its per-device CUDA stream on first use without a lock,
    and the stream that loses a race between two threads is destroyed under the
    other (a segmentation fault at c=16 on a GPU): each worker thread of a client
    process makes and fills its regions holding the process's one lock."""
    import types

    import benchmarks.served_vs_direct as svd

    held: list[tuple[str, bool]] = []
    fake = types.ModuleType("tritonclient.utils.cuda_shared_memory")

    def create_shared_memory_region(name, size, device):
        held.append(("create", svd._CUDA_SHM_SETUP.locked()))
        return types.SimpleNamespace(name=name)

    def set_shared_memory_region(region, values):
        held.append(("set", svd._CUDA_SHM_SETUP.locked()))

    fake.create_shared_memory_region = create_shared_memory_region
    fake.set_shared_memory_region = set_shared_memory_region
    fake.get_raw_handle = lambda region: b"handle"
    utils = pytest.importorskip("tritonclient.utils")
    monkeypatch.setitem(sys.modules, "tritonclient.utils.cuda_shared_memory", fake)
    monkeypatch.setattr(utils, "cuda_shared_memory", fake, raising=False)

    class Settable:
        def __init__(self, *args, **kwargs) -> None:
            self.regions: list[tuple[str, int]] = []

        def set_shared_memory(self, name, size) -> None:
            self.regions.append((name, size))

    client = types.SimpleNamespace(register_cuda_shared_memory=lambda *args: None)
    module = types.SimpleNamespace(InferRequestedOutput=Settable)
    workload = svd.ImageWorkload("cuda_shm", "cuda_shm", "m", "INPUT__0", "OUTPUT__0")
    data = np.zeros((1, *IMAGE), np.float32)
    tensor = Settable()
    svd._shm_call(workload, client, module, tensor, data)
    assert held == [("create", True), ("create", True), ("set", True)]
    assert not svd._CUDA_SHM_SETUP.locked()
    assert tensor.regions == [(tensor.regions[0][0], data.nbytes)]


def test_the_graphs_variant_asks_for_cuda_graphs():
    spec = ModelSpec("resnet50_torch", "torch", "model.pt", "INPUT__0", "OUTPUT__0", gpu=True)
    plain = _config(spec, 100)
    assert "optimization" not in plain
    graphs = _config(replace(spec, name="resnet50_torch_graphs", graphs=True), 100)
    assert graphs.startswith(plain.replace("resnet50_torch", "resnet50_torch_graphs"))
    assert graphs.endswith("optimization { cuda { graphs: true } }\n")
    assert "kind: KIND_GPU" in graphs


def test_onnx_runtime_on_the_cpu_computes_on_one_thread_on_both_sides():
    """The served CNN's config asks for one intra-op thread, as the direct session
    has: the two sides do the same work on the same threads (a GPU model keeps
    ONNX Runtime's defaults; a variant's parameters add to the one thread)."""
    cpu = ModelSpec("cnn_onnx", "onnxruntime", "model.onnx", "INPUT0", "OUTPUT0")
    key = 'key: "intra_op_thread_count" value: { string_value: "1" }'
    assert key in _config(cpu, 500)
    assert key in _config(cpu, 500, {"session.intra_op.allow_spinning": "1"})
    assert key not in _config(replace(cpu, gpu=True), 100)
    torch = ModelSpec("cnn_torch", "torch", "model.pt", "INPUT__0", "OUTPUT__0")
    assert "intra_op_thread_count" not in _config(torch, 500)
