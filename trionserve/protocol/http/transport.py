"""HTTP/1.1 with h11 on Trio sockets: the connection loop of the HTTP frontend.

h11 parses requests and frames responses; this module only reads and writes the
sockets around it. Each request goes one of two ways:

- a *direct route* (the frontend's ``route(method, path)`` returns a handler): the
  whole body is read, the handler gets the headers and the body and returns
  ``(status, headers, body chunks)``, and the answer is written with as few
  writes as possible. This is the inference path: no ASGI in between.
- everything else goes to an ASGI application through a minimal ASGI adapter
  (HTTP scopes and the lifespan protocol, which is all quart-trio needs).

What it guarantees:

- One task per connection; requests on a connection are served one after
  another (pipelined requests wait in h11's buffer until their turn).
- ``Expect: 100-continue`` is answered when the body is about to be read; chunked
  request bodies are accepted; a body larger than ``max_request_body`` (no limit
  by default) is answered with 413 and the connection closed.
- Malformed requests get h11's suggested status (400, 431, ...) with a JSON error.
- A client that resets or drops its connection ends that connection only: Trio
  raises resets inside nurseries as ExceptionGroups, hence ``except*``.
- Shutdown (``shutdown`` set: the server sets it once its drain is over, see
  :class:`~trionserve.dataplane.DataPlane`; until then this server serves as
  usual): the listeners close at once (new connections are refused), idle
  keep-alive connections close, requests in flight finish and are answered with
  ``Connection: close``; after ``graceful_timeout`` whatever is left is cancelled.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

import h11
import structlog
import trio

from trionserve.protocol.listeners import open_tcp_listeners

log = structlog.get_logger(__name__)

__all__ = ["DirectHandler", "DirectResponse", "H11Server", "HttpServerOptions", "Router"]

Headers = Sequence[tuple[bytes, bytes]]
# What a direct handler returns: status, response headers, body chunks in order.
DirectResponse = tuple[int, list[tuple[bytes, bytes]], Sequence[bytes | memoryview]]
# A direct handler gets the request headers (lower-case names) and the whole body.
DirectHandler = Callable[[Headers, bytes], Awaitable[DirectResponse]]
# Picks the direct handler of a request, or None for the ASGI application.
Router = Callable[[bytes, str], DirectHandler | None]

# Responses up to this size are joined with their head and written at once;
# larger bodies are written chunk by chunk from their buffers, without joining.
_JOIN_LIMIT = 64 * 1024
_CLOSE = (b"connection", b"close")
# A request handled for longer than this gets a watcher on its socket, so that a
# client hanging up cancels it (shorter ones finish before a watcher would help).
SLOW_REQUEST_SECS = 0.05
_JSON = (b"content-type", b"application/json")
# Response heads kept for reuse (H11Server.response_head); the cache starts over
# when full.
_HEAD_CACHE_SIZE = 256
# accept() errors that mean "out of resources for now", as trio.serve_listeners has.
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


@dataclass(frozen=True, slots=True)
class HttpServerOptions:
    """Settings of the h11 transport."""

    # Largest request body accepted, in bytes; None: no limit.
    max_request_body: int | None = None
    # Largest request head (request line and headers) h11 buffers.
    max_header_size: int = 1024 * 1024
    # An idle keep-alive connection is closed after this many seconds.
    keep_alive_timeout: float = 3600.0
    # Bytes asked of the socket per read.
    receive_size: int = 256 * 1024
    backlog: int = 1024
    # Bind with SO_REUSEPORT: worker processes share the port (--workers).
    reuse_port: bool = False
    # How long a closing connection waits for the client to close its side, so
    # that unread request bytes do not turn our close into a reset.
    linger: float = 1.0


class _PeerGone(Exception):
    """The client closed its side in the middle of a request."""


class _BodyTooLarge(Exception):
    """The request body passed ``max_request_body``."""


class H11Server:
    """Serves HTTP/1.1 on one address: direct routes first, then the ASGI app.

    ``serve`` runs the app's lifespan startup, listens, reports the bound (host,
    port) pairs to ``task_status`` and serves until ``shutdown`` is set; then it
    drains (see the module docstring) and runs the lifespan shutdown.
    Connections are children of its nursery.
    """

    def __init__(self, app, router: Router, options: HttpServerOptions | None = None) -> None:
        self.app = app
        self.router = router
        self.options = options or HttpServerOptions()
        self.draining = False
        # Connections waiting for their next request: closed when draining starts.
        self._idle: set[_Connection] = set()
        # Connections handling a request, and when it started.
        self._handling: dict[_Connection, float] = {}
        self._heads: dict[tuple, h11.Response] = {}

    async def serve(
        self,
        address: str,
        port: int,
        shutdown: trio.Event,
        graceful_timeout: float,
        *,
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await open_tcp_listeners(
            port,
            host=address or None,
            backlog=self.options.backlog,
            reuse_port=self.options.reuse_port,
        )
        bound = [listener.socket.getsockname()[:2] for listener in listeners]
        async with trio.open_nursery() as nursery:
            lifespan = _Lifespan(self.app)
            await nursery.start(lifespan.run)
            nursery.start_soon(self._watch_slow_requests, nursery)
            async with trio.open_nursery() as connections:
                accepting = trio.CancelScope()
                for listener in listeners:
                    connections.start_soon(self._accept, listener, accepting, connections)
                task_status.started(bound)
                await shutdown.wait()
                accepting.cancel()
                for listener in listeners:
                    await listener.aclose()
                self._drain()
                connections.cancel_scope.deadline = trio.current_time() + graceful_timeout
            with trio.move_on_after(graceful_timeout):
                await lifespan.shutdown()
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

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> h11.Response:
        """The h11 Response event of this status and these headers. h11 validates
        every header of a new event, and most answers repeat an earlier one's head
        (one model's answers have the same types and lengths): events are
        immutable, so they are built once and reused."""
        key = (status, *headers)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= _HEAD_CACHE_SIZE:
                self._heads.clear()
            head = self._heads[key] = h11.Response(status_code=status, headers=headers)
        return head

    def _drain(self) -> None:
        self.draining = True
        for connection in list(self._idle):
            connection.stop_waiting()

    async def _accept(
        self, listener: trio.SocketListener, scope: trio.CancelScope, nursery: trio.Nursery
    ) -> None:
        with scope:
            while True:
                try:
                    stream = await listener.accept()
                except trio.ClosedResourceError:
                    return
                except OSError as exc:
                    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                        raise
                    log.error("http accept failed; retrying", error=str(exc))
                    await trio.sleep(0.1)
                    continue
                nursery.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        connection = _Connection(self, stream)
        try:
            await connection.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as group:
            log.debug("http connection lost", error=repr(group))
        except* Exception:
            log.exception("http connection failed")


class _Connection:
    """One client connection: owns its socket and its h11 state machine."""

    __slots__ = (
        "server", "stream", "h11", "_idle_scope", "_addresses", "_request_method",
        "_handling", "_watch",
    )

    def __init__(self, server: H11Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=server.options.max_header_size
        )
        self._idle_scope: trio.CancelScope | None = None
        self._addresses: tuple | None = None
        self._request_method = b""
        # The request being handled, and the watcher of a slow one's socket.
        self._handling: trio.CancelScope | None = None
        self._watch: tuple[trio.CancelScope, trio.Event] | None = None

    async def run(self) -> None:
        conn = self.h11
        try:
            while True:
                event = await self._next_event(idle=True)
                if type(event) is not h11.Request:
                    return  # closed by the client, idle timeout, or draining
                await self._serve(event)
                if conn.our_state is not h11.DONE:
                    return  # Connection: close, or a response that could not finish
                if conn.their_state is h11.SEND_BODY:
                    await self._discard_body()
                if conn.their_state is not h11.DONE or self.server.draining:
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            await self._protocol_error(exc)
        except _PeerGone:
            pass
        finally:
            await self._close()

    def stop_waiting(self) -> None:
        """Stop waiting for the next request (the server is draining)."""
        if self._idle_scope is not None:
            self._idle_scope.cancel()

    # -- reading -------------------------------------------------------------

    async def _next_event(self, idle: bool = False):
        """The next h11 event, reading as needed. With ``idle`` (between requests)
        the wait ends with None on draining or the keep-alive timeout."""
        conn = self.h11
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            if idle:
                data = await self._receive_idle()
                if data is None:
                    return None
            else:
                data = await self.stream.receive_some(self.server.options.receive_size)
            conn.receive_data(data)

    async def _receive_idle(self) -> bytes | None:
        server = self.server
        if server.draining:
            return None
        with trio.move_on_after(server.options.keep_alive_timeout) as scope:
            self._idle_scope = scope
            server._idle.add(self)
            try:
                return await self.stream.receive_some(server.options.receive_size)
            finally:
                server._idle.discard(self)
                self._idle_scope = None
        return None

    async def _read_body(self, request: h11.Request) -> bytes:
        """The whole request body; raises _BodyTooLarge past the limit."""
        limit = self.server.options.max_request_body
        if self.h11.they_are_waiting_for_100_continue:
            await self._continue()
        parts = []
        size = 0
        while True:
            event = await self._next_event()
            kind = type(event)
            if kind is h11.Data:
                parts.append(event.data)
                size += len(event.data)
                if limit is not None and size > limit:
                    raise _BodyTooLarge
            elif kind is h11.EndOfMessage:
                break
            else:
                raise _PeerGone
        if len(parts) == 1:
            return bytes(parts[0])
        return b"".join(parts)

    async def _discard_body(self) -> None:
        """Read the rest of a body the handler did not want, to keep the
        connection usable for the next request."""
        while True:
            kind = type(await self._next_event())
            if kind is h11.EndOfMessage:
                return
            if kind is not h11.Data:
                raise _PeerGone

    async def _continue(self) -> None:
        await self.stream.send_all(
            self.h11.send(h11.InformationalResponse(status_code=100, headers=[]))
        )

    # -- serving ---------------------------------------------------------------

    async def _serve(self, request: h11.Request) -> None:
        self._request_method = request.method
        target = request.target
        raw_path, _, query = target.partition(b"?")
        # h11 accepts only visible ASCII in the target.
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        handler = self.server.router(request.method, path)
        limit = self.server.options.max_request_body
        try:
            if limit is not None and _content_length(request.headers) > limit:
                raise _BodyTooLarge
            if handler is None:
                await self._asgi(request, path, raw_path, query)
                return
            body = await self._read_body(request)
            status, headers, chunks = await self._run_handler(handler, request.headers, body)
        except _BodyTooLarge:
            await self._too_large()
            return
        await self.respond(status, headers, chunks)

    async def _run_handler(self, handler, headers, body: bytes):
        """The handler's answer. A client that hangs up meanwhile cancels it, so
        its request leaves the queue (or its result is dropped), as DESIGN §3
        says: requests still running after ``SLOW_REQUEST_SECS`` get a watcher on
        their socket (see :meth:`H11Server._watch_slow_requests`); fast ones pay
        nothing for it."""
        server = self.server
        handling = self._handling = trio.CancelScope()
        server._handling[self] = trio.current_time()
        try:
            with handling:
                answer = await handler(headers, body)
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
        kept for h11 and end the watch."""
        try:
            with scope:
                try:
                    data = await self.stream.receive_some(self.server.options.receive_size)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                self.h11.receive_data(data)
                if not data and self._handling is not None:
                    self._handling.cancel()
        finally:
            done.set()

    async def respond(
        self, status: int, headers: list[tuple[bytes, bytes]], chunks: Sequence[bytes | memoryview]
    ) -> None:
        """Write one whole response (headers must carry its content-length)."""
        conn = self.h11
        if self.server.draining:
            headers.append(_CLOSE)
        out = [conn.send(self.server.response_head(status, headers))]
        if self._request_method != b"HEAD":
            size = 0
            for chunk in chunks:
                size += len(chunk)
            if size <= _JOIN_LIMIT:
                if size:
                    out.extend(conn.send_with_data_passthrough(h11.Data(data=b"".join(chunks))))
                out.append(conn.send(h11.EndOfMessage()))
                await self.stream.send_all(b"".join(out))
                return
            for chunk in chunks:
                if len(chunk):
                    out.extend(conn.send_with_data_passthrough(h11.Data(data=chunk)))
        out.append(conn.send(h11.EndOfMessage()))
        await self._write(out)

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

    async def _too_large(self) -> None:
        limit = self.server.options.max_request_body
        await self._error_response(
            413, f"the request body is larger than the limit of {limit} bytes"
        )

    async def _protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        log.debug("http protocol error", error=str(exc))
        await self._error_response(exc.error_status_hint, f"bad request: {exc}")

    async def _error_response(self, status: int, message: str) -> None:
        """Answer with a JSON error and close, if nothing was answered yet."""
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = json.dumps({"error": message}, separators=(",", ":")).encode()
        headers = [_JSON, (b"content-length", str(len(body)).encode()), _CLOSE]
        try:
            head = self.h11.send(h11.Response(status_code=status, headers=headers))
            data = self.h11.send(h11.Data(data=body)) if self._request_method != b"HEAD" else b""
            tail = self.h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        await self.stream.send_all(head + data + tail)

    # -- ASGI ------------------------------------------------------------------

    async def _asgi(self, request: h11.Request, path: str, raw_path: bytes, query: bytes) -> None:
        exchange = _AsgiExchange(self, request)
        if self._addresses is None:
            self._addresses = _addresses(self.stream)
        client, server = self._addresses
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": client,
            "server": server,
            "extensions": {},
        }
        too_large = False
        try:
            await self.server.app(scope, exchange.receive, exchange.send)
        except* _BodyTooLarge:
            too_large = True
        except* h11.RemoteProtocolError as group:
            raise _first(group) from None
        except* (trio.BrokenResourceError, trio.ClosedResourceError, _PeerGone):
            raise _PeerGone from None
        except* Exception:
            log.exception("http application failed", method=scope["method"], path=path)
        if too_large and not exchange.started:
            raise _BodyTooLarge
        if not exchange.started:
            # The application ended without answering: an internal error.
            await self.respond(500, [(b"content-length", b"0")], ())
        # A response started but not finished leaves h11 in SEND_BODY: the
        # connection loop closes the connection.

    # -- closing ---------------------------------------------------------------

    async def _close(self) -> None:
        stream = self.stream
        if self.h11.their_state not in (h11.CLOSED, h11.ERROR):
            # Half-close and give the client a moment to close its side, so that
            # request bytes we did not read do not turn our close into a reset.
            with trio.move_on_after(self.server.options.linger):
                try:
                    await stream.send_eof()
                    while await stream.receive_some(65536):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
        await stream.aclose()


