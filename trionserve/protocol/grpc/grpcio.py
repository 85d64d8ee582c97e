"""The gRPC transport on grpcio's C-core server, behind the same interface as h2's.

grpcio does HTTP/2, framing, flow control, keepalive and compression in C; its
sync server runs each call's Python side in a worker thread. Trio keeps owning
everything else: every call's handler runs as a Trio task in this transport's
nursery, exactly as on the h2 transport (:mod:`~trionserve.protocol.grpc.transport`),
and sees a :class:`GrpcioCall` with the same surface as
:class:`~trionserve.protocol.grpc.connection.GrpcCall`. Messages stay bytes on
both sides, so the service's own codec parses and builds the protobufs.

The hand-offs between the two worlds:

- grpcio's worker thread enters Trio with ``TrioToken.run_sync_soon`` (no task
  spawned per hop) and waits on a lock the call's task releases when the handler
  is done; a unary call costs one hop each way.
- A client-streaming call reads its request messages in a thread of Trio's
  thread cache, which hands each one to the task; a bounded number of messages
  (``STREAM_READ_AHEAD``) may wait there before the reader stops taking more, so
  grpcio's flow control holds the client back.
- Responses of a streaming call go to grpcio's worker thread through a queue; at
  most ``STREAM_WRITE_AHEAD`` may wait there, then ``send`` waits.
- A client that cancels or goes away, and grpcio's own deadline, end the RPC:
  grpcio's termination callback cancels the task's cancel scope. A
  ``grpc-timeout`` is also the scope's deadline, so the handler is cancelled
  and the call answers DEADLINE_EXCEEDED on Trio's clock too.

Shutdown follows the h2 transport's contract: until ``shutdown`` is set
everything is served; then client-streaming calls stop reading (``receive``
returns None, ``call.draining`` is true), grpcio stops taking calls (GOAWAY) and
waits for the calls in flight at most ``graceful_timeout`` seconds, or until the
surrounding cancel scope's deadline, whichever is first; whatever is left is
cancelled.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent import futures
from functools import partial

import grpc
import structlog
import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from multidict import MultiDict

from trionserve.protocol.grpc.connection import Method, TransportOptions

log = structlog.get_logger(__name__)

__all__ = ["GrpcioCall", "GrpcioTransport", "grpcio_arguments", "server_credentials"]

# grpcio runs each call's Python side in one of these threads; a unary call holds
# one while Trio serves it, a streaming call for as long as it lasts. Idle threads
# cost nothing, and grpcio queues calls beyond the limit.
MAX_WORKER_THREADS = 1024
STREAM_READ_AHEAD = 64
STREAM_WRITE_AHEAD = 64

_END = object()
# Request headers that are HTTP/2 or gRPC protocol, not call metadata (as grpclib's
# decode_metadata leaves out).
_NOT_METADATA = ("user-agent", "content-type", "te", "grpc-")


def grpcio_arguments(options: TransportOptions, extra: Sequence[tuple[str, object]] = ()) -> list:
    """The transport options as grpcio server arguments."""
    arguments: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", options.max_message_size or -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_concurrent_streams", options.max_concurrent_streams),
        # grpcio turns SO_REUSEPORT on by default; a second server on a port must
        # fail to bind, unless worker processes share it on purpose.
        ("grpc.so_reuseport", 1 if options.reuse_port else 0),
        ("grpc.keepalive_permit_without_calls", int(options.keepalive_permit_without_calls)),
        ("grpc.keepalive_timeout_ms", int(options.keepalive_timeout * 1000)),
    ]
    if options.keepalive_time is not None:
        arguments.append(("grpc.keepalive_time_ms", int(options.keepalive_time * 1000)))
    else:
        arguments.append(("grpc.keepalive_time_ms", 2**31 - 1))
    if options.response_compression_level is not None:
        # Responses are gzip-compressed for clients that accept it.
        arguments.append(("grpc.default_compression_algorithm", grpc.Compression.Gzip.value))
    arguments.extend(extra)
    return arguments


def server_credentials(ssl) -> grpc.ServerCredentials:
    """grpcio's TLS credentials from a GrpcSsl's PEM files (blocking: reads them),
    as Triton builds them: the server's key and certificate, and for mutual TLS the
    root certificate that client certificates must chain to."""

    def read(path: str, what: str) -> bytes:
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as exc:
            raise OSError(
                f"gRPC SSL: cannot read the {what} '{path}': {exc.strerror}"
            ) from None

    key = read(ssl.server_key, "server key (--grpc-server-key)")
    cert = read(ssl.server_cert, "server certificate (--grpc-server-cert)")
    root = read(ssl.root_cert, "root certificate (--grpc-root-cert)") if ssl.root_cert else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=root, require_client_auth=ssl.mutual
    )


class GrpcioCall:
    """One call as its handler sees it: the same surface as the h2 transport's
    :class:`~trionserve.protocol.grpc.connection.GrpcCall`.

    ``receive`` returns the next request message (None once the client finished
    sending, or, for client-streaming methods, once the server drains); ``send``
    hands one response message to grpcio and raises ``trio.BrokenResourceError``
    once the call is gone. The handler ends the call by returning (OK) or raising
    :class:`GRPCError`.
    """

    def __init__(
        self,
        transport: "GrpcioTransport",
        context: grpc.ServicerContext,
        method: str,
        client_streaming: bool,
        request: bytes | None = None,
    ) -> None:
        self.method = method
        self.client_streaming = client_streaming
        self._transport = transport
        self._context = context
        self._metadata: MultiDict | None = None
        remaining = context.time_remaining()
        # grpcio reports no deadline as a very long remaining time.
        self._timeout = remaining if remaining < 1e8 else None
        self.deadline: float | None = None  # Trio time, set once the task starts
        # Requests: the one of a unary call, or what the reader thread delivered.
        self._messages: deque = deque() if request is None else deque((request,))
        self._ended = not client_streaming  # no more request messages will come
        self._error: GRPCError | None = None
        self._wakeup: trio.Event | None = None
        # Responses: the unary call's one, or (streams) the queue grpcio's thread
        # writes from, with its count and room, and the reader's credits.
        self._response: bytes | None = None
        self._sent = 0
        if client_streaming:
            self._credits = threading.Semaphore(STREAM_READ_AHEAD)
            self._responses: deque = deque()
            self._ready = threading.Condition(threading.Lock())
            self._in_queue = 0
            self._space: trio.Event | None = None
        # The outcome, for grpcio's thread: released once the handler is done.
        self._done = threading.Lock()
        self._done.acquire()
        self._status = Status.OK
        self._message: str | None = None
        self._gone = False  # the RPC ended on grpcio's side (cancel, deadline, close)
        self._finished = False
        self._scope: trio.CancelScope | None = None

    # -- what the handler sees -------------------------------------------------

    @property
    def metadata(self) -> MultiDict:
        """The request's metadata (custom headers), as the h2 transport gives it."""
        if self._metadata is None:
            metadata: MultiDict = MultiDict()
            for key, value in self._context.invocation_metadata() or ():
                if not key.startswith(_NOT_METADATA) and not key.startswith(":"):
                    metadata.add(key, value)
            self._metadata = metadata
        return self._metadata

    @property
    def peer(self) -> str:
        return self._context.peer()

    @property
    def draining(self) -> bool:
        """True once the server began shutting down."""
        return self._transport.draining

    async def receive(self) -> bytes | None:
        while True:
            if self._error is not None:
                raise self._error
            if self.client_streaming and self._transport.draining:
                return None
            if self._messages:
                message = self._messages.popleft()
                if self.client_streaming:
                    self._credits.release()
                return message
            if self._ended:
                return None
            self._wakeup = trio.Event()
            await self._wakeup.wait()

    async def send(self, message: bytes | Sequence[bytes | memoryview]) -> None:
        if self._gone:
            raise trio.BrokenResourceError("the client cancelled the call")
        data = message if isinstance(message, bytes) else b"".join(
            [message] if isinstance(message, (bytearray, memoryview)) else message
        )
        self._sent += 1
        if not self.client_streaming:
            if self._sent > 1:
                raise GRPCError(Status.INTERNAL, f"{self.method} answers one message")
            self._response = data
            return
        while self._in_queue >= STREAM_WRITE_AHEAD:
            self._space = trio.Event()
            await self._space.wait()
            if self._gone:
                raise trio.BrokenResourceError("the client cancelled the call")
        with self._ready:
            self._in_queue += 1
            self._responses.append(data)
            self._ready.notify()

    # -- Trio side, called through run_sync_soon -------------------------------------

    def _deliver(self, message) -> None:
        if message is _END:
            self._ended = True
        elif isinstance(message, GRPCError):
            self._error = message
        else:
            self._messages.append(message)
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _written(self) -> None:
        self._in_queue -= 1
        if self._space is not None:
            self._space.set()

    def _cancel(self) -> None:
        self._gone = True
        if self._scope is not None:
            self._scope.cancel()
        self._wake()
        if self.client_streaming and self._space is not None:
            self._space.set()

    # -- grpcio's side ----------------------------------------------------------------

    def _on_terminated(self) -> None:
        """grpcio's callback when the RPC ends, whichever way."""
        if not self._finished:
            self._transport._run_sync_soon(self._cancel)

    def _take_response(self):
        """The next response for grpcio's thread (blocks), or _END."""
        with self._ready:
            while not self._responses:
                self._ready.wait()
            return self._responses.popleft()

    def _abort_if_failed(self) -> None:
        if self._status is not Status.OK:
            self._context.abort(
                grpc.StatusCode[self._status.name], self._message or self._status.name
            )


