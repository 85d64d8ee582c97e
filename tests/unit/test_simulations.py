"""The fault-injection simulations: a fast sweep of every scenario, and proof that each
invariant check fails when the runtime is broken on purpose.

The sweep runs each scenario for its ``fast_seeds`` seeds on the virtual clock (the
Python stub and real HTTP/gRPC frontend scenarios on the real one). A failing seed is
reported with the command that replays it. The deliberate-break tests patch one runtime
behaviour at a time (a backend that drops a response, a scheduler that answers twice,
...) and assert that the matching invariant reports it, so the checks cannot pass
vacuously.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from simulations import invariants, probes
from simulations.__main__ import main as cli
from simulations.backend import SERVING, AsyncSimInstance
from simulations.harness import COMPLETES, run_seed
from simulations.probes import QUEUE_BOUNDS
from simulations.scenario import SCENARIOS
from simulations.scenarios import client_budget, on_demand
from simulations.sweep import SweepTotals, failure_report, scenarios_named, sweep
from trionserve.actors import executor as executor_module
from trionserve.actors import executor_async as executor_async_module
from trionserve.actors import residency as residency_module
from trionserve.actors import residency_budget as residency_budget_module
from trionserve.actors.model_lifecycle import ModelLifeCycle
from trionserve.actors.residency import ResidencyManager
from trionserve.actors.watcher import ControlMode, RepositoryWatcher
from trionserve.core.client_budget import ClientBudget
from trionserve.repository.snapshot import snapshot_repository
from trionserve.schedulers import batch_queue
from trionserve.schedulers import default as default_module
from trionserve.schedulers import dynamic_batch as batcher_module

ALL = [scenario.name for scenario in scenarios_named(["all"])]
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def fast_sweep(name: str) -> SweepTotals:
    totals = SweepTotals(name)
    scenario = SCENARIOS[name]
    for result, seconds in sweep(scenario, range(scenario.fast_seeds)):
        totals.add(result, seconds)
    return totals


@pytest.mark.parametrize("name", ALL)
def test_fast_sweep(name):
    totals = fast_sweep(name)
    assert not totals.failures, "\n\n".join(failure_report(r) for r in totals.failures)
    assert totals.requests > 0


def test_clients_cancel_at_every_point_of_a_request():
    phases = fast_sweep("client_cancellation").cancel_phases
    assert {"queued", "batched", "executing", "responding"} <= set(phases), phases


def test_http_clients_disconnect_mid_request():
    totals = fast_sweep("http_frontend_faults")
    assert totals.cancel_phases, "no client disconnected while its request was in flight"


def test_a_seed_replays_exactly_in_another_process():
    scenario = SCENARIOS["shutdown_midway"]
    first, second = run_seed(scenario, 7), run_seed(scenario, 7)
    assert first.digest == second.digest
    code = (
        "from simulations.harness import run_seed; from simulations.sweep import "
        "scenarios_named; print(run_seed(scenarios_named(['shutdown_midway'])[0], 7).digest)"
    )
    env = dict(os.environ, PYTHONHASHSEED="4242", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    assert out[-1] == first.digest


# -- deliberate breaks ------------------------------------------------------------------


def variant(name: str, tweak=None, **scenario_changes):
    """A registered scenario with its setup changed by ``tweak(setup)``."""
    base = SCENARIOS[name]

    def setup(world):
        result = base.setup(world)
        if tweak is not None:
            tweak(result)
        return result

    return dataclasses.replace(base, name=f"{name}-broken", setup=setup, **scenario_changes)


def violations_of(scenario, invariant: str, seeds=range(5)) -> list:
    """The violations of ``invariant`` in the first seed that has any."""
    for seed in seeds:
        found = [v for v in run_seed(scenario, seed).violations if v.invariant == invariant]
        if found:
            return found
    return []


def test_a_backend_that_drops_a_response_is_caught():
    def drop(setup):
        setup.faults.p_drop = 0.3
        setup.models = [m.evolve(kind="async") for m in setup.models]

    found = violations_of(variant("backend_exception", drop), invariants.ONE_OUTCOME)
    assert any("never got an outcome" in v.detail for v in found), found
    assert violations_of(variant("backend_exception", drop), invariants.NOTHING_LOST)


def test_a_scheduler_that_answers_twice_is_caught(monkeypatch):
    deliver = default_module.deliver_outcomes

    def twice(requests, outcomes):
        deliver(requests, outcomes)
        deliver(requests, outcomes)

    monkeypatch.setattr(default_module, "deliver_outcomes", twice)
    found = violations_of(SCENARIOS["backend_exception"], invariants.ONE_OUTCOME)
    assert any("2 final outcomes" in v.detail for v in found), found


def test_a_task_left_behind_after_shutdown_is_caught(monkeypatch):
    run = AsyncSimInstance.run

    async def leaky(self, *, task_status=trio.TASK_STATUS_IGNORED):
        trio.lowlevel.spawn_system_task(trio.sleep_forever)
        await run(self, task_status=task_status)

    monkeypatch.setattr(AsyncSimInstance, "run", leaky)
    scenario = variant(
        "backend_exception",
        lambda s: setattr(s, "models", [m.evolve(kind="async") for m in s.models]),
    )
    assert violations_of(scenario, invariants.NO_LEAKS)


def test_a_queue_past_its_bound_is_caught(monkeypatch):
    level_init = batch_queue.Level.__init__

    def unbounded(self, number, policy):
        level_init(self, number, policy)
        self.max_queue_size = 0  # the batcher forgets max_queue_size

    monkeypatch.setattr(batch_queue.Level, "__init__", unbounded)
    found = violations_of(SCENARIOS["queue_overflow"], QUEUE_BOUNDS)
    assert any("its bound is" in v.detail for v in found), found


def test_routing_to_a_version_still_loading_is_caught(monkeypatch):
    start_version = ModelLifeCycle._start_version

    async def route_early(self, entry, version, errors, reason):
        entry.serving[version.version] = version  # switched before it loaded
        self.switch(entry.name)
        await start_version(self, entry, version, errors, reason)

    monkeypatch.setattr(ModelLifeCycle, "_start_version", route_early)

    def explicit(setup):
        setup.mode = ControlMode.EXPLICIT
        setup.faults.load_seconds = (0.2, 0.5)

    found = violations_of(variant("reload_under_load", explicit), SERVING)
    assert any("has not finished loading" in v.detail for v in found), found


def test_loading_a_half_written_model_is_caught(monkeypatch):
    poll = RepositoryWatcher.poll

    async def eager(self, actions):
        # The watcher acts on a change the first time it sees it.
        self._previous = dict(snapshot_repository(self.registry.repository))
        await poll(self, actions)

    monkeypatch.setattr(RepositoryWatcher, "poll", eager)
    found = violations_of(SCENARIOS["poll_changes"], SERVING, seeds=range(10))
    assert any("not fully written" in v.detail for v in found), found


def test_statistics_that_miss_failures_are_caught(monkeypatch):
    for module in (executor_module, executor_async_module):
        monkeypatch.setattr(module, "record_failures", lambda statistics, requests, reason: None)
    found = violations_of(SCENARIOS["backend_exception"], invariants.STATISTICS)
    assert any("BACKEND: counted" in v.detail for v in found), found


def test_responses_delivered_to_the_wrong_requests_are_caught(monkeypatch):
    deliver = batcher_module.deliver_outcomes
    monkeypatch.setattr(
        batcher_module,
        "deliver_outcomes",
        lambda requests, outcomes: deliver(requests, list(outcomes)[::-1]),
    )
    found = violations_of(SCENARIOS["backend_exception"], invariants.NOTHING_LOST)
    assert any("another request's" in v.detail for v in found), found


def test_a_reload_that_unloads_first_is_caught(monkeypatch):
    apply = ModelLifeCycle._apply

    async def unload_first(self, entry, plan, *args):
        for number in plan.unload:
            version = entry.serving.pop(number, None)
            if version is not None:
                self.switch(entry.name)
                self.retire(entry, version, "unloaded before its replacement loaded")
        await apply(self, entry, plan, *args)

    monkeypatch.setattr(ModelLifeCycle, "_apply", unload_first)
    found = violations_of(variant("reload_under_load"), invariants.NO_FAILURES)
    assert found


def test_a_livelock_ends_the_run_with_a_violation(monkeypatch):
    async def spin(self, requests):
        while True:
            await trio.lowlevel.checkpoint()

    monkeypatch.setattr(AsyncSimInstance, "execute_async", spin)
    # A tenth of the steps the sweeps allow at one instant: the spin is caught at
    # the same instant and task either way, in a tenth of the time.
    monkeypatch.setattr(probes, "LIVELOCK_STEPS", 20_000)
    scenario = variant(
        "backend_exception",
        lambda s: setattr(s, "models", [m.evolve(kind="async") for m in s.models]),
    )
    found = violations_of(scenario, COMPLETES, seeds=range(1))
    assert any(
        "livelock: 20000 task steps" in v.detail and "InstanceExecutor.run" in v.detail
        for v in found
    ), found


def test_a_failing_scenario_prints_its_seed_and_replay_command(monkeypatch, capsys):
    def drop(setup):
        setup.faults.p_drop = 0.5
        setup.models = [m.evolve(kind="async") for m in setup.models]

    broken = variant("backend_exception", drop)
    monkeypatch.setitem(SCENARIOS, broken.name, broken)
    assert cli(["run", broken.name, "--seed", "3", "--log-lines", "0"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {broken.name} seed 3" in out
    assert f"replay: python -m simulations run {broken.name} --seed 3" in out


# -- regressions: runtime bugs the simulations found ---------------------------------------


class _StepLimit(trio.abc.Instrument):
    """Cancels ``scope`` after ``limit`` task steps: a livelock becomes a failure
    instead of a test that never ends (virtual time does not pass while it spins)."""

    def __init__(self, scope: trio.CancelScope, limit: int = 50_000) -> None:
        self.scope, self.limit, self.steps = scope, limit, 0

    def after_task_step(self, task) -> None:
        self.steps += 1
        if self.steps == self.limit:
            self.scope.cancel()


def _config(text: str):
    from google.protobuf import text_format

    from trionserve._generated import model_config_pb2 as mc
    from trionserve.repository.config import normalize_model_config

    config = text_format.Parse(
        'name: "m" max_batch_size: 4 '
        'input [ { name: "INPUT0" data_type: TYPE_INT64 dims: [ 1 ] } ] '
        'output [ { name: "OUTPUT0" data_type: TYPE_INT64 dims: [ 1 ] } ] ' + text,
        mc.ModelConfig(),
    )
    normalize_model_config(config)
    return config


async def _batch_time(scheduler, request, submit_at: float) -> float:
    """When an idle executor gets ``request``, submitted at ``submit_at``."""
    from trionserve.core.inference import InferenceResponse

    with trio.CancelScope() as guard:
        limit = _StepLimit(guard)
        trio.lowlevel.add_instrument(limit)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(scheduler.run)
                outlet = scheduler.outlet()
                await trio.sleep(submit_at)
                await scheduler.submit(request)
                batch = await outlet.receive()
                taken = trio.current_time()
                outlet.complete(batch, [InferenceResponse("m", "1")] * len(batch))
                nursery.cancel_scope.cancel()
        finally:
            trio.lowlevel.remove_instrument(limit)
    assert not guard.cancelled_caught, "the scheduler spun without letting time pass"
    return taken


def _request(**fields):
    import numpy as np

    from trionserve.core.inference import InferenceRequest, Tensor

    request = InferenceRequest(
        "m",
        inputs={"INPUT0": Tensor("INPUT0", "INT64", np.zeros((1, 1), dtype=np.int64))},
        **fields,
    )
    request.batch_size = 1
    return request


# 0.0035 s + 0.002 s - 0.0035 s < 0.002 s in floats: waking at the delay's end used to
# find the delay not yet passed, forever.
SUBMIT_AT, DELAY = 0.0035, 0.002


async def test_regression_dynamic_batcher_sends_when_its_delay_ends(autojump_clock):
    from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler

    scheduler = DynamicBatchScheduler(
        _config(f"dynamic_batching {{ max_queue_delay_microseconds: {int(DELAY * 1e6)} }}")
    )
    taken = await _batch_time(scheduler, _request(), SUBMIT_AT)
    assert taken == pytest.approx(SUBMIT_AT + DELAY)


async def test_regression_sequence_batcher_sends_when_its_delay_ends(autojump_clock):
    from trionserve.schedulers.sequence_batch import SequenceBatchScheduler

    scheduler = SequenceBatchScheduler(
        _config(
            "sequence_batching { oldest { max_candidate_sequences: 4 "
            f"max_queue_delay_microseconds: {int(DELAY * 1e6)} }} }}"
        )
    )
    request = _request(sequence_id=1, sequence_start=True)
    taken = await _batch_time(scheduler, request, SUBMIT_AT)
    assert taken == pytest.approx(SUBMIT_AT + DELAY)


async def test_regression_default_scheduler_counts_the_requests_it_aborts():
    from trionserve.core.errors import Unavailable
    from trionserve.observability.statistics import FailureReason, ModelStatistics

    statistics = ModelStatistics("m", 1)
    scheduler = default_module.DefaultScheduler(statistics=statistics)
    request = _request()
    await scheduler.submit(request)
    scheduler.abort(Unavailable("model 'm' version 1 was unloaded"))
    assert request.done
    assert statistics.fail.count == 1
    assert statistics.failures[FailureReason.OTHER] == 1


def test_regression_poll_never_serves_files_changed_during_their_load():
    """A redeploy that starts while POLL is loading the previous one: the version
    loaded from the mix of old config and new files is discarded, not served."""
    from simulations.scenario import Scenario
    from simulations.scenarios.common import loading, settle, verify_converged

    base = SCENARIOS["poll_changes"]

    def setup(world):
        result = base.setup(world)
        result.faults.load_seconds = (1.0, 1.0)
        return result

    async def script(world):
        from simulations.clients import steady_load, wait_for

        stop = trio.Event()
        world.activity.start_soon(
            functools.partial(
                steady_load,
                world,
                ["plain"],
                duration=1e9,
                mean_gap=0.05,
                rng=world.random("clients"),
                stop=stop,
            )
        )
        writer = world.writer
        await writer.write(writer.revise("plain"), max_gap=world.setup.poll_secs)
        assert await wait_for(lambda: loading(world, "plain"), limit=10.0)
        await writer.write(writer.revise("plain"), max_gap=0.1)  # while it loads
        await settle(world, polls=3, load_limit=30.0)
        stop.set()
        await verify_converged(world)

    scenario = Scenario("poll_redeploy_during_load", "", setup, script)
    for seed in range(3):
        result = run_seed(scenario, seed)
        assert result.ok, failure_report(result)
        assert result.summary["versions"] >= 3  # startup, the discarded load, the reload


# -- models on demand: each promise of the residency policy, broken on purpose ------------


def test_an_eviction_of_a_busy_model_is_caught(monkeypatch):
    busy = ResidencyManager.busy

    def forgets_requests_in_flight(self, resident):
        reason = busy(self, resident)
        return None if reason == "requests in flight" else reason

    monkeypatch.setattr(ResidencyManager, "busy", forgets_requests_in_flight)
    found = violations_of(SCENARIOS["models_on_demand"], on_demand.NO_BUSY_EVICTION)
    assert any("requests outstanding" in v.detail for v in found), found


def test_charges_over_the_budget_are_caught(monkeypatch):
    monkeypatch.setattr(residency_budget_module, "over", lambda budgets, used, need: {})
    monkeypatch.setattr(residency_module, "over", lambda budgets, used, need: {})
    found = violations_of(SCENARIOS["models_on_demand"], on_demand.WITHIN_BUDGET)
    assert any("the budget is" in v.detail for v in found), found


def test_a_failed_load_retried_at_once_is_caught(monkeypatch):
    # The policy retries at once; the scenario's check still expects the real backoff.
    monkeypatch.setattr(residency_module, "RETRY_FIRST_SECS", 0.0)
    scenario = variant("models_on_demand", lambda s: setattr(s.faults, "p_load_failure", 0.3))
    found = violations_of(scenario, on_demand.BACKOFF)
    assert any("after its load failed" in v.detail for v in found), found


# -- the budget of bytes held for clients, broken on purpose ------------------------------


def test_a_pressure_policy_that_never_evicts_is_caught(monkeypatch):
    monkeypatch.setattr(ClientBudget, "_stalled", lambda self, now: (None, 1.0))
    found = violations_of(SCENARIOS["client_budget"], client_budget.STALLED_EVICTED)
    assert any("untouched for longer than" in v.detail for v in found), found


def test_producers_that_do_not_wait_are_caught(monkeypatch):
    monkeypatch.setattr(client_budget.SimulatedStub, "told", lambda self, full: None)
    found = violations_of(SCENARIOS["client_budget"], client_budget.WITHIN_LIMIT)
    assert any("limit" in v.detail for v in found), found


def test_an_eviction_of_a_reading_client_is_caught(monkeypatch):
    original = ClientBudget.__init__

    def impatient(self, limit=None, stall_secs=10.0):
        original(self, limit, 0.05)

    monkeypatch.setattr(ClientBudget, "__init__", impatient)
    found = violations_of(SCENARIOS["client_budget"], client_budget.STALLED_EVICTED)
    assert any("though its client read" in v.detail for v in found), found
