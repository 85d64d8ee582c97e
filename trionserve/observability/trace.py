"""Request tracing: Triton's trace settings, sampling, and its JSON trace files.

A :class:`TraceManager` holds the global trace setting and per-model settings with
the semantics of Triton's trace extension (``/v2[/models/{name}]/trace/setting``):
a model setting names only what it overrides and follows the global setting for
the rest; ``null`` (HTTP) or an empty value list (gRPC) clears an override.

Sampling costs an untraced request one attribute check (``TraceManager.active``,
false whenever no setting could sample). A sampled request gets a :class:`Trace`
that collects timestamps from Trio's clock, in nanoseconds: REQUEST_START and
REQUEST_END around the data plane's work, QUEUE_START from the time the scheduler
took the request, and COMPUTE_START / COMPUTE_INPUT_END / COMPUTE_OUTPUT_START /
COMPUTE_END from the measurements the executor already takes for the statistics.

Finished traces are written as Triton writes them (mode ``triton``): a JSON array
of ``{"id", "model_name", "model_version"}`` and ``{"id", "timestamps": [...]}``
objects, into ``trace_file`` at shutdown, or with ``log_frequency`` N into
``trace_file.0``, ``trace_file.1``, ... every N traces (and when ``trace_count``
runs out). Files are written by the manager's writer task in a worker thread,
never on the Trio loop. Mode ``opentelemetry`` exports spans instead when the
OpenTelemetry SDK is installed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import structlog
import trio

from trionserve.core.errors import InvalidArgument, TritonError, Unimplemented

log = structlog.get_logger(__name__)

LEVELS = ("TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
# The settings a client may change, by their protocol names.
_UPDATABLE = ("trace_level", "trace_rate", "trace_count", "log_frequency")
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
# Finished chunks waiting for the writer; beyond it a chunk is written in place.
_WRITE_QUEUE = 256
# OpenTelemetry exporter settings and their defaults (Triton's).
OTEL_DEFAULTS = {
    "url": "http://localhost:4318/v1/traces",
    "bsp_max_queue_size": "2048",
    "bsp_schedule_delay": "5000",
    "bsp_max_export_batch_size": "512",
}


def _ns(seconds: float) -> int:
    """Trio's clock as integer nanoseconds: every trace timestamp is on this clock."""
    return int(seconds * 1_000_000_000)


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


def parse_trace_config(
    settings: Iterable[str],
    *,
    levels: Iterable[str] = (),
    rate: int | None = None,
    count: int | None = None,
    log_frequency: int | None = None,
    file: str | None = None,
) -> TraceConfig:
    """``--trace-config`` values (``<setting>=<value>`` or ``<mode>,<setting>=<value>``)
    plus the deprecated ``--trace-*`` flags, which ``--trace-config`` overrides.

    Raises ValueError with Triton's wording for malformed values.
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
                _parse_int(name, value, 0, _UINT32_MAX)
            if name == "resource" and "=" not in value:
                raise ValueError(
                    "--trace-config opentelemetry,resource=<key>=<value> expects a "
                    f"key=value pair, got {value!r}"
                )
            otel.append((name, value))
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


# -- trace files ------------------------------------------------------------------------


class TraceFile:
    """One trace file name: its index for ``log_frequency`` files, and the main file.

    The main file is opened at its first write (``[`` then traces, ``,`` between
    writes) and closed with ``]`` at shutdown, as Triton does. Its methods run in
    the writer's worker thread, one at a time, in submission order.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.next_index = 0  # taken on the Trio thread when a chunk is queued
        self._handle = None

    def write_indexed(self, path: str, text: str) -> None:
        with open(path, "w") as f:
            f.write("[" + text + "]")

    def append(self, text: str) -> None:
        if self._handle is None:
            self._handle = open(self.name, "w")
            self._handle.write("[" + text)
        else:
            self._handle.write("," + text)
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.write("]")
            self._handle.close()
            self._handle = None


