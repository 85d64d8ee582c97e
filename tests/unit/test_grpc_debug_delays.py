"""Triton's gRPC debugging delays (environment variables its frontend reads,
server src/grpc/infer_handler.h ParseDebugVariable) and its verbose-2 StateNew /
StateRelease lines, on the real transport with a raw HTTP/2 client: a call held
between its model's answer and its send is cancelled by the client's reset, its
cancellation logged once and its state released once; the connection goes on."""

from __future__ import annotations

from contextlib import asynccontextmanager

import h2.errors
import h2.events
import pytest
import trio
import trio.testing

from tests.unit.test_grpc_transport import RawClient, frame
from trionserve.protocol.grpc import call as call_module
from trionserve.protocol.grpc import running as running_module
from trionserve.protocol.grpc import unary as unary_module
from trionserve.protocol.grpc.transport import GrpcTransport, Method, TransportOptions
from trionserve.protocol.grpc.unary import DebugDelays, common_method, unary_method

INFER = "/inference.GRPCInferenceService/ModelInfer"


def test_delays_come_from_tritons_variables_and_add_up(monkeypatch):
    errors: list[str] = []
    monkeypatch.setattr(unary_module, "log", type("L", (), {"error": errors.append})())
    assert DebugDelays.from_environment({}) == DebugDelays(0, 0)
    delays = DebugDelays.from_environment(
        {
            "TRITONSERVER_DELAY_GRPC_PROCESS": "5000",
            "TRITONSERVER_DELAY_GRPC_PROCESS_ENTRY": "1000",
            "TRITONSERVER_DELAY_RESPONSE_COMPLETION": "5000",
            "TRITONSERVER_DELAY_RESPONSE_COMPLETE_EXEC": " 250",
            "TRITONSERVER_DELAY_GRPC_NOTIFICATION": "5000",  # no counterpart here
        }
    )
    assert delays == DebugDelays(before_infer=6000, before_answer=5250)
    assert errors == []
    assert (
        DebugDelays.from_environment({"TRITONSERVER_DELAY_GRPC_PROCESS": "soon"}) == DebugDelays()
    )
    assert errors == [
        "Unable to parse the debug variable TRITONSERVER_DELAY_GRPC_PROCESS. "
        "Value provided: 'soon' is not a valid integer. Error: stoi"
    ]
    # CommonHandler's, in seconds, read with atoi (grpc_server.cc:2398): no error line.
    common = "TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC"
    assert DebugDelays.from_environment({common: "2"}).common_answer == 2
    assert DebugDelays.from_environment({common: " 3s"}).common_answer == 3
    assert DebugDelays.from_environment({common: "x"}).common_answer == 0
    assert len(errors) == 1
    both = DebugDelays(before_infer=1, before_answer=2, common_answer=3)
    assert both.infer() == DebugDelays(1, 2, 0) and both.common() == DebugDelays(0, 0, 3)


@asynccontextmanager
async def serving(methods: dict[str, Method]):
    shutdown = trio.Event()
    transport = GrpcTransport(methods, TransportOptions())
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(transport.serve, "127.0.0.1", 0, shutdown, 10.0)
        yield bound[0][1]
        shutdown.set()


