"""TCP listeners for the frontends, optionally shared between processes (SO_REUSEPORT).

With ``reuse_port`` false this is exactly :func:`trio.open_tcp_listeners`: a port
another process listens on is an error (``EADDRINUSE``), as a single server must
report. With ``reuse_port`` true every socket is bound with ``SO_REUSEPORT``, so
the worker processes of ``--workers N`` (:mod:`trionserve.workers`) listen on one
port and the kernel spreads incoming connections across them. The kernel only
lets sockets share a port when all of them set the option and belong to the same
user, so a reuse-port socket still cannot take over a port held by an ordinary
server.
"""

from __future__ import annotations

import socket
import sys

import trio

__all__ = ["open_tcp_listeners", "REUSE_PORT_SUPPORTED"]

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
