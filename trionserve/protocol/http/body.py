"""A request body that did not come whole with its head, read by the connection's task: straight
into the buffer the protocol allocated for it, within the body's deadline (see
:mod:`trionserve.protocol.http.transport`)."""

from __future__ import annotations

import trio

from trionserve.protocol.http.h1 import CONTINUE, H1Connection, ProtocolError, Request, RequestBody
from trionserve.protocol.sockets import receive_into, receive_now, receive_view

__all__ = ["read_body"]

# A body read without waiting (its bytes already there) yields to the other tasks after this many
# bytes, so that a fast client cannot hold the loop.
_YIELD_BYTES = 4 * 1024 * 1024


async def read_body(
    stream: trio.abc.Stream,
    h1: H1Connection,
    request: Request,
    timeout: float,
    receive_buffer: memoryview,
) -> RequestBody:
    """The whole body of a request whose body did not come whole with its head; raises what the
    protocol refuses (413, 400), PeerGone, and 408 when no byte of it comes for ``timeout``
    (``header_timeout``). ``receive_buffer``: where a chunked body's bytes are read."""
    if request.expects_continue and h1.continue_needed(request):
        await stream.send_all(CONTINUE)
    # A body already there (sent with its head, as clients send it) is read without the
    # deadline's cancel scope, a few microseconds a request.
    empty = h1.body_pending(request)
    if empty is not None:
        received = receive_now(stream, empty)
        if received is not None:
            h1.body_received(request, received)
            if request.complete:
                return h1.body(request)
    # A body that stops arriving times out: no byte of it for header_timeout (the deadline moves
    # on only when it passes: each move is an entry in Trio's deadline heap). A declared body is
    # read into its buffer (receive_into) waiting for all it still lacks: when the deadline
    # passes, what came meanwhile counts as a read.
    unyielded, last = 0, trio.current_time()  # last: when a read last brought bytes
    while not request.complete:
        with trio.move_on_at(last + timeout) as scope:
            while not request.complete:
                empty = h1.body_pending(request)
                if empty is None:
                    h1.receive_data(await receive_view(stream, receive_buffer))
                else:
                    received = await receive_into(stream, empty, fill=True)
                    h1.body_received(request, received)
                    unyielded += received
                    if unyielded > _YIELD_BYTES:  # a read that never waits
                        unyielded = 0  # lets the other connections in now and then
                        await trio.lowlevel.checkpoint()
                last = trio.current_time()
        if scope.cancelled_caught and trio.current_time() >= last + timeout:
            empty = h1.body_pending(request)
            late = None if empty is None else receive_now(stream, empty)
            if not late:
                raise ProtocolError(
                    408,
                    f"the request body stopped arriving: no byte of it for {timeout:g} s "
                    "(--http-header-timeout)",
                )
            h1.body_received(request, late)
            last = trio.current_time()
    return h1.body(request)
