"""HTTP/1.1 on Trio sockets: the connection loop of the HTTP frontend.

httptools (llhttp, the parser of Node.js and uvicorn, in C) parses requests;
this module reads and writes the sockets around it and frames the responses.
Every request goes to the handler that the router (``router(method, path)``)
picks: the whole body is read, the handler gets the
headers and the body and returns ``(status, headers, body)``, and the answer is
written with as few writes as possible. The body is a sequence of chunks (the
headers carry its content-length), or an async iterator of chunks, written as
they come with chunked transfer encoding (server-sent events). A router that
returns None gets a 404 with a JSON error.

A request body is received once, into a buffer of its declared Content-Length
allocated when its head is parsed (its pages are committed as bytes arrive, not
up front): what came with the head is copied in from the parser, the rest is read
from the socket straight into the buffer, with no bytes object per chunk and no
join. The handler gets a writable memoryview of it, so binary tensors are numpy
views that no backend needs to copy. A chunked body is appended to a bytearray as
it comes, in at most ``MAX_CHUNKED_CHUNKS`` non-empty chunks (Triton's limit).

What it guarantees:

- One task per connection; requests on a connection are served one after
  another (pipelined requests wait, parsed, until their turn).
- No client holds connections it does not use: a request head must be whole
  within ``header_timeout``, and a body must not pause for longer (408); an idle
  keep-alive connection closes after ``keep_alive_timeout``, and at
  ``max_connections`` the one idle the longest is closed to make room for a new
  connection (503 only when none is idle).
- ``Expect: 100-continue`` is answered when the body is about to be read; chunked
  request bodies are accepted; a body larger than ``max_request_body`` (no limit
  by default) is answered with 413 and the connection closed.
- Malformed requests get a JSON error (400; 431 for a head larger than
  ``max_header_size``; 505 for an HTTP version other than 1.0 / 1.1) and their
  connection closed; HTTP/1.0 connections close after one answer;
  a handler that raises gets a JSON 500 (and its connection closed), logged.
- A client that resets or drops its connection ends that connection only: Trio
  raises resets inside nurseries as ExceptionGroups, hence ``except*``.
- Shutdown (``shutdown`` set: the server sets it once its drain is over, see
  :class:`~trionserve.dataplane.DataPlane`; until then this server serves as
  usual): the listeners close at once (new connections are refused), idle
  keep-alive connections close, requests in flight finish and are answered with
  ``Connection: close``; after ``graceful_timeout`` whatever is left is cancelled,
  and a request cut while its handler runs is answered 503 (``Connection: close``)
  if its socket takes the answer within a second.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import unquote

import httptools
import numpy as np
import structlog
import trio

from trionserve.protocol.listeners import Acceptor, open_tcp_listeners

log = structlog.get_logger(__name__)

__all__ = ["Handler", "HttpServer", "HttpServerOptions", "RequestBody", "Response", "Router"]

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
# Responses up to this size are joined with their head and written at once;
# larger bodies are written chunk by chunk from their buffers, without joining.
_JOIN_LIMIT = 64 * 1024
_CLOSE = (b"connection", b"close")
# A request handled for longer than this gets a watcher on its socket, so that a
# client hanging up cancels it (shorter ones finish before a watcher would help).
SLOW_REQUEST_SECS = 0.05
_JSON = (b"content-type", b"application/json")
_INTERNAL_BODY = b'{"error":"internal error"}'
_INTERNAL_ERROR = (
    500,
    [_JSON, (b"content-length", b"%d" % len(_INTERNAL_BODY)), _CLOSE],
    [_INTERNAL_BODY],
)
# Response heads kept for reuse (HttpServer.response_head); the cache starts over
# when full.
_HEAD_CACHE_SIZE = 256


@dataclass(frozen=True, slots=True)
class HttpServerOptions:
    """Settings of the HTTP/1.1 transport."""

    # Largest request body accepted, in bytes; None: no limit.
    max_request_body: int | None = None
    # The flag that sets max_request_body, named in the 413 answer.
    max_request_body_flag: str = "--http-max-input-size"
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
    # Bytes asked of the socket per read.
    receive_size: int = 256 * 1024
    backlog: int = 1024
    # Bind with SO_REUSEPORT: worker processes share the port (--workers).
    reuse_port: bool = False
    # How long a closing connection waits for the client to close its side, so
    # that unread request bytes do not turn our close into a reset.
    linger: float = 1.0
    # The body of the transport's own error answers (413, 408, ...) from status and
    # message; None: {"error": message}. The OpenAI frontend gives OpenAI's shape.
    error_body: Callable[[int, str], bytes] | None = None


class _ProtocolError(Exception):
    """A request the parser refused: answered with ``status`` (0: not answered,
    the connection closes) and closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _PeerGone(Exception):
    """The client closed its side in the middle of a request."""


