"""structlog setup, and the log settings the logging extension changes at run time.

Events are rendered one per line, in Triton's own ``default`` format (the
default, as tritonserver's) or its ``ISO8601`` one (triton-inference-server/common
``src/logging.cc`` LogPreamble: ``I1129 08:41:00.123456 <pid> <file>:<line>]
<message>`` and ``2026-11-29T08:41:00Z I <pid> <file>:<line>] <message>``, UTC;
the file and line are the Python caller's; the message, with its fields as
``key=value``, is a JSON string unless ``TRITON_SERVER_ESCAPE_LOG_MESSAGES=0``, as
Triton escapes it), or in this server's structured ``console`` and ``json``
formats. They go where Triton's Logger::Log sends them: to ``log_file`` when one
is set, else info and verbose lines to stdout and warnings and errors to stderr.
An event with a ``table`` field (a list of rows) is followed, in the text formats,
by that table drawn in text (the start-up overview), as LOG_TABLE_INFO writes it
unescaped.
Which levels pass is decided per event from :data:`SETTINGS`, so ``POST
/v2/logging`` takes effect at once for every logger, cached or not.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import IO, Any

import structlog
from structlog.typing import EventDict, WrappedLogger

from trionserve.core.errors import InvalidArgument, Unimplemented

_KEYS = ("log_info", "log_warning", "log_error", "log_verbose_level", "log_format", "log_file")
# Triton's two line formats (Logger::LogFormatString), this server's console one and JSON.
_TRITON_FORMATS = ("default", "ISO8601")
_FORMATS = {"default": "default", "ISO8601": "ISO8601", "console": "console", "json": "json"}
# Triton's level letters (common logging.h LEVEL_NAMES); its verbose lines are "I".
_LETTERS = {"debug": "I", "info": "I", "warning": "W", "warn": "W"}
_CALLSITE = structlog.processors.CallsiteParameterAdder(
    {
        structlog.processors.CallsiteParameter.FILENAME,
        structlog.processors.CallsiteParameter.LINENO,
    },
    additional_ignores=[__name__],
)


@dataclass
class LogSettings:
    """Triton's log settings: the fields of the logging extension."""

    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SETTINGS = LogSettings()
# The --log-file stream; None: stdout and stderr by level.
_file: IO[str] | None = None
_renderers: dict[str, Any] = {}


