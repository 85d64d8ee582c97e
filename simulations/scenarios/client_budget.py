"""The server's budget of bytes held for clients (issue 42), on the virtual clock.

Decoupled streams of a drawn number of responses of a drawn size, each produced
as a Python model's stub produces them (told by the budget each time it turns full
or has room, as ``PythonInstance`` tells its stub, and waiting then), and consumed
by clients of three kinds: ``fast`` ones read each response at once, ``slow`` ones
pause for less than the stall time between reads, ``stalled`` ones never read.
New streams are admitted as the DataPlane admits a request (refused at the limit),
and a well-behaved client sends small requests through the DataPlane meanwhile.
The server's own ``ClientBudget`` counts and runs its pressure policy.

Checks of its own:

- the bytes held never pass the limit (producers wait from seven eighths of it,
  so at most one response each is on its way past that);
- the pressure policy evicts the stalled streams (their requests fail with
  RESOURCE_EXHAUSTED naming --client-buffer-stall-secs; their producers stop,
  as a model's ``is_cancelled()`` turns true) and never a stream whose client
  reads: fast and slow readers get every response, in order;
- the well-behaved client is never refused by the budget (the eighth kept free);
- a new stream is refused only when the budget is at its limit;
- once every client has gone, the budget holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import trio

from simulations.clients import infer
from simulations.faults import FaultPlan, quantize
from simulations.repository import ModelSpec
from simulations.scenario import Setup, scenario
from trionserve.core.client_budget import ClientBudget
from trionserve.core.errors import ResourceExhausted, TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor

KIB = 1024
LIMIT = 4096 * KIB
STALL_SECS = 2.0
WITHIN_LIMIT = "the bytes held for clients never pass the budget"
STALLED_EVICTED = "the pressure policy cancels the stalled streams, and only those"
READERS_SERVED = "clients that read get every response"
WELL_BEHAVED = "a well-behaved client is served while the budget holds slow ones"
REFUSED_AT_LIMIT = "a new stream is refused only at the limit"
RELEASED = "nothing is held once every client has gone"


@dataclass
class Stream:
    number: int
    kind: str  # fast, slow or stalled
    count: int
    size: int
    refused_at: int | None = None  # bytes held when admission refused it
    sent: int = 0
    received: list[int] = field(default_factory=list)
    error: TritonError | None = None
    producer_stopped_early: bool = False
    request: InferenceRequest | None = None
    finished: bool = False  # its client is gone


class SimulatedStub:
    """What a Python model's stub does about the budget: told by the server each
    time it turns full or has room (``ClientBudget.subscribe``), its response
    senders wait for room or for their request's cancellation."""

    def __init__(self, budget: ClientBudget) -> None:
        self.full = False
        self.room = trio.Event()
        self.room.set()
        budget.subscribe(self.told)

    def told(self, full: bool) -> None:
        self.full = full
        if full:
            self.room = trio.Event()
        else:
            self.room.set()

    async def wait_for_room(self, request: InferenceRequest) -> None:
        while self.full and not request.cancelled:
            with trio.move_on_after(0.05):  # the model's poll of is_cancelled()
                await self.room.wait()


def response(stream: Stream, index: int) -> InferenceResponse:
    data = np.full(stream.size, index % 251, np.uint8)
    return InferenceResponse("stream", "1", outputs=[Tensor("OUT", "UINT8", data)])


async def produce(stub: SimulatedStub, stream: Stream, request: InferenceRequest, rng) -> None:
    for index in range(stream.count):
        await stub.wait_for_room(request)
        if request.cancelled or request.done:
            stream.producer_stopped_early = True
            return
        request.send(response(stream, index), final=index == stream.count - 1)
        stream.sent += 1
        await trio.sleep(quantize(rng.uniform(0.001, 0.02)))


async def consume(stream: Stream, request: InferenceRequest, rng) -> None:
    try:
        if stream.kind == "stalled":
            await trio.sleep(STALL_SECS * 4)  # reads nothing, then leaves
            return
        async for item, _final in request.stream():
            if item is not None:
                stream.received.append(int(item.outputs[0].data[0]))
            pause = 0.0 if stream.kind == "fast" else rng.uniform(0.1, STALL_SECS / 2)
            await trio.sleep(quantize(pause))
    except TritonError as error:
        stream.error = error
    finally:
        if not request.done:
            request.cancelled = True
        request.discard()  # as the DataPlane does when its client's call ends
        stream.finished = True


