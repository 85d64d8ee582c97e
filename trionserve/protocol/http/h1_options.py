"""The settings of the HTTP/1.1 protocol and of the transport that serves it
(:class:`HttpServerOptions`), apart from :mod:`~trionserve.protocol.http.h1` for its size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from trionserve.core.client_budget import ClientBudget

if TYPE_CHECKING:
    from trionserve.protocol.http.h1 import ProtocolError
    from trionserve.protocol.http.h1_request import Request

__all__ = ["NO_TRACING", "HttpServerOptions", "TraceClock"]


@dataclass(frozen=True, slots=True)
class HttpServerOptions:
    """Settings of the HTTP/1.1 protocol and of the transport that serves it."""

    # Largest request body accepted, in bytes; None: no limit.
    max_request_body: int | None = None
    # The flag that sets max_request_body, named in the 413 answer.
    max_request_body_flag: str = "--http-max-input-size"
    # The refusal of a body over max_request_body, from the request's head, the
    # body's size (None: a chunked body, past the limit and still coming) and the
    # limit; None: 413 naming max_request_body_flag. The refusal comes before
    # the body is read (or, chunked, read past the limit) whatever it says.
    body_refusal: Callable[[Request, int | None, int], ProtocolError] | None = None
    # Connections served at once; a connection past it is answered 503 and
    # closed. None: no cap.
    max_connections: int | None = None
    # A connection must deliver a whole request head within this many seconds of
    # opening, or of the first byte of a later request (slowloris): 408 and closed.
    # A request body must keep arriving too: no byte of it for this long is a 408.
    header_timeout: float = 30.0
    # Largest request head (request line and headers) buffered: 431 past it.
    max_header_size: int = 1024 * 1024
    # An idle keep-alive connection (answered, nothing sent since) is closed after
    # this many seconds; at the connection cap the oldest idle ones are closed
    # first to make room for new connections.
    keep_alive_timeout: float = 60.0
    # Bytes asked of the socket per read (a chunked body, bytes after a request).
    receive_size: int = 256 * 1024
    # Bytes asked of the socket for the start of a request: its head and what of its
    # body came along, which the parser copies into the body's buffer twice over
    # (httptools hands each piece over as bytes); the rest of a declared body is
    # read straight into its buffer (one more read, without a wait, when it is
    # there). A request this small or smaller (a small tensor, a 4 KB one with its
    # JSON header and head) still comes in one read; of a 602 KB body, 16 KB go
    # through the parser instead of 64 KB: the two copies of the other 48 KB
    # were 95K of the event loop's 727K instructions per request (callgrind,
    # benchmarks/README.md; 256 KB -> 64 KB before: the transport's CPU per body
    # 138-144 -> 93-117 us, benchmarks.investigations.body_receive).
    head_receive_size: int = 16 * 1024
    backlog: int = 1024
    # Bind with SO_REUSEPORT: worker processes share the port (--workers).
    reuse_port: bool = False
    # How long a closing connection waits for the client to close its side, so
    # that unread request bytes do not turn our close into a reset.
    linger: float = 1.0
    # The body of the transport's own error answers (413, 408, ...) from status and
    # message; None: {"error": message}. The OpenAI frontend gives OpenAI's shape.
    error_body: Callable[[int, str], bytes] | None = None
    # The server's budget of bytes held for clients (--client-buffer-limit), which
    # large bodies, received and answered, count in; None: not counted.
    budget: ClientBudget | None = None
    # The server's tracing: while it is active, each request's start is timed
    # (Request.began, Triton's HTTP_RECV_START); None: never.
    tracing: TraceClock | None = None


class TraceClock(Protocol):
    """What the protocol asks of the server's tracing (TraceManager)."""

    active: bool

    def now_ns(self) -> int: ...


class _NoTracing:
    active = False

    def now_ns(self) -> int:
        return 0


NO_TRACING = _NoTracing()
