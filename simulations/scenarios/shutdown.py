"""Shutdown in the middle of everything: load, faults, cancellations, repository changes."""

from __future__ import annotations

from functools import partial

import trio

from simulations.clients import steady_load
from simulations.faults import FaultPlan, quantize
from simulations.scenario import Setup, scenario
from simulations.scenarios.common import change_repository, model_names, two_models
from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import TritonError


def _setup(world) -> Setup:
    rng = world.random("setup")
    exit_timeout = quantize(rng.uniform(0.2, 3.0))
    faults = FaultPlan(
        latency=(0.001, 0.01),
        p_exception=0.05,
        p_request_error=0.03,
        p_hang=0.02,
        p_crash=0.02,
        load_seconds=(0.05, 1.0),
        instance_seconds=(0.0, 0.2),
        thread_hang_seconds=quantize(rng.uniform(0.5, 3.0)),
    )
    mode = rng.choice([ControlMode.POLL, ControlMode.EXPLICIT])
    models = two_models(rng, max_queue_size=rng.choice([0, 16]))
    # Work that cannot be interrupted (a worker thread, a load) delays the stop.
    limit = exit_timeout + faults.thread_hang_seconds + 2.0
    return Setup(
        models,
        faults,
        mode=mode,
        poll_secs=0.5,
        load_models=("*",),
        exit_timeout=exit_timeout,
        shutdown_limit=limit,
    )


async def _operate(world, rng) -> None:
    """Change the repository and, in EXPLICIT mode, load and unload models, until
    shutdown is asked for."""
    explicit = world.setup.mode is ControlMode.EXPLICIT
    while world.shutdown_at is None:
        _, name = await change_repository(world, rng, max_gap=world.setup.poll_secs, deletions=True)
        if explicit and world.shutdown_at is None:
            call = (
                world.dataplane.unload_model if rng.random() < 0.2 else world.dataplane.load_model
            )
            try:
                await call(name)
            except TritonError:
                pass  # a deleted or broken model: its error is the expected outcome
        await trio.sleep(quantize(rng.uniform(0.0, 0.5)))


@scenario(
    "shutdown_midway",
    "shutdown arrives in the middle of load, backend faults, hangs, crashes, client "
    "cancellations and repository changes: it ends in time and answers everyone",
    setup=_setup,
    fast_seeds=30,
)
async def shutdown_midway(world) -> None:
    rng = world.random("script")
    world.activity.start_soon(
        partial(
            steady_load,
            world,
            partial(model_names, world),
            duration=1e9,
            mean_gap=0.003,
            rng=world.random("clients"),
            max_batch=2,
            p_cancel=0.2,
            cancel_span=(0.0, 0.2),
            p_timeout_us=0.1,
            timeout_span_us=(1000, 20000),
            p_stream=0.2,
            stop=world.stopped,
        )
    )
    world.activity.start_soon(_operate, world, world.random("operator"))
    await trio.sleep(quantize(rng.uniform(0.05, 2.0)))
    world.shutdown()
    await world.stopped.wait()
