"""The rate limiter in a running server, driven over HTTP with tritonclient.

The server runs in-process (so a test backend can be registered); each model's
instances block in ``execute`` until the test opens the model's gate, so which
executions run together is observed with events and with the rate limiter's own
queue of waiting instances, not with timing.
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
from trionserve.actors.rate_limiter import RateLimiterResource, RateLimitMode
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.server import Server, ServerOptions

BACKEND = "test_rate_limiter_gate"


class Gate:
    """Executions of one model: how many entered ``execute``, and its release."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()


GATES: dict[str, Gate] = {}
ORDER: list[str] = []  # the models in the order their executions began
INSIDE = [0, 0]  # executions inside execute now, the most there ever were
LOCK = threading.Lock()


class _Instance:
    def __init__(self, context: ModelContext, spec: InstanceSpec) -> None:
        self.model = context.name

    def execute(self, requests):
        gate = GATES[self.model]
        with LOCK:
            ORDER.append(self.model)
            INSIDE[0] += 1
            INSIDE[1] = max(INSIDE)
        gate.entered.release()
        gate.release.wait(timeout=30)
        with LOCK:
            INSIDE[0] -= 1
        return echo_responses(requests, self.model, "1")

    def close(self) -> None:
        pass


BACKENDS = instance_backend(BACKEND, _Instance)


def gated_model(
    repository: Path, name: str, rate_limiter: str | None, backend: str = BACKEND
) -> None:
    """Model ``name`` of the gated backend (or ``backend``): one instance, with
    ``rate_limiter``'s settings when given."""
    block = f"rate_limiter {{ {rate_limiter} }}" if rate_limiter is not None else ""
    group = f"instance_group [ {{ count: 1 kind: KIND_CPU {block} }} ]"
    echo_model(repository, name, backend, group, dims="4")
    GATES[name] = Gate()


@pytest.fixture
def repository(tmp_path):
    ORDER.clear()
    INSIDE[:] = [0, 0]
    yield tmp_path
    for gate in GATES.values():
        gate.release.set()  # never leave a worker thread blocked
    GATES.clear()


def server(repository, mode=RateLimitMode.EXEC_COUNT, resources=()) -> Server:
    return Server(
        ServerOptions(
            model_repositories=[repository],
            http_address="127.0.0.1",
            http_port=free_port(),
            allow_grpc=False,
            allow_metrics=False,
            exit_timeout_secs=10.0,
            rate_limit=mode,
            rate_limit_resources=list(resources),
        ),
        backends=BACKENDS,
    )


def http_infer(port: int, model: str, value: float) -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
    try:
        data = np.full((1, 4), value, dtype=np.float32)
        infer_input = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        infer_input.set_data_from_numpy(data)
        return client.infer(model, [infer_input]).as_numpy("OUTPUT0")
    finally:
        client.close()


async def entered(model: str, count: int = 1) -> bool:
    """True when ``count`` more executions of ``model`` began (10 s at most)."""
    gate = GATES[model]

    def wait() -> bool:
        return all(gate.entered.acquire(timeout=10) for _ in range(count))

    return await trio.to_thread.run_sync(wait)


async def until(predicate, what: str) -> None:
    """Let the server's tasks run until ``predicate()`` holds (10 s at most)."""
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(0.005)


def waiting(srv: Server) -> list[str]:
    """The models whose instances wait in the rate limiter, in arrival order."""
    return [w.slot.model for w in srv.rate_limiter.queue.waiters]


def pending(srv: Server, model: str) -> int:
    return srv.registry.route(model, None)._scheduler.pending  # type: ignore[union-attr]


async def test_two_models_sharing_a_resource_never_execute_together(repository):
    gated_model(repository, "a", 'resources [ { name: "R1" count: 1 } ]')
    gated_model(repository, "b", 'resources [ { name: "R1" count: 1 } ]')
    srv = server(repository)
    port = srv.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        async with trio.open_nursery() as clients:
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "a", 1.0)
            assert await entered("a")
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "b", 2.0)
            # b's instance waits for R1, which a holds: it is not executing.
            await until(lambda: waiting(srv) == ["b"], "b waiting for R1")
            assert not GATES["b"].entered.acquire(blocking=False)
            GATES["a"].release.set()
            assert await entered("b")  # R1 came free
            GATES["b"].release.set()
        srv.shutdown()
    assert ORDER == ["a", "b"] and INSIDE[1] == 1
    assert srv.rate_limiter.table.allocated == {0: {"R1": 0}}


