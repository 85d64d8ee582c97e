"""HTTP/1.1 without I/O: bytes in, requests out, answers framed as bytes.

:class:`H1Connection` is one connection's protocol: httptools (llhttp, the
parser of Node.js and uvicorn, in C) parses what the connection receives as it
is given (:meth:`~H1Connection.receive_data`; its callbacks are the ``on_*``
methods), requests whose head has begun wait in ``requests``, and each side's
state moves by the tables of :mod:`trionserve.protocol.http.state`. It opens no
socket and awaits nothing: the Trio loop around it
(:mod:`trionserve.protocol.http.transport`) reads, writes, keeps the deadlines
and runs the handlers, and asks it what the bytes mean and what to send.

A request body is received once, into a buffer of its declared Content-Length
allocated when its head is parsed (np.empty: its pages are committed as bytes
arrive, not up front): what came with the head is copied in from the parser,
the rest the loop reads straight into the buffer (:meth:`~H1Connection.body_pending`
gives the part still empty), with no bytes object per chunk and no join; the
parser, which saw only the body's beginning, is then replaced by a fresh one. A
chunked body is appended to a bytearray as it comes, in at most
``MAX_CHUNKED_CHUNKS`` non-empty chunks (Triton's limit).

What it refuses (:class:`ProtocolError`, answered with its status and the
connection closed): what the parser refuses (400; 505 for an HTTP version it does
not know or other than 1.0 / 1.1), a head larger than ``max_header_size`` (431), a
body larger than ``max_request_body`` (413, or ``body_refusal``'s answer), a
chunked body in too many chunks (400), a request target that is not ASCII (400). A
Content-Length beside Transfer-Encoding is dropped (the transfer coding frames the body) and the
connection closed after the answer; an upgrade request is answered, then the
connection closes; HTTP/1.0 connections close after one answer.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from http import HTTPStatus
from urllib.parse import unquote

import httptools

from trionserve.protocol.http.h1_options import NO_TRACING, HttpServerOptions
from trionserve.protocol.http.h1_request import LastHead, Request, body_buffer
from trionserve.protocol.http.state import (
    Client,
    ClientEvent,
    ConnectionState,
    LocalProtocolError,
    Server,
    ServerEvent,
)

# The states and events of the hot path, as module names (see state.py).
_BODY, _HEAD, _IDLE, _REFUSED = Client.BODY, Client.HEAD, Client.IDLE, Client.REFUSED
_BEGIN, _HEAD_DONE, _MESSAGE_DONE = (
    ClientEvent.BEGIN,
    ClientEvent.HEAD_DONE,
    ClientEvent.MESSAGE_DONE,
)
_REQUEST, _RESPONSE, _END = ServerEvent.REQUEST, ServerEvent.RESPONSE, ServerEvent.END
_ANSWERABLE = (Server.IDLE, Server.HANDLING)
_SERVER_IDLE, _HANDLING = Server.IDLE, Server.HANDLING
# What a whole request taken at once moves each side through (H1Connection.take_again):
# the client from IDLE back to IDLE, the server from IDLE to HANDLING.
_AGAIN_MOVES = (
    (_IDLE, (_BEGIN, _HEAD_DONE, _MESSAGE_DONE), _IDLE),
    (_SERVER_IDLE, (_REQUEST,), _HANDLING),
)
# What a whole answer on a kept connection moves the server through (answer_kept).
_KEPT_MOVES = (_HANDLING, (_RESPONSE, _END), _SERVER_IDLE)

__all__ = [
    "MAX_CHUNKED_CHUNKS",
    "Body",
    "H1Connection",
    "Handler",
    "HeadCache",
    "Headers",
    "HttpServerOptions",
    "LastHead",
    "PeerGone",
    "ProtocolError",
    "Request",
    "RequestBody",
    "Response",
    "Router",
    "json_error",
    "keepable",
]

Headers = Sequence[tuple[bytes, bytes]]
# What a handler returns: status, response headers, and the body: chunks in order
# (the headers carry the content-length), or an async iterator of chunks streamed
# as they come (no content-length; chunked transfer encoding).
Body = Sequence[bytes | memoryview] | AsyncIterator[bytes]
Response = tuple[int, list[tuple[bytes, bytes]], Body]
# A request body: a writable memoryview of a buffer of the declared Content-Length,
# a bytearray for a chunked body, b"" for none.
RequestBody = memoryview | bytearray | bytes
# A handler gets the request headers (lower-case names) and the whole body.
Handler = Callable[[Headers, RequestBody], Awaitable[Response]]
# Picks the handler of a request; None: 404.
Router = Callable[[bytes, str], Handler | None]

# A chunked request body in more non-empty chunks than this is refused, as Triton
# refuses it (server src/http_server.cc kMaxChunkedChunks): each chunk costs the
# parser's callback whatever its size.
MAX_CHUNKED_CHUNKS = 1 << 16
CLOSE = (b"connection", b"close")
JSON = (b"content-type", b"application/json")
_INTERNAL_BODY = b'{"error":"internal error"}'
# The answer of a handler that raised.
INTERNAL_ERROR: Response = (
    500,
    [JSON, (b"content-length", b"%d" % len(_INTERNAL_BODY)), CLOSE],
    [_INTERNAL_BODY],
)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# The end of a body sent with chunked transfer encoding.
LAST_CHUNK = b"0\r\n\r\n"
# Response heads kept for reuse (HeadCache); the cache starts over when full.
_HEAD_CACHE_SIZE = 256


class ProtocolError(Exception):
    """A request refused: answered with ``status`` (0: not answered, the
    connection closes) and ``message``, and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PeerGone(Exception):
    """The client closed its side in the middle of a request."""


