"""Trace mode ``opentelemetry``: finished traces exported as OpenTelemetry spans.

Needs the optional OpenTelemetry SDK (the ``otel`` extra); the SDK is imported
only when this mode is chosen.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
import trio

from trionserve.core.errors import TritonError
from trionserve.observability.trace.settings import OTEL_DEFAULTS
from trionserve.observability.trace.trace_file import Trace, clock_ns

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

log = structlog.get_logger(__name__)


class _DroppedSpans(logging.Handler):
    """The SDK's batch processor dropping a span for a full queue, logged in the
    words of opentelemetry-cpp's, which Triton's log shows (qa/L0_trace greps
    ``BatchSpanProcessor queue is full - dropping span.``)."""

    def emit(self, record: logging.LogRecord) -> None:
        # The SDK's words: "Queue full, dropping span." (1.3x+), "Queue is full,
        # likely spans will be dropped." (older).
        if str(record.msg).startswith(("Queue full", "Queue is full")):
            log.warning("BatchSpanProcessor queue is full - dropping span.")


_DROPPED_SPANS = _DroppedSpans()


def report_dropped_spans() -> None:
    """Route the SDK's full-queue warnings through :class:`_DroppedSpans` (once)."""
    sdk = logging.getLogger("opentelemetry.sdk")
    if _DROPPED_SPANS not in sdk.handlers:
        sdk.addHandler(_DROPPED_SPANS)


def batch_options(settings: dict[str, str]) -> dict[str, int]:
    """The batch span processor's arguments from the ``bsp_*`` settings.
    opentelemetry-cpp takes an export batch larger than the queue (a batch is at
    most what the queue holds; qa/L0_trace starts Triton with
    ``bsp_max_queue_size=1``); the Python SDK refuses one, so it is capped. A
    ``bsp_schedule_delay`` of 0 (opentelemetry-cpp: export without waiting;
    qa/L0_trace gives it) is 1 ms, the SDK's smallest."""
    queue = int(settings["bsp_max_queue_size"])
    return {
        "max_queue_size": queue,
        "schedule_delay_millis": max(int(settings["bsp_schedule_delay"]), 1),
        "max_export_batch_size": min(int(settings["bsp_max_export_batch_size"]), queue),
    }


def otlp_endpoint(url: str) -> str:
    """The collector's URL as Triton's exporter reaches it. Triton hands
    ``--trace-config opentelemetry,url=`` to opentelemetry-cpp's OTLP/HTTP exporter
    as it is (server src/tracer.cc:515), whose curl client takes a URL without a
    scheme as http (L0_trace: ``url=localhost:10000/v1/traces``); the Python
    exporter's client needs the scheme."""
    return url if "://" in url else f"http://{url}"


# Model spans kept for children finishing after their parent, and children
# waiting for their parent: at most this many each.
_MAX_KEPT = 4096