class _AsgiExchange:
    """The ASGI ``receive`` and ``send`` of one request on one connection."""

    __slots__ = (
        "conn",
        "request",
        "started",
        "_status",
        "_headers",
        "_pending",
        "_body_done",
        "_received",
        "_streamed",
    )

    def __init__(self, conn: _Connection, request: h11.Request) -> None:
        self.conn = conn
        self.request = request
        self.started = False
        self._status = 200
        self._headers: list = []
        self._pending: list = []
        self._body_done = False
        self._received = 0
        # A response without Content-Length is a stream (server-sent events):
        # each piece is written as it comes instead of being joined with the next.
        self._streamed = False

    async def receive(self) -> dict:
        if self._body_done:
            # Nothing more comes from the client until the response is sent;
            # the application cancels this wait once it has answered.
            await trio.sleep_forever()
        conn = self.conn
        h11conn = conn.h11
        if h11conn.their_state is not h11.SEND_BODY:
            self._body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if h11conn.they_are_waiting_for_100_continue:
            await conn._continue()
        event = await conn._next_event()
        kind = type(event)
        if kind is h11.Data:
            limit = conn.server.options.max_request_body
            self._received += len(event.data)
            if limit is not None and self._received > limit:
                raise _BodyTooLarge
            return {"type": "http.request", "body": bytes(event.data), "more_body": True}
        if kind is h11.EndOfMessage:
            self._body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        kind = message["type"]
        conn = self.conn
        if kind == "http.response.start":
            self._status = message["status"]
            self._headers = list(message.get("headers", ()))
            self._streamed = not any(k.lower() == b"content-length" for k, _ in self._headers)
            return
        if kind != "http.response.body":
            return
        h11conn = conn.h11
        pending = self._pending
        if not self.started:
            headers = self._headers
            if conn.server.draining:
                headers.append(_CLOSE)
            pending.append(h11conn.send(h11.Response(status_code=self._status, headers=headers)))
            self.started = True
        body = message.get("body", b"")
        if body and conn._request_method != b"HEAD":
            pending.extend(h11conn.send_with_data_passthrough(h11.Data(data=body)))
        more = message.get("more_body", False)
        if not more:
            pending.append(h11conn.send(h11.EndOfMessage()))
        if not more or self._streamed or sum(len(p) for p in pending) > _JOIN_LIMIT:
            self._pending = []
            await conn._write(pending)


