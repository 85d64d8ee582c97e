"""A unary call's HTTP/2 stream while it goes the common way, held apart from h2.

:class:`~trionserve.protocol.grpc.upstream.H2Connection` holds the stream of a
call to a unary method as a :class:`UnaryStream` instead of h2's stream object,
state machine and events, from its HEADERS to its trailers, and hands it to h2
(in the state h2's own would be in) as soon as anything else happens on it.
What it keeps is what h2's stream would keep that matters on that way.
"""

from __future__ import annotations

from collections.abc import Iterable

from h2.windows import WindowManager

__all__ = ["LEFT_TO_H2", "SPARE_STREAMS", "UnaryStream", "unary_call"]

# Request headers that h2 itself acts on (cookies joined, a content length
# tracked, an informational response): their streams stay h2's.
LEFT_TO_H2 = frozenset((b"cookie", b"content-length", b":status"))

# The closed streams a connection keeps to re-arm for new ones (H2Connection.spare):
# one at c=1, a few for the calls that end together.
SPARE_STREAMS = 8


def unary_call(headers: Iterable[tuple[bytes, bytes]], unary_paths: frozenset[bytes]) -> bool:
    """Whether a new stream's ``headers`` are a call to one of ``unary_paths``
    that goes the common way: none of them is one that h2 acts on."""
    path = None
    for name, value in headers:
        if name == b":path":
            path = value
        elif name in LEFT_TO_H2:
            return False
    return path in unary_paths


class UnaryStream:
    """The stream's receive window (h2's own WindowManager, so the window updates
    are h2's), its send window, whether the client ended its side and whether
    the response headers are out."""

    __slots__ = ("inbound", "outbound", "remote_ended", "sending")

    def __init__(self, inbound: int, outbound: int, remote_ended: bool) -> None:
        self.inbound = WindowManager(inbound)
        self.outbound = outbound
        self.remote_ended = remote_ended
        self.sending = False
