"""The real HTTP frontend (its HTTP/1.1 transport) on a loopback port, driven through real
sockets: backend exceptions and latency, clients that disconnect mid-request, and a
shutdown midway. Real sockets: this scenario runs on the real clock with bounded
waits, so a seed fixes its plan (requests, disconnects, the shutdown moment, the
fault probabilities), not its exact timing.

Each client sends one request on its own connection (``Connection: close``) and
parses the reply with h11. The frontend's DataPlane calls are wrapped so that the
request it decoded is tracked like a simulated client's, which puts every request
under the usual invariants; the wire outcome is checked here besides.
"""

from __future__ import annotations

import functools
import json

import h11
import numpy as np
import trio

from simulations.clients import phase_of, wait_for
from simulations.faults import FaultPlan
from simulations.scenario import Setup, scenario
from simulations.scenarios.common import two_models
from simulations.world import RequestRecord, TrackedRequest
from trionserve.core.errors import TritonError, Unavailable
from trionserve.core.inference import InferenceRequest
from trionserve.lifecycle import Lifecycle
from trionserve.protocol.http.frontend import HttpOptions, serve_http

WIRE = "every answered request gets exactly one outcome on the wire"
SERVES = "the frontend keeps serving after clients disconnect"
WAIT = 10.0  # real seconds any one client waits at most


def frontend_setup(world) -> Setup:
    rng = world.random("setup")
    faults = FaultPlan(
        latency=(0.001, 0.01),
        p_exception=rng.uniform(0.05, 0.2),
        p_request_error=rng.uniform(0.0, 0.1),
    )
    # Async instances only: thread instances need the virtual clock's thread shim.
    # Execution times on the real clock are not exactly what the backend observed.
    return Setup(
        two_models(rng, kinds=("async",)),
        faults,
        exit_timeout=5.0,
        shutdown_limit=8.0,
        observes_executions=False,
        hang_limit=20.0,
        run_limit=90.0,
    )


def track_frontend_requests(world) -> None:
    """Make the requests the frontend decodes tracked requests with their client's
    record (found by the request id the client sent): at ``begin`` (or ``begin_now``),
    and its outcome at the one of ``finish``, ``end`` or ``drop`` that ends the begun request.
    ``infer`` is ``self.begin`` then ``self.finish``: these, set on the DataPlane,
    track it too (a request no wrapper saw fails the run's checks as unanswered)."""
    dataplane = world.dataplane
    begin, finish, end, drop = dataplane.begin, dataplane.finish, dataplane.end, dataplane.drop
    begin_now = dataplane.begin_now

    def tracked(request: InferenceRequest) -> InferenceRequest:
        number = request.id[1:]
        record = world.records[int(number)] if number.isdigit() else None
        if record is None:
            return request
        copy = TrackedRequest.__new__(TrackedRequest)
        for slot in InferenceRequest.__slots__:
            if hasattr(request, slot):
                setattr(copy, slot, getattr(request, slot))
        copy.record = record
        return copy

    # What the frontend got is the request's caller's view, unless its client hung
    # up first (then it stays "cancelled", as a DataPlane client's would).
    def answered(request: InferenceRequest, response) -> None:
        record = world.record_for(request)
        if record is not None and record.client is None:
            record.client, record.client_value = "response", response

    def failed(request: InferenceRequest, exc: BaseException) -> None:
        record = world.record_for(request)
        if record is None or record.client is not None:
            return
        if isinstance(exc, TritonError):
            record.client, record.client_value = "error", exc
        elif isinstance(exc, trio.Cancelled):
            record.client, record.cancel_phase = "cancelled", phase_of(record)

    async def tracked_begin(request: InferenceRequest, **options):
        request = tracked(request)
        return await rest_of_begin(request, begin(request, **options))

    def tracked_begin_now(request: InferenceRequest, endpoint: str):
        # (the frontends' way in: begun as plain calls, or the rest of begin to await)
        request = tracked(request)
        try:
            begun = begin_now(request, endpoint)
        except TritonError as exc:
            failed(request, exc)
            raise
        return begun if isinstance(begun, Lifecycle) else rest_of_begin(request, begun)

    async def rest_of_begin(request: InferenceRequest, rest):
        try:
            run = await rest
        except (TritonError, trio.Cancelled) as exc:
            failed(request, exc)
            raise
        if not isinstance(run, Lifecycle):  # (the response cache's answer)
            answered(request, run)
        return run

    async def tracked_finish(run: Lifecycle):
        try:
            response = await finish(run)
        except (TritonError, trio.Cancelled) as exc:
            failed(run.request, exc)
            raise
        answered(run.request, response)
        return response

    def tracked_end(run: Lifecycle):
        try:
            response = end(run)
        except TritonError as exc:
            failed(run.request, exc)
            raise
        answered(run.request, response)
        return response

    def tracked_drop(run: Lifecycle) -> None:
        record = world.record_for(run.request)
        if record is not None and record.client is None:
            record.client, record.cancel_phase = "cancelled", phase_of(record)
        drop(run)

    dataplane.begin, dataplane.finish = tracked_begin, tracked_finish
    dataplane.begin_now = tracked_begin_now
    dataplane.end, dataplane.drop = tracked_end, tracked_drop


