"""The errors of ``triton_python_backend_utils``: ``TritonError`` and ``TritonModelException``.

``TritonError`` is python_backend's ``PbError`` (an error for one response, with
its ``TRITONSERVER_Error_Code``); ``TritonModelException`` is what a model (and the
module) raises to fail ``initialize``, ``execute`` or ``finalize``. Also the check
of string arguments as Triton's C++ side takes them. Part of the module model.py
imports as ``triton_python_backend_utils``, which re-exports the public names.
"""

from __future__ import annotations


class TritonError(Exception):
    """An error for one response; ``code`` is one of the class constants."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: object, code: int = INTERNAL) -> None:
        if message is None:
            raise TypeError("TritonError needs a message")
        super().__init__(message)
        self._message = str(message)
        self._code = int(code)

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message


class TritonModelException(Exception):
    """Raised by models (and by this module) to fail initialize, execute or finalize."""

    def __init__(self, msg: object = None) -> None:
        super().__init__(msg)
        self._msg = msg

    def message(self) -> object:
        return self._msg

    def __str__(self) -> str:
        return "" if self._msg is None else str(self._msg)


def as_text(value: object, what: str) -> str:
    """A string argument as Triton's C++ side takes it: ``str``, or ``bytes`` as UTF-8
    (a name read from a BYTES tensor is ``bytes``)."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise TritonModelException(f"{what} must be valid UTF-8, got {value!r}") from None
    # A wrong type is a TypeError, as pybind11 raises it for python_backend's API.
    raise TypeError(f"{what} must be a str or bytes, not {type(value).__name__}")
