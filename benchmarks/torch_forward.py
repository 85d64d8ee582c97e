"""Where a served TorchScript batch's compute_infer goes, without a server.

Usage:
    python -m benchmarks.torch_forward [--device cuda|cpu] [--model resnet50|cnn]
        [--iterations N] [--warmup N] [--gil-busy-us 500] [--out FILE]

The GPU session (benchmarks/README.md) measured resnet50 served at c=16 with a
compute_infer of 6.9-7.1 ms per batch of about 5, where the framework called
directly ran batch 5 in 4.05 ms. This times the same model the same ways in one
process, each variable on its own:

- ``forward``: ``module(x)`` then a synchronize, the input already on the device,
  under ``inference_mode`` (ms per batch, the median and p90 of ``--iterations``);
- ``direct``: served_vs_direct's own direct call (numpy in, the copy to the
  device, forward, the copy back, numpy out);
- ``instance``: the server's TorchScriptInstance on requests of batch 1, its
  ``stage`` / ``launch`` / ``finish`` in the order the instance's thread runs
  them while batches wait (the next batch staged before the current one
  finishes); the table gives the wall time per batch and the instance's own
  compute_infer (from ``launch`` to the outputs on the host, which includes the
  next batch's ``stage``);

each with the batch fixed at 5 or cycling 4, 5, 6, 5 (what a dynamic batcher
forms); with TorchScript's profiling executor (torch's default) or with
``ENABLE_JIT_PROFILING`` and ``ENABLE_JIT_EXECUTOR`` off (the legacy executor,
set before the module is loaded); and with or without another Python thread
that holds the GIL half the time (``--gil-busy-us`` spinning in bytecode, then
as long asleep: an event loop's pattern). ``cpu ms`` is the measuring thread's
CPU time per batch.

The model is built as served_vs_direct builds it (torchvision's resnet50, random
weights, traced; on the CPU by default the small CNN). ``--device cpu`` runs the
same rows on the CPU (a check of the script; a few iterations).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.served_vs_direct import (
    CLASSES,
    IMAGE,
    ModelSpec,
    direct_runner,
    write_cnn_torchscript,
    write_resnet50,
)

FIXED = (5,)
CYCLE = (4, 5, 6, 5)


@dataclass
class Row:
    path: str
    batches: str
    jit: str
    gil: str
    median_ms: float
    p90_ms: float
    cpu_ms: float
    infer_ms: float | None = None  # the instance's compute_infer, median


@contextlib.contextmanager
def jit_executor(torch, profiling: bool) -> Iterator[None]:
    """TorchScript's executor for the modules loaded inside: the profiling one
    (torch's default) or, with both flags off, the legacy one."""
    old_executor = torch._C._jit_set_profiling_executor(profiling)
    old_mode = torch._C._jit_set_profiling_mode(profiling)
    try:
        yield
    finally:
        torch._C._jit_set_profiling_executor(old_executor)
        torch._C._jit_set_profiling_mode(old_mode)


@contextlib.contextmanager
def gil_hog(busy_us: int) -> Iterator[None]:
    """A thread holding the GIL ``busy_us`` at a time (a bytecode loop), then
    sleeping as long, until the block ends."""
    stop = threading.Event()

    def hog() -> None:
        busy = busy_us / 1e6
        while not stop.is_set():
            end = time.perf_counter() + busy
            while time.perf_counter() < end:
                pass
            time.sleep(busy)

    thread = threading.Thread(target=hog, name="gil-hog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def timed(step: Callable[[int], float | None], sizes: tuple[int, ...], warmup: int, n: int):
    """(median ms, p90 ms, thread CPU ms per call, median of what ``step`` returned)."""
    cycle = itertools.cycle(sizes)
    for _ in range(warmup):
        step(next(cycle))
    cycle = itertools.cycle(sizes)
    times, extra = [], []
    cpu = time.thread_time()
    for _ in range(n):
        t0 = time.perf_counter()
        got = step(next(cycle))
        times.append((time.perf_counter() - t0) * 1000)
        if got is not None:
            extra.append(got)
    cpu_ms = (time.thread_time() - cpu) * 1000 / n
    times.sort()
    p90 = times[min(len(times) - 1, int(len(times) * 0.9))]
    return statistics.median(times), p90, cpu_ms, (statistics.median(extra) if extra else None)


def forward_step(torch, module, device) -> Callable[[int], None]:
    inputs = {size: torch.rand((size, *IMAGE), device=device) for size in (4, 5, 6)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(size: int) -> None:
        with torch.inference_mode():
            out = module(inputs[size])
        sync()
        if out.shape[0] != size:
            raise RuntimeError(f"forward answered shape {tuple(out.shape)}")

    return step


def direct_step(run: Callable[[np.ndarray], np.ndarray]) -> Callable[[int], None]:
    data = {size: np.random.default_rng(1).random((size, *IMAGE), np.float32) for size in (4, 5, 6)}

    def step(size: int) -> None:
        if run(data[size]).shape != (size, CLASSES):
            raise RuntimeError("direct run answered the wrong shape")

    return step


class InstancePath:
    """The server's TorchScriptInstance over a one-model repository, fed requests
    of batch 1 in the order its thread runs a pipelined instance's steps."""

    def __init__(self, model_dir: Path, kind: str) -> None:
        from trionserve.actors.registry_entries import prepare_model
        from trionserve.backends.base import InstanceSpec, ModelContext
        from trionserve.backends.manager import BackendManager
        from trionserve.core.inference import InferenceRequest, Tensor

        prepared = prepare_model(model_dir, True, None, backends=BackendManager())
        context = ModelContext(model_dir.name, 1, prepared.config, model_dir, model_dir / "1")
        self.model = prepared.backend.load(context)
        self.instance = self.model.create_instance(
            InstanceSpec(f"{model_dir.name}_0_0", f"{model_dir.name}_0", kind, 0)
        )
        image = np.random.default_rng(1).random((1, *IMAGE), np.float32)

        def request(i: int) -> InferenceRequest:
            r = InferenceRequest(
                model_dir.name, id=str(i), inputs={"INPUT__0": Tensor("INPUT__0", "FP32", image)}
            )
            r.batch_size = 1
            return r

        self.requests = {size: [request(i) for i in range(size)] for size in (4, 5, 6)}
        self.launched: tuple | None = None

    def step(self, size: int) -> float | None:
        """Stage this batch, finish the one before (its compute_infer, ms), launch
        this one; as the instance's thread does while batches wait."""
        instance = self.instance
        requests = self.requests[size]
        staged = instance.stage(requests)
        infer_ms = self._finish()
        self.launched = (requests, instance.launch(requests, staged))
        return infer_ms

    def _finish(self) -> float | None:
        if self.launched is None:
            return None
        requests, handle = self.launched
        self.launched = None
        responses = self.instance.finish(requests, handle)
        for response in responses:
            if not hasattr(response, "outputs"):
                raise RuntimeError(f"the instance answered {response}")
        times = self.instance.compute_times
        return None if times is None else times.infer_ns / 1e6

    def close(self) -> None:
        self._finish()
        self.instance.close()
        self.model.unload()


def _nothing() -> None:
    pass


def write_repository(root: Path, model: str, kind: str) -> Path:
    model_dir = root / f"{model}_torch"
    (model_dir / "1").mkdir(parents=True)
    if model == "resnet50":
        write_resnet50(model_dir / "1" / "model.pt", None)
    else:
        write_cnn_torchscript(model_dir / "1" / "model.pt")
    (model_dir / "config.pbtxt").write_text(
        f"""name: "{model_dir.name}"
backend: "pytorch"
max_batch_size: 16
input [{{ name: "INPUT__0" data_type: TYPE_FP32 dims: [3, 224, 224] }}]
output [{{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [{CLASSES}] }}]
instance_group [{{ count: 1 kind: {kind} }}]
"""
    )
    return model_dir


def run(args: argparse.Namespace) -> list[Row]:
    import torch

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    kind = "KIND_GPU" if device.type == "cuda" else "KIND_CPU"
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="torch-forward-") as tmp:
        model_dir = write_repository(Path(tmp), args.model, kind)
        path = model_dir / "1" / "model.pt"
        spec = ModelSpec(model_dir.name, "torch", "model.pt", "INPUT__0", "OUTPUT__0", gpu=True)
        if device.type == "cpu":
            spec = ModelSpec(model_dir.name, "torch", "model.pt", "INPUT__0", "OUTPUT__0")
        for jit, profiling in (("profiling", True), ("legacy", False)):
            for batches, sizes in (("5", FIXED), ("4,5,6,5", CYCLE)):
                for gil in ("free", "hog"):
                    paths: list[str] = ["forward", "instance"]
                    if jit == "profiling" and sizes == FIXED and gil == "free":
                        paths.insert(1, "direct")
                    for name in paths:
                        # A fresh module per row: the executor is chosen when a
                        # module first runs, and its shapes' plans stay with it.
                        with jit_executor(torch, profiling):
                            closer: Callable[[], None] = _nothing
                            if name == "forward":
                                module = torch.jit.load(str(path), map_location=device).eval()
                                step: Callable[[int], float | None] = forward_step(
                                    torch, module, device
                                )
                            elif name == "direct":
                                step = direct_step(direct_runner(spec, path))
                            else:
                                instance = InstancePath(model_dir, kind)
                                step, closer = instance.step, instance.close
                            hog = gil_hog(args.gil_busy_us) if gil == "hog" else None
                            with hog or contextlib.nullcontext():
                                median, p90, cpu, infer = timed(
                                    step, sizes, args.warmup, args.iterations
                                )
                            closer()
                        row = Row(name, batches, jit, gil, median, p90, cpu, infer)
                        rows.append(row)
                        print(format_row(row), file=sys.stderr, flush=True)
    return rows


HEADER = (
    "| path | batches | executor | GIL | ms/batch p50 | p90 | cpu ms/batch | compute_infer ms |\n"
    "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"
)


def format_row(row: Row) -> str:
    infer = "-" if row.infer_ms is None else f"{row.infer_ms:.2f}"
    return (
        f"| {row.path} | {row.batches} | {row.jit} | {row.gil} | {row.median_ms:.2f} "
        f"| {row.p90_ms:.2f} | {row.cpu_ms:.2f} | {infer} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=("resnet50", "cnn"), default=None)
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--gil-busy-us", type=int, default=500)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    args.model = args.model or ("resnet50" if gpu else "cnn")
    args.iterations = args.iterations or (200 if gpu else 12)
    args.warmup = args.warmup if args.warmup is not None else (30 if gpu else 4)
    import torch

    if gpu and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device (try --device cpu)")
    started = time.monotonic()
    rows = run(args)
    where = torch.cuda.get_device_name(0) if gpu else "CPU"
    table = "\n".join([HEADER, *map(format_row, rows)])
    text = (
        f"{args.model} on {where}, torch {torch.__version__}, {args.iterations} batches a row "
        f"after {args.warmup}, GIL hog {args.gil_busy_us} us busy / {args.gil_busy_us} us "
        f"asleep ({time.monotonic() - started:.0f} s)\n\n{table}\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
