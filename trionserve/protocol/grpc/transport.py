"""The gRPC transport: HTTP/2 with h2 on Trio sockets, behind a small interface.

The gRPC service hands :class:`GrpcTransport` a table of :class:`Method` handlers
by request path; each handler sees only a :class:`GrpcCall` (request metadata,
deadline, messages in and out) and ends the call by returning or raising
:class:`GRPCError`. Everything HTTP/2 stays behind this interface
(:mod:`~trionserve.protocol.grpc.connection` and the sans-I/O layers beneath it:
:mod:`~trionserve.protocol.grpc.state`, :mod:`~trionserve.protocol.grpc.flow`,
:mod:`~trionserve.protocol.grpc.framing`),
so the transport can be swapped without touching the service.

What it guarantees:

- Each call runs as its own task in its connection's nursery. A client that resets
  the stream (cancel, its own deadline) or drops the connection cancels that task;
  a ``grpc-timeout`` that passes cancels it and answers DEADLINE_EXCEEDED.
- Every non-OK status carries a percent-encoded ``grpc-message``.
- At most ``max_connections`` connections at once: past it the connection with no
  call in flight for the longest is closed to make room (GOAWAY), else the new one
  is closed at once; a connection that sends no call within ``first_call_timeout``
  is closed, and one with no call in flight for ``idle_timeout`` is too.
- TLS when given an ``ssl.SSLContext`` (ALPN ``h2``, as gRPC clients require); a
  connection whose handshake does not finish within ``handshake_timeout`` is closed.
- HTTP/2 flow control with large windows (16 MiB by default); a connection holds
  at most ``max_connection_buffer`` bytes for its calls, all streams together:
  requests not taken, requests taken and not answered, responses waiting for the
  client's window. Past it no request is taken and the client gets no more window,
  so it holds back instead of the server buffering without bound; a connection
  that held much gives its memory back to the system when it ends.
- An HTTP/2 frame announced past SETTINGS_MAX_FRAME_SIZE is refused
  (FRAME_SIZE_ERROR) on its header, before its payload is read.
- Shutdown (``shutdown`` set: the server sets it once its drain is over, see
  :class:`~trionserve.dataplane.DataPlane`; until then the transport serves as
  usual, and the DataPlane answers new requests UNAVAILABLE) closes: GOAWAY
  (two-step, so requests already on the wire are not lost), in-flight calls
  finish, client-streaming calls stop reading (their ``receive`` returns None and
  ``call.draining`` is true), then each connection closes once everything up to
  its final GOAWAY is written; after ``graceful_timeout`` whatever is left is
  cancelled, and a call cut so ends UNAVAILABLE (naming ``--exit-timeout-secs``)
  if its socket takes the trailers within a second.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping

import structlog
import trio

from trionserve.core.deferred import sweep_deferred
from trionserve.core.memory import release_free_memory
from trionserve.protocol.grpc.call import GrpcCall, Method
from trionserve.protocol.grpc.connection import Connection
from trionserve.protocol.grpc.options import TransportOptions
from trionserve.protocol.grpc.reportsweep import ReportSweep
from trionserve.protocol.grpc.status import GRPCError, Status
from trionserve.protocol.listeners import Acceptor, open_tcp_listeners

log = structlog.get_logger(__name__)

# A connection that held this many bytes for its calls at once gives the memory
# back to the system when it ends (release_free_memory).
RELEASE_MEMORY_AFTER = 16 * 1024 * 1024

__all__ = [
    "GrpcCall",
    "GrpcTransport",
    "Method",
    "TransportOptions",
    "GRPCError",
    "Status",
    "server_ssl_context",
]


def server_ssl_context(
    cert_file: str, key_file: str, root_cert_file: str | None = None, *, mutual: bool = False
) -> ssl.SSLContext:
    """A server TLS context for gRPC: TLS 1.2 or later, ALPN ``h2``; with ``mutual``,
    client certificates are required and must chain to ``root_cert_file``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if root_cert_file is not None:
        context.load_verify_locations(root_cert_file)
    context.verify_mode = ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context


class GrpcTransport:
    """Listens on one address and serves gRPC calls with the given methods.

    ``serve`` starts listening, reports the bound (host, port) pairs to
    ``task_status``, and runs until ``shutdown`` is set; then it stops accepting,
    drains every connection and returns, cancelling whatever is still running
    after ``graceful_timeout`` seconds. Connections are children of its nursery.
    """

    def __init__(
        self,
        methods: Mapping[str, Method],
        options: TransportOptions,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._methods = {path.encode("latin-1"): m for path, m in methods.items()}
        self._options = options
        self._ssl_context = ssl_context
        self.acceptor = Acceptor(
            "gRPC",
            self._connection,
            trio.aclose_forcefully,  # refused cheaply: closed at once
            options.max_connections,
            "--grpc-max-connections",
            evict=self._close_oldest_idle,
        )
        # Connections without a call in flight, longest idle first.
        self._idle: dict[Connection, None] = {}
        # Set when the server starts draining: connections send GOAWAY.
        self._draining = trio.Event()
        # The tick for the reports the threads left, put off by the reads' sweeps.
        self._report_sweep = ReportSweep()

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
            port, host=address or None, backlog=1024, reuse_port=self._options.reuse_port
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._report_sweep.run)
                await self.acceptor.serve_until(
                    listeners,
                    shutdown,
                    graceful_timeout,
                    self._draining.set,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()
        finally:
            sweep_deferred()  # the reports of the answers written last (answer.py)

    def _close_oldest_idle(self) -> bool:
        """Close the connection idle the longest (to make room at the cap); False
        when none is."""
        for connection in self._idle:
            connection.close_idle()
            return True
        return False

    async def _connection(self, socket_stream: trio.SocketStream) -> None:
        await self._serve_connection(socket_stream, self._draining)

    async def _serve_connection(
        self, socket_stream: trio.SocketStream, draining: trio.Event
    ) -> None:
        stream: trio.abc.Stream = socket_stream
        if self._ssl_context is not None:
            tls = trio.SSLStream(socket_stream, self._ssl_context, server_side=True)
            with trio.move_on_after(self._options.handshake_timeout) as handshake:
                try:
                    await tls.do_handshake()
                except trio.BrokenResourceError as exc:  # not TLS, no client certificate...
                    log.debug("grpc TLS handshake failed", error=repr(exc.__cause__ or exc))
                    await trio.aclose_forcefully(socket_stream)
                    return
            if handshake.cancelled_caught:
                log.debug("grpc TLS handshake timed out")
                await trio.aclose_forcefully(socket_stream)
                return
            stream = tls
        connection = Connection(
            stream, self._methods, self._options, draining, self._idle, self._report_sweep
        )
        # Trio reports a peer's reset from inside the connection's nursery as an
        # ExceptionGroup, hence except*: one broken client must never stop the server.
        try:
            await connection.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as group:
            log.debug("grpc connection lost", peer=connection.peer, error=repr(group))
        except* Exception:
            log.exception("grpc connection failed", peer=connection.peer)
        if connection.buffer.peak >= RELEASE_MEMORY_AFTER:
            # What it held is free now: give it back to the system.
            await trio.to_thread.run_sync(release_free_memory)
