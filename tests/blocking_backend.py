"""A test backend whose instances block in execute until the test releases them.

Registered as ``backend: "test_blocking"``; it echoes INPUT0 to OUTPUT0. Tests use
its threading events to know, without sleeping, that a request is executing.
"""

from __future__ import annotations

import threading
from pathlib import Path

from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.registry import register_backend
from trionserve.core.batching import build_response, gather_inputs, split_outputs

BACKEND = "test_blocking"

CONFIG = """
name: "{name}"
backend: "test_blocking"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
"""


class Gate:
    """Counts executions entering and lets them through when released."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.fail_next = False

    def reset(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.fail_next = False


GATE = Gate()

# Bound on every wait for the backend in tests: a request that never arrives must
# fail its test, never hang the suite.
ENTER_TIMEOUT = 60.0


async def wait_entered(timeout: float = ENTER_TIMEOUT) -> None:
    """Wait until one more execution has entered the backend (in a worker thread)."""
    import trio

    entered = await trio.to_thread.run_sync(GATE.entered.acquire, True, timeout)
    assert entered, f"no request reached the blocking backend within {timeout} s"


class _Instance:
    def __init__(self, context: ModelContext) -> None:
        self.name = context.name
        self.version = str(context.version)

    def execute(self, requests):
        GATE.entered.release()
        assert GATE.release.wait(timeout=ENTER_TIMEOUT), "the test never released the gate"
        if GATE.fail_next:
            GATE.fail_next = False
            raise RuntimeError("injected backend failure")
        outputs = {"OUTPUT0": gather_inputs(requests)["INPUT0"]}
        return [
            build_response(r, self.name, self.version, out, {"OUTPUT0": "FP32"})
            for r, out in zip(requests, split_outputs(outputs, requests))
        ]

    def close(self) -> None:
        pass


class _Model:
    def __init__(self, context: ModelContext) -> None:
        self.context = context

    def create_instance(self, spec: InstanceSpec) -> _Instance:
        return _Instance(self.context)

    def unload(self) -> None:
        pass


class BlockingBackend:
    name = BACKEND

    def default_model_filename(self) -> str:
        return "model.txt"

    def auto_complete_config(self, config, model_path: Path, max_batch_size_set: bool) -> None:
        pass

    def load(self, context: ModelContext) -> _Model:
        return _Model(context)


def make_model(repository: Path, name: str) -> Path:
    model_dir = repository / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.txt").write_text("blocking test model\n")
    (model_dir / "config.pbtxt").write_text(CONFIG.format(name=name))
    return model_dir


register_backend(BACKEND, BlockingBackend)