async def test_a_count_of_two_lets_two_run_and_holds_the_third(repository):
    for name in ("a", "b", "c"):
        gated_model(repository, name, 'resources [ { name: "R1" count: 1 } ]')
    srv = server(repository, resources=[RateLimiterResource("R1", 2)])
    port = srv.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        async with trio.open_nursery() as clients:
            for name in ("a", "b"):
                clients.start_soon(trio.to_thread.run_sync, http_infer, port, name, 1.0)
                assert await entered(name)
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "c", 1.0)
            await until(lambda: waiting(srv) == ["c"], "c waiting for R1")
            GATES["b"].release.set()
            assert await entered("c")
            GATES["a"].release.set()
            GATES["c"].release.set()
        srv.shutdown()
    assert INSIDE[1] == 2


async def test_priorities_share_executions_in_their_ratio(repository):
    # a priority 1, b priority 2 (half of a's executions), both exclusive on R1
    # with the holder; six requests each, all queued before R1 comes free.
    gated_model(repository, "holder", 'resources [ { name: "R1" count: 1 } ]')
    gated_model(repository, "a", 'resources [ { name: "R1" count: 1 } ] priority: 1')
    gated_model(repository, "b", 'resources [ { name: "R1" count: 1 } ] priority: 2')
    srv = server(repository)
    port = srv.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        async with trio.open_nursery() as clients:
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "holder", 0.0)
            assert await entered("holder")
            for name in ("a", "b"):
                for value in range(6):
                    clients.start_soon(trio.to_thread.run_sync, http_infer, port, name, value)
            await until(
                lambda: (
                    sorted(waiting(srv)) == ["a", "b"]
                    and pending(srv, "a") == 5
                    and pending(srv, "b") == 5
                ),
                "every request queued",
            )
            GATES["a"].release.set()
            GATES["b"].release.set()
            GATES["holder"].release.set()
        srv.shutdown()
    executions = ORDER[1:]
    assert INSIDE[1] == 1
    # Under contention a runs twice as often as b (Triton's scaled priority).
    assert executions[:9].count("a") == 6 and executions[:9].count("b") == 3, executions
    assert sorted(executions) == ["a"] * 6 + ["b"] * 6


async def test_an_instance_group_without_rate_limiter_is_not_limited(repository):
    gated_model(repository, "a", 'resources [ { name: "R1" count: 1 } ]')
    gated_model(repository, "b", 'resources [ { name: "R1" count: 1 } ]')
    gated_model(repository, "free", None)
    srv = server(repository)
    port = srv.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        async with trio.open_nursery() as clients:
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "a", 1.0)
            assert await entered("a")
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "b", 1.0)
            await until(lambda: waiting(srv) == ["b"], "b waiting for R1")
            # b heads the queue, blocked; the unlimited instance runs anyway.
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "free", 1.0)
            assert await entered("free")
            for gate in GATES.values():
                gate.release.set()
        srv.shutdown()
    assert INSIDE[1] == 2


async def test_off_mode_ignores_rate_limiter_blocks(repository):
    gated_model(repository, "a", 'resources [ { name: "R1" count: 1 } ]')
    gated_model(repository, "b", 'resources [ { name: "R1" count: 1 } ]')
    srv = server(repository, mode=RateLimitMode.OFF, resources=[RateLimiterResource("R1", 1)])
    port = srv.options.http_port
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        async with trio.open_nursery() as clients:
            for name in ("a", "b"):
                clients.start_soon(trio.to_thread.run_sync, http_infer, port, name, 1.0)
            assert await entered("a") and await entered("b")  # both inside at once
            for gate in GATES.values():
                gate.release.set()
        srv.shutdown()
    assert INSIDE[1] == 2 and srv.rate_limiter.table.slots == []


