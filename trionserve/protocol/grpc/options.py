"""The HTTP/2 and gRPC settings of the gRPC transport."""

from __future__ import annotations

from dataclasses import dataclass

from trionserve.core.client_budget import ClientBudget

__all__ = ["TransportOptions"]


@dataclass(frozen=True, slots=True)
class TransportOptions:
    """HTTP/2 and gRPC settings of the transport."""

    # Largest request message accepted (after decompression); None: the most
    # the 32-bit length prefix can say.
    max_message_size: int | None = 64 * 1024 * 1024
    # Our HTTP/2 receive windows (connection and each stream), in bytes, at most
    # max_connection_buffer. A 4 MB message goes in without waiting for a window
    # update; tritonclient (grpc-core) advertises 4 MiB windows and frames itself.
    window_size: int = 16 * 1024 * 1024
    # Largest DATA frame the client may send: large frames mean fewer frames for
    # h2 to parse, each copied once (upstream.FrameBuffer).
    max_frame_size: int = 1024 * 1024
    max_concurrent_streams: int = 1024
    # Bytes one connection may hold for its calls: request messages not taken
    # yet (whole or partial), messages its handlers took and have not answered
    # (decoded, queued or executing), and responses waiting for the client's
    # flow-control window. A handler takes a message only while the answered-not
    # bytes and the waiting responses leave room for it (one is always taken
    # when the connection has none). Past the limit the client gets no more
    # window, connection window included, so it sends nothing more; only the
    # oldest unfinished message may go on (so it completes and no call waits on
    # another), and when nothing of the connection's would drain by itself the
    # connection window is given back for it.
    max_connection_buffer: int = 256 * 1024 * 1024
    # Server keepalive: ping after this long (seconds; None: never), close the
    # connection when the ack takes longer than keepalive_timeout.
    keepalive_time: float | None = 7200.0
    keepalive_timeout: float = 20.0
    keepalive_permit_without_calls: bool = False
    # zlib level for gzip-compressed responses to clients that accept gzip; None:
    # responses are not compressed.
    response_compression_level: int | None = None
    # How long a closing connection waits for the client to close its side, and a
    # draining one for the ack of its first GOAWAY's ping.
    linger: float = 1.0
    # Seconds a TLS client gets to complete its handshake.
    handshake_timeout: float = 10.0
    # Connections served at once; past it a new one is closed at once. None: no cap.
    max_connections: int | None = 1024
    # Seconds a new connection gets to send its first call's headers; a client
    # that connects and sends nothing (slowloris) is closed after it.
    first_call_timeout: float = 30.0
    # Seconds a connection may stay with no call in flight after its first: then
    # it is closed (GOAWAY). At max_connections the longest idle one is closed to
    # make room for a new connection. None: never.
    idle_timeout: float | None = 300.0
    # Bind with SO_REUSEPORT: worker processes share the port (--workers).
    reuse_port: bool = False
    # The server's budget of bytes held for clients (--client-buffer-limit): what
    # every connection's buffer holds counts in it; None: not counted.
    budget: ClientBudget | None = None
