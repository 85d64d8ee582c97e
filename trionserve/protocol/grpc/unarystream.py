"""A unary call's HTTP/2 stream while it goes the common way, held apart from h2.

:class:`~trionserve.protocol.grpc.upstream.H2Connection` holds the stream of a
call to a unary method as a :class:`UnaryStream` instead of h2's stream object,
state machine and events, from its HEADERS to its trailers, and hands it to h2
(in the state h2's own would be in) as soon as anything else happens on it.
What it keeps is what h2's stream would keep that matters on that way.
"""

from __future__ import annotations

from h2.windows import WindowManager

__all__ = ["LEFT_TO_H2", "UnaryStream"]

# Request headers that h2 itself acts on (cookies joined, a content length
# tracked, an informational response): their streams stay h2's.
LEFT_TO_H2 = frozenset((b"cookie", b"content-length", b":status"))


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