# -- settings -----------------------------------------------------------------------------


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

    def take(self) -> bool:
        """Count one request; True when it is to be traced (every ``rate``-th)."""
        if not self.sampling:
            return False
        self.seen += 1
        if self.seen % self.rate:
            return False
        if self.count > 0:
            self.count -= 1
        self.inflight += 1
        return True


# -- traces -----------------------------------------------------------------------------


class Trace:
    """The activities of one sampled request, in the order they happened."""

    __slots__ = ("id", "setting", "model_name", "model_version", "request_id", "events", "tensors")

    def __init__(
        self, id: int, setting: TraceSetting, model_name: str, model_version: int, request_id: str
    ) -> None:
        self.id = id
        self.setting = setting
        self.model_name = model_name
        self.model_version = model_version
        self.request_id = request_id
        self.events: list[tuple[str, int]] = []
        self.tensors: list[dict] | None = [] if "TENSORS" in setting.level else None

    def timestamp(self, name: str, ns: int) -> None:
        self.events.append((name, ns))

    def compute(self, start: float, end: float, input_ns: int, output_ns: int) -> None:
        """The executor's measurements of the batch this request ran in."""
        start_ns, end_ns = _ns(start), _ns(end)
        self.events += (
            ("COMPUTE_START", start_ns),
            ("COMPUTE_INPUT_END", start_ns + input_ns),
            ("COMPUTE_OUTPUT_START", end_ns - output_ns),
            ("COMPUTE_END", end_ns),
        )

    def tensor(self, activity: str, name: str, datatype: str, data: np.ndarray) -> None:
        if self.tensors is None:
            return
        self.tensors.append(
            {
                "id": self.id,
                "activity": activity,
                "tensor": {
                    "name": name,
                    "data": _tensor_text(datatype, data),
                    "shape": ",".join(str(d) for d in data.shape),
                    "dtype": datatype,
                },
            }
        )

    def to_json(self) -> str:
        """This trace as Triton writes it: comma-separated objects of a JSON array."""
        head: dict = {
            "id": self.id,
            "model_name": self.model_name,
            "model_version": self.model_version,
        }
        if self.request_id:
            head["request_id"] = self.request_id
        objects = [head]
        if "TIMESTAMPS" in self.setting.level:
            objects += (
                {"id": self.id, "timestamps": [{"name": name, "ns": ns}]}
                for name, ns in self.events
            )
        if self.tensors:
            objects += self.tensors
        return ",".join(json.dumps(o, separators=(",", ":")) for o in objects)


def _tensor_text(datatype: str, data: np.ndarray) -> str:
    """Tensor data as Triton's TENSORS traces show it: comma-separated elements."""
    flat = data.reshape(-1)
    if datatype == "BYTES":
        items = (
            x.decode("utf-8", errors="replace") if isinstance(x, (bytes, bytearray)) else str(x)
            for x in flat.tolist()
        )
        return ",".join(f'"{item}"' for item in items)
    if datatype in ("FP16", "BF16"):
        return ""  # Triton leaves half-precision data out of traces
    if datatype == "BOOL":
        return ",".join("1" if x else "0" for x in flat.tolist())
    if datatype in ("FP32", "FP64"):
        return ",".join(f"{x:g}" for x in flat.tolist())
    return ",".join(str(x) for x in flat.tolist())


def record_compute(
    traces: dict, requests, start: float, end: float, input_ns: int, output_ns: int
) -> None:
    """Give the traced requests of one batch the batch's compute timestamps."""
    for request in requests:
        trace = traces.get(request)
        if trace is not None:
            trace.compute(start, end, input_ns, output_ns)


# -- the manager --------------------------------------------------------------------------


class _Clear:
    """A setting named with null (HTTP) or no values (gRPC): drop the override."""


CLEAR = _Clear()