@pytest.mark.parametrize("step", ["before_infer", "before_answer"])
async def test_a_call_held_by_a_delay_is_cancelled_by_the_clients_reset(monkeypatch, step):
    states: list[tuple[str, str, int, str]] = []
    cancellations: list[tuple[str, int]] = []
    monkeypatch.setattr(running_module, "log_grpc_state", lambda *a: states.append(a))
    # The state lines are Triton's at verbose 2 (not asked for at all below it).
    monkeypatch.setattr(running_module.LOGGING, "log_verbose_level", 2)
    monkeypatch.setattr(call_module, "log_grpc_cancellation", lambda *a: cancellations.append(a))
    handled: list[bytes] = []

    async def handle(request: bytes, call) -> bytes:
        handled.append(request)
        return b"answer:" + request

    hour = 3_600_000  # never waited out: the client resets first
    delays = DebugDelays(**{step: hour})
    methods = {INFER: unary_method(None, handle, None, delays)}
    async with serving(methods) as port, RawClient.connect(port) as client:
        held = await client.call(INFER, frame(b"x"))
        await trio.testing.wait_all_tasks_blocked()  # the call waits out its delay
        assert handled == ([] if step == "before_infer" else [b"x"])
        client.h2.reset_stream(held, h2.errors.ErrorCodes.CANCEL)
        await client.flush()
        with trio.fail_after(10):
            while [s[0] for s in states] != ["StateNew", "StateRelease"]:
                await trio.sleep(0.01)
        assert held not in client.data  # nothing was sent for it
        assert cancellations == [(INFER, held)]
        assert states == [("StateNew", INFER, held), ("StateRelease", INFER, held, True)]
        # The same connection takes the next call (Triton's
        # test_grpc_async_infer_cancellation_at_step_start: a call cancelled at
        # START must not cost the server its next one; infer_handler.cc Process
        # replaces the handler in its cancellation branch too).
        then = await client.call(INFER, frame(b"z"))
        with trio.fail_after(10):
            while len(states) < 3:
                await trio.sleep(0.01)
        assert states[2] == ("StateNew", INFER, then)
        client.h2.reset_stream(then, h2.errors.ErrorCodes.CANCEL)
        await client.flush()
        with trio.fail_after(10):
            while len(states) < 4:
                await trio.sleep(0.01)
        assert states[3] == ("StateRelease", INFER, then, True)
        assert cancellations == [(INFER, held), (INFER, then)]
        # Without delays a call is answered at once.
        methods[INFER] = unary_method(None, handle)
    monkeypatch.setattr(running_module.LOGGING, "log_verbose_level", 1)
    async with serving(methods) as port, RawClient.connect(port) as client:
        answered = await client.call(INFER, frame(b"y"))
        await client.until(lambda c: c.ended(answered))
        assert client.data[answered] == frame(b"answer:y")
        assert client.of(h2.events.StreamReset) == []
    assert len(states) == 4  # below verbose 2, no state line is even asked for


def test_state_lines_only_for_infer_handlers_at_verbose_2(capsys):
    from trionserve.observability.logging import (
        SETTINGS,
        configure_logging,
        log_grpc_state,
        update_settings,
    )

    saved = SETTINGS.as_dict()
    try:
        configure_logging()
        update_settings({"log_verbose_level": 1}, network=False)
        log_grpc_state("StateNew", INFER, 1)
        update_settings({"log_verbose_level": 2}, network=False)
        log_grpc_state("StateNew", "/inference.GRPCInferenceService/ServerLive", 3)
        log_grpc_state("StateNew", INFER, 5)
        log_grpc_state("StateRelease", INFER, 5)
        log_grpc_state("StateRelease", INFER, 7, True)
        out = capsys.readouterr().out
    finally:
        update_settings(saved, network=False)
    lines = [line.split("] ", 1)[1] for line in out.splitlines()]
    assert lines == [
        '"StateNew, 5 Step START"',
        '"StateRelease, 5 Step FINISH"',
        '"StateRelease, 7 Step CANCELLED"',
    ]


async def test_the_common_delay_holds_the_answer_after_the_work_is_done():
    """TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC: a non-inference call does its
    work, then waits before its answer (grpc_server.cc:239 WriteResponse), so a
    client's short deadline ends it DEADLINE_EXCEEDED (L0_client_timeout's
    non-infer test); without the variable it is answered at once."""
    done: list[str] = []

    async def handle(request: bytes, call) -> bytes:
        done.append("registered")
        return b"ok"

    path = "/inference.GRPCInferenceService/ServerLive"
    held = DebugDelays(before_infer=5, before_answer=5, common_answer=3600)
    methods = {path: common_method(held)(None, handle)}
    async with serving(methods) as port, RawClient.connect(port) as client:
        call = await client.call(path, frame(b""), headers=[(b"grpc-timeout", b"200m")])
        await client.until(lambda c: c.ended(call))
        assert client.status(call)[0] == 4  # DEADLINE_EXCEEDED
        assert done == ["registered"] and call not in client.data
    methods[path] = common_method(DebugDelays())(None, handle)
    async with serving(methods) as port, RawClient.connect(port) as client:
        call = await client.call(path, frame(b""))
        await client.until(lambda c: c.ended(call))
        assert client.status(call)[0] == 0 and client.data[call] == frame(b"ok")
