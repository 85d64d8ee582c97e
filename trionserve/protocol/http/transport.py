"""HTTP/1.1 on Trio streams: the connection loop of the HTTP frontend.

The protocol is :class:`~trionserve.protocol.http.h1.H1Connection` (sans-I/O: httptools parses,
each side's state moves by a table); this module only moves bytes between it and the socket, keeps
the deadlines and runs the handlers. Every request goes to the handler that the router
(``router(method, path)``) picks: the whole body is read, the handler gets the headers and the body
and returns ``(status, headers, body)``, and the answer is written with as few writes as possible.
The body is a sequence of chunks (the headers carry its content-length), or an async iterator of
chunks, written as they come with chunked transfer encoding (server-sent events). A router that
returns None gets a 404 with a JSON error.

A request starts with a read of ``head_receive_size`` (16 KB); the rest of a body of declared
length is read from the socket straight into the buffer the protocol allocated for it (``readv``,
never past its end: a pipelined request after it stays in the socket), with one wake-up for all of
it where the kernel allows (``SO_RCVLOWAT``, see :mod:`trionserve.protocol.sockets`); the handler
gets a writable memoryview of it, so binary tensors are numpy views that no backend needs to copy.
A keep-alive request whose bytes came as its answer was written (by the instance's thread) is read
at once, and one that repeats the connection's last head (``LastHead``) in one ``readv`` with its
body, straight into the body's buffer. A large answer is written gathered from its pieces' own
buffers (``writev`` of the head and the tensors' views).

What it guarantees:

- One task per connection; requests on a connection are served one after another (pipelined
  requests wait, parsed, until their turn).
- No client holds connections it does not use: a request head must be whole within
  ``header_timeout``, and a body must not pause for longer (408); an idle keep-alive connection
  closes after ``keep_alive_timeout``, and at ``max_connections`` the one idle the longest is
  closed to make room for a new connection (503 only when none is idle).
- ``Expect: 100-continue`` is answered when the body is about to be read; a body larger than
  ``max_request_body`` (no limit by default) is answered with 413 (or ``body_refusal``'s answer:
  the KServe port's are Triton's) and the connection closed; what the protocol refuses is answered
  with its JSON error and the connection closed (see :mod:`~trionserve.protocol.http.h1`); a
  handler that raises gets a JSON 500 (and its connection closed), logged.
- A client that resets or drops its connection ends that connection only: Trio raises resets inside
  nurseries as ExceptionGroups, hence ``except*``. A client that hangs up while its request is
  handled for longer than ``SLOW_REQUEST_SECS`` cancels it.
- Large bodies count in the server's budget of bytes held for clients (``options.budget``,
  :mod:`~trionserve.core.client_budget`): a request body of declared length over 64 KB from its
  head until its answer is written (a body that would take the budget past its limit is answered
  503 naming ``--client-buffer-limit`` before it is read, and the connection closed), an answer
  over 64 KB and each stream chunk over 64 KB while it is written. A write waiting for its client
  is one of the budget's holders: the pressure policy ends the connection of one stalled past
  ``--client-buffer-stall-secs``.
- Shutdown (``shutdown`` set: the server sets it once its drain is over, see
  :class:`~trionserve.dataplane.DataPlane`; until then this server serves as usual): the listeners
  close at once (new connections are refused), idle keep-alive connections close, requests in
  flight finish and are answered with ``Connection: close``; after ``graceful_timeout`` whatever is
  left is cancelled, and a request cut while its handler runs is answered 503
  (``Connection: close``) if its socket takes the answer within a second.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

import structlog
import trio

from trionserve.observability.logging import SETTINGS as LOG_SETTINGS
from trionserve.observability.trace.frontend import HTTP_STAMPS, FrontendStamps
from trionserve.protocol.http import answer as answers
from trionserve.protocol.http import later
from trionserve.protocol.http.body import read_body
from trionserve.protocol.http.h1 import (
    CLOSE,
    INTERNAL_ERROR,
    Body,
    H1Connection,
    Handler,
    HeadCache,
    Headers,
    HttpServerOptions,
    LastHead,
    PeerGone,
    ProtocolError,
    Request,
    RequestBody,
    Response,
    Router,
    json_error,
)
from trionserve.protocol.http.h1_request import request_stamps
from trionserve.protocol.http.state import Client
from trionserve.protocol.http.streamed import JOIN_LIMIT, send_streamed
from trionserve.protocol.listeners import Acceptor, open_tcp_listeners
from trionserve.protocol.sockets import (
    HeldWrite,
    readv_now,
    receive_after_wait,
    receive_into,
    receive_some_now,
    send_all,
    send_pieces,
)

log = structlog.get_logger(__name__)

__all__ = [
    "Body",
    "Handler",
    "Headers",
    "HttpServer",
    "HttpServerOptions",
    "RequestBody",
    "Response",
    "Router",
]

# The server's tick, and a request handled this long gets a watcher on its socket so that a client
# hanging up cancels it (each tick wakes the loop cold: ~0.27 ms, README).
SLOW_REQUEST_SECS = 0.25
# How long an error answer may take to write before the connection closes anyway.
_ERROR_WRITE_SECS = 1.0
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class HttpServer:
    """Serves HTTP/1.1 on one address, each request by the handler its router picks.

    ``serve`` listens, reports the bound (host, port) pairs to ``task_status`` and
    serves until ``shutdown`` is set; then it drains (see the module docstring).
    Connections are children of its nursery; ``serve_connection`` serves one
    stream (any ``trio.abc.Stream``: tests serve memory streams).
    """

    def __init__(self, router: Router, options: HttpServerOptions | None = None) -> None:
        self.router = router
        self.options = options or HttpServerOptions()
        self.draining = False
        # Connections waiting for their next request: closed when draining starts.
        self._idle: set[_Connection] = set()
        # Of those, the ones answered and sent nothing since (keep-alive idle), oldest first, and
        # since when: closed to make room at the connection cap, and by watch_slow_requests once
        # idle for keep_alive_timeout.
        self._keep_alive: dict[_Connection, float] = {}
        # Connections handling a request, and when it started.
        self._handling: dict[_Connection, float] = {}
        self.heads = HeadCache()
        # Read into by every connection (chunked bodies, a closing one's last bytes) between awaits.
        self.receive_buffer = memoryview(bytearray(self.options.receive_size))
        self.acceptor = Acceptor(
            "HTTP",
            self.serve_connection,
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
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.watch_slow_requests, nursery)
                await self.acceptor.serve_until(
                    listeners, shutdown, graceful_timeout, self.drain, task_status=task_status
                )
                nursery.cancel_scope.cancel()
        finally:
            answers.sweep()  # the reports of the answers written last (answer.py)

    async def watch_slow_requests(self, nursery: trio.Nursery) -> None:
        """Every ``SLOW_REQUEST_SECS``, give each request handled for longer a watcher on its
        socket, so a client that hangs up cancels it; and close each keep-alive connection idle for
        ``keep_alive_timeout``, at that time. One timer per server instead of one watcher or
        deadline per request keeps fast requests cheap (a deadline moved in and out of Trio's heap
        twice a request costs about half a pass of its run loop)."""
        timeout = self.options.keep_alive_timeout
        next_check = trio.current_time() + SLOW_REQUEST_SECS
        while True:
            # The connection idle the longest comes first (idle since, in order).
            for since in self._keep_alive.values():
                await trio.sleep_until(min(next_check, since + timeout))
                break
            else:  # none idle: one that goes idle now expires after next_check
                await trio.sleep_until(next_check)
            answers.sweep()  # answers the instances' threads wrote (see answer.py)
            now = trio.current_time()
            for connection, since in list(self._keep_alive.items()):
                if since + timeout > now:
                    break
                del self._keep_alive[connection]
                connection.stop_waiting()
            if now < next_check:
                continue
            next_check = now + SLOW_REQUEST_SECS
            cutoff = now - SLOW_REQUEST_SECS
            for connection, started in list(self._handling.items()):
                answer = connection.answer  # (one waiting on its socket watches itself)
                if started <= cutoff and connection.watch is None and not answers.waits(answer):
                    connection.watch_peer(nursery)

    def _close_oldest_idle(self) -> bool:
        """Close the connection idle the longest between requests (to make room at the cap); False
        when none is."""
        for connection in self._keep_alive:
            del self._keep_alive[connection]
            connection.stop_waiting()
            return True
        return False

    def drain(self) -> None:
        """Serve no more requests: idle connections close, requests in flight are answered with
        ``Connection: close``."""
        self.draining = True
        answers.sweep()  # (the waits of answers the threads wrote end: answer.py)
        for connection in list(self._idle):
            connection.stop_waiting()

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """Answer 503 on a connection past the cap and close it, without reading it (bounded: a
        client that does not read cannot hold the accept loop)."""
        cap = self.options.max_connections
        answer = json_error(
            503,
            f"too many connections: {cap} open, the limit of --http-max-connections; "
            "try again later",
        )
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(answer)
                await stream.send_eof()
            except _GONE:
                pass
        await stream.aclose()

    def serve_connection(self, stream: trio.abc.HalfCloseableStream) -> Awaitable[None]:
        """Serve one connection until it closes; closes ``stream`` (the connection's own
        coroutine: no frame of this one to resume at each of its waits)."""
        return _Connection(self, stream).serve()


class _Connection:
    """The Trio side of one client connection: reads bytes into its protocol
    (``h1``), writes what it answers, keeps the deadlines, runs the handlers."""

    __slots__ = (
        "_ended",
        "_handling",
        "_idle_scope",
        "_now",
        "answer",
        "_quiet",
        "_route",
        "_scope",
        "h1",
        "server",
        "stream",
        "watch",
    )

    def __init__(self, server: HttpServer, stream: trio.abc.HalfCloseableStream) -> None:
        self.server = server
        self.stream = stream
        self.h1 = H1Connection(server.options, server.heads)
        # Written by the instance's thread where it can (a plain socket, see answer.py).
        self.answer = answers.ConnectionAnswer.of(self.h1, stream, lambda: server.draining)
        # The connection's scope, for its whole life (no scope per request): cancelled to end it,
        # by the keep-alive timeout, the drain or the connection cap while it waits for the next
        # request (through _idle_scope), or by a slow request's watcher when the client hangs up.
        self._scope = trio.CancelScope()
        # The handler the router gave for the requests made from a last head (h1.keepable).
        # (and whether it may leave a body's binary tensors to the instance's thread: later.py).
        self._route: tuple[LastHead, Handler, bool] | None = None
        # Whether _scope was cancelled (a plain flag: the scope's cancel_called is 4 calls).
        self._ended = False
        # The scope to cancel to stop waiting for the next request (while waiting).
        self._idle_scope: trio.CancelScope | None = None
        # Ended while keep-alive idle: nothing unread, closed without linger.
        self._quiet = False
        # Whether a request is being handled, and the watcher of a slow one's socket.
        self._handling = False
        self.watch: tuple[trio.CancelScope, trio.Event] | None = None
        # trio.current_time of the run's clock, without its two wrappers' calls.
        self._now = trio.lowlevel.current_clock().current_time

    async def serve(self) -> None:
        """Serve the connection until it closes; a client gone is logged, not raised (one
        frame: each frame on the stack is resumed at every wait)."""
        h1 = self.h1
        answers.CONNECTION_ANSWER.set(self.answer)  # this task's (the infer handler arms it)
        try:
            try:
                with self._scope:
                    while True:
                        request = self._ready() or await self._next_request()
                        if request is None:
                            return  # closed by the client, idle timeout, or draining
                        if not await self._serve(request) or self.server.draining:
                            return
            except ProtocolError as exc:
                if exc.status and h1.answerable:
                    log.debug("http protocol error", error=exc.message)
                    await self._send_error(exc.status, exc.message)
            except PeerGone:
                pass
            finally:
                h1.closed()
                await self._close()
        except* _GONE as group:
            log.debug("http connection lost", error=repr(group))
        except* Exception:
            log.exception("http connection failed")

    def stop_waiting(self) -> None:  # (between requests: the drain, the cap, the timeout)
        scope = self._idle_scope
        if scope is not None:
            if scope is self._scope:
                self._ended = True
            scope.cancel()

    def cancel(self) -> None:
        """End the connection (a slow request's client gone, a stalled write evicted)."""
        self._ended = True
        self._scope.cancel()

    # -- reading -------------------------------------------------------------

    async def _next_request(self) -> Request | None:
        """The next request whose head is whole, or None on the client closing, draining or the
        keep-alive timeout. The head must be whole within ``header_timeout`` of the connection
        opening (first request) or of its first byte (later ones): 408 otherwise. Raises what the
        protocol refused."""
        h1 = self.h1
        server = self.server
        await answers.collect(self.answer, self.stream)  # (a thread's write settled in progress)
        timeout = server.options.header_timeout
        deadline = None if h1.served else self._now() + timeout
        while True:
            if h1.requests:  # (none waiting: nothing to take, the common case)
                request = h1.next_request()
                if request is not None:
                    return request
            elif h1.refusal is not None:
                raise h1.refusal
            if h1.state.client is Client.CLOSED:
                return None
            if deadline is None and h1.head_begun:
                deadline = self._now() + timeout
            if server.draining:
                data = None
            elif deadline is None:  # answered, nothing of the next request yet
                if self._receive_ready():
                    continue
                data = await self._receive_keep_alive()
            else:
                data = await self._receive_head(deadline)
            if data is None:
                if deadline is not None and self._now() >= deadline:
                    late = f"the request head did not arrive within {timeout:g} s"
                    raise ProtocolError(408, late + " (--http-header-timeout)")
                return None
            h1.receive_data(data)

    async def _receive_head(self, deadline: float) -> bytes | bytearray | None:
        """Bytes of a request head yet to be whole (or a connection's first); None when ``deadline``
        or the keep-alive timeout passes, or the drain begins."""
        server = self.server
        until = min(self._now() + server.options.keep_alive_timeout, deadline)
        with trio.move_on_at(until) as scope:
            self._idle_scope = scope
            server._idle.add(self)
            try:
                return await self.stream.receive_some(server.options.head_receive_size)
            finally:
                server._idle.discard(self)
                self._idle_scope = None
        return None

    def _ready(self) -> Request | None:
        """The next request, taken, when the bytes its answer's wait saw come are the whole
        request the connection's last head makes (one ``readv``, no parser, one step:
        :meth:`H1Connection.take_again`); None: :meth:`_next_request` (it reads what this read,
        or, if nothing, the bytes the wait saw)."""
        answer = self.answer
        if answer is None or not answer.readable or self._ended or self.server.draining:
            return None
        h1 = self.h1
        buffers = h1.again_buffers()
        if buffers is None:
            return None
        answer.readable = False  # (seen once)
        route = self._route
        if route is not None and route[2] and route[0].scratch is buffers[0]:
            # (an infer request's binary tensors may be left to the instance's thread: later.py)
            received = later.read_again(answer.later, h1, route[0], *buffers)
        else:
            received = readv_now(answer.socket, buffers)  # (a socket of its own: an answer)
        return None if received is None else h1.take_again(received, *buffers)

    def _receive_ready(self) -> bool:
        """Whether the bytes its answer's wait saw come were read, at once (no wait: no idle
        bookkeeping; a request that repeats the last head was read by :meth:`_ready`)."""
        answer = self.answer
        if answer is None or not answer.readable or self._ended:
            return False
        answer.readable = False  # (seen once)
        data = receive_some_now(self.stream, self.server.options.head_receive_size)
        if data is not None:
            self.h1.receive_data(data)
        return data is not None

    async def _receive_keep_alive(self) -> bytes | bytearray | None:
        """The next request's first bytes on a connection that answered one, waited for under the
        connection's own scope, which the keep-alive timeout (watch_slow_requests), the drain or the
        connection cap cancels, ending the connection quietly (bytes that came in the same instant
        go unread with it: None)."""
        server = self.server
        scope = self._scope
        self._idle_scope = scope
        server._idle.add(self)
        server._keep_alive[self] = self._now()
        try:
            # The client sends it once it has read the answer: wait, then read.
            data = await receive_after_wait(self.stream, server.options.head_receive_size)
        finally:
            self._idle_scope = None
            server._idle.discard(self)
            server._keep_alive.pop(self, None)
            self._quiet = scope.cancel_called
        return None if self._quiet else data

    # -- serving ---------------------------------------------------------------

    async def _serve(self, request: Request) -> bool:
        """Answer one request (taken by the protocol); whether the connection is kept for the next.
        The handler runs here (no frame of its own to enter, and to resume at each wait). A client
        that hangs up meanwhile cancels it, so its request leaves the queue (or its result is
        dropped), as DESIGN §3 says: requests running after ``SLOW_REQUEST_SECS`` get a watcher on
        their socket (:meth:`HttpServer.watch_slow_requests`); fast ones pay nothing."""
        h1 = self.h1
        server = self.server
        route = self._route
        if route is not None and request.last is route[0] and not LOG_SETTINGS.log_verbose_level:
            handler = route[1]  # (the request's head is the one its route was kept for)
        else:
            path = h1.path(request)
            routed = server.router(request.method, path)
            if routed is None:
                await self._send_error(404, f"Not Found: {request.method.decode()} {path}")
                return False
            handler = routed
            if request.last is not None and getattr(handler, "keepable", False):
                leaves = getattr(handler, "later", False) and later.deferrable(request.last)
                self._route = (request.last, handler, leaves)
        # A large body counts in the budget of bytes held for clients from its head to its answer (a
        # small one pays one comparison).
        counted = request.length if request.length > JOIN_LIMIT else 0
        budget = server.options.budget if counted else None
        if budget is not None:
            if budget.held + counted > budget.limit:  # (budget.has_room: counted is over 1)
                raise ProtocolError(503, budget.refusal("a request body", counted))
            budget.reserve(counted)
        stamps: FrontendStamps | None = None
        try:
            # (a body that came with its head has no deadline to keep)
            if not request.complete:
                body = await read_body(
                    self.stream, h1, request, server.options.header_timeout, server.receive_buffer
                )
            elif request.buffer is not None:  # (h1.body's first case)
                body = request.buffer
            else:
                body = h1.body(request)
            if request.began:  # tracing is on: timed as Triton's HTTP frontend times it
                stamps = request_stamps(request)
            self._handling = True
            server._handling[self] = self._now()
            try:
                try:
                    status, headers, chunks = await handler(request.headers, body)
                    answer = self.answer
                    if chunks is answers.BEGUN_BODY and answer is not None:  # (answers.Carrier)
                        carrier, run, answer.carrier, answer.run = (
                            answer.carrier,
                            answer.run,
                            None,
                            None,
                        )
                        assert carrier is not None and run is not None
                        try:
                            if not run.request.done:
                                await answer.wait()  # (in this frame: the handler's ended)
                        except Exception as exc:
                            status, headers, chunks = carrier.failed(answer, run, exc)
                        except BaseException:
                            carrier.drop(answer, run)
                            raise
                        else:
                            binary = answer.run_binary_output
                            status, headers, chunks = (
                                carrier.carry_on(answer, run, binary)
                                if run.request.done
                                else await carrier.finish(answer, run, binary)
                            )
                except Exception:  # a handler bug: this request fails, the server goes on
                    log.exception("http handler failed")
                    status, headers, chunks = INTERNAL_ERROR
                finally:
                    del server._handling[self]
                    self._handling = False
                    if self.watch is not None:
                        await self._unwatch()
            except trio.Cancelled:
                if not self._scope.cancel_called:  # the client hung up: nobody to answer
                    await self._cut()
                raise
            rest = self.answer.later if self.answer is not None else None
            if rest is not None:  # (binary tensors left to the thread: later.py)
                if rest.view is not None:
                    rest.settle()  # not read by the thread: read now (none left unread)
                if rest.broken is not None:  # a read failed: the request's error, then the close
                    headers = [*headers, CLOSE]
            if chunks is answers.ANSWERED_BODY and answer is not None:  # the thread wrote it
                return answer.kept if answer.rest is None else await answer.finish(self.stream)
            if self.answer is not None and self.answer.owing:  # (answer.py: an earlier thread's
                await self.answer.collect(self.stream)  # write settled in progress)
            if stamps is None or isinstance(chunks, AsyncIterator):  # (a pair per chunk: _stream)
                return await self.respond(status, headers, chunks)
            stamps.stamp("HTTP_SEND_START")
            kept = await self.respond(status, headers, chunks)
            stamps.stamp("HTTP_SEND_END")
            return kept
        finally:
            if self.answer is not None and self.answer.later.view is not None:
                self.answer.later.settle()  # (cancelled: read before the socket is read or closed)
            if stamps is not None:
                HTTP_STAMPS.set(None)
                stamps.release()
            if budget is not None:
                budget.release(counted)

    async def _unwatch(self) -> None:
        """End the watcher of a slow request's socket: the socket is ours again."""
        watch, self.watch = self.watch, None
        if self.answer is not None:
            self.answer.watched = False
        if watch is not None:
            scope, done = watch
            scope.cancel()
            with trio.CancelScope(shield=True):
                await done.wait()

    def watch_peer(self, nursery: trio.Nursery) -> None:
        """Start watching the socket while a slow request is handled."""
        watch = (trio.CancelScope(), trio.Event())
        self.watch = watch
        if self.answer is not None:
            self.answer.watched = True  # (its wait leaves the socket to the watcher)
        nursery.start_soon(self._watch_peer, *watch)

    async def _watch_peer(self, scope: trio.CancelScope, done: trio.Event) -> None:
        """End of stream (or a reset) cancels the handling; pipelined bytes are parsed (their
        requests wait their turn) and end the watch."""
        try:
            with scope:
                body = self.answer.later if self.answer is not None else None
                if body is not None and body.pending:  # (its tensors unread: they stay there)
                    await trio.lowlevel.wait_readable(body.socket)  # (the rest does not wake it)
                    if body.pending:  # the client's end, or bytes after the rest (left there)
                        if self._handling and later.hung_up(body.socket):
                            self.cancel()
                        return
                try:
                    data = await self.stream.receive_some(self.server.options.receive_size)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                self.h1.receive_data(data)
                if not data and self._handling:
                    self.cancel()  # the connection ends with the request
        finally:
            done.set()

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], chunks: Body) -> bool:
        """Write one whole response (headers must carry its content-length), or stream one whose
        body is an async iterator; whether the connection is kept for the next request."""
        h1 = self.h1
        if isinstance(chunks, AsyncIterator):
            await send_streamed(
                h1, self.stream, self.server.draining, self._held, status, headers, chunks
            )
            return h1.end_response()
        head = h1.start_response(status, headers, self.server.draining, streamed=False)
        # A small answer is written without a checkpoint when the socket takes it at once: reading
        # the next request is the connection's next one.
        if h1.head_only:
            await send_all(self.stream, head)
        else:
            size = 0
            for chunk in chunks:
                size += len(chunk)
            if size <= JOIN_LIMIT:
                await send_all(self.stream, head + b"".join(chunks) if size else head)
            else:  # gathered from the tensors' own buffers, without a join
                await self._held(size, send_pieces(self.stream, [head, *chunks]))
        return h1.end_response()

    async def _held(self, size: int, write: Awaitable[None]) -> None:
        """Run ``write`` of ``size`` bytes counted in the budget as held for the client, the write
        one of the budget's holders meanwhile."""
        budget = self.server.options.budget
        if budget is None:
            await write
            return
        holder = HeldWrite(size, self)
        budget.reserve(size)
        budget.hold(holder)
        try:
            await write
        finally:
            budget.let_go(holder)
            budget.release(size)

    async def _cut(self) -> None:
        """The server cut this request (its drain ended at the exit timeout): answer 503 and close,
        if the socket takes it within a second."""
        with trio.CancelScope(shield=True):
            await self._send_error(
                503,
                "the server is shutting down: the request was still running at "
                "the exit timeout (--exit-timeout-secs)",
            )

    async def _send_error(self, status: int, message: str) -> None:
        """Answer with a JSON error that closes the connection, if nothing was answered yet; a
        client that does not take it within a second is left."""
        if not self.h1.answerable:
            return
        answer = self.h1.error_response(status, message)
        with trio.move_on_after(_ERROR_WRITE_SECS):
            try:
                await answers.collect(self.answer, self.stream)  # (a thread's write: answer.py)
                await self.stream.send_all(answer)
            except _GONE:
                pass

    # -- closing ---------------------------------------------------------------

    async def _close(self) -> None:
        """Close the stream, whatever happens (cancellation included)."""
        stream = self.stream
        try:
            if self.h1.state.client is not Client.CLOSED and not self._quiet:
                # Half-close and give the client a moment to close its side, so that request bytes
                # we did not read do not turn our close into a reset.
                with trio.move_on_after(self.server.options.linger):
                    try:
                        await stream.send_eof()
                        while await receive_into(stream, self.server.receive_buffer):
                            pass
                    except _GONE:
                        pass
        finally:
            answers.release(self.answer)  # (a thread's write in progress has returned)
            await stream.aclose()
