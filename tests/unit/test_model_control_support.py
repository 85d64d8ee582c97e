"""Helpers for the model control tests: model repositories, a fake backend, waiting.

No tests here. The fake backend (``backend: "mc_fake"``) adds the number written in
its version's ``model.txt`` to INPUT0, so a test can tell which files a response
came from; per-model :class:`Controls` let a test hold a load in a worker thread,
make it fail, and count loads, unloads and live instances.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from tests.repository import write_model
from tests.serverproc import EXAMPLES
from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.core.errors import InternalError
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor

FAKE = "mc_fake"
FAKE_CONFIG = """
name: "{name}"
backend: "mc_fake"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {count} }} ]
{extra}
"""


@dataclass
class Controls:
    """What the fake backend does for one model, and what it saw."""

    load_gate: threading.Event = field(default_factory=threading.Event)
    execute_gate: threading.Event = field(default_factory=threading.Event)
    executing: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    loading: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    fail_load: str = ""
    loads: int = 0
    unloads: int = 0
    live_instances: int = 0

    def __post_init__(self) -> None:
        self.load_gate.set()  # loads and requests pass unless a test holds them
        self.execute_gate.set()


CONTROLS: dict[str, Controls] = {}
_LOCK = threading.Lock()
CONCURRENCY = {"now": 0, "max": 0}


def controls(name: str) -> Controls:
    with _LOCK:
        return CONTROLS.setdefault(name, Controls())


def reset_fake() -> None:
    for c in CONTROLS.values():
        c.load_gate.set()
        c.execute_gate.set()
    CONTROLS.clear()
    CONCURRENCY.update(now=0, max=0)


class _Instance:
    def __init__(self, context: ModelContext, offset: float, c: Controls) -> None:
        self.context = context
        self.offset = offset
        self.controls = c
        with _LOCK:
            c.live_instances += 1

    def execute(self, requests):
        self.controls.executing.release()
        self.controls.execute_gate.wait(timeout=10)
        return [
            InferenceResponse(
                self.context.name,
                str(self.context.version),
                r.id,
                [Tensor("OUTPUT0", "FP32", r.inputs["INPUT0"].data + self.offset)],
            )
            for r in requests
        ]

    def close(self) -> None:
        with _LOCK:
            self.controls.live_instances -= 1


class _Model:
    def __init__(self, context: ModelContext, c: Controls) -> None:
        self.context = context
        self.controls = c
        self.offset = float((context.version_dir / "model.txt").read_text())

    def create_instance(self, spec: InstanceSpec) -> _Instance:
        return _Instance(self.context, self.offset, self.controls)

    def unload(self) -> None:
        with _LOCK:
            self.controls.unloads += 1


class FakeBackend(Backend):
    name = FAKE

    def default_model_filename(self) -> str:
        return "model.txt"

    def auto_complete_config(self, config, model_path: Path, max_batch_size_set: bool) -> None:
        pass

    def load(self, context: ModelContext) -> _Model:
        c = controls(context.name)
        with _LOCK:
            c.loads += 1
            CONCURRENCY["now"] += 1
            CONCURRENCY["max"] = max(CONCURRENCY["max"], CONCURRENCY["now"])
        c.loading.release()
        try:
            c.load_gate.wait(timeout=10)  # a failed test must not hang
            if c.fail_load:
                raise InternalError(c.fail_load)
            return _Model(context, c)
        finally:
            with _LOCK:
                CONCURRENCY["now"] -= 1


# For Server(options, backends=BACKENDS) and BackendManager(backends=BACKENDS).
BACKENDS = {FAKE: FakeBackend}


def fake_model(
    repository: Path,
    name: str,
    versions: dict[int, float] | None = None,
    count: int = 1,
    extra: str = "",
) -> Path:
    """Write a fake model; ``versions`` maps version -> the offset it adds."""
    model_dir = repository / name
    model_dir.mkdir(parents=True, exist_ok=True)
    for version, offset in (versions or {1: 1.0}).items():
        (model_dir / str(version)).mkdir(exist_ok=True)
        (model_dir / str(version) / "model.txt").write_text(f"{offset}\n")
    (model_dir / "config.pbtxt").write_text(FAKE_CONFIG.format(name=name, count=count, extra=extra))
    return model_dir


def fake_request(name: str, value: float = 0.0, version: int | None = None) -> InferenceRequest:
    data = np.full((1, 2), value, dtype=np.float32)
    return InferenceRequest(name, version, inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})


def copy_example(repository: Path, name: str = "simple", as_name: str | None = None) -> Path:
    """Copy an example model into ``repository`` (renamed in config.pbtxt too)."""
    target = repository / (as_name or name)
    shutil.copytree(EXAMPLES / name, target)
    if as_name:
        config = target / "config.pbtxt"
        config.write_text(config.read_text().replace(f'name: "{name}"', f'name: "{as_name}"'))
    return target


SLOW_CONFIG = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ {{ name: "ITERS" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {count} }} ]
"""


def slow_onnx() -> bytes:
    """OUT = ITERS as a float, counted one by one in an ONNX Loop (~1 us per step)."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["acc_in", "one"], ["acc_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1]),
        ],
        [one],
    )

    def constant(output: str, kind: int, dims: list[int], values: list):
        tensor = helper.make_tensor(output + "_value", kind, dims, values)
        return helper.make_node("Constant", [], [output], value=tensor)

    graph = helper.make_graph(
        [
            constant("axes", TensorProto.INT64, [1], [0]),
            helper.make_node("Squeeze", ["ITERS", "axes"], ["M"]),
            constant("cond", TensorProto.BOOL, [], [True]),
            constant("zero", TensorProto.FLOAT, [1], [0.0]),
            helper.make_node("Loop", ["M", "cond", "zero"], ["OUT"], body=body),
        ],
        "slow",
        [helper.make_tensor_value_info("ITERS", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def slow_model(repository: Path, name: str = "slow", count: int = 1) -> Path:
    config = SLOW_CONFIG.format(name=name, count=count)
    return write_model(repository, name, config, {"1/model.onnx": slow_onnx()})


def index_rows(client, name: str) -> list[dict]:
    return [row for row in client.get_model_repository_index() if row["name"] == name]


def states(client, name: str) -> dict[str, str]:
    """version -> state for one model in the repository index ("" for no version)."""
    return {row.get("version", ""): row.get("state", "") for row in index_rows(client, name)}
