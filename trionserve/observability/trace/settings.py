"""Trace settings: ``--trace-config`` at startup, and the trace extension's settings.

:class:`TraceConfig` is what the command line asked for (Triton's ``--trace-config``
spellings and messages, see :func:`parse_trace_config`). :class:`TraceSetting` is
one setting in force (global or per model) with its sampling state;
:func:`parse_changes` checks a trace-extension request
(``/v2[/models/{name}]/trace/setting``) with Triton's messages.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trionserve.core.errors import InvalidArgument, Unimplemented

if TYPE_CHECKING:
    from trionserve.observability.trace.trace_file import TraceFile

LEVELS = ("TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
# The settings a client may change, by their protocol names.
_UPDATABLE = ("trace_level", "trace_rate", "trace_count", "log_frequency")
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
# OpenTelemetry exporter settings and their defaults (Triton's).
OTEL_DEFAULTS = {
    "url": "http://localhost:4318/v1/traces",
    "bsp_max_queue_size": "2048",
    "bsp_schedule_delay": "5000",
    "bsp_max_export_batch_size": "512",
}


# -- startup configuration (--trace-config) -------------------------------------------


@dataclass(frozen=True)
class TraceConfig:
    """Trace settings at startup, from tritonserver's ``--trace-config`` flags."""

    level: frozenset[str] = frozenset()  # empty: OFF
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    mode: str = "triton"
    # opentelemetry,<setting>=<value>: url, resource (repeatable), bsp_*.
    opentelemetry: tuple[tuple[str, str], ...] = field(default_factory=tuple)


def _parse_level(value: str) -> str | None:
    """A ``level`` value: a level name, or None for OFF (Triton's spellings)."""
    lowered = value.strip().lower()
    if lowered in ("off", "false"):
        return None
    if lowered in ("timestamps", "true", "on", "min", "max"):
        return "TIMESTAMPS"
    if lowered == "tensors":
        return "TENSORS"
    raise ValueError(f"invalid value for trace level option: {value}")


def _parse_int(setting: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"invalid value for trace setting {setting}: {value!r}") from None
    if not low <= number <= high:
        raise ValueError(f"trace setting {setting} must be in [{low}, {high}], got {number}")
    return number


def _parse_bsp(option: str, setting: str, value: str) -> int:
    """A BatchSpanProcessor setting, a uint32, refused in Triton's words."""
    try:
        return _parse_int(setting, value, 0, _UINT32_MAX)
    except ValueError as exc:
        raise ValueError(f"Bad option: {option}.\n{exc}") from None