class _BodyTooLarge(Exception):
    """The request body passed ``max_request_body``."""


class _BodyTimeout(Exception):
    """No byte of the request body came for ``header_timeout`` seconds."""


class _HeaderTimeout(Exception):
    """A request head did not arrive within ``header_timeout``."""


class HttpServer:
    """Serves HTTP/1.1 on one address, each request by the handler its router picks.

    ``serve`` listens, reports the bound (host, port) pairs to ``task_status`` and
    serves until ``shutdown`` is set; then it drains (see the module docstring).
    Connections are children of its nursery.
    """

    def __init__(self, router: Router, options: HttpServerOptions | None = None) -> None:
        self.router = router
        self.options = options or HttpServerOptions()
        self.draining = False
        # Connections waiting for their next request: closed when draining starts.
        self._idle: set[_Connection] = set()
        # Of those, the ones answered and sent nothing since (keep-alive idle),
        # oldest first: closed to make room at the connection cap.
        self._keep_alive: dict[_Connection, None] = {}
        # Connections handling a request, and when it started.
        self._handling: dict[_Connection, float] = {}
        self._heads: dict[tuple, bytes] = {}
        self.acceptor = Acceptor(
            "HTTP",
            self._connection,
            self._refuse,
            self.options.max_connections,
            "--http-max-connections",
            evict=self._close_oldest_idle,
        )

    async def serve(
        self,
        address: str,
        port: int,
        shutdown: trio.Event,
        graceful_timeout: float,
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await open_tcp_listeners(
            port,
            host=address or None,
            backlog=self.options.backlog,
            reuse_port=self.options.reuse_port,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_slow_requests, nursery)
            await self.acceptor.serve_until(
                listeners, shutdown, graceful_timeout, self._drain, task_status=task_status
            )
            nursery.cancel_scope.cancel()

    async def _watch_slow_requests(self, nursery: trio.Nursery) -> None:
        """Every ``SLOW_REQUEST_SECS``, give each request handled for longer a
        watcher on its socket, so a client that hangs up cancels it. One timer per
        server instead of one watcher per request keeps fast requests cheap."""
        while True:
            await trio.sleep(SLOW_REQUEST_SECS)
            cutoff = trio.current_time() - SLOW_REQUEST_SECS
            for connection, started in list(self._handling.items()):
                if started <= cutoff and connection._watch is None:
                    connection.watch_peer(nursery)

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The status line and headers of a response, as bytes. Most answers repeat
        an earlier one's head (one model's answers have the same types and
        lengths): heads are built once and reused."""
        key = (status, *headers)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= _HEAD_CACHE_SIZE:
                self._heads.clear()
            head = self._heads[key] = _response_head(status, headers)
        return head

    def _close_oldest_idle(self) -> bool:
        """Close the connection idle the longest between requests (to make room
        at the cap); False when none is."""
        for connection in self._keep_alive:
            del self._keep_alive[connection]
            connection.stop_waiting()
            return True
        return False

    def _drain(self) -> None:
        self.draining = True
        for connection in list(self._idle):
            connection.stop_waiting()

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """Answer 503 on a connection past the cap and close it, without reading it
        (bounded: a client that does not read cannot hold the accept loop)."""
        cap = self.options.max_connections
        answer = _raw_error(
            503,
            f"too many connections: {cap} open, the limit of --http-max-connections; "
            "try again later",
        )
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(answer)
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await stream.aclose()

    async def _connection(self, stream: trio.SocketStream) -> None:
        connection = _Connection(self, stream)
        try:
            await connection.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as group:
            log.debug("http connection lost", error=repr(group))
        except* Exception:
            log.exception("http connection failed")


class _Request:
    """One request as the parser delivers it: its head, then its body."""

    __slots__ = (
        "buffer",
        "chunked",
        "chunks",
        "complete",
        "expects_continue",
        "head_done",
        "head_size",
        "headers",
        "in_chunk",
        "keep_alive",
        "method",
        "size",
        "target",
        "too_large",
        "version",
    )

    # Set by on_headers_complete, before anything reads them.
    method: bytes
    version: str
    keep_alive: bool
    expects_continue: bool

    def __init__(self) -> None:
        self.target = b""
        self.head_size = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        # The body: received into ``buffer`` when its length is declared (and within
        # the limit), else (chunked) appended to ``chunked``.
        self.buffer: memoryview | None = None
        self.chunked = bytearray()
        self.chunks = 0  # non-empty chunks of a chunked body
        self.in_chunk = False  # a chunk header was parsed, its data not counted yet
        self.size = 0
        self.too_large = False
        self.complete = False


class _Connection:
    """One client connection: owns its socket and its parser. httptools parses
    what arrives as it arrives (its callbacks are the ``on_*`` methods): requests
    whose head has begun wait in ``requests``, the first one being served."""

    __slots__ = (
        "_answered",
        "_eof",
        "_error",
        "_handling",
        "_head_bytes",
        "_idle_scope",
        "_quiet",
        "_request_method",
        "_served",
        "_watch",
        "parser",
        "requests",
        "server",
        "stream",
    )

    def __init__(self, server: HttpServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.parser = self._new_parser()
        self.requests: deque[_Request] = deque()
        # Bytes received while a request head was incomplete (bounded by
        # max_header_size: the parser buffers a partial header line itself).
        self._head_bytes = 0
        # What the parser refused: raised once the requests before it are served.
        self._error: _ProtocolError | None = None
        self._eof = False  # the client closed its side
        self._idle_scope: trio.CancelScope | None = None
        # Ended while idle between requests: nothing unread, closed without linger.
        self._quiet = False
        self._request_method = b""
        self._answered = False  # the current request's answer has begun
        # The request being handled, and the watcher of a slow one's socket.
        self._handling: trio.CancelScope | None = None
        self._watch: tuple[trio.CancelScope, trio.Event] | None = None
        self._served = 0  # requests answered on this connection

    # -- the parser's callbacks ----------------------------------------------

    def on_message_begin(self) -> None:
        self.requests.append(_Request())

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
        request = self.requests[-1]
        parser = self.parser
        request.method = parser.get_method()
        request.version = parser.get_http_version()
        # HTTP/1.0 connections close after one answer.
        request.keep_alive = request.version == "1.1" and parser.should_keep_alive()
        names = [name for name, _ in request.headers]
        if b"transfer-encoding" in names and b"content-length" in names:
            # Framed by its transfer coding; the Content-Length is dropped and the
            # connection closed after the answer, since an intermediary may have
            # framed it otherwise (RFC 9112 section 6.1, request smuggling).
            request.headers = [h for h in request.headers if h[0] != b"content-length"]
            request.keep_alive = False
        request.expects_continue = request.version == "1.1" and any(
            name == b"expect" and value.strip().lower() == b"100-continue"
            for name, value in request.headers
        )
        request.head_done = True
        self._head_bytes = 0
        length = _content_length(request.headers)
        limit = self.server.options.max_request_body
        if length and (limit is None or length <= limit):
            # np.empty: allocated, not written, so the memory a connection holds
            # grows with the bytes it has sent, as it did with a list of chunks.
            request.buffer = np.empty(length, np.uint8).data

    def on_body(self, data: bytes) -> None:
        request = self.requests[-1]
        if request.too_large:
            return
        start = request.size
        request.size += len(data)
        if request.buffer is not None:  # llhttp delivers no more than Content-Length
            request.buffer[start : request.size] = data
            return
        limit = self.server.options.max_request_body
        if limit is not None and request.size > limit:
            request.too_large = True
            request.chunked = bytearray()
            return
        if request.in_chunk:
            request.in_chunk = False
            request.chunks += 1
            if request.chunks > MAX_CHUNKED_CHUNKS:
                request.too_large = True  # nothing more is kept; _read_body says why
                request.chunked = bytearray()
                return
        request.chunked += data

    def on_chunk_header(self) -> None:
        self.requests[-1].in_chunk = True

    def on_message_complete(self) -> None:
        self.requests[-1].complete = True

    def _feed(self, data: bytes) -> None:
        """Parse received bytes; b"": the client closed its side. A refusal of the
        parser is kept in ``_error``."""
        if not data:
            self._eof = True
            return
        if self._error is not None:
            return  # nothing after a refused request is read
        requests = self.requests
        in_head = not requests or not requests[-1].head_done
        if in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade request (or CONNECT): answered as any request, then the
            # connection closes (nothing after it is HTTP/1.1).
            if requests:
                requests[-1].keep_alive = False
            self._error = _ProtocolError(0, "")
            return
        except httptools.HttpParserError as exc:
            self._error = _parser_error(exc)
            return
        if (not requests or not requests[-1].head_done) and (
            self._head_bytes > self.server.options.max_header_size
        ):
            self._error = self._too_large_head()

    def _too_large_head(self) -> _ProtocolError:
        limit = self.server.options.max_header_size
        return _ProtocolError(431, f"the request head is larger than the limit of {limit} bytes")

    async def run(self) -> None:
        requests = self.requests
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    return  # closed by the client, idle timeout, or draining
                keep_open = await self._serve(request)
                self._served += 1
                if not keep_open or self.server.draining:
                    return
                requests.popleft()
                self._answered = False
                self._request_method = b""
        except _ProtocolError as exc:
            if exc.status:
                await self._protocol_error(exc)
        except _HeaderTimeout:
            # No request to answer: the answer is written as is.
            timeout = self.server.options.header_timeout
            with trio.move_on_after(1.0):
                await self.stream.send_all(
                    _raw_error(
                        408,
                        f"the request head did not arrive within {timeout:g} s "
                        "(--http-header-timeout)",
                    )
                )
        except _PeerGone:
            pass
        finally:
            await self._close()

    def stop_waiting(self) -> None:
        """Stop waiting for the next request (the server is draining)."""
        if self._idle_scope is not None:
            self._idle_scope.cancel()

    # -- reading -------------------------------------------------------------

    async def _next_request(self) -> _Request | None:
        """The next request whose head is whole, or None on the client closing,
        draining or the keep-alive timeout. The head must be whole within
        ``header_timeout`` of the connection opening (first request) or of its
        first byte (later ones); raises _HeaderTimeout otherwise, and
        _ProtocolError for what the parser refused."""
        requests = self.requests
        deadline = None
        if not self._served:
            deadline = trio.current_time() + self.server.options.header_timeout
        while True:
            if requests and requests[0].head_done:
                if requests[0].head_size > self.server.options.max_header_size:
                    raise self._too_large_head()
                return requests[0]
            if self._error is not None:
                raise self._error
            if self._eof:
                return None
            if deadline is None and (requests or self._head_bytes):
                deadline = trio.current_time() + self.server.options.header_timeout
            data = await self._receive_idle(deadline)
            if data is None:
                if deadline is not None and trio.current_time() >= deadline:
                    raise _HeaderTimeout
                return None
            self._feed(data)

    async def _receive_idle(self, deadline: float | None = None) -> bytes | None:
        """Bytes between requests; None on draining, the keep-alive timeout or
        ``deadline``."""
        server = self.server
        if server.draining:
            return None
        until = trio.current_time() + server.options.keep_alive_timeout
        if deadline is not None:
            until = min(until, deadline)
        # Answered and nothing of the next request yet: keep-alive idle.
        keep_alive = self._served and deadline is None
        with trio.move_on_at(until) as scope:
            self._idle_scope = scope
            server._idle.add(self)
            if keep_alive:
                server._keep_alive[self] = None
            try:
                return await self.stream.receive_some(server.options.receive_size)
            finally:
                server._idle.discard(self)
                server._keep_alive.pop(self, None)
                self._idle_scope = None
        self._quiet = bool(keep_alive)
        return None

    async def _read_body(self, request: _Request) -> RequestBody:
        """The whole request body; raises _BodyTooLarge past the size limit and
        _ProtocolError past the chunk count."""
        if request.expects_continue and not request.complete and not request.size:
            await self.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        timeout = self.server.options.header_timeout
        # A body that stops arriving times out: each read must bring a byte within
        # header_timeout (the deadline moves on with every read).
        with trio.move_on_after(timeout) as scope:
            while not request.complete:
                if request.too_large:
                    raise self._too_large_body(request)
                if self._error is not None:
                    raise self._error
                if self._eof:
                    raise _PeerGone
                if request.buffer is not None:
                    await self._receive_into(request, request.buffer, scope)
                    break
                self._feed(await self.stream.receive_some(self.server.options.receive_size))
                scope.deadline = trio.current_time() + timeout
        if scope.cancelled_caught:
            raise _BodyTimeout
        if request.too_large:
            raise self._too_large_body(request)
        if request.buffer is not None:
            return request.buffer
        return request.chunked if request.size else b""

    @staticmethod
    def _too_large_body(request: _Request) -> Exception:
        """Why a body is refused: past the size limit (413), or a chunked one in more
        chunks than Triton takes (400, and the connection closed)."""
        if request.chunks > MAX_CHUNKED_CHUNKS:
            return _ProtocolError(
                400,
                f"Chunked request body exceeds maximum of {MAX_CHUNKED_CHUNKS} non-empty "
                "chunks. Send fewer or larger HTTP chunks.",
            )
        return _BodyTooLarge()

    async def _receive_into(
        self, request: _Request, buffer: memoryview, scope: trio.CancelScope
    ) -> None:
        """The rest of a body of declared length, read from the socket into its
        buffer, never past its end (a pipelined request after it stays in the
        socket); each read moves ``scope``'s deadline on by ``header_timeout``. The
        parser, which saw only the body's beginning, is replaced by a fresh one:
        the next byte on the connection starts a request."""
        socket = self.stream.socket
        size, end = request.size, len(buffer)
        timeout = self.server.options.header_timeout
        while size < end:
            try:
                received = await socket.recv_into(buffer[size:], end - size)
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            if not received:
                self._eof = True
                raise _PeerGone
            size += received
            scope.deadline = trio.current_time() + timeout
        request.size = size
        request.complete = True
        self.parser = self._new_parser()

    def _new_parser(self) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(self)
        # Content-Length beside Transfer-Encoding: the transfer coding frames the
        # body (RFC 9112 section 6.3), as Triton's libevhtp does; see
        # on_headers_complete.
        parser.set_dangerous_leniencies(lenient_chunked_length=True)
        return parser

    # -- serving ---------------------------------------------------------------

    async def _serve(self, request: _Request) -> bool:
        """Answer one request; whether the connection stays open for the next."""
        method = self._request_method = request.method
        raw_path = request.target.partition(b"?")[0]
        try:
            path = raw_path.decode("ascii")
        except UnicodeDecodeError:
            await self._error_response(400, "bad request: the request target is not ASCII")
            return False
        if "%" in path:
            path = unquote(path)
        refusal = _refusal(request)
        if refusal is not None:
            await self._error_response(*refusal)
            return False
        handler = self.server.router(method, path)
        limit = self.server.options.max_request_body
        try:
            if limit is not None and _content_length(request.headers) > limit:
                raise _BodyTooLarge
            if handler is None:
                await self._error_response(404, f"Not Found: {method.decode()} {path}")
                return False
            body = await self._read_body(request)
            try:
                status, headers, chunks = await self._run_handler(handler, request.headers, body)
            except trio.Cancelled:
                await self._cut()
                raise
        except _BodyTooLarge:
            await self._too_large()
            return False
        except _BodyTimeout:
            await self._error_response(
                408,
                f"the request body stopped arriving: no byte of it for "
                f"{self.server.options.header_timeout:g} s (--http-header-timeout)",
            )
            return False
        keep_open = request.keep_alive and not self.server.draining and _CLOSE not in headers
        if not keep_open and _CLOSE not in headers:
            headers = [*headers, _CLOSE]  # handlers may share their header lists
        await self.respond(status, headers, chunks, request.version)
        return keep_open and request.complete

    async def _run_handler(self, handler: Handler, headers: Headers, body: RequestBody) -> Response:
        """The handler's answer. A client that hangs up meanwhile cancels it, so
        its request leaves the queue (or its result is dropped), as DESIGN §3
        says: requests still running after ``SLOW_REQUEST_SECS`` get a watcher on
        their socket (see :meth:`HttpServer._watch_slow_requests`); fast ones pay
        nothing for it."""
        server = self.server
        handling = self._handling = trio.CancelScope()
        server._handling[self] = trio.current_time()
        try:
            with handling:
                try:
                    answer = await handler(headers, body)
                except Exception:  # a handler bug: this request fails, the server goes on
                    log.exception("http handler failed")
                    answer = _INTERNAL_ERROR
        finally:
            del server._handling[self]
            self._handling = None
            watch, self._watch = self._watch, None
            if watch is not None:
                scope, done = watch
                scope.cancel()
                with trio.CancelScope(shield=True):
                    await done.wait()  # the socket is ours again
        if handling.cancelled_caught:
            raise _PeerGone
        return answer

    def watch_peer(self, nursery: trio.Nursery) -> None:
        """Start watching the socket while a slow request is handled."""
        watch = (trio.CancelScope(), trio.Event())
        self._watch = watch
        nursery.start_soon(self._watch_peer, *watch)

    async def _watch_peer(self, scope: trio.CancelScope, done: trio.Event) -> None:
        """End of stream (or a reset) cancels the handling; pipelined bytes are
        parsed (their requests wait their turn) and end the watch."""
        try:
            with scope:
                try:
                    data = await self.stream.receive_some(self.server.options.receive_size)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                self._feed(data)
                if not data and self._handling is not None:
                    self._handling.cancel()
        finally:
            done.set()

    async def respond(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        chunks: Body,
        version: str = "1.1",
    ) -> None:
        """Write one whole response (headers must carry its content-length), or
        stream one whose body is an async iterator."""
        self._answered = True
        if isinstance(chunks, AsyncIterator):
            await self._stream(status, headers, chunks, version)
            return
        head = self.server.response_head(status, headers)
        if self._request_method == b"HEAD":
            await self.stream.send_all(head)
            return
        size = 0
        for chunk in chunks:
            size += len(chunk)
        if size <= _JOIN_LIMIT:
            await self.stream.send_all(head + b"".join(chunks) if size else head)
            return
        await self._write([head, *chunks])

    async def _stream(
        self, status: int, headers: list, chunks: AsyncIterator[bytes], version: str
    ) -> None:
        """Write the head, then each chunk as the iterator yields it (chunked
        transfer encoding; to an HTTP/1.0 client as is, ending with the close);
        the iterator is closed however this ends (a client gone mid-stream
        included)."""
        chunked = version == "1.1"
        if chunked:
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        send = self.stream.send_all
        try:
            await send(self.server.response_head(status, headers))
            if self._request_method == b"HEAD":
                return
            async for chunk in chunks:
                if chunk:
                    await send(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if chunked:
                await send(b"0\r\n\r\n")
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()

    async def _write(self, pieces: list) -> None:
        """Write pieces in order, joining runs of small ones."""
        small: list = []
        size = 0
        for piece in pieces:
            if len(piece) > _JOIN_LIMIT:
                if small:
                    await self.stream.send_all(b"".join(small))
                    small, size = [], 0
                await self.stream.send_all(piece)
            elif piece:
                small.append(piece)
                size += len(piece)
        if small:
            await self.stream.send_all(b"".join(small))

    async def _cut(self) -> None:
        """The server cut this request (its drain ended at the exit timeout): answer
        503 and close, if the socket takes it within a second."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + 1.0
            try:
                await self._error_response(
                    503,
                    "the server is shutting down: the request was still running at "
                    "the exit timeout (--exit-timeout-secs)",
                )
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def _too_large(self) -> None:
        options = self.server.options
        await self._error_response(
            413,
            f"the request body is larger than the limit of {options.max_request_body} "
            f"bytes ({options.max_request_body_flag})",
        )

    async def _protocol_error(self, exc: _ProtocolError) -> None:
        log.debug("http protocol error", error=exc.message)
        await self._error_response(exc.status, exc.message)

    async def _error_response(self, status: int, message: str) -> None:
        """Answer with a JSON error and close, if nothing was answered yet."""
        if self._answered:
            return
        self._answered = True
        shape = self.server.options.error_body
        if shape is not None:
            body = shape(status, message)
        else:
            body = json.dumps({"error": message}, separators=(",", ":")).encode()
        head = self.server.response_head(
            status, [_JSON, (b"content-length", b"%d" % len(body)), _CLOSE]
        )
        await self.stream.send_all(head if self._request_method == b"HEAD" else head + body)

    # -- closing ---------------------------------------------------------------

    async def _close(self) -> None:
        """Close the socket, whatever happens (cancellation included)."""
        stream = self.stream
        try:
            if not self._eof and not self._quiet:
                # Half-close and give the client a moment to close its side, so that
                # request bytes we did not read do not turn our close into a reset.
                with trio.move_on_after(self.server.options.linger):
                    try:
                        await stream.send_eof()
                        while await stream.receive_some(65536):
                            pass
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
        finally:
            await stream.aclose()


def _refusal(request: _Request) -> tuple[int, str] | None:
    """(status, message) for a request that the parser takes but we must not
    serve: an HTTP version other than 1.0 / 1.1 (llhttp takes 0.9 and 2.0)."""
    if request.version not in ("1.1", "1.0"):
        return 505, f"HTTP version {request.version} is not supported; use HTTP/1.1"
    return None


def _parser_error(exc: httptools.HttpParserError) -> _ProtocolError:
    """The answer to a request the parser refused: 505 for an HTTP version it does
    not know (HTTP/9.9), 400 with the parser's words otherwise."""
    reason = str(exc)
    if reason == "Invalid HTTP version":
        return _ProtocolError(505, "the HTTP version is not supported; use HTTP/1.1")
    return _ProtocolError(400, f"bad request: {reason}")


def _raw_error(status: int, message: str) -> bytes:
    """A whole JSON error response that closes the connection (for a connection
    that has no request to answer)."""
    body = json.dumps({"error": message}, separators=(",", ":")).encode()
    reason = {408: b"Request Timeout", 503: b"Service Unavailable"}.get(status, b"Error")
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
    )


def _response_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
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


def _content_length(headers: Headers) -> int:
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return 0