@pytest.mark.parametrize(
    ("is_global", "loads"), [(False, False), (True, True)], ids=["per-device", "global"]
)
async def test_a_count_given_for_another_device_counts_only_for_a_global_resource(
    repository, is_global, loads
):
    flag = "true" if is_global else "false"
    gated_model(repository, "a", f'resources [ {{ name: "R1" global: {flag} count: 2 }} ]')
    # R1:4 on device 1 only; the CPU instance is on device 0.
    srv = server(repository, resources=[RateLimiterResource("R1", 4, 1)])
    srv.options.exit_on_error = False
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        (row,) = srv.registry.index()
        srv.shutdown()
    if loads:
        assert row["state"] == "READY", row
    else:
        assert row["state"] == "UNAVAILABLE", row
        assert 'Resource count for "R1" is limited to 0 which will prevent' in row["reason"]


async def test_an_unloaded_models_waiter_leaves_without_its_resources(repository):
    # b's request waits for R1 when b unloads; once its drain time is over the
    # waiter leaves, the request is answered, and R1 is a's alone.
    gated_model(repository, "a", 'resources [ { name: "R1" count: 1 } ]')
    gated_model(repository, "b", 'resources [ { name: "R1" count: 1 } ]')
    srv = server(repository)
    srv.registry.lifecycle._drain_timeout = 0.2
    port = srv.options.http_port
    errors: list[BaseException] = []

    def infer_b() -> None:
        try:
            http_infer(port, "b", 1.0)
        except Exception as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        async with trio.open_nursery() as clients:
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "a", 1.0)
            assert await entered("a")
            clients.start_soon(trio.to_thread.run_sync, infer_b)
            await until(lambda: waiting(srv) == ["b"], "b waiting for R1")
            await srv.registry.unload("b")
            assert waiting(srv) == [] and [s.model for s in srv.rate_limiter.table.slots] == ["a"]
            GATES["a"].release.set()
            clients.start_soon(trio.to_thread.run_sync, http_infer, port, "a", 2.0)
            assert await entered("a")  # R1 free for a again
        srv.shutdown()
    assert len(errors) == 1 and not GATES["b"].entered.acquire(blocking=False)
    assert "was stopped" in str(errors[0]), errors[0]
    assert srv.rate_limiter.table.allocated == {0: {"R1": 0}}


async def test_the_in_process_api_takes_tritons_option_names(repository):
    from trionserve import api

    # The in-process API's servers have the installed backends only: Triton's identity.
    gated_model(repository, "a", 'resources [ { name: "R1" count: 4 } ]', backend="identity")
    options = api.Options(
        model_repository=repository,
        rate_limiter_mode=api.RateLimitMode.EXEC_COUNT,
        rate_limiter_resources=[api.RateLimiterResource("R1", 1, 0)],
    )
    with pytest.raises(api.InternalError, match='Resource count for "R1" is limited to 1'):
        async with api.open_server(options):
            pass
    options.rate_limiter_resources = [api.RateLimiterResource("R1", 4, 0)]
    async with api.open_server(options) as srv:
        assert srv.ready() is True


async def test_creating_and_warming_up_an_instance_count_as_executions(repository):
    # Triton's INIT and WARM_UP payloads pass the rate limiter and count toward an
    # instance's executions (backend_model_instance.cc InitAndWarmUpModelInstance),
    # which gives a higher-priority model its head start.
    gated_model(repository, "a", 'resources [ { name: "R1" count: 1 } ] priority: 2')
    srv = server(repository)
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        (slot,) = srv.rate_limiter.table.slots
        assert slot.executions == 2 and slot.scaled_priority == 4
        srv.shutdown()
    assert srv.rate_limiter.table.allocated == {0: {"R1": 0}}


async def test_a_changed_rate_limiter_replaces_the_instance_without_a_reload(repository):
    # As Triton compares instance signatures (model_config_utils.cc
    # EquivalentInInstanceConfig): the instance is replaced in place, the old one
    # is gone (and its needs with it) when the load returns.
    gated_model(repository, "a", 'resources [ { name: "R1" count: 2 } ]')
    srv = server(repository)
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        version = srv.registry.route("a", None)
        (before,) = srv.rate_limiter.table.slots
        config = repository / "a" / "config.pbtxt"
        config.write_text(config.read_text().replace("count: 2", "count: 8"))
        await srv.registry.load("a")
        assert srv.registry.route("a", None) is version  # not reloaded
        (after,) = srv.rate_limiter.table.slots
        assert after is not before and not before.registered
        assert srv.rate_limiter.table.available == {0: {"R1": 8}}
        srv.shutdown()