async def watch_pressure(world, budget: ClientBudget, streams: list[Stream]) -> None:
    """Live: while the budget is full, no stalled client holds bytes it has not
    touched for longer than the stall time and a margin: the policy must act."""
    while not streams or not all(s.refused_at is not None or s.finished for s in streams):
        await trio.sleep(0.1)
        if not budget.full:
            continue
        now = trio.current_time()
        overdue = [
            s
            for s in streams
            if s.kind == "stalled"
            and s.request is not None
            and s.request.held_bytes
            and now - s.request.last_read > STALL_SECS + 0.5
        ]
        if overdue:
            world.violate(
                STALLED_EVICTED,
                "the budget is full and stalled streams hold bytes untouched for longer "
                f"than {STALL_SECS:g} s: {', '.join(str(s.number) for s in overdue)}",
            )
            return


async def well_behaved(world, until: float) -> None:
    while trio.current_time() < until:
        await infer(world, "plain")
        await trio.sleep(0.1)


def _setup(world) -> Setup:
    return Setup(
        [ModelSpec("plain", kind=world.random("setup").choice(("async", "thread")))],
        FaultPlan(latency=(0.001, 0.005)),
        client_buffer_limit=LIMIT,
        client_buffer_stall_secs=STALL_SECS,
    )


@scenario(
    "client_budget",
    "decoupled streams to fast, slow and stalled clients under one small budget of "
    "bytes held for clients: producers wait, stalled streams are cancelled, readers "
    "and a well-behaved client are served, new streams are refused only at the limit",
    setup=_setup,
    checks=(),
    fast_seeds=12,
)
async def client_budget(world) -> None:
    rng = world.random("streams")
    budget: ClientBudget = world.dataplane.budget
    stub = SimulatedStub(budget)
    streams: list[Stream] = []
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(well_behaved, world, started + STALL_SECS * 4)
        nursery.start_soon(watch_pressure, world, budget, streams)
        for number in range(rng.randint(6, 14)):
            kind = rng.choice(("fast", "slow", "stalled", "stalled"))
            stream = Stream(number, kind, rng.randint(8, 40), rng.choice((64, 128, 256, 448)) * KIB)
            streams.append(stream)
            held = budget.held
            try:
                budget.admit(f"stream {number}")
            except ResourceExhausted:
                stream.refused_at = held
            else:
                request = InferenceRequest("stream", id=f"s{number}")
                request.budget = budget
                request.undelivered_limit = 1 << 40
                stream.request = request
                nursery.start_soon(produce, stub, stream, request, rng)
                nursery.start_soon(consume, stream, request, rng)
            await trio.sleep(quantize(rng.uniform(0.0, 0.4)))
    world.notes["budget"] = {
        "peak": budget.peak,
        "limit": budget.limit,
        "evicted": budget.evicted,
        "refused": budget.refused,
        "streams": len(streams),
    }
    check(world, budget, streams)


def check(world, budget: ClientBudget, streams: list[Stream]) -> None:
    if budget.peak > budget.limit:
        world.violate(WITHIN_LIMIT, f"held {budget.peak} bytes at most, limit {budget.limit}")
    for stream in streams:
        label = f"stream {stream.number} ({stream.kind}, {stream.count} x {stream.size})"
        if stream.refused_at is not None:
            if stream.refused_at < budget.limit:
                world.violate(
                    REFUSED_AT_LIMIT,
                    f"{label} refused with {stream.refused_at} of {budget.limit} bytes held",
                )
            continue
        evicted = stream.error is not None and "--client-buffer-stall-secs" in stream.error.message
        if evicted and not (stream.request is not None and stream.request.cancelled):
            world.violate(STALLED_EVICTED, f"{label} was cancelled without its model told")
        if stream.kind != "stalled":
            if evicted:
                world.violate(STALLED_EVICTED, f"{label} was cancelled though its client read")
            expected = [index % 251 for index in range(stream.count)]
            if stream.error is not None or stream.received != expected:
                world.violate(
                    READERS_SERVED,
                    f"{label} received {len(stream.received)} of {stream.count} ({stream.error!r})",
                )
    for record in world.records:
        error = record.outcome[1] if record.outcome and record.outcome[0] == "error" else None
        if error is not None and "--client-buffer-limit" in str(error):
            world.violate(WELL_BEHAVED, f"{record} refused: {error}")
    if budget.held:
        world.violate(RELEASED, f"{budget.held} bytes still held after every client left")
