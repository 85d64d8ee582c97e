"""Instance groups: several instances execute at once; groups, names, kinds, counts.

The server runs in-process (so a test backend can be registered) and is driven
through HTTP with the official tritonclient, in worker threads. The test backend's
instances block in ``execute`` until the test lets them go, so concurrency is
observed with events, not timing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import trio
import tritonclient.http as httpclient

from tests.fake_backend import echo_responses, instance_backend
from tests.repository import echo_model
from tests.serverproc import free_port
from trionserve._generated import model_config_pb2 as mc
from trionserve.actors.model import instance_specs
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.cuda.devices import gpu_count
from trionserve.server import Server, ServerOptions

BACKEND = "test_instances_gate"


class Gate:
    """Executions of one model: how many are inside ``execute``, and a release."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.names: list[str] = []


GATES: dict[str, Gate] = {}


class _Instance:
    def __init__(self, context: ModelContext, spec: InstanceSpec) -> None:
        self.model = context.name
        self.spec = spec

    def execute(self, requests):
        gate = GATES[self.model]
        gate.names.append(self.spec.name)
        gate.entered.release()
        gate.release.wait(timeout=30)
        return echo_responses(requests, self.model, "1")

    def close(self) -> None:
        pass


BACKENDS = instance_backend(BACKEND, _Instance)


def gated_model(repository: Path, name: str, extra: str) -> None:
    """Model ``name`` of the gated backend, ``extra`` added to its configuration."""
    echo_model(repository, name, BACKEND, extra, dims="4")
    GATES[name] = Gate()


@pytest.fixture
def repository(tmp_path):
    yield tmp_path
    for gate in GATES.values():
        gate.release.set()  # never leave a worker thread blocked
    GATES.clear()


def options(repository, **overrides) -> ServerOptions:
    values = dict(
        model_repositories=[repository],
        http_address="127.0.0.1",
        http_port=free_port(),
        allow_grpc=False,
        allow_metrics=False,
        exit_timeout_secs=10.0,
    )
    values.update(overrides)
    return ServerOptions(**values)


def http_infer(port: int, model: str, value: float) -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
    try:
        data = np.full((1, 4), value, dtype=np.float32)
        infer_input = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        infer_input.set_data_from_numpy(data)
        return client.infer(model, [infer_input]).as_numpy("OUTPUT0")
    finally:
        client.close()


async def entered(gate: Gate, count: int) -> bool:
    """True when ``count`` executions are inside execute at once (10 s at most)."""

    def wait() -> bool:
        return all(gate.entered.acquire(timeout=10) for _ in range(count))

    return await trio.to_thread.run_sync(wait)


@pytest.mark.parametrize("batching", ["", "dynamic_batching { }"], ids=["default", "dynamic"])
async def test_two_instances_execute_two_batches_at_once(repository, batching):
    gated_model(repository, "pair", f"instance_group [ {{ count: 2 kind: KIND_CPU }} ]\n{batching}")
    gate = GATES["pair"]
    server = Server(options(repository), backends=BACKENDS)
    port = server.options.http_port
    results: dict[float, np.ndarray] = {}

    async def client(value: float) -> None:
        results[value] = await trio.to_thread.run_sync(http_infer, port, "pair", value)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with trio.open_nursery() as clients:
            # One request at a time until each is inside the backend, so that a
            # dynamic batcher cannot gather them into one batch: the second
            # reaches the other instance while the first is still executing.
            for value in (1.0, 2.0):
                clients.start_soon(client, value)
                assert await entered(gate, 1)
            # Two executions inside the backend, neither released yet: both
            # instances are running a batch at the same time.
            assert sorted(gate.names) == ["pair_0_0", "pair_0_1"]
            clients.start_soon(client, 3.0)  # queued until an instance is free
            gate.release.set()
        server.shutdown()
    for value in (1.0, 2.0, 3.0):
        np.testing.assert_array_equal(results[value], np.full((1, 4), value))


async def test_several_groups_are_named_like_triton(repository):
    gated_model(
        repository,
        "groups",
        """instance_group [
            { count: 2 kind: KIND_CPU },
            { name: "extra" count: 1 kind: KIND_CPU },
            { count: 1 kind: KIND_AUTO }
        ]""",
    )
    server = Server(options(repository, allow_http=False), backends=BACKENDS)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        model = server.registry.route("groups", None)
        names = [(spec.name, spec.kind) for spec in model.instances]
        server.shutdown()
    expected_auto = "KIND_GPU" if gpu_count() else "KIND_CPU"
    assert names[:3] == [
        ("groups_0_0", "KIND_CPU"),
        ("groups_0_1", "KIND_CPU"),
        ("extra_0", "KIND_CPU"),
    ]
    assert [kind for name, kind in names[3:]] == [expected_auto] * max(1, gpu_count())