class _Stop(Exception):
    """Raised by a parser callback that refused what came: stops the parser."""


class HeadCache:
    """Response heads (status line and headers) as bytes. Most answers repeat an
    earlier one's head (one model's answers have the same types and lengths):
    heads are built once and reused, by every connection of a server."""

    __slots__ = ("_heads",)

    def __init__(self) -> None:
        self._heads: dict[tuple[object, ...], bytes] = {}

    def get(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        key = (status, *headers)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= _HEAD_CACHE_SIZE:
                self._heads.clear()
            head = self._heads[key] = response_head(status, headers)
        return head


class H1Connection:
    """The protocol of one server-side HTTP/1.1 connection (see the module
    docstring). ``state`` holds both sides' states; ``requests`` the requests whose
    head has begun, the first one being served once taken (``current``)."""

    __slots__ = (
        "_head_bytes",
        "_heads",
        "_keep_alive",
        "_last_head",
        "_tracing",
        "current",
        "max_header_size",
        "max_request_body",
        "options",
        "parser",
        "refusal",
        "requests",
        "served",
        "state",
    )

    def __init__(
        self, options: HttpServerOptions | None = None, heads: HeadCache | None = None
    ) -> None:
        self.options = options = options or HttpServerOptions()
        self.max_request_body = options.max_request_body
        self.max_header_size = options.max_header_size
        self._tracing = options.tracing or NO_TRACING
        self._heads = heads or HeadCache()
        self.state = ConnectionState()
        self.parser = self._new_parser()
        self.requests: deque[Request] = deque()
        # What was refused (the parser, a limit): raised when the server reaches it.
        self.refusal: ProtocolError | None = None
        # Bytes received while a request head was incomplete (bounded by
        # max_header_size: the parser buffers a partial header line itself).
        self._head_bytes = 0
        # The request being served (server HANDLING or RESPONDING), and whether its
        # answer leaves the connection open.
        self.current: Request | None = None
        self._keep_alive = False
        self.served = 0  # requests answered
        self._last_head: LastHead | None = None  # the last head parsed, if kept

    # -- the parser's callbacks ----------------------------------------------

    def on_message_begin(self) -> None:
        self.state.client_event(_BEGIN)
        request = Request()
        if self._tracing.active:
            request.began = self._tracing.now_ns()  # libevhtp's recv_start_ns (frontend.py)
        self.requests.append(request)

    def on_url(self, url: bytes) -> None:
        request = self.requests[-1]
        request.target += url
        request.head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.requests[-1]
        # Lower-case names; values as sent (llhttp drops the leading blanks), trailing
        # blanks kept as Triton's libevhtp keeps them, so that a forwarded header
        # reaches the model whole (qa/L0_parameters test_headers).
        request.headers.append((name.lower(), value))
        request.head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        self.state.client_event(_HEAD_DONE)
        request = self.requests[-1]
        parser = self.parser
        request.method = parser.get_method()
        request.version = parser.get_http_version()
        # HTTP/1.0 connections close after one answer.
        request.keep_alive = request.version == "1.1" and parser.should_keep_alive()
        length = -1  # none declared
        chunked = expects_continue = False
        tensors_at = 0  # where the body's binary tensors begin, if it says
        for name, value in request.headers:
            if name == b"content-length":
                length = int(value)  # llhttp takes only digits, and only one
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"expect":
                expects_continue = value.strip().lower() == b"100-continue"
            elif name == b"inference-header-content-length" and value.isdigit():
                tensors_at = int(value)  # (the infer handler checks it)
        if chunked and length >= 0:
            # Framed by its transfer coding; the Content-Length is dropped and the
            # connection closed after the answer, since an intermediary may have
            # framed it otherwise (RFC 9112 section 6.1, request smuggling).
            request.headers = [h for h in request.headers if h[0] != b"content-length"]
            request.keep_alive = False
            length = -1
        request.length = length
        request.expects_continue = expects_continue and request.version == "1.1"
        request.head_done = True
        self._head_bytes = 0
        limit = self.max_request_body
        if length > 0 and (limit is None or length <= limit):
            request.buffer = body_buffer(length, tensors_at)

    def on_body(self, data: bytes) -> None:
        request = self.requests[-1]
        start = request.size
        request.size += len(data)
        if request.buffer is not None:  # llhttp delivers no more than Content-Length
            request.buffer[start : request.size] = data
            return
        limit = self.max_request_body
        if limit is not None and request.size > limit:
            request.chunked = bytearray()
            self._refuse(self._body_too_large(request, None))
            raise _Stop
        if request.in_chunk:
            request.in_chunk = False
            request.chunks += 1
            if request.chunks > MAX_CHUNKED_CHUNKS:
                request.chunked = bytearray()
                self._refuse(
                    ProtocolError(
                        400,
                        f"Chunked request body exceeds maximum of {MAX_CHUNKED_CHUNKS} "
                        "non-empty chunks. Send fewer or larger HTTP chunks.",
                    )
                )
                raise _Stop
        request.chunked += data

    def on_chunk_header(self) -> None:
        self.requests[-1].in_chunk = True

    def on_message_complete(self) -> None:
        self.state.client_event(_MESSAGE_DONE)
        self.requests[-1].complete = True

    # -- receiving -----------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Parse received bytes; b"": the client closed its side. What is refused
        moves the client side to REFUSED (nothing after it is parsed) and is kept
        in ``refusal``, raised once the requests before it are served."""
        state = self.state
        if not data:
            state.client_event(ClientEvent.EOF)
            return
        if state.client is _REFUSED:
            return
        fresh = state.client is _IDLE and not self._head_bytes  # a head begins here
        if fresh and (last := self._last_head) is not None and data[: len(last.raw)] == last.raw:
            self._again_in(last, data)
            return
        if state.client is not _BODY:
            self._head_bytes += len(data)
        first = len(self.requests)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade request (or CONNECT): answered as any request, then the
            # connection closes (nothing after it is HTTP/1.1).
            if self.requests:
                self.requests[-1].keep_alive = False
            self._refuse(ProtocolError(0, ""))
            return
        except httptools.HttpParserError as exc:
            if self.refusal is not None:
                return  # refused in a callback, which stopped the parser
            if isinstance(exc.__context__, LocalProtocolError):
                raise exc.__context__ from None  # a bug, not the client's
            self._refuse(_parser_error(exc))
            return
        if state.client is _HEAD and self._head_bytes > self.max_header_size:
            self._refuse(self._head_too_large())
        elif fresh and len(self.requests) > first and self.refusal is None:
            # (one that may not be kept leaves the last one: a health check
            # between a client's infer requests does not end their cache)
            self._last_head = LastHead.of(data, self.requests[first]) or self._last_head

    def again_buffers(self) -> tuple[memoryview, memoryview] | None:
        """Where to read the next request in one read, expecting it to repeat the
        last head kept (a client's next infer request of one shape): a buffer of
        that head's length, then a body buffer of its length (then
        :meth:`received_again`); None when no head is kept, or bytes of a request
        have come."""
        last = self._last_head
        if last is None or self.state.client is not _IDLE or self._head_bytes or self.requests:
            return None
        return last.scratch, body_buffer(last.length, last.tensors_at)

    def received_again(self, size: int, head: memoryview, body: memoryview) -> None:
        """``size`` bytes read into :meth:`again_buffers`' ``head`` and ``body`` in
        turn (0: the client's end): the request whose head is the last one's, when
        those are its bytes (its body's start in its own buffer); other bytes
        are received as any (:meth:`receive_data`)."""
        last = self._last_head
        assert last is not None
        start = len(last.raw)
        if size >= start and head == last.raw:
            self._again(last, body, size - start)
        elif size <= start:
            self.receive_data(bytes(head[:size]))
        else:
            self.receive_data(bytes(head) + bytes(body[: size - start]))

    def take_again(self, size: int, head: memoryview, body: memoryview) -> Request | None:
        """:meth:`received_again`, in one step where the bytes are the whole
        request the last head makes (the server idle, as :meth:`again_buffers`
        left the client): that request, made as :meth:`_again` makes it and
        taken as :meth:`next_request` takes it, without the states' tables (client
        IDLE -> HEAD -> BODY -> IDLE, server IDLE -> HANDLING: ``_AGAIN_MOVES``).
        None: the bytes were received as any (:meth:`received_again`)."""
        last = self._last_head
        assert last is not None
        length = last.length
        if (
            size != len(last.raw) + length
            or head != last.raw
            or self.state.server is not _SERVER_IDLE
            or last.head_size > self.max_header_size
        ):
            self.received_again(size, head, body)
            return None
        request = Request()
        request.last = last
        if self._tracing.active:
            request.began = self._tracing.now_ns()
        request.target = last.target
        request.headers = list(last.headers)
        request.head_size = last.head_size
        request.method = last.method
        request.version = "1.1"
        request.keep_alive = True
        request.expects_continue = False
        request.length = length
        request.head_done = True
        request.buffer = body
        request.size = length
        request.complete = True
        self.requests.append(request)
        self.state.server = _HANDLING  # (the client side is IDLE again)
        self.current = request
        self._keep_alive = True
        return request

    def _again_in(self, last: LastHead, data: bytes | bytearray | memoryview) -> None:
        """A request whose head is ``last``'s bytes, at the start of ``data``: the
        rest is its body, then (once it is whole) the next request's bytes,
        parsed as usual."""
        start = len(last.raw)
        length = last.length
        buffer = body_buffer(length, last.tensors_at)
        body = data[start : start + length]
        if body:
            buffer[: len(body)] = body
        self._again(last, buffer, len(body))
        if len(data) > start + length:
            self.receive_data(data[start + length :])

    def _again(self, last: LastHead, buffer: memoryview, size: int) -> None:
        """The request whose head is ``last``'s bytes and whose body's first
        ``size`` bytes are in ``buffer`` (of its length): made as the parser's
        callbacks make it (on_message_begin, on_headers_complete, on_body), from
        what the parser made of those bytes."""
        state = self.state
        state.client_event(_BEGIN)
        request = Request()
        request.last = last
        if self._tracing.active:
            request.began = self._tracing.now_ns()
        self.requests.append(request)
        request.target = last.target
        request.headers = list(last.headers)
        request.head_size = last.head_size
        state.client_event(_HEAD_DONE)
        request.method = last.method
        request.version = "1.1"
        request.keep_alive = True
        request.expects_continue = False
        request.length = last.length
        request.head_done = True
        request.buffer = buffer
        request.size = size
        if size == last.length:
            state.client_event(_MESSAGE_DONE)
            request.complete = True

    def _refuse(self, error: ProtocolError) -> None:
        """Refuse what came (client side -> REFUSED); a callback that refuses then
        raises _Stop, which stops the parser: nothing after a refusal is parsed."""
        self.refusal = error
        self.state.client_event(ClientEvent.REFUSE)

    @property
    def head_begun(self) -> bool:
        """Bytes of a request head not yet whole have arrived."""
        return self.state.client is _HEAD or self._head_bytes > 0

    def next_request(self) -> Request | None:
        """The request to serve next, taken (server IDLE -> HANDLING): the first
        whose head is whole; None until one is (more bytes needed, or none come:
        the client side CLOSED). Raises the refusal it reaches instead."""
        requests = self.requests
        if requests and requests[0].head_done:
            request = requests[0]
            if request.head_size > self.max_header_size:
                raise self._head_too_large()
            self.state.server_event(_REQUEST)
            self.current = request
            self._keep_alive = request.keep_alive
            return request
        if self.refusal is not None:
            raise self.refusal
        return None

    def path(self, request: Request) -> str:
        """The request's path, once its head says it may be served: raises for a
        target that is not ASCII (400), an HTTP version other than 1.0 / 1.1 (505;
        llhttp takes 0.9 and 2.0) and a declared body over the limit (413 or
        ``body_refusal``'s answer, before anything of it is read)."""
        raw_path = request.target.partition(b"?")[0]
        try:
            path = raw_path.decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError(400, "bad request: the request target is not ASCII") from None
        if "%" in path:
            path = unquote(path)
        if request.version not in ("1.1", "1.0"):
            raise ProtocolError(
                505, f"HTTP version {request.version} is not supported; use HTTP/1.1"
            )
        limit = self.max_request_body
        if limit is not None and request.length > limit:
            raise self._body_too_large(request, request.length)
        return path

    def continue_needed(self, request: Request) -> bool:
        """Whether ``100 Continue`` is to be sent before the body is read: asked
        for, and nothing of the body sent yet."""
        return request.expects_continue and not request.complete and not request.size

    def body_pending(self, request: Request) -> memoryview | None:
        """While the body is not whole: the part of its buffer still empty, to be
        received into (then :meth:`body_received`), or None: more bytes to be given
        to :meth:`receive_data`. Raises the refusal of the body, or PeerGone."""
        if self.refusal is not None:
            raise self.refusal
        if self.state.client is Client.CLOSED:
            raise PeerGone
        buffer = request.buffer
        return None if buffer is None else buffer[request.size :]

    def body_received(self, request: Request, size: int) -> None:
        """``size`` bytes received into the buffer's empty part (0: end of stream).
        The body whole, the parser, which saw only its beginning, is replaced: the
        next byte on the connection starts a request (a request made without the
        parser, by :meth:`_again`, left it at a request's start)."""
        if not size:
            self.state.client_event(ClientEvent.EOF)
            raise PeerGone
        request.size += size
        if request.buffer is not None and request.size >= len(request.buffer):
            self.state.client_event(_MESSAGE_DONE)
            request.complete = True
            if request.last is None:
                self.parser = self._new_parser()

    def body(self, request: Request) -> RequestBody:
        """The whole body of ``request``."""
        if request.buffer is not None:
            return request.buffer
        return request.chunked if request.size else b""

    # -- answering -----------------------------------------------------------

    @property
    def answerable(self) -> bool:
        """Nothing of an answer sent yet (an error answer may still be sent)."""
        return self.state.server in _ANSWERABLE

    @property
    def head_only(self) -> bool:
        """The request being answered is a HEAD request: its answer has no body."""
        current = self.current
        return current is not None and current.method == b"HEAD"

    @property
    def chunked_response(self) -> bool:
        """A streamed answer is sent with chunked transfer encoding (HTTP/1.1), or
        as is, ending with the close (HTTP/1.0)."""
        current = self.current
        return current is None or current.version == "1.1"

    def start_response(
        self, status: int, headers: list[tuple[bytes, bytes]], draining: bool, streamed: bool
    ) -> bytes:
        """The head of the answer to the current request (server HANDLING ->
        RESPONDING): ``Connection: close`` added where the connection will close
        (its request's keep-alive, ``draining``, the handler's own headers),
        ``Transfer-Encoding: chunked`` for a ``streamed`` answer over HTTP/1.1."""
        self.state.server_event(_RESPONSE)
        if not self._keep_alive or draining or CLOSE in headers:
            self._keep_alive = False
            if CLOSE not in headers:
                headers = [*headers, CLOSE]  # handlers may share their header lists
        if streamed and self.chunked_response:
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        return self._heads.get(status, headers)

    def end_response(self) -> bool:
        """The answer is written: whether the connection is kept for the next
        request (server RESPONDING -> IDLE) or closes (-> MUST_CLOSE)."""
        request = self.requests.popleft()
        self.current = None
        self.served += 1
        if self._keep_alive and request.complete:
            self.state.server_event(_END)
            return True
        self.state.server_event(ServerEvent.END_CLOSE)
        return False

    def answer_kept(self) -> bool:
        """:meth:`start_response` then :meth:`end_response` in one step, for a
        whole answer whose head (made before by :meth:`start_response`) keeps
        the connection (server HANDLING -> IDLE: ``_KEPT_MOVES``); False, nothing
        moved, where that head would not do: the connection closes after this
        answer, or the request is a HEAD one or not whole."""
        request = self.current
        if (
            request is None
            or self.state.server is not _HANDLING
            or not self._keep_alive
            or not request.complete
            or request.method == b"HEAD"
        ):
            return False
        self.requests.popleft()
        self.current = None
        self.served += 1
        self.state.server = _SERVER_IDLE
        return True

    def error_response(self, status: int, message: str) -> bytes:
        """A whole JSON error answer that closes the connection (server IDLE or
        HANDLING -> MUST_CLOSE); its body left out for a HEAD request."""
        self.state.server_event(ServerEvent.ERROR_RESPONSE)
        shape = self.options.error_body
        body = _json_error_body(message) if shape is None else shape(status, message)
        head = self._heads.get(status, [JSON, (b"content-length", b"%d" % len(body)), CLOSE])
        return head if self.head_only else head + body

    def closed(self) -> None:
        """The connection is closed (server -> CLOSED)."""
        self.state.server_event(ServerEvent.CLOSE)

    # -- helpers -------------------------------------------------------------

    def _new_parser(self) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(self)
        # Content-Length beside Transfer-Encoding: the transfer coding frames the
        # body (RFC 9112 section 6.3), as Triton's libevhtp does; see
        # on_headers_complete.
        parser.set_dangerous_leniencies(lenient_chunked_length=True)
        return parser

    def _head_too_large(self) -> ProtocolError:
        limit = self.max_header_size
        return ProtocolError(431, f"the request head is larger than the limit of {limit} bytes")

    def _body_too_large(self, request: Request, size: int | None) -> ProtocolError:
        refusal = self.options.body_refusal
        if refusal is not None and self.max_request_body is not None:
            return refusal(request, size, self.max_request_body)
        return ProtocolError(
            413,
            f"the request body is larger than the limit of {self.max_request_body} bytes "
            f"({self.options.max_request_body_flag})",
        )


class LastChunk(bytes):
    """A streamed body's last chunk: the transport writes the end of the body with
    it (one write, not two) and takes nothing more from the body."""

    __slots__ = ()


def keepable(handler: Handler) -> Handler:
    """``handler`` marked as the one its router returns for every request of its method and
    target while the verbose log is off: a connection keeps it for the requests it makes from
    its last head (:class:`LastHead`), without asking the router again."""
    handler.keepable = True  # type: ignore[attr-defined]
    return handler


def frame_chunk(chunk: bytes) -> bytes:
    """One chunk of a body sent with chunked transfer encoding."""
    return b"%x\r\n%s\r\n" % (len(chunk), chunk)


def json_error(status: int, message: str) -> bytes:
    """A whole JSON error answer that closes the connection."""
    body = _json_error_body(message)
    return response_head(status, [JSON, (b"content-length", b"%d" % len(body)), CLOSE]) + body


def _json_error_body(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()


def response_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The status line and headers of a response; refuses a header that would
    split the response (CR or LF in it)."""
    try:
        reason = HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        reason = b""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    for name, value in headers:
        if b"\r" in name or b"\n" in name or b"\r" in value or b"\n" in value:
            raise ValueError(f"a response header may not contain CR or LF: {name!r}")
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.append(b"\r\n")
    return b"".join(lines)


def _parser_error(exc: httptools.HttpParserError) -> ProtocolError:
    """The answer to a request the parser refused: 505 for an HTTP version it does
    not know (HTTP/9.9), 400 with the parser's words otherwise."""
    reason = str(exc)
    if reason == "Invalid HTTP version":
        return ProtocolError(505, "the HTTP version is not supported; use HTTP/1.1")
    return ProtocolError(400, f"bad request: {reason}")
