"""Faults inside the backend: exceptions mid-batch, instance crashes, hangs."""

from __future__ import annotations

import trio

from simulations.clients import infer, steady_load
from simulations.faults import FaultPlan, quantize
from simulations.scenario import Setup, scenario
from simulations.scenarios.common import two_models
from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import TritonError

RECOVERS = "a model whose instance crashed serves again once reloaded"


def _exception_setup(world) -> Setup:
    rng = world.random("setup")
    faults = FaultPlan(
        latency=(0.001, 0.006),
        p_exception=rng.uniform(0.1, 0.3),
        p_request_error=rng.uniform(0.0, 0.15),
    )
    return Setup(two_models(rng), faults, exit_timeout=5.0, shutdown_limit=6.0)


@scenario(
    "backend_exception",
    "execute raises mid-batch, or answers single requests with errors; the executor "
    "keeps serving and only the batch's requests fail",
    setup=_exception_setup,
    fast_seeds=30,
)
async def backend_exception(world) -> None:
    rng = world.random("clients")
    await steady_load(
        world,
        ["plain", "batched"],
        duration=0.3,
        mean_gap=0.002,
        rng=rng,
        max_batch=2,
        p_stream=0.3,
    )
    await trio.sleep(0.1)


def _crash_setup(world) -> Setup:
    rng = world.random("setup")
    faults = FaultPlan(
        latency=(0.001, 0.005),
        p_crash=rng.uniform(0.02, 0.08),
        max_crashes=rng.randint(1, 3),
        p_exception=0.05,
        load_seconds=(0.0, 0.2),
    )
    return Setup(
        two_models(rng, kinds=("async",)),
        faults,
        mode=ControlMode.EXPLICIT,
        load_models=("*",),
        exit_timeout=5.0,
        shutdown_limit=6.0,
    )


async def _recover(world, stop) -> None:
    """Reload, as an operator would, any model that stopped serving after a crash."""
    while True:
        await trio.sleep(0.02)
        if stop.is_set():
            return
        for name in ("plain", "batched"):
            if world.crashes and not world.dataplane.model_ready(name, None):
                try:
                    await world.dataplane.load_model(name)
                except TritonError as exc:
                    world.violate(RECOVERS, f"reloading '{name}' failed: {exc.message}")
                world.notes["reloads"] = world.notes.get("reloads", 0) + 1


@scenario(
    "instance_crash",
    "an instance's task dies mid-batch: that batch's requests fail, the model becomes "
    "UNAVAILABLE (contained to it), and an explicit reload brings it back",
    setup=_crash_setup,
    fast_seeds=40,
)
async def instance_crash(world) -> None:
    stop = trio.Event()
    world.activity.start_soon(_recover, world, stop)
    await steady_load(
        world,
        ["plain", "batched"],
        duration=0.4,
        mean_gap=0.002,
        rng=world.random("clients"),
        max_batch=2,
    )
    await trio.sleep(0.3)
    stop.set()
    world.setup.faults.p_crash = 0.0
    world.setup.faults.p_exception = 0.0
    for name in ("plain", "batched"):
        record = await infer(world, name)
        if record.client != "response":
            world.violate(
                RECOVERS, f"'{name}' did not serve after the crashes: {record.client_value!r}"
            )


def _hang_setup(world) -> Setup:
    rng = world.random("setup")
    exit_timeout = quantize(rng.uniform(0.5, 3.0))
    faults = FaultPlan(
        latency=(0.001, 0.005),
        p_hang=rng.uniform(0.02, 0.1),
        thread_hang_seconds=quantize(rng.uniform(1.0, 6.0)),
    )
    models = two_models(rng)
    threads = any(spec.kind == "thread" for spec in models)
    # A worker thread cannot be interrupted: shutdown waits for its hang to end.
    limit = exit_timeout + (faults.thread_hang_seconds if threads else 0.0) + 0.5
    return Setup(models, faults, exit_timeout=exit_timeout, shutdown_limit=limit)


@scenario(
    "backend_hang",
    "batches hang past every limit; clients give up, queues back up, and shutdown "
    "still ends on time, answering whatever was stuck",
    setup=_hang_setup,
    fast_seeds=40,
)
async def backend_hang(world) -> None:
    await steady_load(
        world,
        ["plain", "batched"],
        duration=0.5,
        mean_gap=0.003,
        rng=world.random("clients"),
        max_batch=2,
        p_cancel=0.4,
        cancel_span=(0.01, 0.3),
        p_timeout_us=0.2,
        timeout_span_us=(1000, 50000),
    )
    await trio.sleep(quantize(world.random("script").uniform(0.0, 0.5)))
