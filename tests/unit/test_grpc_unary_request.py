"""A unary method's request (unary.unary_method): its one message taken at
once when the request came whole (GrpcCall.take_whole), else received; none,
or more than one, ends the call INTERNAL, and a compressed one is inflated."""

from __future__ import annotations

import gzip

from tests.unit.test_grpc_debug_delays import serving
from tests.unit.test_grpc_transport import RawClient, frame
from trionserve.protocol.grpc.status import Status
from trionserve.protocol.grpc.unary import unary_method

ECHO = "/t.T/Echo"
ONE = "/t.T/Echo expects exactly one request message"


async def test_a_unary_request_has_exactly_one_message():
    handled: list[bytes] = []

    async def handle(request, call) -> bytes:
        handled.append(bytes(request))
        return b"answer:" + bytes(request)

    async with serving({ECHO: unary_method(None, handle)}) as port:
        async with RawClient.connect(port) as client:
            whole = await client.call(ECHO, frame(b"one"))
            two = await client.call(ECHO, frame(b"a") + frame(b"b"))
            none = await client.call(ECHO, None)
            zipped = await client.call(
                ECHO,
                frame(gzip.compress(b"z" * 100), compressed=True),
                headers=[(b"grpc-encoding", b"gzip")],
            )
            # Its message in one read, its end in the next: received, not taken whole.
            later = await client.call(ECHO, frame(b"later"), end=False)
            await client.until(lambda c: all(c.ended(s) for s in (whole, two, none, zipped)))
            client.h2.end_stream(later)
            await client.flush()
            await client.until(lambda c: c.ended(later))
        assert client.data[whole] == frame(b"answer:one")
        assert client.status(whole) == (Status.OK.value, "")
        assert client.status(two) == (Status.INTERNAL.value, ONE)
        assert client.status(none) == (Status.INTERNAL.value, ONE)
        assert client.data[zipped] == frame(b"answer:" + b"z" * 100)
        assert client.data[later] == frame(b"answer:later")
        assert handled == [b"one", b"z" * 100, b"later"]
