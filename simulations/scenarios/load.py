"""Load beyond capacity and clients that go away: full queues, bursts, cancellations."""

from __future__ import annotations

import dataclasses

import trio

from simulations.clients import spawn, steady_load
from simulations.faults import FaultPlan, quantize
from simulations.repository import Batching, ModelSpec
from simulations.scenario import Setup, scenario
from simulations.scenarios.common import KINDS
from trionserve.schedulers.scheduler import QUEUE_CAPACITY

REACHES_BOUND = "overload reaches the queue bound (the bound check is exercised)"


def _overflow_setup(world) -> Setup:
    rng = world.random("setup")
    timeout_us = rng.choice([0, 0, 20000, 60000])
    delay = timeout_us > 0 and rng.random() < 0.5
    batching = Batching(
        max_queue_delay_us=rng.choice([0, 2000]),
        max_queue_size=rng.randint(3, 8),
        timeout_us=timeout_us,
        delay_on_timeout=delay,
        allow_override=rng.random() < 0.5,
        # preserve_ordering allows neither DELAY timeouts nor priority levels.
        preserve_ordering=not delay and rng.random() < 0.3,
    )
    if not batching.preserve_ordering and rng.random() < 0.4:
        batching = dataclasses.replace(batching, priority_levels=2)
    models = [
        ModelSpec(
            "slow",
            kind=rng.choice(KINDS),
            instances=1,
            max_batch_size=rng.randint(1, 4),
            batching=batching,
        )
    ]
    faults = FaultPlan(latency=(0.01, 0.03), p_request_error=0.05)
    return Setup(models, faults, exit_timeout=2.0, shutdown_limit=3.0)


def check_reaches_bound(world) -> None:
    batching = world.setup.models[0].batching
    bound = batching.max_queue_size
    peak = max(
        (length for queue, length in world.queue_peaks.items() if queue.startswith("slow/1 level")),
        default=0,
    )
    if peak != bound:
        world.violate(REACHES_BOUND, f"the queue of 'slow' peaked at {peak}, its bound is {bound}")


@scenario(
    "queue_overflow",
    "a slow model with a small max_queue_size under bursts: requests beyond the bound "
    "are rejected at once, queue timeouts reject or delay, nothing else fails",
    setup=_overflow_setup,
    checks=(check_reaches_bound,),
    fast_seeds=60,
)
async def queue_overflow(world) -> None:
    rng = world.random("clients")
    for _ in range(rng.randint(3, 5)):
        for _ in range(rng.randint(10, 30)):
            options = {"batch": 1}
            if rng.random() < 0.3:
                options["timeout_us"] = rng.randint(1000, 40000)
            if rng.random() < 0.2:
                options["cancel_after"] = quantize(rng.uniform(0.0, 0.1))
            options["priority"] = rng.randint(0, 3)
            spawn(world, "slow", **options)
        await trio.sleep(quantize(rng.uniform(0.02, 0.15)))
    await trio.sleep(0.3)


def _burst_setup(world) -> Setup:
    rng = world.random("setup")
    models = [
        ModelSpec("plain", kind=rng.choice(KINDS), instances=1, max_batch_size=1),
        ModelSpec(
            "batched",
            kind=rng.choice(KINDS),
            instances=rng.randint(1, 2),
            max_batch_size=8,
            batching=Batching(max_queue_delay_us=1000),
        ),
    ]
    faults = FaultPlan(latency=(0.0005, 0.002))
    return Setup(models, faults, exit_timeout=30.0, shutdown_limit=31.0)


def check_backpressure(world) -> None:
    peak = world.queue_peaks.get("plain/1 channel", 0)
    if peak != QUEUE_CAPACITY:
        world.violate(
            REACHES_BOUND,
            f"the queue of 'plain' peaked at {peak}; the burst should "
            f"have filled it to {QUEUE_CAPACITY}",
        )


@scenario(
    "burst",
    f"bursts far above capacity (more than the {QUEUE_CAPACITY}-request queue bound at "
    "one instant): submitters wait for room, some give up while waiting",
    setup=_burst_setup,
    checks=(check_backpressure,),
    fast_seeds=4,
)
async def burst(world) -> None:
    rng = world.random("clients")
    for name in ("plain", "batched"):
        for _ in range(QUEUE_CAPACITY + rng.randint(20, 200)):
            options = {"batch": 1 if name == "plain" else rng.randint(1, 4)}
            if rng.random() < 0.1:
                options["cancel_after"] = quantize(rng.uniform(0.0, 1.0))
            spawn(world, name, **options)
    await trio.sleep(0.01)


def _cancellation_setup(world) -> Setup:
    rng = world.random("setup")
    models = [
        ModelSpec(
            "threaded",
            kind="thread",
            instances=rng.randint(1, 2),
            max_batch_size=4,
            batching=Batching(
                max_queue_delay_us=rng.choice([1000, 2000]), preserve_ordering=rng.random() < 0.5
            ),
        ),
        ModelSpec("awaited", kind="async", instances=1, max_batch_size=2),
        ModelSpec("pooled", kind="thread", instances=rng.randint(1, 2), max_batch_size=2),
    ]
    faults = FaultPlan(latency=(0.001, 0.003), p_exception=0.03)
    return Setup(models, faults, exit_timeout=2.0, shutdown_limit=3.0)


@scenario(
    "client_cancellation",
    "clients give up at instants that coincide with batching delays, execution starts "
    "and ends: cancellation at every point (queued, batched, executing, responding)",
    setup=_cancellation_setup,
    fast_seeds=40,
)
async def client_cancellation(world) -> None:
    await steady_load(
        world,
        ["threaded", "awaited", "pooled"],
        duration=0.15,
        mean_gap=0.001,
        rng=world.random("clients"),
        max_batch=2,
        p_cancel=0.7,
        cancel_span=(0.0, 0.008),
        p_stream=0.3,
    )
    await trio.sleep(0.05)
