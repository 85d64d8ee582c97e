"""Trace mode ``opentelemetry``: finished traces exported as OpenTelemetry spans.

Needs the optional OpenTelemetry SDK (the ``otel`` extra); the SDK is imported
only when this mode is chosen.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import structlog
import trio

from trionserve.core.errors import TritonError
from trionserve.observability.trace.settings import OTEL_DEFAULTS
from trionserve.observability.trace.trace_file import Trace, clock_ns

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    from trionserve.observability.trace.frontend import FrontendStamps

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


# The timestamps a frontend takes (:mod:`.frontend`): events of the root
# InferRequest span, as Triton's Trace::CaptureTimestamp adds them (server
# src/tracer.cc:378-407), never of the model span.
_FRONTEND_EVENTS = frozenset(
    {
        "HTTP_RECV_START",
        "HTTP_RECV_END",
        "HTTP_SEND_START",
        "HTTP_SEND_END",
        "GRPC_WAITREAD_START",
        "GRPC_WAITREAD_END",
        "GRPC_SEND_START",
        "GRPC_SEND_END",
        "INFER_RESPONSE_COMPLETE",
    }
)


class _GivenIds:
    """The tracer provider's id generator: the SDK's random ids, except for the
    spans whose ids a trace was given at REQUEST_START (the root and model spans,
    see :meth:`OpenTelemetryExporter.begin`), which take them."""

    def __init__(self, random: Any) -> None:
        self.random = random
        self.span_id = 0  # the next span's id, if given
        self.trace_id = 0  # the next root span's trace id, if given

    def generate_span_id(self) -> int:
        given, self.span_id = self.span_id, 0
        return given or self.random.generate_span_id()

    def generate_trace_id(self) -> int:
        given, self.trace_id = self.trace_id, 0
        return given or self.random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return False  # a trace id can be the client's


class OpenTelemetryExporter:
    """Spans for traces, through the OpenTelemetry SDK's batch processor.

    Each trace becomes a root ``InferRequest`` span (the frontend's timestamps,
    HTTP_RECV_START ..., its events), a span named after the model from
    REQUEST_START to REQUEST_END, a ``compute`` span and a span per custom
    activity a backend reported (``X_START`` ... ``X_END``), with the timestamps
    as events and ``triton.*`` attributes, as Triton exports them.

    A trace gets the ids of its spans as it starts (:meth:`begin`), as Triton's
    tracer starts its model span at REQUEST_START (server src/tracer.cc
    Trace::StartSpan :538-588): the model is handed their trace context, and a
    child trace (an ensemble's step, a BLS request given the request's trace)
    knows its parent span. The model span and its compute and custom spans are
    ended at REQUEST_END (:meth:`end_request`), the root span once the frontend too
    is done (:meth:`end_root`; Triton: ``Trace::~Trace``, :362-375), so the batch
    processor sees them end as Triton's does, not a whole tree at once.
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
            from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
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
        self._ids = _GivenIds(RandomIdGenerator())
        self._provider = TracerProvider(
            resource=Resource.create(attributes), id_generator=cast("IdGenerator", self._ids)
        )
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("triton-server")
        # Trio's clock has its own origin; spans carry wall-clock nanoseconds.
        self._offset: int | None = None

    def begin(self, trace: Trace, parent: Trace | None, client: FrontendStamps | None) -> None:
        """REQUEST_START: the ids of the trace's spans and its trace context.

        A child trace's model span is a span of its parent's model span in the
        parent's trace (server src/tracer.cc:549-566: a child's REQUEST_START span
        takes its parent trace's span as parent); any other trace has its own
        root InferRequest span, in the client's trace if the client sent a
        ``traceparent`` (src/tracer.cc SampleTrace :343-352), else a new one.
        The context is the model span's, as Triton's PrepareTraceContext writes
        it (src/tracer.cc:710-730): ``{"traceparent":"00-<trace>-<span>-01"}``
        (every span is sampled: the SDK's default sampler is always on), with
        ``"tracestate"`` when the client sent one (its spans inherit it)."""
        from opentelemetry.trace.span import TraceState

        random = self._ids.random
        span_id = random.generate_span_id()
        if parent is not None and parent.otel is not None:
            trace_id, parent_span, root, state = (*parent.otel[:2], 0, parent.otel[4])
        else:
            root = parent_span = random.generate_span_id()
            state = ""
            if client is not None and client.traceparent is not None:
                trace_id = int(client.traceparent[3:35], 16)
                if client.tracestate:
                    state = TraceState.from_header([client.tracestate]).to_header()
            else:
                trace_id = random.generate_trace_id()
        trace.otel = (trace_id, span_id, parent_span, root, state)
        context = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}
        if state:
            context["tracestate"] = state
        trace.context = json.dumps(context, separators=(",", ":"))

    def _wall(self) -> int:
        if self._offset is None:
            self._offset = time.time_ns() - clock_ns(trio.current_time())
        return self._offset

    def end_request(self, trace: Trace) -> None:
        """REQUEST_END: the model span, with its compute and custom spans."""
        from opentelemetry import trace as otel

        if trace.otel is None:
            return
        trace_id, span_id, parent_span, _, state = trace.otel
        wall = self._wall()
        events = dict(trace.events)
        start = events.get("REQUEST_START", trace.events[0][1]) + wall
        end = events.get("REQUEST_END", trace.events[-1][1]) + wall
        parent = otel.set_span_in_context(
            otel.NonRecordingSpan(
                otel.SpanContext(
                    trace_id,
                    parent_span,
                    False,
                    otel.TraceFlags(1),
                    otel.TraceState.from_header([state]) if state else None,
                )
            )
        )
        self._ids.span_id = span_id
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
            if name in _FRONTEND_EVENTS:  # the root span's
                continue
            at = ns + wall
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

    def end_root(self, trace: Trace) -> None:
        """The frontend and the data plane are done: the root InferRequest span
        (none for a child trace), with the frontend's timestamps as its events."""
        if trace.otel is None or not trace.otel[3]:
            return
        trace_id, _, _, root_id, _ = trace.otel
        wall = self._wall()
        frontend = trace.frontend
        before = [] if frontend is None else frontend.before
        after = [] if frontend is None else frontend.after
        middle = [(name, ns) for name, ns in trace.events if name in _FRONTEND_EVENTS]
        events = dict(trace.events)
        first = events.get("REQUEST_START", trace.events[0][1])
        last = events.get("REQUEST_END", trace.events[-1][1])
        stamps = [*before, *middle, *after]
        if stamps:
            first = min(first, min(ns for _, ns in stamps))
            last = max(last, max(ns for _, ns in stamps))
        # Under the client's trace context, if it sent one (server src/tracer.cc
        # SampleTrace: the propagated span is the root's parent).
        client = None
        if frontend is not None and frontend.traceparent is not None:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            carrier = {"traceparent": frontend.traceparent}
            if frontend.tracestate:
                carrier["tracestate"] = frontend.tracestate
            client = TraceContextTextMapPropagator().extract(carrier)
        else:
            self._ids.trace_id = trace_id
        self._ids.span_id = root_id
        root = self._tracer.start_span("InferRequest", context=client, start_time=first + wall)
        for name, ns in stamps:
            root.add_event(name, timestamp=ns + wall)
        root.end(end_time=last + wall)

    def shutdown(self) -> None:
        self._provider.shutdown()