class _Lifespan:
    """Runs the ASGI application's lifespan protocol (startup, then shutdown)."""

    def __init__(self, app) -> None:
        self.app = app
        self._to_app, self._app_inbox = trio.open_memory_channel[dict](1)
        self._from_app, self._replies = trio.open_memory_channel[dict](1)
        self._supported = True

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._app)
            await self._to_app.send({"type": "lifespan.startup"})
            reply = await self._replies.receive()
            if reply["type"] == "lifespan.startup.failed":
                raise RuntimeError(f"HTTP application failed to start: {reply.get('message')}")
            task_status.started()

    async def _app(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            await self.app(scope, self._app_inbox.receive, self._from_app.send)
        except* Exception:
            # An application without lifespan support: serve without it.
            log.debug("http application has no lifespan support")
            self._supported = False
            await self._from_app.send({"type": "lifespan.unsupported"})

    async def shutdown(self) -> None:
        if not self._supported:
            return
        await self._to_app.send({"type": "lifespan.shutdown"})
        await self._replies.receive()


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a (possibly nested) exception group."""
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def _content_length(headers: Headers) -> int:
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return 0


def _addresses(stream: trio.SocketStream) -> tuple:
    """The (client, server) addresses of an ASGI scope."""
    try:
        client = tuple(stream.socket.getpeername()[:2])
        server = tuple(stream.socket.getsockname()[:2])
    except (OSError, AttributeError):
        return None, None
    return client, server
