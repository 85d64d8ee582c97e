"""ModelInfer's handler's first step as its plain first step (``now``, unary._direct): a
call ``now`` parks is PARKED with no coroutine at all; a traced call, one not taken whole
or one with a debug delay is the handler's; the rest (what ``now`` returns to await, an
error it raises, an answer the rest returns at once) is the handler's rest: statuses and
the send kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from trionserve.core.errors import InvalidArgument
from trionserve.protocol.grpc.parking import PARKED
from trionserve.protocol.grpc.status import GRPCError, Status
from trionserve.protocol.grpc.unary import DebugDelays, _direct


class Call:
    method = "/inference.GRPCInferenceService/ModelInfer"

    def __init__(self, data: bytes | None = b"message") -> None:
        self.data = data
        self.sent: list = []

    def take_whole(self) -> bytes | None:
        return self.data

    async def send(self, response) -> None:
        self.sent.append(response)


def traced(active: bool = False):
    return SimpleNamespace(tracing=SimpleNamespace(active=active))


async def handler(call):  # the handler's own way: never taken when _direct steps handle
    raise AssertionError("the handler ran")


def test_a_call_parked_at_once_needs_no_coroutine():
    seen: list = []

    def handle(data, call):
        seen.append(data)
        return PARKED

    call = Call()
    assert _direct(handler, handle, traced(), DebugDelays(), call) is PARKED
    assert seen == [b"message"] and call.sent == []


@pytest.mark.parametrize(
    ("active", "data", "delays"),
    [(True, b"m", DebugDelays()), (False, None, DebugDelays()), (False, b"m", DebugDelays(5))],
)
def test_a_traced_call_one_not_whole_or_delayed_is_the_handlers(active, data, delays):
    def handle(data, call):
        raise AssertionError("stepped in place")

    ran = []

    async def own(call):
        ran.append(call)

    coroutine = _direct(own, handle, traced(active), delays, Call(data))
    assert coroutine is not PARKED and ran == []
    with pytest.raises(StopIteration):
        coroutine.send(None)
    assert len(ran) == 1


async def test_a_rest_that_waits_is_answered():
    async def waits():
        await trio.lowlevel.checkpoint()
        return [b"answer"]

    def handle(data, call):
        return waits()

    call = Call()
    rest = _direct(handler, handle, traced(), DebugDelays(), call)
    assert await rest is None and call.sent == [[b"answer"]]


async def test_an_answer_the_rest_returns_at_once_is_sent():
    async def at_once():
        return [b"at once"]

    def handle(data, call):
        return at_once()

    call = Call()
    assert await _direct(handler, handle, traced(), DebugDelays(), call) is None
    assert call.sent == [[b"at once"]]


async def test_an_error_of_the_step_or_its_rest_is_its_status():
    def handle(data, call):
        raise InvalidArgument("no such input")

    call = Call()
    rest = _direct(handler, handle, traced(), DebugDelays(), call)
    with pytest.raises(GRPCError) as raised:
        await rest
    assert raised.value.status == Status.INVALID_ARGUMENT and call.sent == []

    async def bug():
        await trio.lowlevel.checkpoint()
        raise ValueError("bug")

    def broken(data, call):
        return bug()

    with pytest.raises(GRPCError) as raised:
        await _direct(handler, broken, traced(), DebugDelays(), call)
    assert raised.value.status == Status.INTERNAL


async def test_a_rest_that_parks_after_all_is_parked():
    async def parks():
        return PARKED

    call = Call()
    assert await _direct(handler, lambda data, call: parks(), traced(), DebugDelays(), call) is (
        PARKED
    )
    assert call.sent == []