class OpenTelemetryExporter:
    """Spans for finished traces, through the OpenTelemetry SDK's batch processor.

    Each trace becomes a root ``InferRequest`` span (the frontend's timestamps,
    HTTP_RECV_START ..., its events), a span named after the model from
    REQUEST_START to REQUEST_END, a ``compute`` span and a span per custom
    activity a backend reported (``X_START`` ... ``X_END``), with the timestamps
    as events and ``triton.*`` attributes, as Triton exports them.
    Needs ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``
    (or a span processor given for tests).
    """

    def __init__(
        self, settings: Sequence[tuple[str, str]], processor: SpanProcessor | None = None
    ) -> None:
        """``settings``: the ``opentelemetry,<name>=<value>`` pairs in order; every
        ``resource`` pair is a resource attribute (Triton takes each one given,
        server src/command_line_parser.cc)."""
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
        for key, value in settings:
            if key == "resource":
                name, _, val = value.partition("=")
                attributes[name] = val
        if processor is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as exc:
                raise TritonError(
                    f"trace mode opentelemetry needs opentelemetry-exporter-otlp-proto-http ({exc})"
                ) from None
            merged = {**OTEL_DEFAULTS, **dict(settings)}
            options = batch_options(merged)
            processor = BatchSpanProcessor(
                OTLPSpanExporter(endpoint=otlp_endpoint(merged["url"])),
                max_queue_size=options["max_queue_size"],
                schedule_delay_millis=options["schedule_delay_millis"],
                max_export_batch_size=options["max_export_batch_size"],
            )
            report_dropped_spans()
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("triton-server")
        # Trio's clock has its own origin; spans carry wall-clock nanoseconds.
        self._offset: int | None = None
        # A child trace (an ensemble's step, a BLS request given the request's
        # trace) is a span of its parent's model span, as in Triton (server
        # src/tracer.cc Trace::StartSpan: a child's REQUEST_START span takes its
        # parent trace's span as parent; only a trace with no parent has the root
        # InferRequest span). Children usually finish first: they wait for their
        # parent here; the model spans of exported traces are kept for children
        # finishing later. Both bounded.
        self._model_spans: OrderedDict[int, Any] = OrderedDict()
        self._waiting: dict[int, list[Trace]] = {}
        self._waiting_count = 0

    def export(self, trace: Trace) -> None:
        from opentelemetry import trace as otel

        parent = trace.parent_id
        if parent is None:
            self._export(trace, None)
        elif parent in self._model_spans:
            self._export(trace, otel.set_span_in_context(self._model_spans[parent]))
        elif self._waiting_count < _MAX_KEPT:
            self._waiting.setdefault(parent, []).append(trace)
            self._waiting_count += 1
        else:  # a parent that never came: exported on its own
            self._export(trace, None)

    def _export(self, trace: Trace, parent: Any) -> None:
        from opentelemetry import trace as otel

        if self._offset is None:
            self._offset = time.time_ns() - clock_ns(trio.current_time())
        wall = self._offset
        events = dict(trace.events)
        start = events.get("REQUEST_START", trace.events[0][1]) + wall
        end = events.get("REQUEST_END", trace.events[-1][1]) + wall
        # The frontend's timestamps are the root span's events, as Triton's
        # Trace::CaptureTimestamp adds them (server src/tracer.cc), and it spans them.
        frontend = trace.frontend
        stamps = [] if frontend is None else [*frontend.before, *frontend.after]
        first, last = start, end
        if stamps:
            first = min(start, min(ns for _, ns in stamps) + wall)
            last = max(end, max(ns for _, ns in stamps) + wall)
        root = None
        if parent is None:
            # Under the client's trace context, if it sent one (server
            # src/tracer.cc SampleTrace: the propagated span is the root's parent).
            client = None
            if frontend is not None and frontend.traceparent is not None:
                from opentelemetry.trace.propagation.tracecontext import (
                    TraceContextTextMapPropagator,
                )

                carrier = {"traceparent": frontend.traceparent}
                client = TraceContextTextMapPropagator().extract(carrier)
            root = self._tracer.start_span("InferRequest", context=client, start_time=first)
            for name, ns in frontend.before if frontend is not None else ():
                root.add_event(name, timestamp=ns + wall)
            parent = otel.set_span_in_context(root)
        model = self._tracer.start_span(trace.model_name, context=parent, start_time=start)
        model.set_attribute("triton.model_name", trace.model_name)
        model.set_attribute("triton.model_version", trace.model_version)
        model.set_attribute("triton.trace_id", trace.id)
        model.set_attribute("triton.trace_parent_id", trace.parent_id or 0)
        if trace.request_id:
            model.set_attribute("triton.request_id", trace.request_id)
        # A stack of spans, as Triton's Trace::AddEvent keeps one (src/tracer.cc):
        # COMPUTE_START and a backend's custom ``X_START`` open a child span
        # ("compute", "X") of the innermost one; every timestamp is an event of
        # the innermost span; COMPUTE_END and ``X_END`` close it.
        stack = [model]
        for name, ns in trace.events:
            at = ns + wall
            if name == "INFER_RESPONSE_COMPLETE":  # taken by the frontend
                if root is not None:
                    root.add_event(name, timestamp=at)
                continue
            custom = name.startswith("CUSTOM_")
            if name == "COMPUTE_START" or (custom and name.endswith("_START")):
                span_name = "compute" if name == "COMPUTE_START" else name[: -len("_START")]
                parent = otel.set_span_in_context(stack[-1])
                stack.append(self._tracer.start_span(span_name, context=parent, start_time=at))
            stack[-1].add_event(name, timestamp=at)
            if len(stack) > 1 and (name == "COMPUTE_END" or (custom and name.endswith("_END"))):
                stack.pop().end(end_time=at)
        for span in reversed(stack[1:]):  # a span a backend left open
            span.end(end_time=end)
        model.end(end_time=end)
        if root is not None:
            for name, ns in frontend.after if frontend is not None else ():
                root.add_event(name, timestamp=ns + wall)
            root.end(end_time=last)
        self._model_spans[trace.id] = model
        if len(self._model_spans) > _MAX_KEPT:
            self._model_spans.popitem(last=False)
        children = self._waiting.pop(trace.id, [])
        self._waiting_count -= len(children)
        for child in children:
            self._export(child, otel.set_span_in_context(model))

    def shutdown(self) -> None:
        self._provider.shutdown()
