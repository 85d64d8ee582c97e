"""A model served by trionserve against the same model run directly in its framework.

Usage:
    python -m benchmarks.served_vs_direct [--duration 3] [--warmup 1] [--rounds 1]
        [--concurrency 1,8] [--paths http,grpc,shm,inproc] [--models cnn_onnx,cnn_torch]
        [--delay-us 500[,0]] [--ort-variant NAME:KEY=VALUE[,KEY=VALUE]]
        [--client-processes N] [--gpu auto|off] [--graphs]

One run, one table. The models are generated at run time into a temporary
repository:

- ``cnn_onnx`` / ``cnn_torch``: a small CNN on the CPU (FP32 [N,3,224,224] in,
  602 KB a request: Conv 3->32 3x3 + ReLU, Conv 32->32 3x3 stride 2 + ReLU, global
  average pool, MatMul to 1000), as ONNX (written with the ``onnx`` helper) served by
  the ONNX Runtime backend and as TorchScript served by the PyTorch backend (where
  torch is installed). One instance, ``dynamic_batching`` with a 500 us delay
  (``--delay-us``; each further delay adds the same model as ``<model>_d<delay>``,
  so ``--delay-us 500,0`` shows what the delay costs a lone request, which waits
  it out in full as in Triton's dynamic batcher; ``--ort-variant
  spin:session.intra_op.allow_spinning=1`` adds each ONNX Runtime model again as
  ``<model>_spin`` with those config parameters).
- on a GPU (lazily; skipped without one): ``resnet50_torch`` (TorchScript, needs
  torchvision; random weights) and ``resnet50_onnx`` on ONNX Runtime's CUDA
  provider (needs onnxruntime-gpu), one KIND_GPU instance, max batch 16, 100 us
  delay; ``--graphs`` adds ``resnet50_torch_graphs``, the same TorchScript model
  with ``optimization { cuda { graphs: true } }``, whose ``direct`` replays a CUDA
  graph captured per batch size with pinned staging (the framework at its best).

For each model and concurrency C, in turn and rotated each round:

- ``direct``: the same file loaded in its framework in this process
  (``onnxruntime.InferenceSession`` with the options the backend gives the
  served model: on the CPU one intra-op thread (``intra_op_thread_count`` "1"
  in the served config too) and idle threads that sleep;
  ``torch.jit.load`` under ``inference_mode``), one thread calling it on batch C,
  numpy in and out (at batch min(C, 16) where C exceeds the models' max batch);
- ``http``, ``grpc``: tritonclient (client processes of benchmarks.loadgen, C
  closed-loop workers), one request of batch 1 each, binary tensors;
- ``shm``: HTTP with input and output in system shared memory (a region per worker);
- ``cuda_shm``: the same in CUDA shared memory (GPU only);
- ``inproc``: ``trionserve.api.Server`` inside a process of its own, C threads
  calling ``model.infer``.

After the rounds at a concurrency C, ``direct bN`` runs the model directly at each
batch size N the server formed there (its mean batch, rounded) that is not C: a
closed loop of C clients on one instance forms smaller batches than C (while one
batch computes, the other clients' requests wait for the next), so ``x formed``
compares each served row with the framework at the batch the server ran.

Reported per row: infer/s and its ratio to ``direct`` at the same C, p50/p99 of a
request (of a batch-C call for ``direct``), the batch the server formed (its
statistics: inferences / executions), the statistics extension's mean phases per
request (queue, compute_input, compute_infer, compute_output, in us), the CPU time
per inference (the server's process tree; for ``inproc`` the process that holds
both the server and its calling threads; for ``direct`` this process) and, for
the served paths, how much of it ran on the event loop (the server's main
thread) and on the instance's thread (which calls the framework, as ``direct``
does; the rest is the framework's own threads and worker threads; for
``direct``, ``instance`` is the thread that calls the framework), what is left
(``other``: the framework's own threads, worker threads, child processes), issue
39's ratio of CPU per inference (``direct / served CPU``: direct at the batch the
server formed over the served row's), the load
generator's CPU time per inference (its client processes: what tritonclient
costs on the same cores; none for ``direct`` and ``inproc``) and the GPU's mean
utilisation over the window (NVML) when one is present.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from benchmarks.loadgen import ClientPool, LoadResult
from benchmarks.matrix import cpu_seconds, start_trionserve, thread_cpu_seconds, tree_pids
from trionserve.testing import free_port

IMAGE = (3, 224, 224)
CLASSES = 1000
# ONNX Runtime on the CPU computes with one intra-op thread on both sides (the
# served model's config parameter, the direct session's option), with idle
# threads sleeping as the backend has them: the comparison is of the same work
# on the same thread count, which two cores can hold.
ORT_CPU_PARAMETERS = {"intra_op_thread_count": "1"}
PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
CPU_PATHS = ("http", "grpc", "shm", "inproc")


# ------------------------------------------------------------------------ models


@dataclass(frozen=True)
class ModelSpec:
    """A model of the repository: its name, tensors, and how to run it directly."""

    name: str
    framework: str  # "onnxruntime" or "torch"
    file: str  # model.onnx / model.pt
    input_name: str
    output_name: str
    gpu: bool = False
    max_batch: int = 16
    graphs: bool = False  # optimization { cuda { graphs: true } }


def _cnn_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def he(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    return {
        "w1": he((32, 3, 3, 3), 27),
        "b1": np.zeros(32, np.float32),
        "w2": he((32, 32, 3, 3), 288),
        "b2": np.zeros(32, np.float32),
        "w3": he((32, CLASSES), 32),
    }


def write_cnn_onnx(path: Path) -> None:
    """The small CNN as an ONNX graph, written with onnx's helper (opset 17)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = _cnn_weights()
    nodes = [
        helper.make_node("Conv", ["INPUT0", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node(
            "Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]
        ),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "w3"], ["OUTPUT0"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["N", *IMAGE])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["N", CLASSES])],
        initializer=[numpy_helper.from_array(array, name) for name, array in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_cnn_torchscript(path: Path) -> None:
    """The same CNN, same weights, traced to TorchScript."""
    import torch

    w = {k: torch.from_numpy(v) for k, v in _cnn_weights().items()}

    class Cnn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 32, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(32, 32, 3, stride=2, padding=1)
            self.fc = torch.nn.Parameter(w["w3"].clone())
            with torch.no_grad():
                self.conv1.weight.copy_(w["w1"])
                self.conv1.bias.copy_(w["b1"])
                self.conv2.weight.copy_(w["w2"])
                self.conv2.bias.copy_(w["b2"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.conv1(x))
            x = torch.relu(self.conv2(x))
            return x.mean(dim=(2, 3)) @ self.fc

    module = Cnn().eval()
    with torch.no_grad():
        traced = torch.jit.trace(module, torch.zeros(1, *IMAGE))
    traced.save(str(path))


def write_resnet50(torch_path: Path | None, onnx_path: Path | None) -> None:
    """torchvision's resnet50 (random weights) as TorchScript and/or ONNX."""
    import torch
    import torchvision

    module = torchvision.models.resnet50(weights=None).eval()
    example = torch.zeros(1, *IMAGE)
    with torch.no_grad():
        if torch_path is not None:
            torch.jit.trace(module, example).save(str(torch_path))
        if onnx_path is not None:
            torch.onnx.export(
                module,
                (example,),
                str(onnx_path),
                input_names=["INPUT0"],
                output_names=["OUTPUT0"],
                dynamic_axes={"INPUT0": {0: "N"}, "OUTPUT0": {0: "N"}},
                opset_version=17,
                dynamo=False,
            )


def _config(spec: ModelSpec, delay_us: int, parameters: Mapping[str, str] | None = None) -> str:
    backend = "onnxruntime" if spec.framework == "onnxruntime" else "pytorch"
    kind = "KIND_GPU" if spec.gpu else "KIND_CPU"
    if spec.framework == "onnxruntime" and not spec.gpu:
        parameters = {**ORT_CPU_PARAMETERS, **(parameters or {})}
    extra = "".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        for key, value in (parameters or {}).items()
    )
    return (
        extra
        + f"""name: "{spec.name}"
backend: "{backend}"
max_batch_size: {spec.max_batch}
input [{{ name: "{spec.input_name}" data_type: TYPE_FP32 dims: [3, 224, 224] }}]
output [{{ name: "{spec.output_name}" data_type: TYPE_FP32 dims: [{CLASSES}] }}]
instance_group [{{ count: 1 kind: {kind} }}]
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
"""
        + ("optimization { cuda { graphs: true } }\n" if spec.graphs else "")
    )


def has_gpu() -> bool:
    """A CUDA device this process can use (NVML's count, else torch's)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        pass
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def build_repository(
    root: Path,
    wanted: list[str],
    gpu: bool,
    log,
    cpu_delays: Sequence[int] = (500,),
    ort_variants: Mapping[str, Mapping[str, str]] | None = None,
    graphs: bool = False,
) -> list[ModelSpec]:
    """Write the wanted models that this machine can run; log why others are left out.

    The CPU models get the first of ``cpu_delays`` as their batch delay (us); each
    further delay adds a copy named ``<model>_d<delay>``. Each of ``ort_variants``
    (name -> config parameters) adds a copy of every ONNX Runtime model named
    ``<model>_<name>`` with those parameters. ``graphs`` adds each GPU TorchScript
    model again as ``<model>_graphs`` with CUDA graphs on."""
    specs: list[ModelSpec] = []

    def add(spec: ModelSpec, write: Callable[[Path], None], delay_us: int) -> None:
        if spec.name not in wanted:
            return
        directory = root / spec.name
        (directory / "1").mkdir(parents=True)
        try:
            write(directory / "1" / spec.file)
        except ImportError as exc:
            # Leave no version folder without its model file: the server would
            # refuse the whole repository over it.
            shutil.rmtree(directory)
            log(f"{spec.name}: skipped ({exc})")
            return
        (directory / "config.pbtxt").write_text(_config(spec, delay_us))
        specs.append(spec)
        copies: list[tuple[ModelSpec, int, Mapping[str, str]]] = []
        # The same model at the other delays asked for, e.g. cnn_onnx_d0.
        for other in cpu_delays[1:] if not spec.gpu else ():
            copies.append((replace(spec, name=f"{spec.name}_d{other}"), other, {}))
        # ... and with other session parameters, e.g. cnn_onnx_spin.
        for suffix, parameters in (ort_variants or {}).items():
            if spec.framework == "onnxruntime":
                copies.append((replace(spec, name=f"{spec.name}_{suffix}"), delay_us, parameters))
        # ... and with CUDA graphs, e.g. resnet50_torch_graphs.
        if graphs and spec.gpu and spec.framework == "torch":
            copies.append((replace(spec, name=f"{spec.name}_graphs", graphs=True), delay_us, {}))
        for variant, delay, parameters in copies:
            name = variant.name
            shutil.copytree(directory / "1", root / name / "1")
            (root / name / "config.pbtxt").write_text(_config(variant, delay, parameters))
            specs.append(variant)

    add(
        ModelSpec("cnn_onnx", "onnxruntime", "model.onnx", "INPUT0", "OUTPUT0"),
        write_cnn_onnx,
        cpu_delays[0],
    )
    add(
        ModelSpec("cnn_torch", "torch", "model.pt", "INPUT__0", "OUTPUT__0"),
        write_cnn_torchscript,
        cpu_delays[0],
    )
    if not gpu:
        gpu_models = [n for n in wanted if n.startswith("resnet50")]
        if gpu_models:
            log(f"{', '.join(gpu_models)}: skipped (no GPU)")
        return specs
    add(
        ModelSpec("resnet50_torch", "torch", "model.pt", "INPUT__0", "OUTPUT__0", gpu=True),
        lambda path: write_resnet50(path, None),
        100,
    )
    try:
        import onnxruntime as ort

        cuda_ort = "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        cuda_ort = False
    if cuda_ort:
        add(
            ModelSpec("resnet50_onnx", "onnxruntime", "model.onnx", "INPUT0", "OUTPUT0", gpu=True),
            lambda path: write_resnet50(None, path),
            100,
        )
    elif "resnet50_onnx" in wanted:
        log("resnet50_onnx: skipped (onnxruntime has no CUDAExecutionProvider)")
    return specs


# ------------------------------------------------------------------- direct runs


def direct_runner(spec: ModelSpec, path: Path) -> Callable[[np.ndarray], np.ndarray]:
    """The model loaded in its own framework: numpy in, numpy out."""
    if spec.framework == "onnxruntime":
        import onnxruntime as ort

        providers = ["CUDAExecutionProvider"] if spec.gpu else ["CPUExecutionProvider"]
        options = ort.SessionOptions()
        if not spec.gpu:  # as the served model: one intra-op thread, idle ones sleep
            options.intra_op_num_threads = int(ORT_CPU_PARAMETERS["intra_op_thread_count"])
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        session = ort.InferenceSession(str(path), options, providers=providers)
        name = spec.input_name

        def run_ort(batch: np.ndarray) -> np.ndarray:
            return session.run(None, {name: batch})[0]

        return run_ort
    import torch

    device = torch.device("cuda:0" if spec.gpu else "cpu")
    module = torch.jit.load(str(path), map_location=device).eval()
    if spec.graphs:
        return graph_runner(torch, module, device)

    def run_torch(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(batch).to(device)).cpu().numpy()

    return run_torch


def graph_runner(torch, module, device) -> Callable[[np.ndarray], np.ndarray]:
    """``module`` captured as a CUDA graph per batch size (on first use), replayed
    with pinned staging: numpy into a pinned buffer, copied to the graph's static
    input, replayed, the static output copied to a pinned buffer, then numpy."""
    stream = torch.cuda.Stream(device)
    graphs: dict[int, tuple] = {}

    def capture(batch: int) -> tuple:
        with torch.inference_mode(), torch.cuda.device(device), torch.cuda.stream(stream):
            static_in = torch.zeros((batch, *IMAGE), device=device)
            for _ in range(3):
                module(static_in)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                static_out = module(static_in)
        pinned_in = torch.empty((batch, *IMAGE), pin_memory=True)
        pinned_out = torch.empty(tuple(static_out.shape), pin_memory=True)
        return graph, static_in, static_out, pinned_in, pinned_out

    def run_graph(batch: np.ndarray) -> np.ndarray:
        size = batch.shape[0]
        if size not in graphs:
            graphs[size] = capture(size)
        graph, static_in, static_out, pinned_in, pinned_out = graphs[size]
        pinned_in.numpy()[...] = batch
        with torch.inference_mode(), torch.cuda.stream(stream):
            static_in.copy_(pinned_in, non_blocking=True)
            graph.replay()
            pinned_out.copy_(static_out, non_blocking=True)
        stream.synchronize()  # the pinned buffers are reused by the next call
        return pinned_out.numpy().copy()

    return run_graph


def run_direct(
    run: Callable[[np.ndarray], np.ndarray], batch: int, duration: float, warmup: float
) -> tuple[LoadResult, float, float]:
    """One thread calling ``run`` on batch ``batch``; (result counting inferences,
    CPU seconds of this process over the window, of which the calling thread's:
    the rest is the framework's own threads)."""
    data = np.random.default_rng(1).random((batch, *IMAGE), dtype=np.float32)
    end_warmup = time.monotonic() + warmup
    while time.monotonic() < end_warmup:
        run(data)
    latencies: list[float] = []
    cpu_before, thread_before = time.process_time(), time.thread_time()
    began = time.monotonic()
    stop_at = began + duration
    while time.monotonic() < stop_at:
        t0 = time.perf_counter()
        out = run(data)
        latencies.append((time.perf_counter() - t0) * 1000)
        if out.shape != (batch, CLASSES):
            raise RuntimeError(f"direct run answered shape {out.shape}")
    seconds = time.monotonic() - began
    cpu, thread = time.process_time() - cpu_before, time.thread_time() - thread_before
    result = LoadResult("direct", batch, len(latencies) * batch, 0, seconds, latencies)
    return result, cpu, thread


# ------------------------------------------------------------ served workloads


@dataclass(frozen=True)
class ImageWorkload:
    """One request of batch 1 of a ModelSpec over ``path`` (http, grpc, shm,
    cuda_shm, inproc); what benchmarks.loadgen.ClientPool runs per thread."""

    name: str
    path: str
    model: str
    input_name: str
    output_name: str
    # inproc: the repository the process's own server serves, and its HTTP port
    # (for the statistics)
    repository: str = ""
    stats_port: int = 0

    def make_call(self, url: str) -> tuple[Callable[[], None], Callable[[], None]]:
        data = np.random.default_rng(1).random((1, *IMAGE), dtype=np.float32)
        expected = (1, CLASSES)
        if self.path == "inproc":
            return _inproc_call(self, data)
        if self.path == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        client = (
            module.InferenceServerClient(url)
            if self.path == "grpc"
            else module.InferenceServerClient(url, connection_timeout=60, network_timeout=60)
        )
        tensor = module.InferInput(self.input_name, list(data.shape), "FP32")
        if self.path in ("http", "grpc"):
            tensor.set_data_from_numpy(data)
            inputs = [tensor]
            output_name = self.output_name

            def call() -> None:
                out = client.infer(self.model, inputs).as_numpy(output_name)
                if out is None or out.shape != expected:
                    raise RuntimeError(f"unexpected {output_name}: {out}")

            return call, client.close
        return _shm_call(self, client, module, tensor, data)


# The set-up of a worker's CUDA shared memory regions, one thread at a time (_shm_call).
_CUDA_SHM_SETUP = threading.Lock()


def _shm_call(workload: ImageWorkload, client, module, tensor, data: np.ndarray):
    """Input and output in shared memory regions of this thread (system or CUDA)."""
    tag = f"svd_{os.getpid()}_{threading.get_ident()}"
    in_size, out_size = data.nbytes, CLASSES * 4
    output = module.InferRequestedOutput(workload.output_name, binary_data=True)
    if workload.path == "shm":
        import tritonclient.utils.shared_memory as shm

        regions = [
            shm.create_shared_memory_region(f"{tag}_in", f"/{tag}_in", in_size),
            shm.create_shared_memory_region(f"{tag}_out", f"/{tag}_out", out_size),
        ]
        try:
            shm.set_shared_memory_region(regions[0], [data])
            client.register_system_shared_memory(f"{tag}_in", f"/{tag}_in", in_size)
            client.register_system_shared_memory(f"{tag}_out", f"/{tag}_out", out_size)
        except BaseException:
            for region in regions:
                shm.destroy_shared_memory_region(region)
            raise

        def close() -> None:
            client.unregister_system_shared_memory(f"{tag}_in")
            client.unregister_system_shared_memory(f"{tag}_out")
            for region in regions:
                shm.destroy_shared_memory_region(region)
            client.close()

    else:
        import tritonclient.utils.cuda_shared_memory as shm

        # One worker thread at a time: tritonclient creates its per-device CUDA
        # stream on first use without a lock (_get_or_create_global_cuda_stream),
        # so two threads' first copies each create one, and the stream that loses
        # the race is destroyed by its __del__ while the other thread copies on it
        # (a segmentation fault at c=16). Once made, the stream is only read.
        with _CUDA_SHM_SETUP:
            regions = [
                shm.create_shared_memory_region(f"{tag}_in", in_size, 0),
                shm.create_shared_memory_region(f"{tag}_out", out_size, 0),
            ]
            shm.set_shared_memory_region(regions[0], [data])
        client.register_cuda_shared_memory(f"{tag}_in", shm.get_raw_handle(regions[0]), 0, in_size)
        client.register_cuda_shared_memory(
            f"{tag}_out", shm.get_raw_handle(regions[1]), 0, out_size
        )

        def close() -> None:
            client.unregister_cuda_shared_memory(f"{tag}_in")
            client.unregister_cuda_shared_memory(f"{tag}_out")
            for region in regions:
                shm.destroy_shared_memory_region(region)
            client.close()

    tensor.set_shared_memory(f"{tag}_in", in_size)
    output.set_shared_memory(f"{tag}_out", out_size)
    out_region = regions[1]

    def call() -> None:
        client.infer(workload.model, [tensor], outputs=[output])
        out = shm.get_contents_as_numpy(out_region, np.float32, [1, CLASSES])
        if not np.isfinite(out[0, 0]):
            raise RuntimeError("output not finite")

    return call, close


_INPROC: dict[str, object] = {}
_INPROC_LOCK = threading.Lock()


def _inproc_call(workload: ImageWorkload, data: np.ndarray):
    """A call into this process's own in-process server (started by its first caller)."""
    from trionserve import api

    with _INPROC_LOCK:
        server = _INPROC.get(workload.repository)
        if server is None:
            server = api.Server(model_repository=workload.repository)
            server.start(wait_until_ready=True, timeout=120)
            server.attach_http("127.0.0.1", workload.stats_port)
            _INPROC[workload.repository] = server
    model = server.model(workload.model)  # type: ignore[attr-defined]
    inputs = {workload.input_name: data}
    output_name = workload.output_name

    def call() -> None:
        for response in model.infer(inputs=inputs):
            out = np.from_dlpack(response.outputs[output_name])  # Triton's Tensor
            if out.shape != (1, CLASSES):
                raise RuntimeError(f"unexpected {output_name}: {out.shape}")

    return call, lambda: None


# --------------------------------------------------------------- measurements


def model_stats(http_url: str, model: str) -> dict:
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=30) as r:
        return json.load(r)["model_stats"][0]


def stats_delta(before: dict, after: dict) -> tuple[float, dict[str, float]]:
    """(mean batch, mean us per request of each phase) between two statistics."""
    executions = after["execution_count"] - before["execution_count"]
    inferences = after["inference_count"] - before["inference_count"]
    phases = {}
    for phase in PHASES:
        count = after["inference_stats"][phase]["count"] - before["inference_stats"][phase]["count"]
        ns = after["inference_stats"][phase]["ns"] - before["inference_stats"][phase]["ns"]
        phases[phase] = ns / count / 1000 if count else float("nan")
    return (inferences / executions if executions else float("nan")), phases


class GpuSampler:
    """The GPU's utilisation sampled by NVML every 20 ms while it runs (None without one)."""

    def __init__(self, enabled: bool) -> None:
        self.handle = None
        if enabled:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def mean_between(self, start_at: float, stop_at: float) -> float | None:
        if self.handle is None:
            return None
        import pynvml

        time.sleep(max(0.0, start_at - time.monotonic()))
        samples = []
        while time.monotonic() < stop_at:
            samples.append(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            time.sleep(0.02)
        return sum(samples) / len(samples) if samples else None


@dataclass
class Row:
    model: str
    concurrency: int
    path: str
    requests: int = 0
    seconds: float = 0.0
    errors: int = 0
    cpu: float = 0.0
    # The load generator's CPU seconds (its client processes), None where it is
    # not apart from the server (direct, inproc).
    client_cpu: float | None = None
    # The server's CPU seconds on its event loop and its instances' threads (the
    # rest of ``cpu`` is its other threads and processes); for direct, the
    # calling thread's as ``instance_cpu``; None for inproc.
    loop_cpu: float | None = None
    instance_cpu: float | None = None
    latencies_ms: list[float] = field(default_factory=list)
    batches: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    gpu: list[float] = field(default_factory=list)
    first_error: str = ""
    direct_batch: int = 0  # a direct row's batch (0: its concurrency)

    def add(self, result: LoadResult, cpu: float, client_cpu: float | None = None) -> None:
        self.requests += result.requests
        self.seconds += result.seconds
        self.errors += result.errors
        self.cpu += cpu
        if client_cpu is not None:
            self.client_cpu = (self.client_cpu or 0.0) + client_cpu
        self.latencies_ms.extend(result.latencies_ms)
        self.first_error = self.first_error or result.first_error

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, p: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def new_row(spec: ModelSpec, concurrency: int, path: str) -> Row:
    """The row of one (model, concurrency, path) point. ``direct`` at a concurrency
    above the model's max batch runs (and says it runs) the max batch."""
    batch = min(concurrency, spec.max_batch) if path == "direct" else 0
    return Row(spec.name, concurrency, path, direct_batch=batch if batch != concurrency else 0)


def _mean(values: list[float]) -> float:
    known = [v for v in values if v == v]
    return sum(known) / len(known) if known else float("nan")


def format_table(rows: list[Row]) -> str:
    head = (
        "| model | c | path | infer/s | x direct | x formed | p50 ms | p99 ms | batch | queue us "
        "| input us | infer us | output us | CPU ms/inf | loop ms/inf | instance ms/inf "
        "| other ms/inf | direct / served CPU | client CPU ms/inf | GPU % |"
    )
    lines = [head, "|" + " --- |" * 3 + " ---: |" * 17]
    direct = {(r.model, r.concurrency): r.rate for r in rows if r.path == "direct"}
    direct_at = {
        (r.model, r.concurrency, r.direct_batch or r.concurrency): r.rate
        for r in rows
        if r.path.startswith("direct")
    }
    direct_cpu_at = {
        (r.model, r.concurrency, r.direct_batch or r.concurrency): r.cpu / r.requests * 1000
        for r in rows
        if r.path.startswith("direct") and r.requests
    }
    for r in rows:
        is_direct = r.path.startswith("direct")
        reference = direct.get((r.model, r.concurrency), 0.0)
        ratio = f"{r.rate / reference:.2f}x" if reference and not is_direct else ""
        cpu = r.cpu / r.requests * 1000 if r.requests else float("nan")
        client = (
            f"{r.client_cpu / r.requests * 1000:.2f}"
            if r.client_cpu is not None and r.requests
            else "-"
        )
        loop, instance = (
            f"{seconds / r.requests * 1000:.2f}" if seconds is not None and r.requests else "-"
            for seconds in (r.loop_cpu, r.instance_cpu)
        )
        phases = {p: _mean([ph[p] for ph in r.phases]) for p in PHASES}
        batch = float(r.direct_batch or r.concurrency) if is_direct else _mean(r.batches)
        formed = 0.0
        if not is_direct and batch == batch:
            formed = direct_at.get((r.model, r.concurrency, max(1, round(batch))), 0.0)
        ratio_formed = f"{r.rate / formed:.2f}x" if formed else ""
        # Issue 39's figure: the framework's CPU per inference called directly at
        # the batch the server formed, over the served CPU per inference.
        direct_cpu = (
            direct_cpu_at.get((r.model, r.concurrency, max(1, round(batch))), 0.0)
            if not is_direct and batch == batch
            else 0.0
        )
        cpu_ratio = f"{direct_cpu / cpu:.2f}" if direct_cpu and cpu == cpu and cpu else "-"
        # What neither the loop nor the instance's thread ran (for direct: the
        # framework's own threads beside the calling one).
        other = (
            f"{(r.cpu - (r.loop_cpu or 0.0) - r.instance_cpu) / r.requests * 1000:.2f}"
            if r.instance_cpu is not None and r.requests
            else "-"
        )

        def fmt(value: float, spec: str = ".0f") -> str:
            return "-" if value != value else format(value, spec)

        gpu = fmt(_mean(r.gpu)) if r.gpu else "-"
        lines.append(
            f"| {r.model} | {r.concurrency} | {r.path} | {r.rate:,.0f} | {ratio} | {ratio_formed} "
            f"| {r.percentile(50):.2f} | {r.percentile(99):.2f} | {fmt(batch, '.1f')} "
            + " ".join(f"| {fmt(phases[p])}" for p in PHASES)
            + f" | {cpu:.2f} | {loop} | {instance} | {other} | {cpu_ratio} | {client} | {gpu} |"
        )
        if r.errors:
            lines.append(f"|   errors: {r.errors}, first: {r.first_error[:150]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per point")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each point")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, the order rotated")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated (default 1,8)")
    parser.add_argument(
        "--paths", default=None, help=f"served paths (default {','.join(CPU_PATHS)}, +cuda_shm)"
    )
    parser.add_argument(
        "--models",
        default="cnn_onnx,cnn_torch,resnet50_torch,resnet50_onnx",
        help="models (the resnet50 ones run on a GPU only)",
    )
    parser.add_argument(
        "--delay-us",
        default="500",
        help="the CPU models' max_queue_delay_microseconds, comma-separated: each delay "
        "after the first adds <model>_d<delay> (e.g. 500,0)",
    )
    parser.add_argument(
        "--ort-variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="add each ONNX Runtime model again as <model>_NAME with these config "
        "parameters (e.g. spin:session.intra_op.allow_spinning=1); repeatable",
    )
    parser.add_argument("--client-processes", type=int, default=None)
    parser.add_argument("--gpu", choices=("auto", "off"), default="auto")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="on a GPU, add resnet50_torch_graphs (CUDA graphs on) against direct graph replay",
    )
    parser.add_argument(
        "--server-flags", default="", help="extra trionserve flags (one string, shell-split)"
    )
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if not all(0 < c <= 64 for c in concurrencies):
        raise SystemExit("each concurrency must be in 1..64")
    gpu = args.gpu == "auto" and has_gpu()
    paths = (args.paths or ",".join(CPU_PATHS + (("cuda_shm",) if gpu else ()))).split(",")
    log = lambda line: print(line, flush=True)  # noqa: E731

    import shlex

    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="svd-")))
        repository = root / "models"
        delays = [int(d) for d in args.delay_us.split(",")]
        variants = {}
        for option in args.ort_variant:
            name, _, pairs = option.partition(":")
            variants[name] = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
        specs = build_repository(
            repository, args.models.split(","), gpu, log, delays, variants, args.graphs
        )
        if not specs:
            raise SystemExit("no model to run")
        flags = shlex.split(args.server_flags)
        if {"shm", "cuda_shm"} & set(paths):
            flags.append("--allow-client-shm=true")
        server, target = start_trionserve("trionserve", repository=repository, args=flags)
        stack.callback(server.stop)
        pool = stack.enter_context(ClientPool(args.client_processes))
        inproc_pool = stack.enter_context(ClientPool(1)) if "inproc" in paths else None
        inproc_port = free_port()
        sampler = GpuSampler(gpu)
        log(
            f"host: {os.cpu_count()} CPUs, GPU: {'yes' if gpu else 'none'}; "
            f"{args.duration:g} s x {args.rounds} round(s) per point; models "
            f"{', '.join(s.name for s in specs)}; paths direct, {', '.join(paths)}"
        )
        rows: dict[tuple[str, int, str], Row] = {}
        for spec in specs:
            runner = direct_runner(spec, repository / spec.name / "1" / spec.file)
            if inproc_pool is not None:  # start its server outside any measured window
                warm = ImageWorkload(
                    "inproc",
                    "inproc",
                    spec.name,
                    spec.input_name,
                    spec.output_name,
                    str(repository),
                    inproc_port,
                )
                inproc_pool.run(warm, "127.0.0.1:0", 1, 0.2, warmup=0.0, max_requests=5)
            for concurrency in concurrencies:
                order = ["direct", *paths]
                for round_index in range(args.rounds):
                    shift = round_index % len(order)
                    for path in order[shift:] + order[:shift]:
                        row = rows.setdefault(
                            (spec.name, concurrency, path), new_row(spec, concurrency, path)
                        )
                        _point(
                            row, spec, path, runner, target, pool, inproc_pool, inproc_port,
                            repository, sampler, args,
                        )  # fmt: skip
                        log(
                            f"  {spec.name:<15} c={concurrency:<3} {path:<9} "
                            f"{row.rate:9.1f} infer/s  errors {row.errors}"
                            + (f" ({row.first_error[:120]})" if row.first_error else "")
                        )
                # Direct at the batch sizes the server formed, when they differ
                # from C (after the served points, which tell what they are).
                formed = {
                    max(1, round(_mean(row.batches)))
                    for (name, c, path), row in rows.items()
                    if name == spec.name and c == concurrency and row.batches
                    if _mean(row.batches) == _mean(row.batches)
                }
                for batch in sorted(formed - {min(concurrency, spec.max_batch)}):
                    path = f"direct b{batch}"
                    row = rows.setdefault(
                        (spec.name, concurrency, path),
                        Row(spec.name, concurrency, path, direct_batch=batch),
                    )
                    for _ in range(args.rounds):
                        _point(
                            row, spec, "direct", runner, target, pool, inproc_pool, inproc_port,
                            repository, sampler, args,
                        )  # fmt: skip
                    log(f"  {spec.name:<15} c={concurrency:<3} {path:<9} {row.rate:9.1f} infer/s")
    print()
    print(format_table(list(rows.values())))