def _body(record: RequestRecord) -> bytes:
    values = np.arange(record.batch_size, dtype=np.int64) + record.number * 1000
    return json.dumps(
        {
            "id": f"r{record.number}",
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [record.batch_size, 1],
                    "datatype": "INT64",
                    "data": values.tolist(),
                }
            ],
        }
    ).encode()


async def _exchange(port: int, record: RequestRecord) -> tuple:
    """One request over a fresh connection: ("response", data), ("error", status,
    message), ("closed",) when the server closed it without answering (allowed only
    for a request the shutdown stopped before it reached the DataPlane), or raises
    OSError when the connection fails."""
    body = _body(record)
    client = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            client.send(
                h11.Request(
                    method="POST",
                    target=f"/v2/models/{record.model}/infer",
                    headers=[
                        ("host", "127.0.0.1"),
                        ("content-type", "application/json"),
                        ("content-length", str(len(body))),
                        ("connection", "close"),
                    ],
                )
            )
        )
        await stream.send_all(client.send(h11.Data(data=body)))
        await stream.send_all(client.send(h11.EndOfMessage()))
        status, chunks = None, []
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data and status is None:
                    return ("closed",)  # closed without answering
                client.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        rest = await stream.receive_some(65536)
        if rest:
            return ("extra", status, rest[:80])
    if status is None:
        return ("silence",)
    payload = json.loads(b"".join(chunks) or b"{}")
    if status == 200:
        return ("response", payload["outputs"][0]["data"])
    return ("error", status, payload.get("error", ""))


async def _client(world, port: int, record: RequestRecord) -> None:
    try:
        with trio.move_on_after(record.cancel_after or WAIT) as scope:
            record.tags["wire"] = await _exchange(port, record)
    except OSError as exc:  # refused: the frontend had stopped listening
        record.tags["wire"] = ("refused", str(exc))
    except trio.BrokenResourceError as exc:  # reset: as closed without an answer
        record.tags["wire"] = ("closed", str(exc))
    except (h11.RemoteProtocolError, json.JSONDecodeError) as exc:
        record.tags["wire"] = ("garbled", repr(exc))
    if scope.cancelled_caught:
        record.tags["wire"] = ("disconnected",) if record.cancel_after else ("timeout",)
    record.finished_at = trio.current_time()
    if record.client is not None:  # the DataPlane answered before the client went
        return
    if scope.cancelled_caught and record.cancel_after:
        record.client, record.cancel_phase = "cancelled", phase_of(record)
    else:  # refused, or closed unanswered: the request never reached the DataPlane
        record.client = "error"
        record.client_value = Unavailable(f"no answer on the wire: {record.tags['wire']}")


def launch(
    world,
    client,
    port: int,
    model: str,
    batch: int,
    cancel_after: float | None,
    *,
    late: bool = False,
) -> RequestRecord:
    number = len(world.records)
    record = RequestRecord(
        number, model, trio.current_time(), batch, cancel_after, tags={"late": late}
    )
    world.records.append(record)
    world.activity.start_soon(client, world, port, record)
    return record


