"""Request-parameter rules both inference protocols share.

Keys starting with ``triton_`` are Triton's own: a client may set only the ones a
protocol gives a meaning to, and every other such key is refused before the
request reaches a model, with Triton's wording for that protocol.
"""

from __future__ import annotations

from trionserve.core.errors import InvalidArgument

__all__ = [
    "EMPTY_FINAL_RESPONSE",
    "FINAL_RESPONSE",
    "RESERVED_PARAMETER_KEYS",
    "check_forwarded_header",
    "check_reserved_key",
]

# Asks a gRPC stream for a last response with no outputs that only ends the request.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
# Set by the server on every response of a gRPC stream.
FINAL_RESPONSE = "triton_final_response"

_RESERVED_PREFIX = "triton_"

# Keys the protocols give a meaning of their own, never a model's parameter
# (Triton's src/common.h kReservedParameterKeys).
RESERVED_PARAMETER_KEYS = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "headers",
        "binary_data_output",
    }
)


def check_reserved_key(key: str, allowed: tuple[str, ...] = ()) -> bool:
    """Whether ``key`` is one of Triton's reserved keys that ``allowed`` lets through.

    False for an ordinary key; raises :class:`InvalidArgument` for a ``triton_`` key
    not in ``allowed``. Over HTTP no such key is allowed (Triton's
    ``src/http_server.cc``); over gRPC the ones Triton's ``src/common.h`` lists in
    ``TRITON_RESERVED_REQUEST_PARAMS`` are (``src/grpc/infer_handler.cc``).
    """
    if not key.startswith(_RESERVED_PREFIX):
        return False
    if key in allowed:
        return True
    if allowed:
        raise InvalidArgument(
            "parameter keys starting with 'triton_' are reserved for Triton usage. "
            "Only the following keys starting with 'triton_' are allowed: " + " ".join(allowed)
        )
    raise InvalidArgument(
        "parameter keys starting with 'triton_' are reserved for Triton usage and "
        "should not be specified."
    )


def check_forwarded_header(name: str) -> None:
    """Refuse a header that ``--http-header-forward-pattern`` or
    ``--grpc-header-forward-pattern`` would forward under a reserved name, as Triton
    does (``src/http_server.cc`` ForEachHeader, ``src/grpc/infer_handler.h``
    ForwardHeadersAsParameters): a reserved key or one starting with ``triton_``."""
    if name in RESERVED_PARAMETER_KEYS or name.startswith(_RESERVED_PREFIX):
        raise InvalidArgument(
            f"Header '{name}' is reserved for Triton usage and cannot be forwarded."
        )