class TraceManager:
    """The trace settings of the server, sampling, and the writer of trace files.

    Owns the settings (global and per model), the trace files by name, and one
    writer task (``run``) that writes finished chunks in a worker thread, in
    order. Every method other than ``run`` is synchronous and runs on the Trio
    thread. ``aclose`` writes what is buffered and closes the files.
    """

    def __init__(self, config: TraceConfig | None = None, *, span_processor=None) -> None:
        """``span_processor``: where opentelemetry mode sends its spans (tests);
        by default an OTLP/HTTP exporter behind a batch processor."""
        config = config or TraceConfig()
        self.config = config
        self._files: dict[str, TraceFile] = {}
        file = self._file(config.file)
        defaults = (config.level, config.rate, config.count, config.log_frequency, file, config.mode)
        self._default = TraceSetting(*defaults)
        self._global = TraceSetting(*defaults)
        self._models: dict[str, TraceSetting] = {}
        self._follows_global: set[str] = set()
        self._retired: list[TraceSetting] = []
        self._next_id = 1
        self._send: trio.MemorySendChannel | None = None
        self._writer_done = trio.Event()
        self._otel = None
        if config.mode == "opentelemetry":
            self._otel = OpenTelemetryExporter(dict(config.opentelemetry), span_processor)
        self.active = False
        self._refresh()

    # -- settings (the trace extension) ---------------------------------------------

    def settings(self, model_name: str = "") -> dict[str, str | list[str]]:
        """The setting in force for a model (or the global one), as Triton lists it."""
        setting = self._models.get(model_name, self._global) if model_name else self._global
        levels = [level for level in LEVELS if level in setting.level] or ["OFF"]
        out: dict[str, str | list[str]] = {
            "trace_level": levels,
            "trace_rate": str(setting.rate),
            "trace_count": str(setting.count),
        }
        if setting.mode == "triton":
            out["log_frequency"] = str(setting.log_frequency)
            out["trace_file"] = setting.file.name
        out["trace_mode"] = setting.mode
        if setting.mode == "opentelemetry":
            for key, value in self.config.opentelemetry:
                out[key] = value
            for key, value in OTEL_DEFAULTS.items():
                out.setdefault(key, value)
        return out

    def update(self, model_name: str, changes: dict[str, list[str] | None]) -> None:
        """Apply a trace-extension request: setting name -> values (None: clear).

        Every value is checked before anything changes. A model's first update
        takes what it does not name from the global setting; a global update
        passes on to the models that follow it in some field.
        """
        parsed = _parse_changes(changes)
        self._update(model_name, parsed)
        if not model_name:
            for name in sorted(self._follows_global):
                self._update(name, {})
        self._refresh()

    def _update(self, model_name: str, new: dict) -> None:
        if model_name:
            current = self._models.get(model_name)
            fallback = self._global
        else:
            current = self._global
            fallback = self._default
        values = {
            "level": fallback.level,
            "rate": fallback.rate,
            "count": fallback.count,
            "log_frequency": fallback.log_frequency,
        }
        specified = set()
        for key in values:
            change = new.get(key)
            if change is CLEAR:
                continue
            if key in new:
                values[key] = change
                specified.add(key)
            elif current is not None and key in current.specified:
                values[key] = getattr(current, key)
                specified.add(key)
        if model_name:
            if not specified:
                # Nothing of its own left: the model follows the global setting.
                self._follows_global.discard(model_name)
                old = self._models.pop(model_name, None)
                if old is not None:
                    self._retire(old)
                return
            if len(specified) == len(values):
                self._follows_global.discard(model_name)
            else:
                self._follows_global.add(model_name)
        setting = TraceSetting(
            values["level"],
            values["rate"],
            values["count"],
            values["log_frequency"],
            fallback.file,
            fallback.mode,
            frozenset(specified),
        )
        reason = setting.invalid_reason()
        if reason and setting.level:
            raise InvalidArgument(f"Attempting to set invalid trace setting :{reason}")
        if model_name:
            self._models[model_name] = setting
        else:
            self._global = setting
        if current is not None:
            self._retire(current)

    def _refresh(self) -> None:
        self.active = self._global.sampling or any(s.sampling for s in self._models.values())

    def _file(self, name: str) -> TraceFile:
        file = self._files.get(name)
        if file is None:
            file = self._files[name] = TraceFile(name)
        return file

    # -- sampling (the data plane) ---------------------------------------------------

    def start(self, model, request) -> Trace | None:
        """Sample a request about to be queued; a Trace with REQUEST_START if taken.

        Call only when ``active``. The trace is registered on the model version's
        statistics so that the executor adds the compute timestamps.
        """
        setting = self._models.get(model.name, self._global) if self._models else self._global
        if not setting.take():
            return None
        if setting.count == 0:
            self._refresh()
        trace = Trace(self._next_id, setting, model.name, model.version, request.id)
        self._next_id += 1
        trace.timestamp("REQUEST_START", _ns(trio.current_time()))
        if trace.tensors is not None:
            for tensor in request.inputs.values():
                trace.tensor("TENSOR_QUEUE_INPUT", tensor.name, tensor.datatype, tensor.data)
        model.statistics.traces[request] = trace
        return trace

    def finish(self, trace: Trace, model, request, response=None) -> None:
        """The request has its outcome: REQUEST_END, then the trace is written."""
        model.statistics.traces.pop(request, None)
        end = _ns(trio.current_time())
        if request.arrival_time:
            trace.events.insert(1, ("QUEUE_START", _ns(request.arrival_time)))
        trace.timestamp("REQUEST_END", end)
        if response is not None and trace.tensors is not None:
            for tensor in response.outputs:
                trace.tensor("TENSOR_BACKEND_OUTPUT", tensor.name, tensor.datatype, tensor.data)
        setting = trace.setting
        setting.inflight -= 1
        if setting.mode == "opentelemetry":
            if self._otel is not None:
                self._otel.export(trace)
            return
        setting.buffer.append(trace.to_json())
        if setting.log_frequency and len(setting.buffer) >= setting.log_frequency:
            self._save(setting, indexed=True)
        elif setting.count == 0 and setting.inflight == 0:
            # The last trace this setting will take: write them all now.
            self._save(setting, indexed=True)
        if setting.inflight == 0 and setting in self._retired:
            self._save(setting, indexed=setting.log_frequency != 0)
            self._retired.remove(setting)

    def _retire(self, setting: TraceSetting) -> None:
        if setting.buffer:
            self._save(setting, indexed=setting.log_frequency != 0)
        if setting.inflight:
            self._retired.append(setting)

    # -- writing -------------------------------------------------------------------------

    def _save(self, setting: TraceSetting, indexed: bool) -> None:
        if not setting.buffer:
            return
        text = ",".join(setting.buffer)
        setting.buffer = []
        file = setting.file
        if indexed:
            path = f"{file.name}.{file.next_index}"
            file.next_index += 1
            self._write(file.write_indexed, path, text)
        else:
            self._write(file.append, text)

    def _write(self, function, *args) -> None:
        if self._send is not None:
            try:
                self._send.send_nowait((function, args))
                return
            except trio.WouldBlock:
                log.warning("trace writer is behind; writing a trace chunk in place")
            except trio.ClosedResourceError:
                pass
        _run_write(function, args)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The writer: writes queued chunks in a worker thread until ``aclose``.

        If it is cancelled first, what is queued is written before it ends.
        """
        self._send, receive = trio.open_memory_channel(_WRITE_QUEUE)
        self._writer_done = trio.Event()
        task_status.started()
        job = None
        try:
            async for job in receive:
                # Cancellation can only strike before the thread starts the job
                # (then ``job`` is still set, and is written below).
                await trio.to_thread.run_sync(_run_write, *job)
                job = None
        finally:
            self._send.close()
            if job is not None:
                _run_write(*job)
            while True:
                try:
                    job = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                _run_write(*job)
            self._writer_done.set()

    async def aclose(self) -> None:
        """Write every buffered trace, close the trace files, stop the writer."""
        settings = [self._global, *self._models.values(), *self._retired]
        for setting in settings:
            self._save(setting, indexed=setting.log_frequency != 0)
        self._retired.clear()
        for file in self._files.values():
            self._write(file.close)
        if self._send is not None:
            self._send.close()
            await self._writer_done.wait()
        if self._otel is not None:
            await trio.to_thread.run_sync(self._otel.shutdown)


def _run_write(function, args) -> None:
    try:
        function(*args)
    except OSError as exc:
        log.error("failed writing trace file", error=str(exc))


def _parse_changes(changes: dict[str, list[str] | None]) -> dict:
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


# -- OpenTelemetry ------------------------------------------------------------------------


class OpenTelemetryExporter:
    """Spans for finished traces, through the OpenTelemetry SDK's batch processor.

    Each trace becomes a root ``InferRequest`` span, a span named after the model
    from REQUEST_START to REQUEST_END, and a ``compute`` span, with the
    timestamps as events and ``triton.*`` attributes, as Triton exports them.
    Needs ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``
    (or a span processor given for tests).
    """

    def __init__(self, settings: dict[str, str], processor=None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise TritonError(
                "trace mode opentelemetry needs the OpenTelemetry SDK: install "
                "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http "
                f"({exc})"
            ) from None
        attributes = {"service.name": "triton-inference-server"}
        for key, value in settings.items():
            if key == "resource":
                name, _, val = value.partition("=")
                attributes[name] = val
        if processor is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError as exc:
                raise TritonError(
                    "trace mode opentelemetry needs opentelemetry-exporter-otlp-proto-http "
                    f"({exc})"
                ) from None
            merged = {**OTEL_DEFAULTS, **settings}
            processor = BatchSpanProcessor(
                OTLPSpanExporter(endpoint=merged["url"]),
                max_queue_size=int(merged["bsp_max_queue_size"]),
                schedule_delay_millis=int(merged["bsp_schedule_delay"]),
                max_export_batch_size=int(merged["bsp_max_export_batch_size"]),
            )
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("triton-server")
        # Trio's clock has its own origin; spans carry wall-clock nanoseconds.
        self._offset: int | None = None

    def export(self, trace: Trace) -> None:
        from opentelemetry import trace as otel

        if self._offset is None:
            self._offset = time.time_ns() - _ns(trio.current_time())
        wall = self._offset
        events = dict(trace.events)
        start = events.get("REQUEST_START", trace.events[0][1]) + wall
        end = events.get("REQUEST_END", trace.events[-1][1]) + wall
        root = self._tracer.start_span("InferRequest", start_time=start)
        context = otel.set_span_in_context(root)
        model = self._tracer.start_span(trace.model_name, context=context, start_time=start)
        model.set_attribute("triton.model_name", trace.model_name)
        model.set_attribute("triton.model_version", trace.model_version)
        model.set_attribute("triton.trace_id", trace.id)
        model.set_attribute("triton.trace_parent_id", 0)
        if trace.request_id:
            model.set_attribute("triton.request_id", trace.request_id)
        compute = None
        for name, ns in trace.events:
            if name == "COMPUTE_START":
                compute = self._tracer.start_span(
                    "compute", context=otel.set_span_in_context(model), start_time=ns + wall
                )
            target = compute if compute is not None and name.startswith("COMPUTE") else model
            target.add_event(name, timestamp=ns + wall)
            if name == "COMPUTE_END" and compute is not None:
                compute.end(end_time=ns + wall)
                compute = None
        model.end(end_time=end)
        root.end(end_time=end)

    def shutdown(self) -> None:
        self._provider.shutdown()
