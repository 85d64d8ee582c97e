"""Model lifecycle in-process: the registry and the watcher with a fake backend.

Each test runs the real actor tree (no HTTP) and steps it through events: the fake
backend's load gate holds a load in its worker thread for as long as a test needs,
and POLL is driven one poll at a time with ``watcher.poll_once``.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import trio
import trio.testing

from tests.unit.test_model_control_support import (
    BACKENDS,
    CONCURRENCY,
    controls,
    fake_model,
    fake_request,
    reset_fake,
)
from trionserve.actors import model_lifecycle, registry_entries
from trionserve.actors import registry as registry_module
from trionserve.actors import watcher as watcher_module
from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import NotFound, TritonError
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.server import Server, ServerOptions


@pytest.fixture
def repo(tmp_path):
    reset_fake()
    yield tmp_path / "models"
    reset_fake()  # never leave a worker thread waiting on a gate


@pytest.fixture
def events(monkeypatch):
    """Every event the registry and the watcher log, as (event, fields)."""
    seen: list[tuple[str, dict]] = []

    class Recorder:
        def _record(self, event, *args, **fields):
            seen.append((event, fields))

        info = warning = error = debug = exception = _record

    monkeypatch.setattr(registry_module, "log", Recorder())
    monkeypatch.setattr(model_lifecycle, "log", Recorder())
    monkeypatch.setattr(registry_entries, "log", Recorder())
    monkeypatch.setattr(watcher_module, "log", Recorder())
    return seen


def make_server(repo, mode=ControlMode.EXPLICIT, **overrides) -> Server:
    values = dict(
        model_repositories=[repo],
        model_control_mode=mode,
        repository_poll_secs=0,  # tests drive POLL with watcher.poll_once()
        allow_http=False,
        allow_grpc=False,
        allow_metrics=False,
        exit_timeout_secs=5.0,
        exit_on_error=False,
    )
    values.update(overrides)
    return Server(ServerOptions(**values), backends=BACKENDS)


async def infer(server: Server, name: str, version: int | None = None) -> float:
    response = await server.dataplane.infer(fake_request(name, 0.0, version))
    return float(response.outputs[0].data[0, 0])


async def entered(name: str) -> None:
    """Wait until a load of ``name`` is inside the backend (its worker thread)."""
    assert await trio.to_thread.run_sync(controls(name).loading.acquire, True, 10)


async def settle(server: Server, name: str) -> None:
    """Wait (bounded) until no version of ``name`` is still draining."""
    with trio.fail_after(10):
        while server.registry.entries().get(name) and server.registry.entries()[name].draining:
            await trio.sleep(0.01)


def rows(server: Server, name: str) -> dict[str, tuple[str, str]]:
    return {
        r.get("version", ""): (r.get("state", ""), r.get("reason", ""))
        for r in server.dataplane.repository_index()
        if r["name"] == name
    }


def transitions(events, model: str) -> list[tuple]:
    return [
        (f["version"], f["from"], f["to"])
        for e, f in events
        if e == "model state" and f["model"] == model
    ]


async def test_concurrent_identical_loads_load_once(repo):
    """Triton #7018: two concurrent explicit loads of one model loaded it twice."""
    fake_model(repo, "m")
    gate = controls("m").load_gate
    gate.clear()
    server = make_server(repo)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with trio.open_nursery() as clients:
            for _ in range(3):
                clients.start_soon(server.dataplane.load_model, "m")
            await entered("m")
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        assert controls("m").loads == 1
        # A later load of an unchanged model is not a reload either.
        await server.dataplane.load_model("m")
        assert controls("m").loads == 1
        assert await infer(server, "m") == 1.0
        server.shutdown()


