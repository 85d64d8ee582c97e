"""One exception hierarchy for every error a client can see.

Each error carries a :class:`Status`; the HTTP and gRPC frontends map the status to
their own codes, so the message text is the same on both protocols.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """Error categories, named after Triton's TRITONSERVER_Error codes."""

    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"


class TritonError(Exception):
    """An error with a status and a message meant for the client."""

    status: Status = Status.INTERNAL

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidArgument(TritonError):
    status = Status.INVALID_ARGUMENT


class NotFound(TritonError):
    status = Status.NOT_FOUND


class Unavailable(TritonError):
    status = Status.UNAVAILABLE


class InternalError(TritonError):
    status = Status.INTERNAL


class Unimplemented(TritonError):
    status = Status.UNIMPLEMENTED


class AlreadyExists(TritonError):
    status = Status.ALREADY_EXISTS


class Cancelled(TritonError):
    status = Status.CANCELLED


class DeadlineExceeded(TritonError):
    status = Status.DEADLINE_EXCEEDED


class ResourceExhausted(TritonError):
    """A bound the server keeps was reached (the message names it and its flag)."""

    status = Status.RESOURCE_EXHAUSTED


def as_triton_error(exc: BaseException, context: str = "") -> TritonError:
    """Wrap any exception as a TritonError; TritonErrors pass through unchanged."""
    if isinstance(exc, TritonError):
        return exc
    prefix = f"{context}: " if context else ""
    return InternalError(f"{prefix}{type(exc).__name__}: {exc}")


# How Triton writes each status code before a message it logs or keeps as a
# reason (common src/error.cc Error::CodeString, Error::AsString:
# "<code>: <message>"). Codes Triton's core has no name for are "Unknown".
_TRITON_CODE_STRINGS = {
    Status.UNKNOWN: "Unknown",
    Status.INTERNAL: "Internal",
    Status.NOT_FOUND: "Not found",
    Status.INVALID_ARGUMENT: "Invalid argument",
    Status.UNAVAILABLE: "Unavailable",
    Status.UNIMPLEMENTED: "Unsupported",
    Status.ALREADY_EXISTS: "Already exists",
}


def as_status_string(error: TritonError) -> str:
    """``error`` as Triton's ``Status::AsString`` writes it: ``Invalid argument: ...``."""
    return f"{_TRITON_CODE_STRINGS.get(error.status, 'Unknown')}: {error.message}"
