"""The timestamps Triton's frontends add to a trace: HTTP_RECV_START / HTTP_RECV_END /
HTTP_SEND_START / HTTP_SEND_END, GRPC_WAITREAD_START / GRPC_WAITREAD_END /
GRPC_SEND_START / GRPC_SEND_END, and INFER_RESPONSE_COMPLETE.

A frontend takes them only while tracing is on (``TraceManager.active``): a
:class:`FrontendStamps` goes with its request to the data plane
(``InferenceRequest.trace_context``). If the request is sampled, its trace is
written only once both the data plane (``TraceManager.finish``) and the frontend
(:meth:`FrontendStamps.release`) are done with it, as Triton's
``TraceManager::Trace`` is written when the frontend's last reference to it goes
(server src/tracer.cc ``Trace::~Trace``), after the answer was sent.

Where Triton takes them, and where these are taken:

- ``HTTP_RECV_START``: libevhtp's parser starting a request (third_party
  libevhtp/evhtp.c ``htp__request_parse_start_``, ``recv_start_ns``); here the
  parser's ``on_message_begin`` (protocol/http/h1.py).
- ``HTTP_RECV_END``: the request parsed whole, before its handler runs
  (evhtp.c ``htp__request_parse_fini_``); here once its body is read, before
  the handler (protocol/http/transport.py).
- ``HTTP_SEND_START`` / ``HTTP_SEND_END``: around ``evhtp_send_reply``, the
  answer handed to the connection's buffer (evhtp.c ``evhtp_send_reply``,
  server src/http_server.cc ``InferRequestClass::ReplyCallback``); here around
  the answer's write; a streamed answer (``generate_stream``) has a pair per
  chunk, into the trace as it is written (http_server.cc
  ``SendChunkResponse``). Triton's HTTP frontend writes RECV into the trace as it
  samples it, before REQUEST_START (http_server.cc ``HTTPAPIServer::StartTrace``),
  and SEND as it replies, after REQUEST_END.
- ``GRPC_WAITREAD_START`` / ``GRPC_WAITREAD_END``: around the wait for the
  call's request message (src/grpc/infer_handler.cc
  ``ModelInferHandler::StartNewRequest`` / ``Process`` at step START; a
  stream's next message, src/grpc/stream_infer_handler.cc ``Process`` at READ);
  here from the handler starting to wait for the message to its whole message.
- ``GRPC_SEND_START`` / ``GRPC_SEND_END``: the response handed to gRPC
  (infer_handler.cc ``InferResponseComplete``, before ``Finish``) and gRPC done
  with it (``Process`` at step COMPLETE; a stream's at WRITTEN, per
  response); here around each response's send.
  Triton's gRPC frontend keeps all of its timestamps aside and adds them when it
  lets go of the trace (src/grpc/infer_handler.h ``ClearTraceTimestamps``), so
  they come after REQUEST_END: ``deferred``.
- ``INFER_RESPONSE_COMPLETE``: the frontend receiving the response
  (http_server.cc ``InferRequestClass::InferResponseComplete``,
  infer_handler.cc ``InferResponseComplete``); here the data plane handing the
  response to the frontend (``_Lifecycle.deliverable``).

Every one of them is on Trio's clock, as the data plane's timestamps are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING

import trio

from trionserve.observability.trace.trace_file import clock_ns

if TYPE_CHECKING:
    from trionserve.observability.trace.trace_file import Trace

__all__ = ["HTTP_STAMPS", "FrontendStamps", "now_ns", "valid_traceparent"]

# The stamps of the HTTP request its connection's task is handling, while
# tracing is on: set by the transport, read by the handlers that make an
# inference request of it (no other code reads it).
HTTP_STAMPS: ContextVar[FrontendStamps | None] = ContextVar("trionserve_http_stamps", default=None)


_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def valid_traceparent(value: str | bytes | None) -> str | None:
    """A W3C ``traceparent`` value if it is a valid one (version not ``ff``, trace
    and parent ids not all zeros), as OpenTelemetry's HttpTraceContext extracts
    it for Triton's frontends (server src/tracer.cc GetTraceStartOptions)."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    match = _TRACEPARENT.fullmatch(text.strip())
    if match is None or match[1] == "ff" or not int(match[2], 16) or not int(match[3], 16):
        return None
    return match[0]