def check_wire(world) -> None:
    """What each client read off its socket agrees with the request's one outcome."""
    for record in world.records:
        wire = record.tags.get("wire")
        kind = wire[0] if wire else None
        if kind in ("silence", "extra", "garbled", "timeout", None):
            world.violate(WIRE, f"{record}: {wire!r} on the wire")
            continue
        if kind in ("refused", "closed") and not record.tags.get("late"):
            world.violate(WIRE, f"{record}: {kind} before the shutdown: {wire!r}")
        if kind == "closed" and record.accepted:
            world.violate(
                WIRE, f"{record}: accepted, then its connection was closed without an answer"
            )
        if kind == "response":
            expected = (np.arange(record.batch_size) + record.number * 1000).tolist()
            if record.client != "response" or sorted(np.ravel(wire[1]).tolist()) != expected:
                world.violate(
                    WIRE,
                    f"{record}: got {wire[1]!r} on the wire; the request "
                    f"ended with {record.client}",
                )
        if kind == "error" and record.client == "response":
            world.violate(
                WIRE,
                f"{record}: error {wire[1]} {wire[2]!r} on the wire, though "
                "the DataPlane answered it",
            )
    if not any(r.tags.get("wire", ("",))[0] == "response" for r in world.records):
        world.violate(SERVES, "no request succeeded through the frontend")


@scenario(
    "http_frontend_faults",
    "requests through the real HTTP frontend (loopback sockets) while the backend "
    "raises and lags, clients disconnect mid-request and the server shuts down midway: "
    "one outcome on the wire per answered request, nothing lost, no task left",
    setup=frontend_setup,
    checks=(check_wire,),
    fast_seeds=3,
    real_time=True,
)
async def http_frontend_faults(world) -> None:
    await drive_frontend(world, functools.partial(serve_http, options=HttpOptions()), _client)


async def drive_frontend(world, serve, client) -> None:
    """The plan of a real-frontend scenario: start the frontend ``serve(dataplane,
    address, port, shutdown, graceful_timeout)`` on a free loopback port, then send
    ``client(world, port, record)`` requests, some that hang up early, then shut
    down midway through the rest. The plan is drawn before anything runs."""
    rng = world.random("script")
    plan = [
        (
            rng.choice(["plain", "batched"]),
            rng.randint(1, 2),
            rng.uniform(0.001, 0.02) if rng.random() < 0.25 else None,
            rng.uniform(0.0, 0.005),
        )
        for _ in range(rng.randint(30, 60))
    ]
    shutdown_after = rng.randint(len(plan) // 2, len(plan) - 5)
    track_frontend_requests(world)
    stop = trio.Event()
    binds = await world.activity.start(
        serve, world.dataplane, "127.0.0.1", 0, stop, world.setup.exit_timeout
    )
    port = binds[0][1]
    for model, batch, cancel_after, gap in plan[:shutdown_after]:
        launch(world, client, port, model, batch, cancel_after)
        await trio.sleep(gap)
    # Every disconnect so far happened: the frontend must still answer.
    await wait_for(lambda: all(r.finished_at is not None for r in world.records), limit=WAIT)
    probe = launch(world, client, port, "plain", 1, None)
    await wait_for(lambda: probe.finished_at is not None, limit=WAIT)
    if probe.tags.get("wire", ("",))[0] not in ("response", "error"):
        world.violate(SERVES, f"{probe}: {probe.tags.get('wire')}")
    # The rest go out while the server stops.
    for model, batch, cancel_after, gap in plan[shutdown_after:]:
        launch(world, client, port, model, batch, cancel_after, late=True)
        await trio.sleep(gap)
    stop.set()
    world.shutdown()
    for model, batch, cancel_after, _ in plan[shutdown_after:][:3]:
        launch(world, client, port, model, batch, cancel_after, late=True)
    await wait_for(lambda: all(r.finished_at is not None for r in world.records), limit=WAIT)
    world.notes["disconnects"] = sum(r.tags.get("wire") == ("disconnected",) for r in world.records)
    world.notes["wire_errors"] = sum(r.tags.get("wire", ("",))[0] == "error" for r in world.records)