def _level_filter(_logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    if method_name == "debug":
        allowed = SETTINGS.log_verbose_level > 0
    elif method_name == "info":
        allowed = SETTINGS.log_info
    elif method_name == "warning":
        allowed = SETTINGS.log_warning
    else:  # error, exception, critical
        allowed = SETTINGS.log_error
    if not allowed:
        raise structlog.DropEvent
    return event_dict


def _callsite(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """The caller's file and line, for Triton's formats only (finding them walks
    the stack, which the other formats do not need)."""
    if SETTINGS.log_format in _TRITON_FORMATS:
        return _CALLSITE(logger, method_name, event_dict)
    return event_dict


def _escape() -> bool:
    """Triton escapes messages unless TRITON_SERVER_ESCAPE_LOG_MESSAGES is "0"
    (common src/logging.cc Logger::Logger)."""
    return os.environ.get("TRITON_SERVER_ESCAPE_LOG_MESSAGES") != "0"


def _triton_line(_logger: WrappedLogger, method_name: str, event_dict: EventDict) -> str:
    """One record in Triton's ``default`` or ``ISO8601`` format (LogPreamble,
    LogTimestamp: UTC; the message as TritonJson::SerializeString writes it)."""
    now = time.time()
    stamp = time.gmtime(now)
    letter = _LETTERS.get(method_name, "E")
    place = f"{event_dict.pop('filename', 'unknown')}:{event_dict.pop('lineno', 0)}"
    for key in ("timestamp", "level"):
        event_dict.pop(key, None)
    event = str(event_dict.pop("event", ""))
    trace = event_dict.pop("exception", None)
    fields = " ".join(f"{key}={value}" for key, value in event_dict.items())
    message = f"{event} {fields}" if fields else event
    if trace:
        message += "\n" + str(trace)
    if _escape():
        message = json.dumps(message, ensure_ascii=False)
    if SETTINGS.log_format == "ISO8601":
        prefix = time.strftime("%Y-%m-%dT%H:%M:%SZ", stamp) + f" {letter}"
    else:
        micros = int((now % 1) * 1_000_000)
        prefix = letter + time.strftime("%m%d %H:%M:%S", stamp) + f".{micros:06d}"
    return f"{prefix} {os.getpid()} {place}] {message}"


def _render(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> str:
    table = event_dict.pop("table", None) if SETTINGS.log_format != "json" else None
    line = _renderers[SETTINGS.log_format](logger, method_name, event_dict)
    if table:
        return line + "\n" + format_table(table)
    return line


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows of the same keys as a boxed text table, as tritonserver prints its
    model and option tables at start-up (the console format's ``table=`` field)."""
    headers = list(rows[0])
    cells = [[str(row.get(h, "")) for h in headers] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

    return "\n".join([rule, line(headers), rule, *(line(r) for r in cells), rule])


class _LineWriter:
    """A structlog logger that writes each rendered line where Triton's
    Logger::Log does (common src/logging.cc): to the log file when one is set,
    else info (and verbose) lines to stdout, warnings and errors to stderr."""

    def out(self, message: str) -> None:
        stream = _file or sys.stdout
        stream.write(message + "\n")
        stream.flush()

    def err(self, message: str) -> None:
        stream = _file or sys.stderr
        stream.write(message + "\n")
        stream.flush()

    debug = info = log = msg = out
    warning = warn = error = critical = exception = fatal = err


def verbose() -> bool:
    return SETTINGS.log_verbose_level > 0


_log = structlog.get_logger(__name__)


def log_infer_failed(request_id: str | None, message: str) -> None:
    """Triton's verbose line for an inference request answered with an error
    (server src/http_server.cc:3485 and 3880, grpc/infer_handler.cc:1030,
    grpc/stream_infer_handler.cc:394: ``[request id: <id>] Infer failed:
    <message>``). The message is the client's error text as it is, request
    fields named in it included: escaped with the rest of the line unless
    TRITON_SERVER_ESCAPE_LOG_MESSAGES=0. Nothing is formatted unless verbose."""
    if SETTINGS.log_verbose_level > 0:
        _log.debug(f"[request id: {request_id or '<id_unknown>'}] Infer failed: {message}")


# Triton's gRPC handlers that watch for a client's cancellation; its other
# methods are CommonHandler's, which log none (server src/grpc/infer_handler.h).
_CANCEL_HANDLERS = {
    "/inference.GRPCInferenceService/ModelInfer": "ModelInferHandler",
    "/inference.GRPCInferenceService/ModelStreamInfer": "ModelStreamInferHandler",
}


def log_grpc_state(event: str, method: str, stream_id: int, cancelled: bool = False) -> None:
    """Triton's verbose-2 lines for the state an infer handler holds for a call
    (server src/grpc/infer_handler.h:1346 ``StateNew, <id> Step <step>`` and :1354
    ``StateRelease, <id> Step <step>``), which its QA counts to prove each is
    released exactly once: here that state is the call's (its HTTP/2 stream's),
    new when the call's task starts and released when it ends, a stream's once
    for all its requests. Its step: START when new, then CANCELLED when the
    client reset the call, else FINISH."""
    if method in _CANCEL_HANDLERS and SETTINGS.log_verbose_level >= 2:
        step = "START" if event == "StateNew" else "CANCELLED" if cancelled else "FINISH"
        _log.debug(f"{event}, {stream_id} Step {step}")


def log_grpc_cancellation(method: str, stream_id: int) -> None:
    """Triton's verbose line when a client cancels an infer call before its
    answer (server src/grpc/infer_handler.h:850 HandleCancellation:
    ``Cancellation notification received for <handler>, rpc_ok=<ok>, context
    <id>, <id> step <step>``): here the context is the call's HTTP/2 stream; the
    completion-queue fields (``rpc_ok``, its handler's step) do not exist on
    this stack and are left out."""
    handler = _CANCEL_HANDLERS.get(method)
    if handler is not None and SETTINGS.log_verbose_level > 0:
        _log.debug(f"Cancellation notification received for {handler}, context {stream_id}")


# libevhtp's htp_method numbers, which Triton's "HTTP request:" line prints
# (evhtp parser.h enum htp_method: GET = 0, HEAD, POST, PUT, DELETE, ...).
_HTP_METHODS = {
    b"GET": 0,
    b"HEAD": 1,
    b"POST": 2,
    b"PUT": 3,
    b"DELETE": 4,
    b"OPTIONS": 8,
    b"TRACE": 13,
    b"CONNECT": 14,
    b"PATCH": 15,
}


def log_http_request(method: bytes, path: str) -> None:
    """Triton's verbose line for each HTTP request received (server
    src/http_server.cc:4857 ``HTTP request: <method> <path>``, the method as
    libevhtp's number; 16, htp_method_UNKNOWN, for any other). Callers check
    :func:`verbose` first."""
    _log.debug(f"HTTP request: {_HTP_METHODS.get(method, 16)} {path}")


def configure_logging(
    fmt: str = "default",
    verbose_level: int = 0,
    *,
    log_file: str = "",
    log_info: bool = True,
    log_warning: bool = True,
    log_error: bool = True,
) -> None:
    """Configure structlog once at start; later changes go through update_settings.

    The keywords are tritonserver's ``--log-file`` (append to this file instead of
    stderr) and ``--log-info``, ``--log-warning``, ``--log-error``.
    """
    _renderers["console"] = structlog.dev.ConsoleRenderer(colors=False)
    _renderers["json"] = structlog.processors.JSONRenderer()
    _renderers["default"] = _renderers["ISO8601"] = _triton_line
    update_settings(
        {
            "log_format": fmt,
            "log_verbose_level": verbose_level,
            "log_file": log_file,
            "log_info": log_info,
            "log_warning": log_warning,
            "log_error": log_error,
        },
        network=False,
    )
    structlog.configure(
        processors=[
            _level_filter,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _callsite,
            _render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=lambda *args: _LineWriter(),
        cache_logger_on_first_use=True,
    )


def update_settings(changes: dict[str, Any], *, network: bool = True) -> dict[str, Any]:
    """Apply a logging-extension request; returns the settings now in force.

    Every value is checked before any is applied, so a bad request changes nothing.
    A null value leaves its setting as it is. A request from the network
    (``network``) cannot set ``log_file``: as Triton since CVE-2024-0087, that is
    Unimplemented (501 / UNIMPLEMENTED), so a client cannot make the server append
    to a file of its choosing; only ``--log-file`` at start sets it.
    """
    global _file
    checked: dict[str, Any] = {}
    for key, value in changes.items():
        if value is None and key in _KEYS:
            continue
        if key == "log_file" and network:
            raise Unimplemented("log file location can not be updated through network protocol")
        if key in ("log_info", "log_warning", "log_error"):
            if type(value) is not bool:
                raise InvalidArgument(f"log setting '{key}' must be a boolean, got {value!r}")
        elif key == "log_verbose_level":
            if type(value) is not int or value < 0:
                raise InvalidArgument(
                    f"log setting 'log_verbose_level' must be a non-negative integer, got {value!r}"
                )
        elif key == "log_format":
            if value not in _FORMATS:
                raise InvalidArgument(
                    f"log setting 'log_format' must be one of {sorted(_FORMATS)}, got {value!r}"
                )
            value = _FORMATS[value]
        elif key == "log_file":
            if type(value) is not str:
                raise InvalidArgument(f"log setting 'log_file' must be a string, got {value!r}")
        else:
            raise InvalidArgument(f"unknown log setting '{key}'")
        checked[key] = value
    if "log_file" in checked and checked["log_file"] != SETTINGS.log_file:
        old, _file = _file, open(checked["log_file"], "a") if checked["log_file"] else None
        if old is not None:
            old.close()
    for key, value in checked.items():
        setattr(SETTINGS, key, value)
    return SETTINGS.as_dict()
