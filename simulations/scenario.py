"""What a scenario is: a seeded setup (models, server options, fault plan), a script
that drives clients and faults on the virtual clock, and checks of its own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from simulations.faults import FaultPlan
from simulations.repository import ModelSpec
from trionserve.actors.residency import ResidencyOptions
from trionserve.actors.watcher import ControlMode


@dataclass
class Setup:
    """One run's starting point, drawn from the seed.

    ``shutdown_limit``: virtual seconds the server may take to stop once asked
    (None: not checked). ``expect_no_failures``: every request submitted before
    shutdown must succeed. ``tolerate_repeated_errors``: a request may be failed
    again after it failed (the second is ignored by the request; some backends
    report a failure twice by design).
    """

    models: list[ModelSpec]
    faults: FaultPlan = field(default_factory=FaultPlan)
    mode: ControlMode = ControlMode.NONE
    poll_secs: float = 1.0
    load_models: tuple[str, ...] = ()
    exit_timeout: float = 5.0
    load_threads: int = 2
    shutdown_limit: float | None = None
    expect_no_failures: bool = False
    tolerate_repeated_errors: bool = False
    files: dict[str, str] = field(default_factory=dict)
    backend_errors: tuple[str, ...] = ("[sim]",)
    observes_executions: bool = True
    # --model-load-on-demand, --model-memory-limit, --model-idle-unload-secs
    residency: ResidencyOptions = field(default_factory=ResidencyOptions)
    # --client-buffer-limit (None: the default) and --client-buffer-stall-secs
    client_buffer_limit: int | None = None
    client_buffer_stall_secs: float = 10.0
    hang_limit: float = 60.0  # seconds a client may still wait after the server stopped
    run_limit: float = 3600.0  # seconds after which the run is stopped


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    setup: Callable[..., Setup]
    script: Callable[..., Awaitable[None]]
    checks: tuple[Callable, ...] = ()
    fast_seeds: int = 20  # seeds the fast sweep of the test suite runs
    real_time: bool = False  # real clock and threads (a seed fixes the plan, not timing)


SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str, summary: str, *, setup, checks=(), fast_seeds: int = 20, real_time: bool = False
):
    """Register the decorated script as scenario ``name``."""

    def register(script):
        SCENARIOS[name] = Scenario(
            name, summary, setup, script, tuple(checks), fast_seeds, real_time
        )
        return script

    return register
