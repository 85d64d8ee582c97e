"""Request tracing: the TraceManager, which holds Triton's trace settings and samples.

A :class:`TraceManager` holds the global trace setting and per-model settings with
the semantics of Triton's trace extension (``/v2[/models/{name}]/trace/setting``):
a model setting names only what it overrides and follows the global setting for
the rest; ``null`` (HTTP) or an empty value list (gRPC) clears an override.

Sampling costs an untraced request one attribute check (``TraceManager.active``,
false whenever no setting could sample). A sampled request gets a
:class:`~trionserve.observability.trace.trace_file.Trace`, with its frontend's
timestamps when the frontend took them (:mod:`.frontend`); the trace is written
once the data plane and that frontend are both done with it. Finished traces go to
the Triton trace files (:mod:`.trace_file`, mode ``triton``) or, in mode
``opentelemetry``, to :mod:`.opentelemetry_exporter` as spans.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import trio

from trionserve.core.errors import Cancelled, InvalidArgument, TritonError
from trionserve.observability.trace.frontend import FrontendStamps, now_ns
from trionserve.observability.trace.opentelemetry_exporter import OpenTelemetryExporter
from trionserve.observability.trace.settings import (
    CLEAR,
    LEVELS,
    OTEL_DEFAULTS,
    TraceConfig,
    TraceSetting,
    parse_changes,
)
from trionserve.observability.trace.trace_file import Trace, TraceFileWriter, clock_ns

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

    from trionserve.core.inference import InferenceRequest, InferenceResponse
    from trionserve.observability.statistics import ObservedVersion

# Finished traces held in memory (all settings together) before they are written:
# past it they are written at once, not at log_frequency, the count's end or
# shutdown. A client can turn TENSORS tracing on with count -1 and log_frequency
# 0, which Triton holds until OFF without a bound.
MAX_BUFFERED_TRACE_BYTES = 16 << 20


class TraceManager:
    """The trace settings of the server, sampling, and the writer of trace files.

    Owns the settings (global and per model), the trace files by name, and one
    writer task (``run``) that writes finished chunks in a worker thread, in
    order. Every method other than ``run`` is synchronous and runs on the Trio
    thread. ``aclose`` writes what is buffered and closes the files.
    """

    def __init__(
        self, config: TraceConfig | None = None, *, span_processor: SpanProcessor | None = None
    ) -> None:
        """``span_processor``: where opentelemetry mode sends its spans (tests);
        by default an OTLP/HTTP exporter behind a batch processor."""
        config = config or TraceConfig()
        self.config = config
        self._writer = TraceFileWriter()
        file = self._writer.file(config.file)
        defaults = (
            config.level,
            config.rate,
            config.count,
            config.log_frequency,
            file,
            config.mode,
        )
        self._default = TraceSetting(*defaults)
        self._global = TraceSetting(*defaults)
        self._models: dict[str, TraceSetting] = {}
        self._follows_global: set[str] = set()
        self._retired: list[TraceSetting] = []
        self._next_id = 1
        self._buffered_bytes = 0  # finished traces not yet handed to the writer
        self._otel = None
        if config.mode == "opentelemetry":
            self._otel = OpenTelemetryExporter(config.opentelemetry, span_processor)
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
        parsed = parse_changes(changes)
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
        values: dict[str, Any] = {
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
        self.active = any(
            s.sampling or s.propagates for s in (self._global, *self._models.values())
        )

    # -- sampling (the data plane) ---------------------------------------------------

    def start(
        self,
        model: ObservedVersion,
        request: InferenceRequest,
        frontend: FrontendStamps | None = None,
    ) -> Trace | None:
        """Sample a request about to be queued; a Trace with REQUEST_START if taken.

        Call only when ``active``. The trace is registered on the model version's
        statistics so that the executor adds the compute timestamps. With the
        ``frontend``'s timestamps, the trace is written once the frontend too
        released it (see :mod:`.frontend`).
        """
        setting = self._models.get(model.name, self._global) if self._models else self._global
        if not setting.take(frontend is not None and frontend.traceparent is not None):
            return None
        if setting.count == 0:
            self._refresh()
        trace = self._begin(setting, model, request, None, frontend)
        if frontend is not None and frontend.attach(trace, self._let_go):
            trace.frontend = frontend
            trace.holders += 1
        return trace

    @staticmethod
    def now_ns() -> int:
        """Now on the traces' clock (a frontend's HTTP_RECV_START)."""
        return now_ns()

    def start_child(
        self, model: ObservedVersion, parent: Trace, request: InferenceRequest
    ) -> Trace:
        """The trace of a request an ensemble made for one of its steps while it
        was traced: taken whatever the sampling, with the parent's setting and the
        next id, its ``parent_id`` the ensemble request's trace (core
        InferenceTrace::SpawnChildTrace, ensemble_scheduler.cc)."""
        setting = parent.setting
        setting.inflight += 1
        return self._begin(setting, model, request, parent)

    def _begin(
        self,
        setting: TraceSetting,
        model: ObservedVersion,
        request: InferenceRequest,
        parent: Trace | None,
        frontend: FrontendStamps | None = None,
    ) -> Trace:
        parent_id = None if parent is None else parent.id
        trace = Trace(self._next_id, setting, model.name, model.version, request.id, parent_id)
        self._next_id += 1
        trace.timestamp("REQUEST_START", now_ns())
        if self._otel is not None:
            # Its spans' ids and the trace context its model is handed.
            self._otel.begin(trace, parent, frontend)
        if trace.tensors is not None:
            for tensor in request.inputs.values():
                trace.tensor("TENSOR_QUEUE_INPUT", tensor.name, tensor.datatype, tensor.data)
        model.statistics.traces[request] = trace
        return trace

    def finish(
        self,
        trace: Trace,
        model: ObservedVersion,
        request: InferenceRequest,
        response: InferenceResponse | None = None,
    ) -> None:
        """The request has its outcome: REQUEST_END, then the trace is written
        (once its model is done with it, if it still runs it: ``Trace.running``)."""
        if trace.running:
            trace.finish_later = functools.partial(self.finish, trace, model, request, response)
            return
        model.statistics.traces.pop(request, None)
        end = now_ns()
        if request.arrival_time:
            trace.events.insert(1, ("QUEUE_START", clock_ns(request.arrival_time)))
        trace.timestamp("REQUEST_END", end)
        if response is not None and trace.tensors is not None:
            for tensor in response.outputs:
                trace.tensor("TENSOR_BACKEND_OUTPUT", tensor.name, tensor.datatype, tensor.data)
        if self._otel is not None:
            self._otel.end_request(trace)  # the model span ends at REQUEST_END
        self._let_go(trace)

    def answered_with_error(self, trace: Trace, error: BaseException) -> None:
        """The model answered the request with an error. Triton's frontends take
        INFER_RESPONSE_COMPLETE for an error response as for any other (server
        src/http_server.cc InferRequestClass::InferResponseComplete, src/grpc/
        infer_handler.cc ModelInferHandler::InferResponseComplete); a cancelled
        request gets no response, so none (infer_handler.cc: a cancelled context
        skips the response)."""
        if (
            trace.frontend is not None
            and isinstance(error, TritonError)
            and not isinstance(error, Cancelled)
        ):
            trace.frontend.response_complete()

    def _let_go(self, trace: Trace) -> None:
        """The data plane or the frontend is done with the trace: written once
        neither holds it."""
        trace.holders -= 1
        if trace.holders:
            return
        setting = trace.setting
        setting.inflight -= 1
        if setting.mode == "opentelemetry":
            if self._otel is not None:
                self._otel.end_root(trace)
            return
        text = trace.to_json()
        setting.buffer.append(text)
        self._buffered_bytes += len(text)
        if setting.log_frequency and len(setting.buffer) >= setting.log_frequency:
            self._save(setting, indexed=True)
        elif self._buffered_bytes > MAX_BUFFERED_TRACE_BYTES:
            # Written now rather than held until log_frequency, the count's end
            # or shutdown: what waits in memory stays bounded.
            for held in self._settings():
                self._save(held, indexed=held.log_frequency != 0)
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

    def _settings(self) -> list[TraceSetting]:
        return [self._global, *self._models.values(), *self._retired]

    def _save(self, setting: TraceSetting, indexed: bool) -> None:
        if setting.buffer:
            self._buffered_bytes -= sum(len(text) for text in setting.buffer)
            text = ",".join(setting.buffer)
            setting.buffer = []
            self._writer.write(setting.file, text, indexed=indexed)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The trace-file writer's task, until ``aclose`` (see TraceFileWriter.run)."""
        await self._writer.run(task_status=task_status)

    async def aclose(self) -> None:
        """Write every buffered trace, close the trace files, stop the writer."""
        for setting in self._settings():
            self._save(setting, indexed=setting.log_frequency != 0)
        self._retired.clear()
        await self._writer.aclose()
        if self._otel is not None:
            await trio.to_thread.run_sync(self._otel.shutdown)
