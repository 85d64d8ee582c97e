"""Models on demand under a memory budget: memory given back, and a Zipf request mix.

Usage:
    python -m benchmarks.model_residency cycles [--cycles 100] [--weights-mib 20]
        [--backends onnx,pytorch,python,python_in_process] [--tree PATH]
    python -m benchmarks.model_residency zipf [--models 40] [--model-mib 50]
        [--budget-mib 500] [--clients 16] [--seconds 60] [--zipf 1.1]

``cycles``: for each backend, one trionserve (``--model-control-mode=explicit``)
loads a model holding ``--weights-mib`` MiB of weights, runs one request and
unloads it, ``--cycles`` times over HTTP; after each unload the resident memory of
the server's process tree (its stub processes included) is read. Printed: the RSS
after the first cycle, after the last, the drift between them and the most it
reached. ``--tree`` runs another source tree (a ``git worktree`` of an older
commit) for a before/after.

``zipf``: ``--models`` ONNX models of ``--model-mib`` MiB each, requested by
``--clients`` HTTP clients for ``--seconds`` seconds with a Zipf(``--zipf``) mix,
twice: with ``--model-load-on-demand --model-memory-limit=host:<budget>`` (each
model declaring nothing: its charge is measured), and with every model loaded at
start and no budget. Printed per run: requests, failures, throughput, p50 / p99
of every request and of those that found their model loaded, loads/s,
evictions/s, the most bytes charged (sampled from /metrics every 0.25 s), and the
server's peak RSS against budget + its idle RSS.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.matrix import start_trionserve
from trionserve.actors.memory_usage import children, process_tree_rss
from trionserve.testing import free_port

MIB = 1 << 20

PYTHON_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.weights = np.random.default_rng(0).random({floats}, dtype=np.float32)

    def execute(self, requests):
        responses = []
        for request in requests:
            index = pb_utils.get_input_tensor_by_name(request, "INDEX").as_numpy()
            out = self.weights[index.ravel()].reshape(index.shape)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("VALUE", out)]))
        return responses
"""

CONFIG = """
name: "{name}"
{kind}
max_batch_size: 0
input [ {{ name: "{input}" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "{output}" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{extra}
"""