# The most of a client's ``tracestate`` kept: W3C Trace Context asks vendors to
# propagate at least 512 characters and lets them drop a longer one whole.
MAX_TRACESTATE = 512


def now_ns() -> int:
    """Now, on the clock of every trace timestamp."""
    return clock_ns(trio.current_time())


class FrontendStamps:
    """One request's frontend timestamps, and its trace once the data plane sampled it.

    ``before``: written ahead of the trace's first object (HTTP's RECV pair);
    ``after``: written after REQUEST_END (HTTP's SEND pair; all of gRPC's).
    """

    __slots__ = (
        "after",
        "before",
        "deferred",
        "trace",
        "traceparent",
        "tracestate",
        "_let_go",
        "_released",
    )

    def __init__(self, before: list[tuple[str, int]] | None = None, deferred: bool = False) -> None:
        self.before = before if before is not None else []
        self.after: list[tuple[str, int]] = []
        # The client's W3C trace context (its ``traceparent`` header or metadata),
        # if valid: in mode opentelemetry the request is traced under it.
        self.traceparent: str | None = None
        # Its ``tracestate`` with it, as sent (checked when a span takes it).
        self.tracestate: str | None = None
        # gRPC: INFER_RESPONSE_COMPLETE too is kept aside until the end.
        self.deferred = deferred
        self.trace: Trace | None = None
        self._let_go: Callable[[Trace], None] | None = None
        self._released = False

    def take_context(self, traceparent: str | bytes | None, tracestate: str | bytes | None) -> None:
        """The client's W3C trace context (its ``traceparent`` and ``tracestate``
        headers or metadata), as Triton's frontends extract it with
        OpenTelemetry's HttpTraceContext (server src/tracer.cc
        GetTraceStartOptions): a ``tracestate`` only with a valid ``traceparent``,
        and dropped past MAX_TRACESTATE characters."""
        self.traceparent = valid_traceparent(traceparent)
        if self.traceparent is not None and tracestate:
            text = tracestate.decode("latin-1") if isinstance(tracestate, bytes) else tracestate
            if len(text) <= MAX_TRACESTATE:
                self.tracestate = text

    def attach(self, trace: Trace, let_go: Callable[[Trace], None]) -> bool:
        """The data plane sampled the request: the trace waits for ``release``
        too. False if these stamps already went with a trace, or were released."""
        if self.trace is not None or self._released:
            return False
        self.trace = trace
        self._let_go = let_go
        return True

    def stamp(self, name: str) -> None:
        """Record ``name`` now, after REQUEST_END in the trace."""
        self.after.append((name, now_ns()))

    def sent_chunk(self, start: int, end: int) -> None:
        """A chunk of a streamed answer was written (HTTP_SEND_START / _END at
        ``start`` / ``end``): into the trace as it happens, as Triton's
        SendChunkResponse captures it (server src/http_server.cc)."""
        if self.trace is not None:
            self.trace.timestamp("HTTP_SEND_START", start)
            self.trace.timestamp("HTTP_SEND_END", end)
        else:
            self.after += [("HTTP_SEND_START", start), ("HTTP_SEND_END", end)]

    def response_complete(self) -> None:
        """The frontend got a response (INFER_RESPONSE_COMPLETE)."""
        if self.deferred:
            self.stamp("INFER_RESPONSE_COMPLETE")
        elif self.trace is not None:
            self.trace.timestamp("INFER_RESPONSE_COMPLETE", now_ns())

    def release(self) -> None:
        """The frontend is done (answered, failed or cancelled): the trace is
        written once the data plane is done with it too. Idempotent."""
        if self._released:
            return
        self._released = True
        trace, let_go = self.trace, self._let_go
        if trace is not None and let_go is not None:
            let_go(trace)
