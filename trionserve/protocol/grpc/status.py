"""gRPC status codes, the error that carries one, and the header text encodings.

What the gRPC-over-HTTP/2 specification (PROTOCOL-HTTP2.md) defines for a server:
the status codes, ``grpc-message`` percent-encoding, ``grpc-timeout`` values and
how request headers become call metadata (``-bin`` keys are base64). Pure
functions, no I/O.
"""

from __future__ import annotations

import enum
import re
from base64 import b64decode
from collections.abc import Iterable
from urllib.parse import quote, unquote

__all__ = [
    "Status",
    "GRPCError",
    "encode_grpc_message",
    "decode_grpc_message",
    "decode_timeout",
    "decode_metadata",
]


class Status(enum.IntEnum):
    """gRPC status codes (grpc/include/grpcpp/support/status_code_enum.h)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GRPCError(Exception):
    """Ends a call with ``status`` and ``message`` (sent as ``grpc-message``)."""

    def __init__(self, status: Status, message: str | None = None) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


# Printable ASCII except '%' goes out as is; everything else percent-encoded (UTF-8).
_UNQUOTED = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)


def encode_grpc_message(message: str) -> str:
    return quote(message, safe=_UNQUOTED, encoding="utf-8")


def decode_grpc_message(value: str) -> str:
    return unquote(value, encoding="utf-8", errors="replace")


_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# At most 8 digits, per the specification.
_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")


def decode_timeout(value: str) -> float:
    """Seconds of a ``grpc-timeout`` value such as ``100m``; ValueError if malformed."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        raise ValueError(f"invalid grpc-timeout value {value!r}")
    return int(match.group(1)) * _TIMEOUT_UNITS[match.group(2)]


# Request headers that are HTTP/2 or gRPC protocol, not call metadata.
_PROTOCOL_HEADERS = frozenset({"te", "content-type", "user-agent"})


def decode_metadata(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str | bytes]]:
    """The call metadata among request headers: pseudo-headers, ``grpc-*`` and
    protocol headers left out, ``-bin`` values base64-decoded to bytes."""
    metadata: list[tuple[str, str | bytes]] = []
    for key, value in headers:
        if key.startswith((":", "grpc-")) or key in _PROTOCOL_HEADERS:
            continue
        if key.endswith("-bin"):
            try:
                metadata.append((key, b64decode(value + "=" * (-len(value) % 4))))
            except ValueError:  # not base64: not metadata anyone can read
                continue
        else:
            metadata.append((key, value))
    return metadata
