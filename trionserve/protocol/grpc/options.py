"""The gRPC frontend's settings (tritonserver's --grpc-* flags) and the HTTP/2
and gRPC settings of its transport."""

from __future__ import annotations

from dataclasses import dataclass, field

from trionserve.core.client_budget import ClientBudget
from trionserve.protocol.restricted import RestrictedFeatures

__all__ = ["COMPRESSION_LEVELS", "GrpcOptions", "GrpcSsl", "TransportOptions"]


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


# --grpc-infer-response-compression-level -> zlib level (None: uncompressed).
COMPRESSION_LEVELS = {"none": None, "low": 1, "med": 5, "high": 9}


@dataclass(frozen=True)
class GrpcSsl:
    """TLS for the gRPC endpoint (--grpc-use-ssl, --grpc-use-ssl-mutual): PEM files.

    ``mutual`` requires and verifies a client certificate signed by ``root_cert``.
    """

    server_cert: str
    server_key: str
    root_cert: str | None = None
    mutual: bool = False


@dataclass(frozen=True)
class GrpcOptions:
    """The gRPC frontend's settings, named after tritonserver's --grpc-* flags."""

    # Request headers whose name matches this regular expression are passed to
    # the model as request parameters (string values).
    header_forward_pattern: str | None = None
    # Triton preallocates this many response objects; here every response is
    # built for its call, so the value is accepted and has no effect.
    infer_allocation_pool_size: int = 8
    infer_response_compression_level: str = "none"
    keepalive_time_ms: int = 7_200_000
    keepalive_timeout_ms: int = 20_000
    keepalive_permit_without_calls: bool = False
    # Client ping policy (Triton passes these to grpcio): accepted; the h2
    # transport does not police pings.
    http2_max_pings_without_data: int = 2
    http2_min_recv_ping_interval_without_data_ms: int = 300_000
    http2_max_ping_strikes: int = 2
    # Largest request message accepted, after decompression (--grpc-max-message-size).
    # Triton lets grpcio take up to 2 GiB - 1; 64 MiB is Triton's HTTP body limit
    # (--http-max-input-size), so a tensor that fits one protocol fits the other,
    # and one message cannot make the server buffer gigabytes.
    max_message_size: int = 64 * 1024 * 1024
    # HTTP/2 streams (calls) one connection may have open at once; clients queue
    # the rest (--grpc-max-concurrent-streams).
    max_concurrent_streams: int = 1024
    # Bytes one connection may hold: requests not taken yet and responses the
    # client has not granted window for (--grpc-max-connection-buffer).
    max_connection_buffer: int = 256 * 1024 * 1024
    # Connections served at once (--grpc-max-connections), and the seconds a new
    # one gets to start its first call (--grpc-first-call-timeout).
    max_connections: int = 1024
    first_call_timeout: float = 30.0
    # Seconds a connection may stay without a call in flight (--grpc-idle-timeout).
    idle_timeout: float = 300.0
    # Bind with SO_REUSEPORT so that worker processes share the port (--workers).
    reuse_port: bool = False
    # TLS; None: plaintext.
    ssl: GrpcSsl | None = None
    # Protocol groups whose calls must carry a header (--grpc-restricted-protocol).
    restricted_protocols: RestrictedFeatures = field(default_factory=RestrictedFeatures)

    def transport_options(self) -> TransportOptions:
        return TransportOptions(
            max_message_size=self.max_message_size,
            max_concurrent_streams=self.max_concurrent_streams,
            max_connection_buffer=self.max_connection_buffer,
            max_connections=self.max_connections,
            first_call_timeout=self.first_call_timeout,
            idle_timeout=self.idle_timeout,
            keepalive_time=self.keepalive_time_ms / 1000 if self.keepalive_time_ms > 0 else None,
            keepalive_timeout=self.keepalive_timeout_ms / 1000,
            keepalive_permit_without_calls=self.keepalive_permit_without_calls,
            response_compression_level=COMPRESSION_LEVELS[self.infer_response_compression_level],
            reuse_port=self.reuse_port,
        )
