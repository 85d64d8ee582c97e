"""The states of a gRPC call and of its connection, and the events that move them.

Sans-I/O, as h11's ``_state.py`` and h2's stream state machine: each state moves
only by the rows of its transition table, and an event a state has no row for is
a bug in the caller and raises :class:`LocalProtocolError` naming the machine, the
state and the event (a second final status, a message after the call was
answered, a reset stream's call ending with a status). The Trio loop
(:mod:`~trionserve.protocol.grpc.connection`) feeds the events; h2 keeps the
HTTP/2 stream states beneath these.

A call has two sides:

- the **request** side: what the client sends. Open while it may send more; ended
  once it half-closed (END_STREAM); failed once a message it sent was refused (too
  large, not decompressible: nothing after it is read); reset once it reset the
  stream (RST_STREAM: there is nobody to answer any more).
- the **response** side: what the server sends. Idle until the first message
  (its response headers go first), sending after it, answered once the trailers
  (the status) are queued, abandoned when there is nobody to answer (the stream
  was reset or closed under the call): an abandoned call ends without a status.

A connection is open, draining (the server is shutting down: the final GOAWAY's
last stream id is sent, client-streaming calls stop reading), or closing (the
final GOAWAY is queued: h2 reads nothing more), after a drain or without one.

The states and events are StrEnums: their hash is str's, so the tables are looked
up at C speed.
"""

from __future__ import annotations

import enum

__all__ = [
    "CONNECTION_TRANSITIONS",
    "REQUEST_TRANSITIONS",
    "RESPONSE_TRANSITIONS",
    "CallState",
    "Conn",
    "ConnEvent",
    "ConnectionState",
    "LocalProtocolError",
    "Request",
    "RequestEvent",
    "Response",
    "ResponseEvent",
]


class LocalProtocolError(Exception):
    """An event that the state machine does not allow in the state it is in."""


class Request(enum.StrEnum):
    """What the client sends on the call's stream."""

    OPEN = "OPEN"  # it may send more messages
    ENDED = "ENDED"  # it half-closed its side
    FAILED = "FAILED"  # a message it sent was refused: nothing after it is read
    RESET = "RESET"  # it reset the stream


class RequestEvent(enum.StrEnum):
    END_STREAM = "END_STREAM"  # the client half-closed (h2's StreamEnded)
    REFUSE = "REFUSE"  # a message was refused (the call's receive raises its error)
    RESET = "RESET"  # the client reset the stream (h2's StreamReset)


class Response(enum.StrEnum):
    """What the server sends on the call's stream."""

    IDLE = "IDLE"  # nothing sent yet
    SENDING = "SENDING"  # the response headers are sent: messages follow
    ANSWERED = "ANSWERED"  # the trailers (the call's status) are queued
    ABANDONED = "ABANDONED"  # nobody to answer: the call ends without a status


class ResponseEvent(enum.StrEnum):
    HEADERS = "HEADERS"  # the response headers, before the first message
    FINISH = "FINISH"  # the trailers (or a trailers-only answer)
    ABANDON = "ABANDON"  # the stream is gone (reset or closed)


class Conn(enum.StrEnum):
    """Where a connection stands."""

    OPEN = "OPEN"
    DRAINING = "DRAINING"  # the final last stream id is sent; calls in flight finish
    CLOSING = "CLOSING"  # the final GOAWAY is queued (no drain before it)
    DRAINED = "DRAINED"  # the final GOAWAY is queued after a drain


class ConnEvent(enum.StrEnum):
    DRAIN = "DRAIN"  # the server shuts down: the second GOAWAY is sent
    CLOSE = "CLOSE"  # the final GOAWAY is queued (a drain's end, an error, idle)


