"""Simulated clients: they submit requests through the DataPlane, cancel them, give up
on them, and record what they got, all on the virtual clock."""

from __future__ import annotations

import random

import numpy as np
import trio

from simulations.faults import QUANTUM, quantize
from simulations.world import RequestRecord, TrackedRequest, World
from trionserve.core.errors import TritonError
from trionserve.core.inference import Tensor


def phase_of(record: RequestRecord) -> str:
    """Where a request was when its client went away."""
    if record.ended_at is not None or record.attempts:
        return "responding"
    if record.begun_at is not None:
        return "executing"
    if record.taken_at is not None:
        return "batched"
    if record.accepted:
        return "queued"
    return "admission"


async def infer(
    world: World,
    model: str,
    *,
    batch: int = 1,
    cancel_after: float | None = None,
    priority: int = 0,
    timeout_us: int = 0,
    version: int | None = None,
    sequence_id: int = 0,
    start: bool = False,
    end: bool = False,
    tags: dict | None = None,
    stream: bool = False,
) -> RequestRecord:
    """One client call: submit, wait, and record the single outcome it saw.

    ``cancel_after`` is when the client gives up (a cancellation or a client-side
    timeout: the runtime cannot tell them apart). ``stream`` uses the streaming
    path of the DataPlane (gRPC streams), which must deliver exactly one final
    response for these models.
    """
    number = len(world.records)
    now = trio.current_time()
    record = RequestRecord(number, model, now, batch, cancel_after, tags=tags or {})
    world.records.append(record)
    values = np.arange(batch, dtype=np.int64).reshape(batch, 1) + number * 1000
    request = TrackedRequest(
        model,
        version,
        id=f"r{number}",
        inputs={"INPUT0": Tensor("INPUT0", "INT64", values)},
        priority=priority,
        timeout_us=timeout_us,
        sequence_id=sequence_id,
        sequence_start=start,
        sequence_end=end,
    )
    request.record = record
    with trio.CancelScope() as scope:
        if cancel_after is not None:
            scope.deadline = now + cancel_after
        try:
            if stream:
                response = await _infer_stream(world, request)
            else:
                response = await world.dataplane.infer(request)
        except TritonError as exc:
            record.client, record.client_value = "error", exc
        else:
            record.client, record.client_value = "response", response
    if scope.cancelled_caught:
        record.client = "cancelled"
        record.cancel_phase = phase_of(record)
    record.finished_at = trio.current_time()
    return record


async def _infer_stream(world: World, request):
    delivered: list = []

    async def deliver(response, final: bool) -> None:
        delivered.append((response, final))

    await world.dataplane.infer_stream(request, deliver)
    if len(delivered) != 1 or not delivered[0][1] or delivered[0][0] is None:
        world.violate(
            "every request gets exactly one final outcome",
            f"{request.record}: its stream delivered {delivered!r}",
        )
    return delivered[-1][0] if delivered else None


def spawn(world: World, model: str, **options) -> None:
    assert world.activity is not None
    world.activity.start_soon(lambda: infer(world, model, **options))


async def steady_load(
    world: World,
    models,
    *,
    duration: float,
    mean_gap: float,
    rng: random.Random,
    max_batch: int = 1,
    p_cancel: float = 0.0,
    cancel_span: tuple[float, float] = (0.0, 0.01),
    p_timeout_us: float = 0.0,
    timeout_span_us: tuple[int, int] = (500, 5000),
    p_stream: float = 0.0,
    priorities: int = 0,
    stop: trio.Event | None = None,
) -> None:
    """Start clients at random, quantized moments for ``duration`` virtual seconds
    (or until ``stop`` is set); each picks a model (from ``models``, a list or a
    function returning one), a batch size and maybe a time to give up, or a queue
    timeout of its own."""
    end = trio.current_time() + duration
    while trio.current_time() < end and not (stop is not None and stop.is_set()):
        options: dict = {"batch": rng.randint(1, max_batch)}
        if rng.random() < p_cancel:
            options["cancel_after"] = quantize(rng.uniform(*cancel_span))
        if rng.random() < p_timeout_us:
            options["timeout_us"] = rng.randint(*timeout_span_us)
        if rng.random() < p_stream:
            options["stream"] = True
        if priorities:
            options["priority"] = rng.randint(0, priorities + 1)
        names = models() if callable(models) else models
        if names:
            spawn(world, rng.choice(names), **options)
        await trio.sleep(max(QUANTUM, quantize(rng.expovariate(1.0 / mean_gap))))


async def wait_for(condition, *, limit: float, step: float = 0.01) -> bool:
    """Poll ``condition`` on the virtual clock; False if it did not hold in time."""
    with trio.move_on_after(limit):
        while not condition():
            await trio.sleep(step)
        return True
    return False
