"""What a call's request headers ask for, checked: sans-I/O.

:func:`read_request_head` reads the headers of a new stream once and says what to
do with it: serve it (a :class:`RequestHead`: the method, the message encoding,
the timeout, whether to compress responses), refuse it at the HTTP level (not a
POST: 405; not ``application/grpc``: 415) or end it at once with a gRPC status
(unknown method, unsupported ``grpc-encoding``, bad ``grpc-timeout``). Tested
with header lists (tests/unit/test_grpc_state.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import final

from trionserve.protocol.grpc.call import Method
from trionserve.protocol.grpc.framing import ENCODINGS
from trionserve.protocol.grpc.options import TransportOptions
from trionserve.protocol.grpc.status import GRPCError, Status, decode_timeout

__all__ = ["HttpRefusal", "RequestHead", "read_request_head"]


@final
@dataclass(frozen=True, slots=True)
class RequestHead:
    """A call to serve."""

    method: Method
    path: str
    encoding: bytes  # of the request messages
    timeout: float | None  # seconds, from grpc-timeout
    compress: bool  # gzip the responses


@dataclass(frozen=True, slots=True)
class HttpRefusal:
    """Not a gRPC request: answered with this HTTP status alone."""

    status: bytes


def read_request_head(
    headers: Sequence[tuple[bytes, bytes]],
    methods: Mapping[bytes, Method],
    options: TransportOptions,
) -> RequestHead | HttpRefusal | GRPCError:
    """What the request headers of a new stream ask for (one pass over them)."""
    http_method = content_type = path = encoding = timeout = accept = None
    for name, value in headers:
        if name == b":path":
            path = value
        elif name == b":method":
            http_method = value
        elif name == b"content-type":
            content_type = value
        elif name == b"grpc-timeout":
            timeout = value
        elif name == b"grpc-encoding":
            encoding = value
        elif name == b"grpc-accept-encoding":
            accept = value
    if http_method != b"POST":
        return HttpRefusal(b"405")
    if content_type is None or not content_type.startswith(b"application/grpc"):
        return HttpRefusal(b"415")
    path = path or b""
    method = methods.get(path)
    if method is None:
        return GRPCError(Status.UNIMPLEMENTED, f"Method not found: {path.decode('latin-1')}")
    encoding = encoding or b"identity"
    if encoding not in ENCODINGS:
        return GRPCError(
            Status.UNIMPLEMENTED,
            f"grpc-encoding '{encoding.decode('latin-1')}' is not supported; "
            "supported: identity, deflate, gzip",
        )
    seconds = None
    if timeout is not None:
        try:
            seconds = decode_timeout(timeout.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return GRPCError(
                Status.INVALID_ARGUMENT,
                f"invalid grpc-timeout header {timeout.decode('latin-1')!r}",
            )
    compress = (
        options.response_compression_level is not None and accept is not None and b"gzip" in accept
    )
    return RequestHead(method, path.decode("latin-1"), encoding, seconds, compress)
