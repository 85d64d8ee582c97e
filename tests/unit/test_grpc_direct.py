"""ModelInfer's handler's first step with its handle stepped in place (unary._direct): a
call its handle parks at once is PARKED with no handler coroutine; a traced call, one not
taken whole or one with a debug delay is the handler's; the rest (a handle that waits, an
error, an answer returned at once) is the handler's rest: statuses and the send kept."""

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


def test_a_call_parked_at_once_needs_no_coroutine_of_the_handler():
    seen: list = []

    async def handle(data, call):
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
    async def handle(data, call):
        raise AssertionError("stepped in place")

    ran = []

    async def own(call):
        ran.append(call)

    coroutine = _direct(own, handle, traced(active), delays, Call(data))
    assert coroutine is not PARKED and ran == []
    with pytest.raises(StopIteration):
        coroutine.send(None)
    assert len(ran) == 1


async def test_a_handle_that_waits_is_answered_by_the_rest():
    async def handle(data, call):
        await trio.lowlevel.checkpoint()
        return [b"answer"]

    call = Call()
    rest = _direct(handler, handle, traced(), DebugDelays(), call)
    assert await rest is None and call.sent == [[b"answer"]]


async def test_an_answer_returned_at_once_is_sent():
    async def handle(data, call):
        return [b"at once"]

    call = Call()
    assert await _direct(handler, handle, traced(), DebugDelays(), call) is None
    assert call.sent == [[b"at once"]]


async def test_a_handles_error_is_its_status():
    async def handle(data, call):
        raise InvalidArgument("no such input")

    call = Call()
    rest = _direct(handler, handle, traced(), DebugDelays(), call)
    with pytest.raises(GRPCError) as raised:
        await rest
    assert raised.value.status == Status.INVALID_ARGUMENT and call.sent == []

    async def broken(data, call):
        await trio.lowlevel.checkpoint()
        raise ValueError("bug")

    with pytest.raises(GRPCError) as raised:
        await _direct(handler, broken, traced(), DebugDelays(), call)
    assert raised.value.status == Status.INTERNAL