async def test_loads_are_bounded_by_the_load_thread_count(repo):
    names = [f"m{i}" for i in range(5)]
    for name in names:
        fake_model(repo, name)
        controls(name).load_gate.clear()
    server = make_server(repo, model_load_thread_count=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with trio.open_nursery() as clients:
            for name in names:
                clients.start_soon(server.dataplane.load_model, name)
            with trio.fail_after(10):  # every load has started: each shows LOADING
                while not all(rows(server, n).get("1", ("",))[0] == "LOADING" for n in names):
                    await trio.sleep(0.01)
            # Two loads enter the backend in their worker threads; a thread starts after
            # the row shows LOADING, so wait for the entries themselves (each releases its
            # model's ``loading`` once), not for Trio's tasks to block.
            inside: set[str] = set()
            with trio.fail_after(10):
                while len(inside) < 2:
                    inside |= {
                        n for n in names if n not in inside and controls(n).loading.acquire(False)
                    }
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()
            assert CONCURRENCY["now"] == 2  # two in the backend, three waiting their turn
            assert not any(controls(n).loading.acquire(False) for n in names if n not in inside)
            for name in names:
                controls(name).load_gate.set()
        assert CONCURRENCY["max"] == 2
        assert all(rows(server, n)["1"][0] == "READY" for n in names)
        server.shutdown()


async def test_a_stuck_load_blocks_neither_other_models_nor_the_repository(repo):
    """Triton #6710 (repository froze on a model error) and #8958 (a load blocked
    inference on other models): a load that never returns holds only itself."""
    fake_model(repo, "stuck")
    fake_model(repo, "busy")
    fake_model(repo, "other")
    controls("stuck").load_gate.clear()
    server = make_server(repo, load_models=["busy"])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        nursery.start_soon(server.dataplane.load_model, "stuck")
        await entered("stuck")
        assert rows(server, "stuck") == {"1": ("LOADING", "")}
        assert not server.dataplane.model_ready("stuck", None)
        for value in range(20):
            response = await server.dataplane.infer(fake_request("busy", float(value)))
            assert float(response.outputs[0].data[0, 0]) == value + 1.0
        with trio.fail_after(5):
            await server.dataplane.load_model("other")
            await server.dataplane.unload_model("busy")
        assert rows(server, "other") == {"1": ("READY", "")}
        assert rows(server, "busy") == {"1": ("UNAVAILABLE", "unloaded")}
        assert server.dataplane.live()
        controls("stuck").load_gate.set()
        with trio.fail_after(5):
            while rows(server, "stuck") != {"1": ("READY", "")}:
                await trio.sleep(0.01)
        server.shutdown()


async def test_reload_serves_the_old_version_until_the_new_one_is_ready(repo, events):
    """Triton #2076: a reload unloaded the model before loading it (downtime)."""
    model = fake_model(repo, "m", {1: 1.0})
    server = make_server(repo, load_models=["m"])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        assert await infer(server, "m") == 1.0
        (model / "1" / "model.txt").write_text("2.5\n")
        controls("m").load_gate.clear()
        nursery.start_soon(server.dataplane.load_model, "m")
        await entered("m")
        # The new version is loading; the old one serves every request meanwhile.
        assert server.dataplane.model_ready("m", 1)
        assert rows(server, "m") == {"1": ("READY", "")}
        for _ in range(10):
            assert await infer(server, "m") == 1.0
        controls("m").load_gate.set()
        with trio.fail_after(5):
            while await infer(server, "m") != 2.5:
                await trio.sleep(0.01)
        await settle(server, "m")
        assert controls("m").live_instances == 1
        order = transitions(events, "m")
        new_ready = order.index((1, "LOADING", "READY"), 1)  # the reload's
        old_unloading = order.index((1, "READY", "UNLOADING"))
        assert new_ready < old_unloading
        assert (1, "UNLOADING", "UNAVAILABLE") in order
        fields = [f for e, f in events if e == "model state" and f["to"] == "UNLOADING"][0]
        assert fields["reason"].startswith("load requested")
        assert set(fields) == {"model", "version", "from", "to", "reason", "duration_s"}
        assert all(f["duration_s"] >= 0 for e, f in events if e == "model state")
        server.shutdown()


async def test_failed_reload_keeps_the_loaded_version_and_reports_why(repo):
    model = fake_model(repo, "m", {1: 1.0})
    server = make_server(repo, load_models=["m"])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        (model / "1" / "model.txt").write_text("7\n")
        controls("m").fail_load = "injected load failure"
        with pytest.raises(TritonError, match="injected load failure"):
            await server.dataplane.load_model("m")
        assert await infer(server, "m") == 1.0
        state, reason = rows(server, "m")["1"]
        assert state == "READY" and "injected load failure" in reason
        assert server.dataplane.ready()  # the serving set is complete
        controls("m").fail_load = ""
        await server.dataplane.load_model("m")
        assert await infer(server, "m") == 7.0
        assert rows(server, "m")["1"] == ("READY", "")
        server.shutdown()


async def test_reloads_release_every_old_version(repo):
    """Triton #4528 / #4966: memory grew across reloads. Nothing keeps old versions."""
    model = fake_model(repo, "m", {1: 0.0})
    server = make_server(repo, load_models=["m"])
    old: list[weakref.ref] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        for i in range(1, 21):
            old.append(weakref.ref(server.registry.route("m", None)))
            (model / "1" / "model.txt").write_text(f"{i}.0\n" + " " * i)
            await server.dataplane.load_model("m")
            assert await infer(server, "m") == float(i)
        await settle(server, "m")
        gc.collect()
        assert [ref for ref in old if ref() is not None] == []
        assert controls("m").loads == 21
        assert controls("m").unloads == 20
        assert controls("m").live_instances == 1
        server.shutdown()


async def test_version_policy_change_loads_and_unloads_single_versions(repo):
    model = fake_model(repo, "m", {1: 1.0, 2: 2.0, 3: 3.0})
    server = make_server(repo, load_models=["m"])
    config = model / "config.pbtxt"
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        assert sorted(server.registry.entries()["m"].serving) == [3]
        config.write_text(config.read_text() + "version_policy: { all {} }\n")
        await server.dataplane.load_model("m")
        assert controls("m").loads == 3  # versions 1 and 2 loaded; 3 kept
        assert await infer(server, "m") == 3.0  # no version: the highest
        assert await infer(server, "m", 1) == 1.0
        config.write_text(config.read_text().replace("all {}", "specific { versions: [1] }"))
        await server.dataplane.load_model("m")
        assert controls("m").loads == 3  # nothing new to load
        assert await infer(server, "m") == 1.0
        with pytest.raises(NotFound, match="'m' version 3 is not found"):
            await infer(server, "m", 3)
        await settle(server, "m")
        assert rows(server, "m") == {
            "1": ("READY", ""),
            "2": ("UNAVAILABLE", "unloaded"),
            "3": ("UNAVAILABLE", "unloaded"),
        }
        server.shutdown()


async def test_instance_count_change_adds_and_removes_executors_without_reload(repo, events):
    model = fake_model(repo, "m", count=1)
    server = make_server(repo, load_models=["m"])
    config = model / "config.pbtxt"
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        serving = server.registry.route("m", None)
        for count in (3, 2):
            config.write_text(
                config.read_text()
                .replace("count: 1", f"count: {count}")
                .replace("count: 3", f"count: {count}")
            )
            await server.dataplane.load_model("m")
            assert server.registry.route("m", None) is serving  # not reloaded
            assert controls("m").loads == 1
            assert controls("m").live_instances == count
            assert server.dataplane.model_config("m", None).instance_group[0].count == count
            assert await infer(server, "m") == 1.0
        changed = [f for e, f in events if e == "model instances changed"]
        assert [(f["from"], f["to"]) for f in changed] == [([1], [3]), ([3], [2])]
        server.shutdown()


ENSEMBLE_CONFIG = """
name: "ens"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "a" model_version: -1
    input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "MID" } },
  { model_name: "b" model_version: -1
    input_map { key: "INPUT0" value: "MID" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""


async def test_ensemble_loads_its_composing_models_and_unload_dependents(repo):
    fake_model(repo, "a")
    fake_model(repo, "b")
    (repo / "ens" / "1").mkdir(parents=True)
    (repo / "ens" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    server = make_server(repo)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        await server.dataplane.load_model("b")  # loaded by name: stays
        await server.dataplane.load_model("ens")
        assert {n: rows(server, n)["1"][0] for n in ("ens", "a", "b")} == {
            "ens": "READY",
            "a": "READY",
            "b": "READY",
        }
        # Triton's check of the ensemble sets its transaction policy, present in
        # its config whether decoupled or not (core ensemble_utils.cc:364).
        policy = server.dataplane.model_config("ens", None)
        assert policy.HasField("model_transaction_policy")
        assert not policy.model_transaction_policy.decoupled
        data = np.ones((1, 2), dtype=np.float32)
        request = InferenceRequest("ens", inputs={"IN": Tensor("IN", "FP32", data)})
        response = await server.dataplane.infer(request)
        assert float(response.outputs[0].data[0, 0]) == 3.0  # a and b each add 1
        await server.dataplane.unload_model("ens")  # composing models stay loaded
        assert server.dataplane.model_ready("a", None)
        await server.dataplane.load_model("ens")
        await server.dataplane.unload_model("ens", unload_dependents=True)
        assert not server.dataplane.model_ready("ens", None)
        assert not server.dataplane.model_ready("a", None)  # loaded only for ens
        assert server.dataplane.model_ready("b", None)  # loaded by name
        assert controls("a").live_instances == 0
        server.shutdown()


async def test_poll_acts_on_a_change_in_the_poll_that_sees_it_once_a_second_look_agrees(repo):
    """Triton acts on the poll that first sees a change (core
    model_repository_manager.cc PollAndUpdateInternal): so does this watcher,
    once a second look ``settle`` later finds the same files."""
    fake_model(repo, "m")
    server = make_server(repo, mode=ControlMode.POLL)
    looks = []

    async def second_look():
        looks.append(controls("copied").loads)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        server.watcher.settle = 1.0
        server.watcher._wait_settle = second_look
        copied = repo / "copied"
        (copied / "1").mkdir(parents=True)
        (copied / "config.pbtxt").write_text(
            (repo / "m" / "config.pbtxt").read_text().replace('"m"', '"copied"')
        )
        (copied / "1" / "model.txt").write_text("4.0\n")
        await server.watcher.poll_once()
        assert looks == [0]  # looked twice, then loaded
        assert await infer(server, "copied") == 4.0
        await server.watcher.poll_once()  # nothing changed: no second look
        assert looks == [0] and controls("copied").loads == 1
        server.shutdown()


async def test_poll_never_loads_a_copy_that_goes_on_between_its_two_looks(repo, events):
    """Triton #356: POLL loaded partially copied models. A copy still writing
    when the poll looks again is left until two looks agree."""
    fake_model(repo, "m")
    server = make_server(repo, mode=ControlMode.POLL)
    target = repo / "copied"
    # Copy a model file by file, like a slow `cp -r` that never pauses a poll
    # interval: one step between two polls, the next between a poll's two looks.
    steps = [
        lambda: (target / "config.pbtxt").write_text('name: "copied"\n'),
        lambda: (target / "config.pbtxt").write_text(
            (repo / "m" / "config.pbtxt").read_text().replace('"m"', '"copied"')
        ),
        lambda: (target / "1" / "model.txt").write_text("4"),
        lambda: (target / "1" / "model.txt").write_text("4.0\n"),
    ]

    async def copy_goes_on():
        if steps:
            steps.pop(0)()

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        server.watcher.settle = 1.0
        server.watcher._wait_settle = copy_goes_on
        (target / "1").mkdir(parents=True)
        while steps:
            steps.pop(0)()
            await server.watcher.poll_once()
            assert controls("copied").loads == 0
            assert "copied" not in server.registry.entries()
        # The last step was seen by one look only; the next poll agrees with it.
        await server.watcher.poll_once()
        assert await infer(server, "copied") == 4.0
        assert controls("copied").loads == 1
        pending = [f for e, f in events if e.startswith("model change pending")]
        assert pending and pending[0]["model"] == "copied"
        assert [e for e, _ in events if e.startswith("model load failed")] == []
        server.shutdown()


async def test_poll_keeps_following_after_a_failed_load(repo):
    """Triton #6534: POLL stopped seeing changes after one failed load."""
    model = fake_model(repo, "m", {1: 1.0})
    server = make_server(repo, mode=ControlMode.POLL)
    config = model / "config.pbtxt"
    good = config.read_text()

    async def two_polls():
        await server.watcher.poll_once()
        await server.watcher.poll_once()

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        config.write_text(good.replace("max_batch_size: 8", "max_batch_size: -3"))
        await two_polls()
        state, reason = rows(server, "m")["1"]
        assert state == "READY" and "'max_batch_size' must be non-negative value" in reason
        assert await infer(server, "m") == 1.0  # the loaded version keeps serving
        config.write_text(good)
        (model / "1" / "model.txt").write_text("2.0\n")
        await two_polls()
        assert await infer(server, "m") == 2.0
        assert rows(server, "m")["1"] == ("READY", "")
        fake_model(repo, "later", {1: 5.0})
        await two_polls()
        assert await infer(server, "later") == 5.0
        server.shutdown()


async def test_poll_ignores_bytecode_and_editor_files(repo):
    """Triton 2.51 loaded Python models twice: their stub wrote __pycache__."""
    model = fake_model(repo, "m")
    server = make_server(repo, mode=ControlMode.POLL)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        (model / "1" / "__pycache__").mkdir()
        (model / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0" * 64)
        (model / ".config.pbtxt.swp").write_bytes(b"\0" * 16)
        (model / "config.pbtxt~").write_text("old")
        for _ in range(3):
            await server.watcher.poll_once()
        assert controls("m").loads == 1
        # An edit that changes nothing that matters (a comment) is no reload either.
        config = model / "config.pbtxt"
        config.write_text("# reviewed\n" + config.read_text())
        for _ in range(3):
            await server.watcher.poll_once()
        assert controls("m").loads == 1
        server.shutdown()


async def test_index_rows_leave_an_empty_reason_out_as_triton(repo):
    """Triton's index has a ``reason`` only when there is one (core
    src/tritonserver.cc:3176-3179); qa/L0_storage_S3_local matches the row
    ``{"name":...,"version":"4","state":"READY"}`` as text."""
    model = fake_model(repo, "m", {1: 1.0})
    server = make_server(repo, mode=ControlMode.POLL)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        (model / "2").mkdir()
        (model / "2" / "model.txt").write_text("2.0\n")
        await server.watcher.poll_once()
        await server.watcher.poll_once()
        await settle(server, "m")
        index = [r for r in server.dataplane.repository_index() if r["name"] == "m"]
        assert index == [
            {"name": "m", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
            {"name": "m", "version": "2", "state": "READY"},
        ]
        server.shutdown()


async def test_poll_follows_versions_removals_and_duplicates(repo, tmp_path):
    model = fake_model(repo, "m", {1: 1.0})
    second = tmp_path / "second"
    second.mkdir()
    server = make_server(repo, mode=ControlMode.POLL, model_repositories=[repo, second])

    async def two_polls():
        await server.watcher.poll_once()
        await server.watcher.poll_once()

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        (model / "2").mkdir()
        (model / "2" / "model.txt").write_text("2.0\n")
        await two_polls()
        assert await infer(server, "m") == 2.0  # latest 1: version 2 replaced 1
        await settle(server, "m")
        assert rows(server, "m") == {"1": ("UNAVAILABLE", "unloaded"), "2": ("READY", "")}

        fake_model(second, "m", {1: 9.0})  # the same name in a second repository
        await two_polls()
        assert rows(server, "m")[""][0] == "UNAVAILABLE"
        assert "multiple model repositories" in rows(server, "m")[""][1]
        assert not server.dataplane.model_ready("m", None)

        import shutil

        shutil.rmtree(second / "m")
        await two_polls()
        assert await infer(server, "m") == 2.0
        shutil.rmtree(model)
        await server.watcher.poll_once()
        assert server.dataplane.model_ready("m", None)  # one poll is not enough
        await server.watcher.poll_once()
        assert not server.dataplane.model_ready("m", None)
        assert {s for s, _ in rows(server, "m").values()} == {"UNAVAILABLE"}
        server.shutdown()


async def test_unload_drains_then_answers_what_is_left_after_the_timeout(repo, autojump_clock):
    """Unload waits for in-flight work, bounded: past the drain deadline (virtual
    time here) the requests still executing or queued get an error, not silence."""
    fake_model(repo, "m")
    server = make_server(repo, load_models=["m"], exit_timeout_secs=0.5)
    c = controls("m")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        outcomes: dict[float, str] = {}
        unloaded = trio.Event()

        async def call(value: float) -> None:
            try:
                await server.dataplane.infer(fake_request("m", value))
                outcomes[value] = "ok"
            except TritonError as exc:
                outcomes[value] = exc.status.value

        async def unload() -> None:
            await server.dataplane.unload_model("m")
            unloaded.set()

        async with trio.open_nursery() as clients:
            c.execute_gate.clear()
            clients.start_soon(call, 1.0)
            assert await trio.to_thread.run_sync(c.executing.acquire, True, 10)
            clients.start_soon(call, 2.0)
            await trio.testing.wait_all_tasks_blocked()
            clients.start_soon(unload)
            await trio.sleep(0.2)  # virtual: within the drain deadline
            assert not unloaded.is_set() and outcomes == {}
            assert rows(server, "m") == {"1": ("UNLOADING", "")}
            await trio.sleep(1)  # virtual: past it
            c.execute_gate.set()
        assert unloaded.is_set()
        assert outcomes[2.0] == "UNAVAILABLE"  # queued past the deadline
        assert outcomes[1.0] in ("ok", "UNAVAILABLE")  # executing: one outcome either way
        assert rows(server, "m") == {"1": ("UNAVAILABLE", "unloaded")}
        server.shutdown()


async def test_load_model_star_loads_everything_at_startup(repo):
    for name in ("a", "b", "c"):
        fake_model(repo, name)
    server = make_server(repo, load_models=["*"])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        assert all(server.dataplane.model_ready(n, None) for n in ("a", "b", "c"))
        server.shutdown()
    with pytest.raises(Exception, match="'\\*' must be the only startup model"):
        make_server(repo, load_models=["*", "a"])


async def test_load_and_unload_write_tritons_own_lines(repo, events):
    """Triton's core writes these (model_lifecycle.cc:472, :624, :654, :777,
    :839); users and their log tooling grep them."""
    fake_model(repo, "m", {1: 1.0, 2: 2.0}, extra="version_policy: { all: {} }")
    fake_model(repo, "bad")
    controls("bad").fail_load = "injected load failure"
    server = make_server(repo)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        await server.dataplane.load_model("m")
        with pytest.raises(TritonError):
            await server.dataplane.load_model("bad")
        await server.dataplane.unload_model("m")
        await settle(server, "m")
        server.shutdown()
    lines = [e for e, f in events if not f]
    # Versions load and unload concurrently: each pair in either order.
    assert sorted(lines[:2]) == ["loading: m:1", "loading: m:2"]
    assert lines[2:6] == [
        "successfully loaded 'm'",
        "loading: bad:1",
        # The version's error (:654, an error), then the load's end (:777).
        "failed to load 'bad' version 1: Internal: injected load failure",
        "failed to load 'bad'",
    ]
    assert sorted(lines[6:]) == [
        "successfully unloaded 'm' version 1",
        "successfully unloaded 'm' version 2",
    ]


def one_step_ensemble(repo, name: str, step: str) -> None:
    """An ensemble whose one step calls ``step`` (IN -> OUT, as ENSEMBLE_CONFIG)."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}" platform: "ensemble" max_batch_size: 8 '
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ] '
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ] '
        f'ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1 '
        'input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } '
        "} ] }"
    )


async def test_ensembles_calling_each_other_fail_at_startup_without_waiting(repo):
    """Loaded together at startup, each would wait for the other's load: the
    cycle is found in their configs first (Triton's CircularDependencyCheck,
    core model_repository_manager.cc), and both fail in Triton's words."""
    one_step_ensemble(repo, "up", "down")
    one_step_ensemble(repo, "down", "up")
    one_step_ensemble(repo, "self", "self")
    server = make_server(repo, mode=ControlMode.NONE)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            assert (
                "circular dependency between ensembles: up -> ... -> down -> up"
                in (rows(server, "up")[""][1])
            )
            assert (
                "circular dependency between ensembles: down -> ... -> up -> down"
                in (rows(server, "down")[""][1])
            )
            assert (
                "circular dependency between ensembles: self -> ... -> self -> self"
                in (rows(server, "self")[""][1])
            )
            server.shutdown()


async def test_an_ensemble_step_naming_a_model_no_repository_has(repo):
    fake_model(repo, "a")
    (repo / "ens" / "1").mkdir(parents=True)
    config = ENSEMBLE_CONFIG.replace('"b"', '"gone"').replace('"a"', '"absent"')
    (repo / "ens" / "config.pbtxt").write_text(config)
    server = make_server(repo)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with pytest.raises(TritonError) as caught:
            await server.dataplane.load_model("ens")
        # Triton's words (model_repository_manager.cc ConnectDependencyGraph),
        # the names sorted; not polled, so INTERNAL as Triton's explicit load.
        assert caught.value.message == (
            "failed to load 'ens', failed to poll from model repository: ensemble ens "
            "contains models that are not available or ambiguous: absent, gone"
        )
        server.shutdown()


async def test_a_backend_that_does_not_exist_fails_each_version_as_triton_logs_it(repo, events):
    """Triton finds a model's backend when a version loads (core backend_model.cc
    LocateBackendLibrary), so the model is polled and its versions fail; each
    failure is logged as core model_lifecycle.cc does, the status code first."""
    (repo / "odd" / "1").mkdir(parents=True)
    (repo / "odd" / "config.pbtxt").write_text('backend: "nowhere"\n')
    server = make_server(repo)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with pytest.raises(TritonError) as caught:
            await server.dataplane.load_model("odd")
        server.shutdown()
    triton_words = (
        "unable to find backend library for backend 'nowhere', try specifying runtime on the "
        "model configuration."
    )
    assert triton_words in caught.value.message
    state, reason = rows(server, "odd")["1"]
    assert state == "UNAVAILABLE" and reason.startswith(triton_words)
    failed = [e for e, f in events if e.startswith("failed to load 'odd' version 1: ")]
    assert failed == [f"failed to load 'odd' version 1: Invalid argument: {reason}"]
