"""Stateful models: sequence idle timeouts racing late requests, cancellations, shutdown."""

from __future__ import annotations

import trio

from simulations.clients import infer
from simulations.faults import QUANTUM, FaultPlan, quantize
from simulations.repository import ModelSpec, Sequencing
from simulations.scenario import Setup, scenario
from simulations.scenarios.common import KINDS

IDLE_EXACT = "a sequence is released exactly when it has been idle too long"
RELEASED = "was released after it was idle"


def _setup(world) -> Setup:
    rng = world.random("setup")
    oldest = rng.random() < 0.5
    max_batch = rng.randint(1, 4)
    sequencing = Sequencing(
        idle_us=rng.choice([2000, 5000, 10000]),
        oldest=oldest,
        max_candidates=rng.randint(max_batch, 4) if oldest else 0,
        delay_us=rng.choice([0, 1000]) if oldest else 0,
    )
    models = [
        ModelSpec(
            "seq",
            kind=rng.choice(KINDS),
            instances=rng.randint(1, 2),
            max_batch_size=max_batch,
            sequence=sequencing,
        )
    ]
    faults = FaultPlan(latency=(0.0005, 0.003), p_request_error=0.03)
    return Setup(models, faults, exit_timeout=1.0, shutdown_limit=2.0)


def _think_time(rng, idle: float) -> float:
    """Often exactly at the idle limit or one quantum either side of it."""
    return rng.choice(
        [
            quantize(rng.uniform(0.0, idle / 2)),
            idle - QUANTUM,
            idle,
            idle + QUANTUM,
            2 * idle,
        ]
    )


async def _sequence(world, rng, ids: list[int], length: int, idle: float) -> None:
    """One client's sequence: each request after the previous one's outcome. Its
    correlation id is taken from ``ids`` (the ids no running sequence uses, so a
    released id gets reused) and given back at the end."""
    correlation_id = ids.pop(rng.randrange(len(ids)))
    try:
        previous = None
        for index in range(length):
            if index:
                await trio.sleep(_think_time(rng, idle))
            tags = {"sequence": correlation_id, "index": index}
            if previous is not None and previous.client in ("response", "error"):
                # The sequence went idle when the previous request was answered.
                tags["idle_for"] = trio.current_time() - previous.finished_at
            cancel = quantize(rng.uniform(0.0, 0.004)) if rng.random() < 0.15 else None
            previous = await infer(
                world,
                "seq",
                sequence_id=correlation_id,
                start=index == 0,
                end=index == length - 1,
                cancel_after=cancel,
                tags=tags,
            )
            if (
                previous.client == "error"
                and previous.client_value.status.value
                in ("INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE")
                and "[sim]" not in previous.client_value.message
            ):
                return  # released, or the server is going away
    finally:
        ids.append(correlation_id)


def check_idle_exact(world) -> None:
    idle = world.setup.models[0].sequence.idle_us / 1e6
    for record in world.records:
        idle_for = record.tags.get("idle_for")
        if idle_for is None or record.client == "cancelled" or record.version is None:
            continue
        if world.shutdown_at is not None and record.submitted_at >= world.shutdown_at:
            continue
        released = record.client == "error" and RELEASED in record.client_value.message
        if released != (idle_for >= idle - 1e-9):
            world.violate(
                IDLE_EXACT,
                f"{record} came {idle_for * 1e6:.0f} us after its "
                f"sequence went idle (limit {idle * 1e6:.0f} us) and "
                f"was {'refused' if released else 'accepted'}",
            )


@scenario(
    "sequence_idle",
    "sequences on the sequence batcher with think times on the idle limit: late "
    "requests race the idle reaper, clients cancel, shutdown may cut sequences short",
    setup=_setup,
    checks=(check_idle_exact,),
    fast_seeds=60,
)
async def sequence_idle(world) -> None:
    rng = world.random("clients")
    idle = world.setup.models[0].sequence.idle_us / 1e6
    ids = list(range(1, 41))
    for number in range(rng.randint(10, 30)):
        world.activity.start_soon(
            _sequence, world, world.random(f"sequence {number}"), ids, rng.randint(2, 6), idle
        )
        await trio.sleep(quantize(rng.uniform(0.0, 0.004)))
    if rng.random() < 0.5:
        await trio.sleep(quantize(rng.uniform(0.0, 0.05)))  # shut down mid-sequence
    else:
        await trio.sleep(1.0)
