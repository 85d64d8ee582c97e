"""The ONNX Runtime instance's CPU per batch outside ``Session.run``, in process.

Usage:
    python -m benchmarks.investigations.onnx_instance_cpu [--rounds 9] [--calls 60]
        [--batch 1]

Loads benchmarks.served_vs_direct's ``cnn_onnx`` as the server does (its config,
``OnnxRuntimeBackend``, one instance) and, in rounds, runs ``--calls`` batches of
``--batch`` fresh requests (read-only 602 KB bodies, as a frontend hands them
over) three ways, on this thread:

- ``direct``: ``session.run(None, {name: x})``, as served_vs_direct's direct does;
- ``served``: a :class:`~trionserve.backends.instance_thread.Job` through the
  instance thread's steps (``_stage``; the staged pipeline or ``execute``), then
  each output's wire bytes (``output_bytes``, as the answer's encoding reads them);
- ``floor``: the least a server does around the run: the request made, the C
  session called, one response, its output's bytes.

The session's C object is wrapped so that the CPU time (``thread_time_ns``)
inside its ``run`` is subtracted: what is printed is the CPU per batch outside
the model's computation, right after it (the model's activations have evicted the
interpreter's working set, which is what this Python costs in a server). The
figure to compare between trees is the median over rounds of ``served -
floor`` (the floor is the same code in every tree, so the load's drift
cancels); run it in each tree in turn. Also printed: Python calls per batch
(``sys.setprofile``'s call and C-call events), which the load does not move.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.served_vs_direct import IMAGE, build_repository
from trionserve.actors import registry_entries
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.instance_thread import InstanceThread, Job
from trionserve.backends.onnxruntime.backend import OnnxRuntimeBackend
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.core.outputs import output_bytes


class _TimedSession:
    """The C session, its ``run``'s CPU time added up."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ns = 0

    def run(self, *args: Any) -> Any:
        started = time.thread_time_ns()
        try:
            return self.inner.run(*args)
        finally:
            self.ns += time.thread_time_ns() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _calls(fn: Callable[[], None]) -> int:
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    fn()
    sys.setprofile(profile)
    fn()
    sys.setprofile(None)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    build_repository(root, ["cnn_onnx"], False, print)
    directory = root / "cnn_onnx"
    config = registry_entries.prepare_model(directory, autocomplete=True, override_json=None)
    context = ModelContext("cnn_onnx", 1, config.config, directory, directory / "1")
    instance = (
        OnnxRuntimeBackend()
        .load(context)
        .create_instance(InstanceSpec("cnn_onnx_0_0", "cnn_onnx_0", "KIND_CPU", 0))
    )
    session = instance._session
    timed = _TimedSession(session._sess)
    session._sess = timed
    body = np.random.default_rng(1).random((1, *IMAGE), dtype=np.float32).tobytes()
    batch = np.frombuffer(body * args.batch, np.float32).reshape(args.batch, *IMAGE)

    def request() -> InferenceRequest:
        data = np.frombuffer(body, np.float32).reshape(1, *IMAGE)
        made = InferenceRequest("cnn_onnx", 1, inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})
        made.batch_size = 1
        return made

    thread = InstanceThread("cnn_onnx_0_0", instance)
    pipeline = thread._pipeline

    def served() -> None:
        job = Job([request() for _ in range(args.batch)])
        thread._stage(job)
        if pipeline is not None:
            pipeline.launch(job)
            pipeline.finish(job)
        else:
            job.results = instance.execute(job.requests)
        for response in job.results or ():
            for tensor in response.outputs:
                output_bytes(tensor.datatype, tensor.data)

    def direct() -> None:
        session.run(None, {"INPUT0": batch})

    def floor() -> None:
        made = [request() for _ in range(args.batch)]
        data = made[0].inputs["INPUT0"].data if args.batch == 1 else batch
        (out,) = timed.run(["OUTPUT0"], {"INPUT0": data}, None)
        response = InferenceResponse("cnn_onnx", "1", "", [Tensor("OUTPUT0", "FP32", out)])
        for tensor in response.outputs:
            output_bytes(tensor.datatype, tensor.data)

    def outside(fn: Callable[[], None]) -> float:
        timed.ns = 0
        started = time.thread_time_ns()
        for _ in range(args.calls):
            fn()
        return (time.thread_time_ns() - started - timed.ns) / args.calls / 1000

    print(
        f"Python calls per batch: direct {_calls(direct)}, served {_calls(served)}, "
        f"floor {_calls(floor)}"
    )
    beyond = []
    for index in range(args.rounds):
        d, s, f = outside(direct), outside(served), outside(floor)
        beyond.append(s - f)
        print(
            f"round {index}: µs of CPU per batch outside the run: direct {d:.1f}, "
            f"served {s:.1f}, floor {f:.1f}"
        )
    print(f"median served - floor: {statistics.median(beyond):+.1f} µs")


if __name__ == "__main__":
    main()