def onnx_gather(path: Path, weights_mib: float) -> None:
    """VALUE = W[INDEX]: a model whose weights (W) are ``weights_mib`` MiB that runs in
    microseconds (INDEX is an input, so nothing is folded away at load)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    floats = int(weights_mib * MIB) // 4
    weights = np.random.default_rng(0).random(floats, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["W", "INDEX"], ["VALUE"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("INDEX", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("VALUE", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def torchscript_gather(path: Path, weights_mib: float) -> None:
    import torch

    class Gather(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.Parameter(torch.rand(int(weights_mib * MIB) // 4))

        def forward(self, index: torch.Tensor) -> torch.Tensor:
            return self.weights[index]

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(Gather()), str(path))


def write_model(repository: Path, backend: str, name: str, weights_mib: float) -> None:
    model_dir = repository / name
    if backend == "onnx":
        onnx_gather(model_dir / "1" / "model.onnx", weights_mib)
        kind, names, extra = 'platform: "onnxruntime_onnx"', ("INDEX", "VALUE"), ""
    elif backend == "pytorch":
        torchscript_gather(model_dir / "1" / "model.pt", weights_mib)
        kind, names, extra = 'platform: "pytorch_libtorch"', ("INPUT__0", "OUTPUT__0"), ""
    else:
        (model_dir / "1").mkdir(parents=True)
        source = PYTHON_MODEL.format(floats=int(weights_mib * MIB) // 4)
        (model_dir / "1" / "model.py").write_text(source)
        kind, names = 'backend: "python"', ("INDEX", "VALUE")
        extra = (
            'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }'
            if backend == "python_in_process"
            else ""
        )
    (model_dir / "config.pbtxt").write_text(
        CONFIG.format(name=name, kind=kind, input=names[0], output=names[1], extra=extra)
    )


def _post(url: str, path: str, body: bytes = b"{}") -> bytes:
    request = urllib.request.Request(f"http://{url}{path}", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.read()


def _infer(client, name: str, backend: str, index: int = 0):
    import tritonclient.http as httpclient

    input_name = "INPUT__0" if backend == "pytorch" else "INDEX"
    tensor = httpclient.InferInput(input_name, [1], "INT64")
    tensor.set_data_from_numpy(np.array([index], dtype=np.int64))
    return client.infer(name, [tensor])


def cycles(args: argparse.Namespace) -> None:
    import tritonclient.http as httpclient

    variants = {"explicit": [], "with the policy": ["--model-idle-unload-secs=3600"]}
    if args.tree is not None:
        variants = {"explicit": []}
    for backend in args.backends.split(","):
        for variant, flags in variants.items():
            cycle_backend(args, backend, variant, flags, httpclient)


def cycle_backend(args, backend: str, variant: str, flags: list[str], httpclient) -> None:
    """One server, ``args.cycles`` load / infer / unload cycles of one model."""
    repository = Path(tempfile.mkdtemp(prefix=f"residency-{backend}-"))
    try:
        write_model(repository, backend, "m", args.weights_mib)
        server, target = start_trionserve(
            backend,
            repository,
            ["--model-control-mode=explicit", "--log-verbose=0", *flags],
            tree=args.tree,
        )
        try:
            client = httpclient.InferenceServerClient(target.http_url)
            readings = []
            started = time.perf_counter()
            for _ in range(args.cycles):
                _post(target.http_url, "/v2/repository/models/m/load")
                _infer(client, "m", backend)
                _post(target.http_url, "/v2/repository/models/m/unload")
                readings.append(process_tree_rss(target.pid) / MIB)
            seconds = time.perf_counter() - started
            left = len(children(target.pid))
        finally:
            server.stop()
    finally:
        shutil.rmtree(repository, ignore_errors=True)
    first, last = readings[0], readings[-1]
    print(
        f"{backend:18} {variant:15} cycles {len(readings):4}  RSS after 1st {first:7.1f} MiB"
        f"  after last {last:7.1f} MiB  drift {last - first:+6.1f} MiB  max "
        f"{max(readings):7.1f} MiB  child processes left {left}  "
        f"({seconds / len(readings) * 1000:.0f} ms/cycle)",
        flush=True,
    )


def _metric(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _zipf_weights(count: int, exponent: float) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(count)]


def zipf_run(args: argparse.Namespace, repository: Path, on_demand: bool) -> dict:
    import tritonclient.http as httpclient

    metrics_port = free_port()
    names = [f"m{i:02d}" for i in range(args.models)]
    flags = [
        "--model-control-mode=explicit",
        "--allow-metrics=true",
        f"--metrics-port={metrics_port}",
        "--log-verbose=0",
    ]
    if on_demand:
        flags += ["--model-load-on-demand=true", f"--model-memory-limit=host:{args.budget_mib}MiB"]
    else:
        flags += [f"--load-model={name}" for name in names]
    server, target = start_trionserve("zipf", repository, flags, ready_timeout=600)
    idle_rss = process_tree_rss(target.pid) / MIB if on_demand else 0.0
    weights = _zipf_weights(len(names), args.zipf)
    latencies: list[tuple[float, bool]] = []  # (seconds, the model was loaded already)
    failures: list[str] = []
    stop = threading.Event()
    peaks = {"rss": 0.0, "charged": 0.0}
    lock = threading.Lock()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            return response.read().decode()

    def sample() -> None:
        while not stop.is_set():
            peaks["rss"] = max(peaks["rss"], process_tree_rss(target.pid) / MIB)
            if on_demand:
                charged = _metric(scrape(), "trionserve_memory_budget_used_bytes", 'device="host"')
                peaks["charged"] = max(peaks["charged"], charged / MIB)
            stop.wait(0.25)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        connection = httpclient.InferenceServerClient(target.http_url, network_timeout=300)
        while not stop.is_set():
            name = rng.choices(names, weights)[0]
            # Asked in both runs, so that both send the same requests.
            loaded_before = connection.is_model_ready(name)
            began = time.perf_counter()
            try:
                _infer(connection, name, "onnx")
            except Exception as exc:  # counted and printed below
                with lock:
                    failures.append(f"{name}: {exc}")
                continue
            with lock:
                latencies.append((time.perf_counter() - began, loaded_before))

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(args.clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(args.seconds)
    stop.set()
    for thread in threads:
        thread.join()
    sampler.join()
    elapsed = time.perf_counter() - began
    text = scrape()
    server.stop()
    everything = sorted(s for s, _ in latencies)
    resident = sorted(s for s, loaded in latencies if loaded)

    def quantile(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else 0.0

    return {
        "requests": len(latencies) + len(failures),
        "failures": len(failures),
        "first_failures": failures[:3],
        "infer_per_s": len(latencies) / elapsed,
        "p50_ms": quantile(everything, 0.5),
        "p99_ms": quantile(everything, 0.99),
        "resident_p50_ms": quantile(resident, 0.5),
        "resident_p99_ms": quantile(resident, 0.99),
        "loads_per_s": _metric(text, "trionserve_model_on_demand_loads_total") / elapsed,
        "evictions_per_s": _metric(text, "trionserve_model_evictions_total") / elapsed,
        "peak_charged_mib": peaks["charged"],
        "peak_rss_mib": peaks["rss"],
        "idle_rss_mib": idle_rss,
        "mean_wait_ms": (
            _metric(text, "trionserve_model_load_wait_seconds_sum")
            / max(1.0, _metric(text, "trionserve_model_load_wait_seconds_count"))
            * 1000
        ),
    }


def zipf(args: argparse.Namespace) -> None:
    repository = Path(tempfile.mkdtemp(prefix="residency-zipf-"))
    try:
        write_model(repository, "onnx", "m00", args.model_mib)
        for index in range(1, args.models):
            shutil.copytree(repository / "m00", repository / f"m{index:02d}")
            config = repository / f"m{index:02d}" / "config.pbtxt"
            config.write_text(config.read_text().replace('"m00"', f'"m{index:02d}"'))
        results = {
            "on demand": zipf_run(args, repository, on_demand=True),
            "all preloaded": zipf_run(args, repository, on_demand=False),
        }
    finally:
        shutil.rmtree(repository, ignore_errors=True)
    for label, result in results.items():
        print(f"{label}:")
        for key, value in result.items():
            print(f"  {key:18} {value:.2f}" if isinstance(value, float) else f"  {key:18} {value}")
    on_demand, preloaded = results["on demand"], results["all preloaded"]
    if preloaded["resident_p50_ms"]:
        ratio = on_demand["resident_p50_ms"] / preloaded["resident_p50_ms"]
        print(f"resident p50, on demand / all preloaded: {ratio:.2f}x (goal <= 1.1x)")
    limit = (args.budget_mib + on_demand["idle_rss_mib"]) * 1.15
    print(
        f"peak RSS {on_demand['peak_rss_mib']:.0f} MiB against (budget + idle RSS) + 15% "
        f"{limit:.0f} MiB; peak charged {on_demand['peak_charged_mib']:.0f} MiB "
        f"of {args.budget_mib} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cycle = commands.add_parser("cycles")
    cycle.add_argument("--cycles", type=int, default=100)
    cycle.add_argument("--weights-mib", type=float, default=20.0)
    cycle.add_argument("--backends", default="onnx,pytorch,python,python_in_process")
    cycle.add_argument("--tree", type=Path, default=None)
    mix = commands.add_parser("zipf")
    mix.add_argument("--models", type=int, default=40)
    mix.add_argument("--model-mib", type=float, default=50.0)
    mix.add_argument("--budget-mib", type=int, default=500)
    mix.add_argument("--clients", type=int, default=16)
    mix.add_argument("--seconds", type=float, default=60.0)
    mix.add_argument("--zipf", type=float, default=1.1)
    args = parser.parse_args()
    {"cycles": cycles, "zipf": zipf}[args.command](args)


if __name__ == "__main__":
    main()
