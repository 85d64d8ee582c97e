"""TCP listeners for the frontends, optionally shared between processes (SO_REUSEPORT).

With ``reuse_port`` false this is exactly :func:`trio.open_tcp_listeners`: a port
another process listens on is an error (``EADDRINUSE``), as a single server must
report. With ``reuse_port`` true every socket is bound with ``SO_REUSEPORT``, so
the worker processes of ``--workers N`` (:mod:`trionserve.workers`) listen on one
port and the kernel spreads incoming connections across them. The kernel only
lets sockets share a port when all of them set the option and belong to the same
user, so a reuse-port socket still cannot take over a port held by an ordinary
server.

:class:`Acceptor` is the accept loop both frontends (HTTP and gRPC) run on their
listeners: a cap on the connections served at once, the excess refused cheaply,
and accept failures for want of descriptors or memory waited out instead of
spun on, each logged at a bounded rate. At the cap, a protocol that can close
an idle connection (HTTP keep-alive, gRPC without calls) is asked to close its
oldest idle one first, so idle connections never keep a new client out.
"""

from __future__ import annotations

import errno
import math
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence

import structlog
import trio

__all__ = [
    "Acceptor",
    "RateLimitedLog",
    "open_tcp_listeners",
    "REUSE_PORT_SUPPORTED",
]

log = structlog.get_logger(__name__)

REUSE_PORT_SUPPORTED = hasattr(socket, "SO_REUSEPORT")


async def open_tcp_listeners(
    port: int, *, host: str | None = None, backlog: int | None = None, reuse_port: bool = False
) -> list[trio.SocketListener]:
    """Listeners on every address ``host`` resolves to (all interfaces for None),
    as :func:`trio.open_tcp_listeners`, with ``SO_REUSEPORT`` when asked."""
    if not reuse_port:
        return await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    listeners = []
    try:
        for sock in _bound_sockets(host, port):
            sock.listen(backlog if backlog is not None else socket.SOMAXCONN)
            sock.setblocking(False)
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners


def _bound_sockets(host: str | None, port: int) -> list[socket.socket]:
    """Sockets bound to each address of ``host``, with SO_REUSEADDR and SO_REUSEPORT,
    IPv6 ones IPv6-only (as Trio binds them)."""
    if not REUSE_PORT_SUPPORTED:
        raise OSError("SO_REUSEPORT is not supported on this platform")
    addresses = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, type_, proto, _, address in addresses:
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            if sys.platform != "win32":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


# accept() errors that mean "out of resources for now", as trio.serve_listeners has.
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
# How long the accept loop waits after such an error before it tries again.
ACCEPT_RETRY_SECS = 0.1
# How long the accept loop waits for an idle connection it closed to end.
EVICT_WAIT_SECS = 1.0


class RateLimitedLog:
    """One warning now, then at most one every ``every`` seconds with the number of
    occurrences in between: a flood (of refused connections, of accept errors)
    neither fills the log nor costs a line each."""

    def __init__(self, message: str, every: float = 10.0) -> None:
        self.message = message
        self.every = every
        self._next = -math.inf
        self._suppressed = 0

    def __call__(self, **fields: object) -> None:
        now = trio.current_time()
        if now < self._next:
            self._suppressed += 1
            return
        log.warning(self.message, suppressed_since_last=self._suppressed, **fields)
        self._suppressed = 0
        self._next = now + self.every


class Acceptor:
    """Accepts connections and serves each with ``handle`` in a nursery the caller
    owns, at most ``max_connections`` at once (None: no cap).

    At the cap, ``evict`` (when given) is asked to close the oldest idle
    connection (it returns False when none is idle) and the new connection is
    served as soon as that one has ended (within ``EVICT_WAIT_SECS``). A
    connection past the cap with nothing to evict goes to ``refuse`` instead
    (which answers if its protocol can, and closes it) and is logged at a bounded
    rate naming ``flag``;
    an accept that fails for want of descriptors or memory is retried after
    ``ACCEPT_RETRY_SECS``, also logged at a bounded rate, so a flood of either
    neither spins the event loop nor fills the log. ``open`` counts the
    connections being served.
    """

    def __init__(
        self,
        protocol: str,
        handle: Callable[[trio.SocketStream], Awaitable[None]],
        refuse: Callable[[trio.SocketStream], Awaitable[None]],
        max_connections: int | None,
        flag: str,
        evict: Callable[[], bool] | None = None,
    ) -> None:
        self._handle = handle
        self._refuse = refuse
        self._evict = evict
        self.max_connections = max_connections
        self.open = 0
        self.evicted = 0  # idle connections closed to make room
        self._ended = trio.Event()  # set (and replaced) when a connection ends
        self._log_refused = RateLimitedLog(f"refusing {protocol} connections: at the cap ({flag})")
        self._log_accept_error = RateLimitedLog(f"{protocol} accept failed; retrying")

    async def serve_until(
        self,
        listeners: Sequence[trio.SocketListener],
        shutdown: trio.Event,
        graceful_timeout: float,
        drain: Callable[[], None],
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve connections on ``listeners`` until ``shutdown`` is set (their
        addresses reported to ``task_status``), then drain: the listeners close
        (new connections are refused), ``drain()`` tells the protocol (idle
        connections close, busy ones finish), and whatever is still open after
        ``graceful_timeout`` seconds is cancelled. Returns when every connection
        has ended."""
        bound = [listener.socket.getsockname()[:2] for listener in listeners]
        async with trio.open_nursery() as connections:
            accepting = trio.CancelScope()

            async def accept() -> None:
                with accepting:
                    await self.serve(listeners, connections)

            connections.start_soon(accept)
            task_status.started(bound)
            await shutdown.wait()
            accepting.cancel()
            for listener in listeners:
                await listener.aclose()
            drain()
            connections.cancel_scope.deadline = trio.current_time() + graceful_timeout

    async def serve(
        self, listeners: Sequence[trio.SocketListener], connections: trio.Nursery
    ) -> None:
        """Accept on every listener until cancelled or they close; each connection
        is served in ``connections``."""
        async with trio.open_nursery() as accepting:
            for listener in listeners:
                accepting.start_soon(self.accept, listener, connections)

    async def accept(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        """The accept loop of one listener: until it closes or this is cancelled."""
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                # Out of descriptors or memory: wait for connections to end
                # instead of spinning on accept.
                self._log_accept_error(error=str(exc))
                await trio.sleep(ACCEPT_RETRY_SECS)
                continue
            cap = self.max_connections
            if cap is not None and self.open >= cap and not await self._make_room(cap):
                self._log_refused(max_connections=cap)
                await self._refuse(stream)
                continue
            self.open += 1
            connections.start_soon(self._serve, stream)

    async def _make_room(self, cap: int) -> bool:
        """Close idle connections, oldest first, until one fewer than ``cap`` is
        open; False when none is idle (or the closed one takes too long to end)."""
        if self._evict is None:
            return False
        with trio.move_on_after(EVICT_WAIT_SECS):
            while self.open >= cap:
                if not self._evict():
                    return False
                self.evicted += 1
                await self._ended.wait()
            return True
        return False

    async def _serve(self, stream: trio.SocketStream) -> None:
        try:
            await self._handle(stream)
        finally:
            self.open -= 1
            self._ended.set()
            self._ended = trio.Event()
