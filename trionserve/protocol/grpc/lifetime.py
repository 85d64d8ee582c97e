"""How long a gRPC connection lives: its first-call and idle deadlines, its
keepalive pings, the server's drain, and the socket's close at its end.

Each is a task in the connection's nursery (:class:`~.connection.Connection`
starts them), watching one thing and ending the connection, or telling it to
drain, when that thing happens: no call within the first-call timeout, no call
in flight for the idle timeout, a keepalive ping not answered within its
timeout, the server shutting down (a GOAWAY with the largest stream id and a
ping, then, once the ping's ack is in, the real last stream id). The GOAWAY
and PING frames they send go beside h2's output (send_goaway, ping).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
import trio
from hyperframe.frame import GoAwayFrame

from trionserve.protocol.grpc.state import ConnEvent

if TYPE_CHECKING:  # the connection imports this module; no cycle at run time
    from trionserve.protocol.grpc.connection import Connection

__all__ = [
    "MAX_STREAM_ID",
    "close_socket",
    "drain_when",
    "first_call_deadline",
    "idle_deadline",
    "keepalive",
    "ping",
    "send_goaway",
]

log = structlog.get_logger(__name__)

MAX_STREAM_ID = 2**31 - 1
_DRAIN_PING = b"drainGA\x00"
_KEEPALIVE_PING = b"keepaliv"


async def close_socket(conn: Connection) -> None:
    """Close the connection's socket as it ends: after a GOAWAY (unless closed
    while idle), half-close and wait a moment for the client to close too, so
    that unread bytes do not turn our close into a reset that loses the answers."""
    stream = conn.stream
    if conn.state.closing and not conn.quiet:
        with trio.move_on_after(conn.options.linger):
            try:
                # A TLS stream cannot half-close: the client closes on the GOAWAY.
                if isinstance(stream, trio.abc.HalfCloseableStream):
                    await stream.send_eof()
                while await stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass
    await stream.aclose()


async def first_call_deadline(conn: Connection) -> None:
    with trio.move_on_after(conn.options.first_call_timeout):
        await conn.first_call.wait()
        return
    log.info(
        "grpc connection sent no call within the first-call timeout; closing",
        peer=conn.peer,
        timeout=conn.options.first_call_timeout,
    )
    conn.cancel()


async def idle_deadline(conn: Connection) -> None:
    """Close the connection once it has had no call in flight for the idle
    timeout (before its first call, the first-call timeout applies)."""
    await conn.first_call.wait()
    if conn.idle_since is None:  # no call ended yet (or the first was refused)
        conn.idle_since = trio.current_time()
    timeout = conn.idle_timeout
    while True:
        with trio.CancelScope() as scope:
            if not conn.calls:
                scope.deadline = conn.idle_since + timeout
            conn.idle_scope = scope
            await trio.sleep_forever()
        conn.idle_scope = None
        # The deadline was set as the connection last turned idle, or before:
        # over only if it has been idle since, for the whole timeout.
        if not conn.calls and trio.current_time() >= conn.idle_since + timeout:
            break
    log.info("grpc connection idle for the idle timeout; closing", peer=conn.peer)
    conn.close_idle()


async def drain_when(conn: Connection, event: trio.Event) -> None:
    await event.wait()
    if conn.state.closing:
        return
    # Step 1: "stop soon" with the largest stream id, and a ping; requests the
    # client sent before it saw the GOAWAY still arrive before the ping's ack.
    send_goaway(conn, MAX_STREAM_ID)
    ack = ping(conn, _DRAIN_PING)
    with trio.move_on_after(conn.options.linger):
        await ack.wait()
    if conn.state.closing:  # closed meanwhile (a protocol error, idle)
        return
    # Step 2: the real last stream id; anything later is refused.
    conn.last_stream_id = conn.h2.highest_inbound_stream_id
    send_goaway(conn, conn.last_stream_id)
    conn.state.event(ConnEvent.DRAIN)
    for call in conn.calls.values():
        call.wake()
    if not conn.calls:
        conn.close()


async def keepalive(conn: Connection) -> None:
    o = conn.options
    assert o.keepalive_time is not None
    while True:
        await trio.sleep(o.keepalive_time)
        if not conn.calls and not o.keepalive_permit_without_calls:
            continue
        ack = ping(conn, _KEEPALIVE_PING)
        with trio.move_on_after(o.keepalive_timeout):
            await ack.wait()
            continue
        log.info("grpc keepalive ping not answered; closing", peer=conn.peer)
        conn.cancel()
        return


# -- frames beside h2's: GOAWAY and PING -------------------------------------------


def send_goaway(conn: Connection, last_stream_id: int) -> None:
    # h2's close_connection() would also close its state machine and break the
    # calls still in flight, so the GOAWAY frame is written beside it.
    conn.take_answer()
    frame = GoAwayFrame(stream_id=0, last_stream_id=last_stream_id, error_code=0)
    conn.extra_frames.append(frame.serialize())
    conn.flush()


def ping(conn: Connection, opaque: bytes) -> trio.Event:
    """Send a PING; the event is set when its ack comes."""
    ack = conn.ping_acks[opaque] = trio.Event()
    conn.take_answer()
    conn.h2.ping(opaque)
    conn.flush()
    return ack