Q, QE = Request, RequestEvent
REQUEST_TRANSITIONS: dict[Request, dict[RequestEvent, Request]] = {
    Q.OPEN: {QE.END_STREAM: Q.ENDED, QE.REFUSE: Q.FAILED, QE.RESET: Q.RESET},
    Q.ENDED: {QE.RESET: Q.RESET},
    # A refused message's stream may still end or be reset; what follows is dropped.
    Q.FAILED: {QE.END_STREAM: Q.FAILED, QE.RESET: Q.RESET},
    Q.RESET: {},
}
R, RE = Response, ResponseEvent
RESPONSE_TRANSITIONS: dict[Response, dict[ResponseEvent, Response]] = {
    R.IDLE: {RE.HEADERS: R.SENDING, RE.FINISH: R.ANSWERED, RE.ABANDON: R.ABANDONED},
    R.SENDING: {RE.FINISH: R.ANSWERED, RE.ABANDON: R.ABANDONED},
    # Answered: the client may still reset the stream before reading the status.
    R.ANSWERED: {RE.ABANDON: R.ANSWERED},
    R.ABANDONED: {RE.ABANDON: R.ABANDONED},
}
C, CE = Conn, ConnEvent
CONNECTION_TRANSITIONS: dict[Conn, dict[ConnEvent, Conn]] = {
    C.OPEN: {CE.DRAIN: C.DRAINING, CE.CLOSE: C.CLOSING},
    C.DRAINING: {CE.CLOSE: C.DRAINED},
    C.CLOSING: {},
    C.DRAINED: {},
}
del Q, QE, R, RE, C, CE


def _refused(machine: str, state: enum.StrEnum, event: enum.StrEnum) -> LocalProtocolError:
    return LocalProtocolError(f"{machine}: event {event.name} is not allowed in state {state.name}")


class CallState:
    """The two sides' states of one call, moved only by their tables.

    What the call's code asks of them on every call (``reset``, ``client_done``,
    ``answerable``) is kept as attributes, set with each move: read on the hot
    path, they cost no call."""

    __slots__ = ("request", "response", "reset", "client_done", "answerable")

    def __init__(self, ended: bool = False) -> None:
        self.request = Request.ENDED if ended else Request.OPEN
        self.response = Response.IDLE
        # The client reset the stream: nobody to answer.
        self.reset = False
        # The client sends no more messages that the call will read.
        self.client_done = ended
        # The call may still end with a status: not answered, not abandoned.
        self.answerable = True

    def again(self, ended: bool) -> None:
        """Both sides back at their start, as ``__init__`` leaves them: the
        state of a new call on a re-armed :class:`~.call.GrpcCall`."""
        self.request = Request.ENDED if ended else Request.OPEN
        self.response = Response.IDLE
        self.reset = False
        self.client_done = ended
        self.answerable = True

    def request_event(self, event: RequestEvent) -> None:
        try:
            request = self.request = REQUEST_TRANSITIONS[self.request][event]
        except KeyError:
            raise _refused("request side", self.request, event) from None
        self.reset = request is Request.RESET
        self.client_done = request is not Request.OPEN

    def response_event(self, event: ResponseEvent) -> None:
        try:
            response = self.response = RESPONSE_TRANSITIONS[self.response][event]
        except KeyError:
            raise _refused("response side", self.response, event) from None
        self.answerable = response is Response.IDLE or response is Response.SENDING

    def __repr__(self) -> str:
        return f"CallState(request={self.request.name}, response={self.response.name})"


class ConnectionState:
    """A connection's state, moved only by its table; ``draining`` and
    ``closing`` kept as attributes, set with each move."""

    __slots__ = ("state", "draining", "closing")

    def __init__(self) -> None:
        self.state = Conn.OPEN
        # The server told the connection to drain: client-streaming calls stop
        # reading.
        self.draining = False
        # The final GOAWAY is queued: h2 is closed and reads nothing more.
        self.closing = False

    def event(self, event: ConnEvent) -> None:
        try:
            state = self.state = CONNECTION_TRANSITIONS[self.state][event]
        except KeyError:
            raise _refused("connection", self.state, event) from None
        self.draining = state is Conn.DRAINING or state is Conn.DRAINED
        self.closing = state is Conn.CLOSING or state is Conn.DRAINED