def _method_not_found(path: str, requests, context) -> None:
    # Said the way the h2 transport says it: the path included.
    context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")


class GrpcioTransport:
    """Serves gRPC calls with the given methods on grpcio's C-core server.

    ``serve`` binds, reports the bound (host, port) pairs to ``task_status``, and
    runs until ``shutdown`` is set; then it drains and returns (see the module
    docstring). Every call's handler is a task of its nursery.
    """

    def __init__(
        self,
        methods: Mapping[str, Method],
        options: TransportOptions,
        extra_arguments: Sequence[tuple[str, object]] = (),
        *,
        ssl=None,
    ) -> None:
        self._methods = dict(methods)
        self._ssl = ssl  # a GrpcSsl: serve TLS (--grpc-use-ssl)
        self._options = options
        self._arguments = grpcio_arguments(options, extra_arguments)
        self.draining = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._streams: set[GrpcioCall] = set()

    async def serve(
        self,
        address: str,
        port: int,
        shutdown: trio.Event,
        graceful_timeout: float,
        *,
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> None:
        self._token = trio.lowlevel.current_trio_token()
        pool = futures.ThreadPoolExecutor(MAX_WORKER_THREADS, thread_name_prefix="grpcio")
        server = grpc.server(pool, handlers=[self._generic_handler()], options=self._arguments)
        host = address or "0.0.0.0"
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if self._ssl is None:
                bound_port = server.add_insecure_port(target)
            else:
                credentials = await trio.to_thread.run_sync(server_credentials, self._ssl)
                bound_port = server.add_secure_port(target, credentials)
        except RuntimeError as exc:
            raise OSError(f"gRPC: cannot listen on {target}: {exc}") from None
        if not bound_port:
            raise OSError(f"gRPC: cannot listen on {target}")
        stopped: threading.Event | None = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                server.start()
                task_status.started([(host, bound_port)])
                await shutdown.wait()
                self._drain_streams()
                grace = graceful_timeout
                deadline = trio.current_effective_deadline()
                if deadline != math.inf:
                    grace = max(0.0, min(grace, deadline - trio.current_time()))
                stopped = server.stop(grace)
                await trio.to_thread.run_sync(stopped.wait, abandon_on_cancel=True)
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            if stopped is None or not stopped.is_set():
                server.stop(None)  # cancel whatever is left, at once
            pool.shutdown(wait=False)

    def _drain_streams(self) -> None:
        self.draining = True
        for call in list(self._streams):
            call._wake()

    # -- entering Trio ---------------------------------------------------------------

    def _run_sync_soon(self, fn, *args) -> bool:
        try:
            self._token.run_sync_soon(fn, *args)  # type: ignore[union-attr]
        except trio.RunFinishedError:
            return False
        return True

    def _start(self, call: GrpcioCall, handler) -> None:
        nursery = self._nursery
        try:
            if nursery is None:
                raise RuntimeError("not serving")
            nursery.start_soon(self._run_call, call, handler)
        except RuntimeError:  # the transport stopped between grpcio's call and now
            self._release(call, Status.UNAVAILABLE, "the server is shutting down")

    async def _run_call(self, call: GrpcioCall, handler) -> None:
        status, message = Status.OK, None
        try:
            with trio.CancelScope() as scope:
                call._scope = scope
                if call._timeout is not None:
                    call.deadline = scope.deadline = trio.current_time() + call._timeout
                if call._gone:
                    scope.cancel()
                try:
                    await handler(call)
                except GRPCError as error:
                    status, message = error.status, error.message
                except trio.BrokenResourceError:
                    status, message = Status.CANCELLED, "the client cancelled the call"
                except Exception as exc:
                    log.exception("grpc handler failed", method=call.method)
                    status, message = Status.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
            if scope.cancelled_caught:
                if call._gone:
                    status, message = Status.CANCELLED, "the client cancelled the call"
                else:
                    status, message = Status.DEADLINE_EXCEEDED, "Deadline Exceeded"
            elif status is Status.OK and not call.client_streaming and call._response is None:
                status, message = Status.INTERNAL, f"{call.method} sent no response"
        finally:
            self._release(call, status, message)

    def _release(self, call: GrpcioCall, status: Status, message: str | None) -> None:
        call._status, call._message = status, message
        call._finished = True
        if call.client_streaming:
            self._streams.discard(call)
            call._credits.release()  # a reader waiting for room goes on, and ends
            with call._ready:
                call._responses.append(_END)
                call._ready.notify()
        call._done.release()

    # -- grpcio's threads ---------------------------------------------------------------

    def _generic_handler(self) -> grpc.GenericRpcHandler:
        transport = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails):
                method = transport._methods.get(details.method)
                if method is None:
                    return grpc.stream_stream_rpc_method_handler(
                        partial(_method_not_found, details.method)
                    )
                if method.client_streaming:
                    return grpc.stream_stream_rpc_method_handler(
                        lambda requests, context: transport._stream(
                            details.method, method, requests, context
                        )
                    )
                return grpc.unary_unary_rpc_method_handler(
                    lambda request, context: transport._unary(
                        details.method, method, request, context
                    )
                )

        return Handler()

    def _unary(self, path: str, method: Method, request: bytes, context) -> bytes | None:
        call = GrpcioCall(self, context, path, False, request)
        if not context.add_callback(call._on_terminated):
            return None  # already over
        if not self._run_sync_soon(self._start, call, method.handler):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        call._done.acquire()
        call._abort_if_failed()
        return call._response

    def _stream(self, path: str, method: Method, requests, context):
        call = GrpcioCall(self, context, path, True)
        if not context.add_callback(call._on_terminated):
            return
        if not self._run_sync_soon(self._start_stream, call, method.handler, requests):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        while True:
            response = call._take_response()
            if response is _END:
                break
            yield response
            self._run_sync_soon(call._written)
        call._done.acquire()
        call._abort_if_failed()

    def _start_stream(self, call: GrpcioCall, handler, requests) -> None:
        self._streams.add(call)
        self._start(call, handler)
        if self._nursery is not None:
            trio.lowlevel.start_thread_soon(
                lambda: self._read(call, requests), lambda outcome: None
            )

    def _read(self, call: GrpcioCall, requests) -> None:
        """A cache thread: hand the request messages of one stream to its task."""
        credits = call._credits
        try:
            while True:
                credits.acquire()
                if call._finished:
                    return
                try:
                    message = next(requests)
                except StopIteration:
                    self._run_sync_soon(call._deliver, _END)
                    return
                if not self._run_sync_soon(call._deliver, message):
                    return
        except grpc.RpcError:
            pass  # the RPC ended (cancelled, or the server answered): the callback tells
        except Exception as exc:  # e.g. a message over the size limit
            self._run_sync_soon(
                call._deliver, GRPCError(Status.INTERNAL, f"reading the request stream: {exc}")
            )