def _point(row, spec, path, runner, target, pool, inproc_pool, inproc_port, repository, sampler,
           args) -> None:  # fmt: skip
    """Measure one (model, concurrency, path) point into ``row``."""
    concurrency = row.concurrency
    if path == "direct":
        gpu_box: list[float | None] = []
        start_at = time.monotonic() + args.warmup
        watcher = threading.Thread(
            target=lambda: gpu_box.append(sampler.mean_between(start_at, start_at + args.duration)),
            daemon=True,
        )
        watcher.start()
        batch = row.direct_batch or min(concurrency, spec.max_batch)
        result, cpu, caller = run_direct(runner, batch, args.duration, args.warmup)
        watcher.join()
        row.add(result, cpu)
        # The calling thread does what the served instance's thread does.
        row.instance_cpu = (row.instance_cpu or 0.0) + caller
        if gpu_box and gpu_box[0] is not None:
            row.gpu.append(gpu_box[0])
        return
    workload = ImageWorkload(
        path, path, spec.name, spec.input_name, spec.output_name, str(repository), inproc_port
    )
    if path == "inproc":
        assert inproc_pool is not None
        chosen, url, pids = inproc_pool, "127.0.0.1:0", inproc_pool.pids
        stats_url = f"127.0.0.1:{inproc_port}"
    else:
        chosen, url = pool, target.http_url if path != "grpc" else target.grpc_url
        pids = tree_pids(target.pid)
        stats_url = target.http_url
    before = model_stats(stats_url, spec.name)

    # The load generator's processes, where they are not the server's (inproc).
    clients = [] if path == "inproc" else chosen.pids

    def window(start_at: float, stop_at: float) -> tuple:
        time.sleep(max(0.0, start_at - time.monotonic()))
        cpu_before, client_before = cpu_seconds(pids), cpu_seconds(clients)
        threads_before = thread_cpu_seconds(target.pid) if clients else None
        gpu = sampler.mean_between(start_at, stop_at)
        time.sleep(max(0.0, stop_at - time.monotonic()))
        threads = None
        if threads_before is not None:
            after = thread_cpu_seconds(target.pid)
            threads = {k: after[k] - threads_before[k] for k in after}
        cpu = cpu_seconds(pids) - cpu_before
        return cpu, cpu_seconds(clients) - client_before, gpu, threads

    result = chosen.run(workload, url, concurrency, args.duration, args.warmup, on_window=window)
    after = model_stats(stats_url, spec.name)
    cpu, client_cpu, gpu, threads = result.extra
    row.add(result, cpu, client_cpu if clients else None)
    if threads is not None:
        row.loop_cpu = (row.loop_cpu or 0.0) + threads["loop"]
        row.instance_cpu = (row.instance_cpu or 0.0) + threads["instance"]
    batch, phases = stats_delta(before, after)
    row.batches.append(batch)
    row.phases.append(phases)
    if gpu is not None:
        row.gpu.append(gpu)


if __name__ == "__main__":
    main()
