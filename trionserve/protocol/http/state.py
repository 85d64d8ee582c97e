"""The states of an HTTP/1.1 connection and the events that move them.

Each side of a connection has one state (as h11's ``_state.py`` keeps them):

- the **client** side is where the parser stands in what the client sends: nothing
  of a next request yet, in a request head, in its body; refused (the parser or a
  limit refused what came, nothing after it is read); or closed (end of stream).
  The parser runs ahead of the server: pipelined requests are parsed while the
  first one is served, so the client side may be in the third request's head while
  the server answers the first.
- the **server** side is where the answer to the request at the front stands:
  waiting for a whole request head, handling one (its body read, its handler
  running), responding (the answer begun), done with a connection that must close,
  or closed.

The states and events are StrEnums: their hash is str's, so the tables are
looked up at C speed; the hot path binds the members it uses to module names
(an Enum's class attribute costs a Python-level lookup each time).
Each side moves only by the rows of its transition table; an event that a state
has no row for is a bug in the caller and raises :class:`LocalProtocolError`
naming the side, the state and the event (a second answer to one request, a body
after a refusal, a request taken while one is being answered).
"""

from __future__ import annotations

import enum

__all__ = [
    "CLIENT_TRANSITIONS",
    "SERVER_TRANSITIONS",
    "Client",
    "ClientEvent",
    "ConnectionState",
    "LocalProtocolError",
    "Server",
    "ServerEvent",
]


class LocalProtocolError(Exception):
    """An event that the state machine does not allow in the state it is in."""


class Client(enum.StrEnum):
    """Where the parser stands in what the client sends."""

    IDLE = "IDLE"  # between requests: nothing of the next one parsed
    HEAD = "HEAD"  # a request head has begun
    BODY = "BODY"  # its head is whole; its body is arriving
    REFUSED = "REFUSED"  # what came was refused: nothing after it is parsed
    CLOSED = "CLOSED"  # the client closed its side


class ClientEvent(enum.StrEnum):
    BEGIN = "BEGIN"  # the first byte of a request
    HEAD_DONE = "HEAD_DONE"  # its head is whole
    MESSAGE_DONE = "MESSAGE_DONE"  # its body is whole
    REFUSE = "REFUSE"  # the parser or a limit refused what came
    EOF = "EOF"  # end of stream


class Server(enum.StrEnum):
    """Where the answer to the request at the front stands."""

    IDLE = "IDLE"  # waiting for a whole request head
    HANDLING = "HANDLING"  # a request taken: its body read, its handler running
    RESPONDING = "RESPONDING"  # its answer begun
    MUST_CLOSE = "MUST_CLOSE"  # answered; nothing more is served on the connection
    CLOSED = "CLOSED"


class ServerEvent(enum.StrEnum):
    REQUEST = "REQUEST"  # the request at the front taken to be served
    RESPONSE = "RESPONSE"  # its answer begun
    ERROR_RESPONSE = "ERROR_RESPONSE"  # a whole error answer that closes the connection
    END = "END"  # the answer written; the connection kept for the next request
    END_CLOSE = "END_CLOSE"  # the answer written; the connection closes
    CLOSE = "CLOSE"  # the connection closed


C, CE = Client, ClientEvent
CLIENT_TRANSITIONS: dict[Client, dict[ClientEvent, Client]] = {
    C.IDLE: {CE.BEGIN: C.HEAD, CE.REFUSE: C.REFUSED, CE.EOF: C.CLOSED},
    C.HEAD: {CE.HEAD_DONE: C.BODY, CE.REFUSE: C.REFUSED, CE.EOF: C.CLOSED},
    C.BODY: {CE.MESSAGE_DONE: C.IDLE, CE.REFUSE: C.REFUSED, CE.EOF: C.CLOSED},
    # The refusal is answered when the server reaches it; end of stream meanwhile
    # is noted (a closing connection then does not wait for it).
    C.REFUSED: {CE.EOF: C.CLOSED},
    # A second end of stream (a watcher's read, then the loop's) changes nothing.
    C.CLOSED: {CE.EOF: C.CLOSED},
}
S, SE = Server, ServerEvent
SERVER_TRANSITIONS: dict[Server, dict[ServerEvent, Server]] = {
    S.IDLE: {SE.REQUEST: S.HANDLING, SE.ERROR_RESPONSE: S.MUST_CLOSE, SE.CLOSE: S.CLOSED},
    S.HANDLING: {SE.RESPONSE: S.RESPONDING, SE.ERROR_RESPONSE: S.MUST_CLOSE, SE.CLOSE: S.CLOSED},
    S.RESPONDING: {SE.END: S.IDLE, SE.END_CLOSE: S.MUST_CLOSE, SE.CLOSE: S.CLOSED},
    S.MUST_CLOSE: {SE.CLOSE: S.CLOSED},
    S.CLOSED: {SE.CLOSE: S.CLOSED},
}
del C, CE, S, SE


class ConnectionState:
    """The two sides' states of one connection, moved only by their tables."""

    __slots__ = ("client", "server")

    def __init__(self) -> None:
        self.client = Client.IDLE
        self.server = Server.IDLE

    def client_event(self, event: ClientEvent) -> None:
        try:
            self.client = CLIENT_TRANSITIONS[self.client][event]
        except KeyError:
            raise LocalProtocolError(
                f"client side: event {event.name} is not allowed in state {self.client.name}"
            ) from None

    def server_event(self, event: ServerEvent) -> None:
        try:
            self.server = SERVER_TRANSITIONS[self.server][event]
        except KeyError:
            raise LocalProtocolError(
                f"server side: event {event.name} is not allowed in state {self.server.name}"
            ) from None