@pytest.mark.skipif(gpu_count() > 0, reason="this host has a GPU")
async def test_kind_gpu_without_a_gpu_is_a_load_error(repository):
    gated_model(repository, "needs_gpu", "instance_group [ { kind: KIND_GPU } ]")
    server = Server(options(repository, allow_http=False, exit_on_error=False), backends=BACKENDS)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        rows = [r for r in server.registry.index() if r["name"] == "needs_gpu"]
        server.shutdown()
    assert rows and all(r["state"] == "UNAVAILABLE" for r in rows)
    assert "KIND_GPU but no GPU is available" in rows[0]["reason"]


def group(kind: str, count: int, gpus=()) -> mc.ModelConfig:
    config = mc.ModelConfig(name="m")
    config.instance_group.add(
        name="m_0", kind=mc.ModelInstanceGroup.Kind.Value(kind), count=count, gpus=list(gpus)
    )
    return config


def test_instance_specs_per_gpu_and_auto():
    specs = instance_specs(group("KIND_GPU", 2, gpus=[0, 1]), gpus=2)
    assert [(s.name, s.device_id) for s in specs] == [
        ("m_0_0", 0),
        ("m_0_0", 1),
        ("m_0_1", 0),
        ("m_0_1", 1),
    ]
    assert [s.kind for s in instance_specs(group("KIND_AUTO", 1), gpus=0)] == ["KIND_CPU"]
    assert [(s.kind, s.device_id) for s in instance_specs(group("KIND_AUTO", 1), gpus=2)] == [
        ("KIND_GPU", 0),
        ("KIND_GPU", 1),
    ]
    with pytest.raises(Exception, match="names GPU"):
        instance_specs(group("KIND_GPU", 1, gpus=[3]), gpus=2)


async def test_instance_count_changes_without_a_reload(repository):
    gated_model(repository, "grow", "instance_group [ { count: 1 kind: KIND_CPU } ]")
    gate = GATES["grow"]
    server = Server(options(repository), backends=BACKENDS)
    port = server.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        model = server.registry.route("grow", None)
        config = mc.ModelConfig()
        config.CopyFrom(model.config)
        config.instance_group[0].count = 2
        await model.set_instance_groups(config)
        assert [s.name for s in model.instances] == ["grow_0_0", "grow_0_1"]
        assert model.config.instance_group[0].count == 2
        assert server.registry.route("grow", None) is model  # the same loaded version

        async with trio.open_nursery() as clients:
            for value in (1.0, 2.0):
                clients.start_soon(trio.to_thread.run_sync, http_infer, port, "grow", value)
            assert await entered(gate, 2)  # the new instance takes work
            gate.release.set()

        config.instance_group[0].count = 1
        await model.set_instance_groups(config)
        assert [s.name for s in model.instances] == ["grow_0_0"]
        np.testing.assert_array_equal(
            await trio.to_thread.run_sync(http_infer, port, "grow", 5.0), np.full((1, 4), 5.0)
        )
        server.shutdown()


def test_kind_auto_stays_on_cpu_for_a_backend_without_gpu_support(monkeypatch):
    """A GPU host with the CPU build of onnxruntime: KIND_AUTO is KIND_CPU (as
    Triton resolves it for a backend built without GPU support), so the example
    repository still loads; a backend that can use the GPU gets KIND_GPU."""
    import onnxruntime

    from trionserve.actors import registry_entries
    from trionserve.backends.onnxruntime.backend import OnnxRuntimeBackend

    monkeypatch.setattr(registry_entries, "gpu_count", lambda: 2)
    simple = Path(__file__).resolve().parents[2] / "examples" / "model_repository" / "simple"

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert OnnxRuntimeBackend().can_use_gpu() is False
    prepared = registry_entries.prepare_model(simple, autocomplete=True, override_json=None)
    assert [g.kind for g in prepared.config.instance_group] == [mc.ModelInstanceGroup.KIND_CPU]

    monkeypatch.setattr(
        onnxruntime,
        "get_available_providers",
        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    prepared = registry_entries.prepare_model(simple, autocomplete=True, override_json=None)
    assert [g.kind for g in prepared.config.instance_group] == [mc.ModelInstanceGroup.KIND_GPU]