def parse_trace_config(
    settings: Iterable[str],
    *,
    levels: Iterable[str] = (),
    rate: int | None = None,
    count: int | None = None,
    log_frequency: int | None = None,
    file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> TraceConfig:
    """``--trace-config`` values (``<setting>=<value>`` or ``<mode>,<setting>=<value>``)
    plus the deprecated ``--trace-*`` flags, which ``--trace-config`` overrides.

    In mode ``opentelemetry`` a ``bsp_*`` setting the flags leave out is taken
    from ``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_SCHEDULE_DELAY`` or
    ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` in ``environ`` (the process's by default),
    as Triton does (server command_line_parser.cc
    ProcessOpenTelemetryBatchSpanProcessorArgs).

    Raises ValueError with Triton's wording for malformed values: a bad
    ``bsp_*`` value is 'Bad option: "--trace-config opentelemetry,<setting>"',
    a bad environment value 'Bad option: "OTEL_BSP_<SETTING>"'.
    """
    chosen: set[str] = set()
    disabled = False
    for value in levels:
        parsed = _parse_level(value)
        disabled |= parsed is None
        if parsed:
            chosen.add(parsed)
    values: dict = {"rate": rate, "count": count, "log_frequency": log_frequency, "file": file}
    mode = "triton"
    otel: list[tuple[str, str]] = []
    for setting in settings:
        scope, name, value = _split_trace_config(setting)
        if scope == "":
            if name == "level":
                parsed = _parse_level(value)
                disabled |= parsed is None
                if parsed:
                    chosen.add(parsed)
            elif name == "rate":
                values["rate"] = _parse_int("rate", value, 0, _UINT32_MAX)
            elif name == "count":
                values["count"] = _parse_int("count", value, -1, _INT32_MAX)
            elif name == "mode":
                mode = value.strip().lower()
                if mode not in MODES:
                    raise ValueError(
                        f"invalid value for trace mode option: {value}. Available "
                        'options are "triton" and "opentelemetry"'
                    )
            else:
                raise ValueError(f"unknown trace setting '{name}' in --trace-config {setting}")
        elif scope == "triton":
            if name == "file":
                values["file"] = value
            elif name == "log-frequency":
                values["log_frequency"] = _parse_int("log-frequency", value, 0, _UINT32_MAX)
            else:
                raise ValueError(f"unknown triton trace setting '{name}' in --trace-config")
        else:
            if name not in ("url", "resource") and name not in OTEL_DEFAULTS:
                raise ValueError(f"unknown opentelemetry trace setting '{name}' in --trace-config")
            if name.startswith("bsp_"):
                _parse_bsp(f'"--trace-config opentelemetry,{name}"', name, value)
            if name == "resource" and "=" not in value:
                raise ValueError(
                    "--trace-config opentelemetry,resource=<key>=<value> expects a "
                    f"key=value pair, got {value!r}"
                )
            otel.append((name, value))
    if mode == "opentelemetry":
        given = {name for name, _ in otel}
        env = os.environ if environ is None else environ
        for name in OTEL_DEFAULTS:
            variable = "OTEL_" + name.upper()
            if name.startswith("bsp_") and name not in given and variable in env:
                _parse_bsp(f'"{variable}"', name, env[variable])
                otel.append((name, env[variable]))
    level = frozenset() if disabled else frozenset(chosen)
    return TraceConfig(
        level=level,
        rate=1000 if values["rate"] is None else values["rate"],
        count=-1 if values["count"] is None else values["count"],
        log_frequency=0 if values["log_frequency"] is None else values["log_frequency"],
        file=values["file"] or "",
        mode=mode,
        opentelemetry=tuple(otel),
    )


def _split_trace_config(setting: str) -> tuple[str, str, str]:
    comma = setting.find(",")
    scope = ""
    rest = setting
    if comma == 0:
        raise ValueError(
            "No trace mode specified. --trace-config option format is "
            f"<trace mode>,<setting>=<value> or <setting>=<value>. Got {setting}"
        )
    equal = setting.find("=")
    if comma > 0 and (equal < 0 or comma < equal):
        scope = setting[:comma].strip().lower()
        if scope not in MODES:
            raise ValueError(
                f"invalid value for trace mode option: {setting[:comma]}. Available "
                'options are "triton" and "opentelemetry"'
            )
        rest = setting[comma + 1 :]
    name, sep, value = rest.partition("=")
    if not sep or not name or not value:
        raise ValueError(
            f"--trace-config option format is '<trace mode>,<setting>=<value>'. Got {setting}"
        )
    return scope, name.strip(), value


# -- the settings in force ------------------------------------------------------------


class TraceSetting:
    """One trace configuration and the traces sampled under it.

    Replaced whole when a client changes it; traces sampled under an old setting
    finish under it, and its buffered traces are written when it is retired.
    ``specified`` names the fields set for this scope itself (the rest follow the
    global setting, or Triton's defaults for the global setting).
    """

    __slots__ = (
        "level",
        "rate",
        "count",
        "log_frequency",
        "file",
        "mode",
        "specified",
        "seen",
        "inflight",
        "buffer",
    )

    def __init__(
        self,
        level: frozenset[str],
        rate: int,
        count: int,
        log_frequency: int,
        file: TraceFile,
        mode: str,
        specified: frozenset[str] = frozenset(),
    ) -> None:
        self.level = level
        self.rate = rate
        self.count = count
        self.log_frequency = log_frequency
        self.file = file
        self.mode = mode
        self.specified = specified
        self.seen = 0  # requests considered for sampling
        self.inflight = 0  # sampled traces not yet finished
        self.buffer: list[str] = []  # finished traces not yet written

    def invalid_reason(self) -> str:
        if not self.level:
            return "tracing is disabled"
        if self.rate == 0:
            return "sample rate must be non-zero"
        if self.mode == "triton" and not self.file.name:
            return "trace file name is not given"
        return ""

    @property
    def sampling(self) -> bool:
        return self.count != 0 and not self.invalid_reason()

    @property
    def propagates(self) -> bool:
        """Mode opentelemetry with tracing on: a request carrying its client's
        trace context is traced whatever the rate and count (Triton's
        workaround, server src/tracer.cc TraceSetting::SampleTrace ``force_sample``:
        with rate 0 only such requests are traced)."""
        return self.mode == "opentelemetry" and bool(self.level)

    def take(self, forced: bool = False) -> bool:
        """Count one request; True when it is to be traced (every ``rate``-th, or
        ``forced``: it carries a trace context and :attr:`propagates`)."""
        forced = forced and self.propagates
        if not (self.sampling or forced):
            return False
        hit = False
        if self.rate:
            self.seen += 1
            hit = self.seen % self.rate == 0 and self.count != 0
            if hit and self.count > 0:
                self.count -= 1
        if not (hit or forced):
            return False
        self.inflight += 1
        return True


# -- the trace extension ----------------------------------------------------------------


class _Clear:
    """A setting named with null (HTTP) or no values (gRPC): drop the override."""


CLEAR = _Clear()


def parse_changes(changes: dict[str, list[str] | None]) -> dict:
    """Trace-extension settings (values as lists of strings, None to clear) into
    TraceSetting fields, with Triton's checks and messages."""
    parsed: dict = {}
    for key, values in changes.items():
        if key == "trace_file":
            raise Unimplemented("trace file location can not be updated through network protocol")
        if key not in _UPDATABLE:
            raise InvalidArgument(f"unknown trace setting '{key}'")
        if values is None:
            parsed[_FIELD[key]] = CLEAR
            continue
        if key == "trace_level":
            if "OFF" in values:
                if len(values) != 1:
                    raise InvalidArgument("Expect only one trace level 'OFF' is specified")
                parsed["level"] = frozenset()
                continue
            unknown = [v for v in values if v not in LEVELS]
            if unknown:
                raise InvalidArgument(
                    f"invalid trace level {unknown[0]!r}: expected OFF, TIMESTAMPS or TENSORS"
                )
            parsed["level"] = frozenset(values)
            continue
        if len(values) != 1:
            raise InvalidArgument(f"expect only 1 value for '{key}'")
        low = -1 if key == "trace_count" else 0
        high = _INT32_MAX if key == "trace_count" else _UINT32_MAX
        try:
            number = int(values[0])
        except ValueError:
            raise InvalidArgument(f"Unable to parse '{key}', got: {values[0]}") from None
        if not low <= number <= high:
            raise InvalidArgument(
                f"Unable to parse '{key}', value is out of range [ {low}, {high} ], "
                f"got: {values[0]}"
            )
        parsed[_FIELD[key]] = number
    return parsed


_FIELD = {
    "trace_level": "level",
    "trace_rate": "rate",
    "trace_count": "count",
    "log_frequency": "log_frequency",
}


def settings_from_json(body: dict) -> dict[str, list[str] | None]:
    """An HTTP trace setting request: values are strings, lists of strings, or null."""
    changes: dict[str, list[str] | None] = {}
    for key, value in body.items():
        if value is None:
            changes[key] = None
        elif isinstance(value, str):
            changes[key] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            changes[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            # Triton wants strings; numbers are what a user means.
            changes[key] = [str(value)]
        else:
            raise InvalidArgument(
                f"trace setting '{key}' must be a string, a list of strings or null, "
                f"got {json.dumps(value)}"
            )
    return changes


def settings_to_grpc(settings: dict[str, str | list[str]]) -> dict[str, list[str]]:
    return {k: (v if isinstance(v, list) else [v]) for k, v in settings.items()}
