"""Runs one scenario for one seed: the real server on a virtual clock, then the checks.

The server is trionserve's own ``Server`` (registry, watcher, model versions with
their schedulers and executors, the DataPlane) with its network frontends turned
off: the simulated clients call the DataPlane directly. Everything runs in one
``trio.run`` on ``MockClock(autojump_threshold=0)`` with seeded scheduling, so a
seed replays a run exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import trio
import trio.testing

from simulations import invariants
from simulations.backend import SERVING, simulated_backends
from simulations.probes import Monitor, runtime_probes
from simulations.repository import RepositoryWriter
from simulations.scenario import Scenario
from simulations.virtual import seeded_scheduling, virtual_runtime
from simulations.world import Violation, World
from trionserve.actors.model import ModelState
from trionserve.observability import logging as server_logging
from trionserve.server import Server, ServerOptions

COMPLETES = "the run completes"
SETUP_LOADS = "the scenario's models load at startup"


@dataclass
class RunResult:
    scenario: str
    seed: int
    violations: list[Violation]
    summary: dict = field(default_factory=dict)
    digest: str = ""
    log: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def replay_command(scenario: str, seed: int) -> str:
    return f"python -m simulations run {scenario} --seed {seed}"


@contextlib.contextmanager
def captured_logs(world: World) -> Iterator[None]:
    """The server's log lines go to the run's ring buffer, shown when a run fails."""
    saved_config = structlog.get_config()
    settings = server_logging.SETTINGS
    saved_levels = (settings.log_info, settings.log_warning, settings.log_error)

    def capture(_logger, method: str, event: dict):
        fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "exc_info"))
        try:
            now = f"{trio.current_time():9.4f}"
        except RuntimeError:
            now = "         "
        world.log.append(f"{now} {method:7} {event.get('event')} {fields}")
        raise structlog.DropEvent

    structlog.configure(processors=[capture], cache_logger_on_first_use=False)
    # Loggers cached by an earlier configure_logging() go through these settings.
    settings.log_info = settings.log_warning = settings.log_error = False
    try:
        yield
    finally:
        structlog.configure(**saved_config)
        settings.log_info, settings.log_warning, settings.log_error = saved_levels


def _all_tasks() -> list:
    tasks, stack = [], [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        tasks.append(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return tasks


def _probe_routing(world: World) -> None:
    """Flag any request the routing table sends to a version still loading."""
    registry = world.registry
    route = registry.route

    def checked_route(name: str, version: int | None, namespace: str | None = None):
        model = route(name, version, namespace)
        if model.state is ModelState.LOADING:
            world.violate(
                SERVING,
                f"the routing table sent a request for '{name}' to "
                f"{model!r}, which has not finished loading",
            )
        return model

    registry.route = checked_route


async def _serve(world: World, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    world.server_task = trio.lowlevel.current_task()
    try:
        await world.server.serve(task_status=task_status)
    finally:
        world.stopped_at = trio.current_time()
        world.stopped.set()


async def _watchdog(
    world: World, activity: trio.CancelScope, everything: trio.CancelScope, clients_done: trio.Event
) -> None:
    """End a run that would never end: clients waiting forever after the server
    stopped, or a server that never stops."""
    setup = world.setup
    with trio.move_on_after(setup.run_limit) as limit:
        await world.stopped.wait()
        with trio.move_on_after(setup.hang_limit):
            await clients_done.wait()
            return
        world.clients_hung = True
        activity.cancel()
        return
    if limit.cancelled_caught:
        world.violate(COMPLETES, f"the run was stopped after {setup.run_limit:g} seconds")
        everything.cancel()


async def _main(world: World, scenario: Scenario, monitor: Monitor) -> None:
    world.started_at = trio.current_time()
    setup = world.setup = scenario.setup(world)
    baseline = set(_all_tasks())
    writer = world.writer = RepositoryWriter(world)
    for spec in setup.models:
        writer.install(spec)
    for relative, text in setup.files.items():
        path = world.repository / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    world.server = Server(
        ServerOptions(
            model_repositories=[world.repository],
            model_control_mode=setup.mode,
            repository_poll_secs=setup.poll_secs,
            load_models=list(setup.load_models),
            allow_http=False,
            allow_grpc=False,
            allow_metrics=False,
            exit_timeout_secs=setup.exit_timeout,
            exit_on_error=False,
            model_load_thread_count=setup.load_threads,
            residency=setup.residency,
            client_buffer_limit=setup.client_buffer_limit,
            client_buffer_stall_secs=setup.client_buffer_stall_secs,
        ),
        backends=simulated_backends(world),
    )
    _probe_routing(world)
    clients_done = trio.Event()
    async with trio.open_nursery() as outer:
        monitor.everything = outer.cancel_scope
        await outer.start(_serve, world)
        for name, reason in world.server.watcher.startup_errors.items():
            world.violate(SETUP_LOADS, f"'{name}' did not load at startup: {reason}")
        with trio.CancelScope() as activity_scope:
            async with trio.open_nursery() as activity:
                world.activity = activity
                outer.start_soon(_watchdog, world, activity_scope, outer.cancel_scope, clients_done)
                await scenario.script(world)
                world.shutdown()
        clients_done.set()
    leaked = set(monitor.server_tasks)
    leaked.update(t for t in _all_tasks() if t not in baseline)
    leaked.discard(trio.lowlevel.current_task())
    world.leaked_tasks = sorted(repr(t) for t in leaked)


def _summary(world: World, started: float) -> dict:
    records = world.records
    phases: dict[str, int] = {}
    for record in records:
        if record.cancel_phase:
            phases[record.cancel_phase] = phases.get(record.cancel_phase, 0) + 1
    return {
        "requests": len(records),
        "responses": sum(r.client == "response" for r in records),
        "errors": sum(r.client == "error" for r in records),
        "cancelled": sum(r.client == "cancelled" for r in records),
        "executions": len(world.executions),
        "versions": len(world.versions),
        "crashes": world.crashes,
        "cancel_phases": phases,
        "queue_peaks": dict(world.queue_peaks),
        "clock_s": round((world.stopped_at or world.started_at) - world.started_at, 4),
        "repeated_outcomes": sum(len(r.attempts) > 1 for r in records),
        "real_s": round(time.perf_counter() - started, 3),
        **world.notes,
    }


def _digest(world: World) -> str:
    """A fingerprint of what happened, equal for two runs of the same seed."""
    parts = [
        (
            r.number,
            r.model,
            r.client,
            r.cancel_phase,
            r.finished_at,
            None if r.outcome is None else r.outcome[0],
            r.taken_at,
            r.begun_at,
        )
        for r in world.records
    ]
    parts.append(tuple((e.instance, e.started_at, e.batch_size) for e in world.executions))
    parts.append(tuple(repr(v) for v in world.versions))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def run_seed(scenario: Scenario, seed: int) -> RunResult:
    """Run ``scenario`` with ``seed`` and check every invariant."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trionserve-sim-") as tmp:
        world = World(scenario.name, seed, Path(tmp))
        monitor = Monitor(world)
        completed = False
        if scenario.real_time:
            runtime, clock = seeded_scheduling(seed), None
        else:
            runtime, clock = virtual_runtime(seed), trio.testing.MockClock(autojump_threshold=0)
        with runtime, runtime_probes(world), captured_logs(world):
            try:
                trio.run(_main, world, scenario, monitor, clock=clock, instruments=[monitor])
                completed = True
            except Exception:
                world.violate(COMPLETES, "the run raised:\n" + traceback.format_exc())
        if completed:
            invariants.check_all(world)
            for check in scenario.checks:
                check(world)
        return RunResult(
            scenario.name,
            seed,
            list(world.violations),
            _summary(world, started),
            _digest(world),
            list(world.log),
        )
