"""structlog setup, and the log settings the logging extension changes at run time.

Events are rendered one per line to stderr or to ``log_file``: in this server's
``console`` format (the default) or ``json``, or in Triton's own ``default`` and
``ISO8601`` formats (triton-inference-server/common ``src/logging.cc``
LogPreamble: ``I1129 08:41:00.123456 <pid> <file>:<line>] <message>`` and
``2026-11-29T08:41:00Z I <pid> <file>:<line>] <message>``, UTC; the file and line
are the Python caller's; the message, with its fields as ``key=value``, is a JSON
string unless ``TRITON_SERVER_ESCAPE_LOG_MESSAGES=0``, as Triton escapes it). An
event with a ``table`` field (a list of rows) is followed, in the text formats, by
that table drawn in text (the start-up overview).
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
# Triton's two line formats, this server's console one and JSON.
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
    log_format: str = "console"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SETTINGS = LogSettings()
_stream: IO[str] = sys.stderr
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
    """A structlog logger that writes each rendered line to the current stream."""

    def msg(self, message: str) -> None:
        _stream.write(message + "\n")
        _stream.flush()

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


def verbose() -> bool:
    return SETTINGS.log_verbose_level > 0


def configure_logging(
    fmt: str = "console",
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
    global _stream
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
        new_stream = open(checked["log_file"], "a") if checked["log_file"] else sys.stderr
        old, _stream = _stream, new_stream
        if old is not sys.stderr:
            old.close()
    for key, value in checked.items():
        setattr(SETTINGS, key, value)
    return SETTINGS.as_dict()
