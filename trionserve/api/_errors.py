"""The in-process API's errors, under the names of ``tritonserver``'s exceptions."""

from __future__ import annotations

from trionserve.core import errors

# Triton's exception names (tritonserver/_c/tritonserver_pybind.cc) for our one
# hierarchy: the core raises these very classes, so nothing is translated.
TritonError = errors.TritonError
InvalidArgumentError = errors.InvalidArgument
NotFoundError = errors.NotFound
UnavailableError = errors.Unavailable
InternalError = errors.InternalError
UnsupportedError = errors.Unimplemented
AlreadyExistsError = errors.AlreadyExists
# Codes Triton's Python package reports as UnknownError; named here.
CancelledError = errors.Cancelled
DeadlineExceededError = errors.DeadlineExceeded
ResourceExhaustedError = errors.ResourceExhausted


class UnknownError(errors.TritonError):
    """Triton's UnknownError (TRITONSERVER_ERROR_UNKNOWN), for code that catches it;
    this server raises the specific error instead."""
