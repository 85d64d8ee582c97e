"""The trace extension: settings semantics, sampling, trace files, and the
HTTP / gRPC settings endpoints and trace file contents on a real server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.serverproc import ServerProcess
from trionserve.core.errors import InvalidArgument, Unimplemented
from trionserve.observability.trace.manager import TraceManager
from trionserve.observability.trace.settings import (
    TraceConfig,
    parse_trace_config,
    settings_from_json,
)
from trionserve.observability.trace.trace_file import TraceFileWriter

ORDER = (
    "REQUEST_START",
    "QUEUE_START",
    "COMPUTE_START",
    "COMPUTE_INPUT_END",
    "COMPUTE_OUTPUT_START",
    "COMPUTE_END",
    "REQUEST_END",
)

# Triton's order in the trace file: the HTTP frontend writes its RECV pair as it
# samples the request (before REQUEST_START), INFER_RESPONSE_COMPLETE as the
# response reaches it and SEND as it replies (server src/http_server.cc
# StartTrace, InferResponseComplete, ReplyCallback); the gRPC frontend keeps
# all of its own and adds them as it lets go of the trace, after REQUEST_END
# (src/grpc/infer_handler.h ClearTraceTimestamps).
HTTP_ORDER = [
    "HTTP_RECV_START",
    "HTTP_RECV_END",
    *ORDER[:-1],
    "INFER_RESPONSE_COMPLETE",
    "REQUEST_END",
    "HTTP_SEND_START",
    "HTTP_SEND_END",
]
GRPC_ORDER = [
    *ORDER,
    "GRPC_WAITREAD_START",
    "GRPC_WAITREAD_END",
    "INFER_RESPONSE_COMPLETE",
    "GRPC_SEND_START",
    "GRPC_SEND_END",
]

# -- command line ---------------------------------------------------------------------------


def test_trace_config_flags_as_triton_spells_them():
    config = parse_trace_config(
        [
            "triton,file=/tmp/t.json",
            "triton,log-frequency=50",
            "rate=100",
            "level=TIMESTAMPS",
            "level=TENSORS",
            "count=10",
        ]
    )
    assert config == TraceConfig(
        level=frozenset({"TIMESTAMPS", "TENSORS"}),
        rate=100,
        count=10,
        log_frequency=50,
        file="/tmp/t.json",
    )
    # The deprecated flags, overridden by --trace-config; OFF anywhere disables.
    old = parse_trace_config(["rate=5"], levels=["TIMESTAMPS"], rate=9, file="/tmp/x")
    assert (old.rate, old.level, old.file) == (5, frozenset({"TIMESTAMPS"}), "/tmp/x")
    assert parse_trace_config(["level=TIMESTAMPS", "level=OFF"]).level == frozenset()
    otel = parse_trace_config(
        [
            "mode=opentelemetry",
            "opentelemetry,url=http://c:4318/v1/traces",
            "opentelemetry,resource=service.name=me",
        ]
    )
    assert otel.mode == "opentelemetry"
    assert dict(otel.opentelemetry) == {
        "url": "http://c:4318/v1/traces",
        "resource": "service.name=me",
    }


@pytest.mark.parametrize(
    "setting",
    [
        "level=LOUD",
        "rate=-1",
        "count=-2",
        "mode=zipkin",
        "zipkin,url=x",
        ",rate=1",
        "rate",
        "triton,log-frequency=x",
        "speed=1",
    ],
)
def test_bad_trace_config_is_refused(setting):
    with pytest.raises(ValueError):
        parse_trace_config([setting])


def test_batch_span_processor_settings_come_from_the_environment_and_bad_ones_are_named():
    # server command_line_parser.cc ProcessOpenTelemetryBatchSpanProcessorArgs:
    # OTEL_BSP_* fill the bsp_* settings the flags leave out (qa/L0_cmdline_trace).
    env = {"OTEL_BSP_SCHEDULE_DELAY": "7", "OTEL_BSP_MAX_QUEUE_SIZE": "9"}
    otel = parse_trace_config(
        ["mode=opentelemetry", "opentelemetry,bsp_max_queue_size=3"], environ=env
    )
    assert dict(otel.opentelemetry) == {"bsp_max_queue_size": "3", "bsp_schedule_delay": "7"}
    # Outside mode opentelemetry they are not read.
    assert parse_trace_config([], environ={"OTEL_BSP_SCHEDULE_DELAY": "x"}).opentelemetry == ()
    with pytest.raises(ValueError, match='^Bad option: "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"'):
        parse_trace_config(
            ["mode=opentelemetry"], environ={"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "bad_value"}
        )
    with pytest.raises(
        ValueError, match='^Bad option: "--trace-config opentelemetry,bsp_schedule_delay"'
    ):
        parse_trace_config(["mode=opentelemetry", "opentelemetry,bsp_schedule_delay=-1"])


def test_the_deprecated_trace_flags_warn_as_tritons_do(capsys):
    from trionserve.cli.options import trace_config
    from trionserve.cli.parser import build_parser

    parser = build_parser()
    args = parser.parse_args(
        [
            "--model-repository=/m",
            "--trace-file=/tmp/t.json",
            "--trace-rate=100",
            "--trace-level=TIMESTAMPS",
            "--trace-level=TENSORS",
            "--trace-count=10",
            "--trace-log-frequency=50",
        ]
    )
    trace_config(parser, args)
    err = capsys.readouterr().err
    for flag, times in (
        ("--trace-file", 1),
        ("--trace-rate", 1),
        ("--trace-level", 2),
        ("--trace-count", 1),
        ("--trace-log-frequency", 1),
    ):
        assert err.count(f"Warning: '{flag}' has been deprecated") == times
    args = parser.parse_args(["--model-repository=/m", "--trace-config=rate=5"])
    trace_config(parser, args)
    assert capsys.readouterr().err == ""


# -- settings semantics -------------------------------------------------------------------------


def manager(**kwargs) -> TraceManager:
    return TraceManager(TraceConfig(file="/tmp/unused-trace.json", **kwargs))


def test_model_settings_follow_the_global_setting_for_what_they_do_not_name():
    tracing = manager()
    assert tracing.settings() == {
        "trace_level": ["OFF"],
        "trace_rate": "1000",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_file": "/tmp/unused-trace.json",
        "trace_mode": "triton",
    }
    assert not tracing.active
    tracing.update("m", {"trace_rate": ["5"]})
    assert tracing.settings("m")["trace_rate"] == "5"
    assert tracing.settings("m")["trace_level"] == ["OFF"]
    assert not tracing.active
    tracing.update("", {"trace_level": ["TIMESTAMPS"], "trace_rate": ["2"]})
    assert tracing.active
    # The model keeps its own rate and follows the new global level.
    assert tracing.settings("m")["trace_level"] == ["TIMESTAMPS"]
    assert tracing.settings("m")["trace_rate"] == "5"
    assert tracing.settings("other")["trace_rate"] == "2"
    # Clearing the model's rate: the global rate again.
    tracing.update("m", {"trace_rate": None})
    assert tracing.settings("m")["trace_rate"] == "2"
    tracing.update("", {"trace_level": ["OFF"]})
    assert not tracing.active


def test_invalid_updates_change_nothing():
    tracing = TraceManager()  # no trace file
    with pytest.raises(InvalidArgument, match="trace file name is not given"):
        tracing.update("", {"trace_level": ["TIMESTAMPS"]})
    with pytest.raises(Unimplemented, match="can not be updated through network"):
        tracing.update("", {"trace_file": ["/tmp/elsewhere"]})
    tracing = manager()
    with pytest.raises(InvalidArgument, match="only one trace level 'OFF'"):
        tracing.update("", {"trace_level": ["OFF", "TIMESTAMPS"]})
    with pytest.raises(InvalidArgument, match="Unable to parse 'trace_rate'"):
        tracing.update("", {"trace_rate": ["fast"]})
    with pytest.raises(InvalidArgument, match="out of range"):
        tracing.update("", {"trace_count": ["-2"]})
    with pytest.raises(InvalidArgument, match="sample rate must be non-zero"):
        tracing.update("", {"trace_level": ["TIMESTAMPS"], "trace_rate": ["0"]})
    assert tracing.settings()["trace_level"] == ["OFF"]
    assert settings_from_json({"trace_rate": 3, "trace_level": ["TIMESTAMPS"], "x": None}) == {
        "trace_rate": ["3"],
        "trace_level": ["TIMESTAMPS"],
        "x": None,
    }
    with pytest.raises(InvalidArgument):
        settings_from_json({"trace_rate": {"a": 1}})


class _Model:
    """What the trace manager needs of a model version."""

    def __init__(self, name: str = "m") -> None:
        from trionserve._generated.model_config_pb2 import ModelConfig
        from trionserve.observability.statistics import ModelStatistics

        self.name, self.version = name, 1
        self.statistics = ModelStatistics(name, 1)
        self.config = ModelConfig(name=name, backend="identity")


class _Request:
    def __init__(self, id: str = "") -> None:
        self.id, self.inputs, self.arrival_time = id, {}, 0.0


async def test_sampling_rate_count_and_log_frequency_files(tmp_path):
    path = tmp_path / "trace.json"
    tracing = TraceManager(
        TraceConfig(
            level=frozenset({"TIMESTAMPS"}), rate=2, count=3, log_frequency=2, file=str(path)
        )
    )
    model = _Model()
    async with trio.open_nursery() as nursery:
        await nursery.start(tracing.run)
        sampled = []
        for index in range(10):
            request = _Request(f"r{index}")
            trace = tracing.start(model, request) if tracing.active else None
            if trace is not None:
                sampled.append(request.id)
                request.arrival_time = trio.current_time()
                tracing.finish(trace, model, request)
        await tracing.aclose()
        nursery.cancel_scope.cancel()
    # Every 2nd request, 3 in all; then tracing stops by itself.
    assert sampled == ["r1", "r3", "r5"]
    assert not tracing.active
    assert tracing.settings()["trace_count"] == "0"
    first = json.loads((tmp_path / "trace.json.0").read_text())
    second = json.loads((tmp_path / "trace.json.1").read_text())
    assert [o["request_id"] for o in first if "model_name" in o] == ["r1", "r3"]
    assert [o["request_id"] for o in second if "model_name" in o] == ["r5"]
    assert not path.exists()  # everything went to the indexed files


async def test_without_log_frequency_traces_are_written_at_shutdown(tmp_path):
    path = tmp_path / "trace.json"
    tracing = TraceManager(TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=1, file=str(path)))
    model = _Model()
    async with trio.open_nursery() as nursery:
        await nursery.start(tracing.run)
        for index in range(3):
            request = _Request(f"r{index}")
            tracing.finish(tracing.start(model, request), model, request)
        assert not path.exists()
        await tracing.aclose()
        nursery.cancel_scope.cancel()
    objects = json.loads(path.read_text())
    assert [o["id"] for o in objects if "model_name" in o] == [1, 2, 3]
    assert model.statistics.traces == {}


# -- end to end -----------------------------------------------------------------------------------


def read_traces(paths: list[Path]) -> dict[int, dict]:
    """Traces by id from Triton-format trace files: head and ordered timestamps."""
    traces: dict[int, dict] = {}
    for path in paths:
        for entry in json.loads(path.read_text()):
            trace = traces.setdefault(entry["id"], {"timestamps": []})
            if "model_name" in entry:
                trace.update(entry)
            else:
                trace["timestamps"] += [(t["name"], t["ns"]) for t in entry.get("timestamps", [])]
    return traces


def wait_for(paths: list[Path], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().endswith("]") for p in paths):
        assert time.monotonic() < deadline, f"trace files never written: {paths}"
        time.sleep(0.02)


def infer_simple(client, request_id: str):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    return client.infer("simple", inputs, request_id=request_id)


def test_trace_settings_and_trace_files_on_a_server(tmp_path):
    trace_file = tmp_path / "trace.json"
    proc = ServerProcess(
        args=[
            f"--trace-config=triton,file={trace_file}",
            "--trace-config=level=OFF",
            "--allow-metrics=false",
        ]
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        http = httpclient.InferenceServerClient(proc.http_url)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.grpc_port}")

        assert http.get_trace_settings() == {
            "trace_level": ["OFF"],
            "trace_rate": "1000",
            "trace_count": "-1",
            "log_frequency": "0",
            "trace_file": str(trace_file),
            "trace_mode": "triton",
        }
        updated = http.update_trace_settings(
            settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "log_frequency": "2"}
        )
        assert (updated["trace_level"], updated["trace_rate"], updated["log_frequency"]) == (
            ["TIMESTAMPS"],
            "1",
            "2",
        )
        # A model setting over gRPC: its own count, the rest from the global setting.
        grpc.update_trace_settings(model_name="simple", settings={"trace_count": "4"})
        model = http.get_trace_settings(model_name="simple")
        assert (model["trace_count"], model["trace_rate"], model["trace_level"]) == (
            "4",
            "1",
            ["TIMESTAMPS"],
        )
        over_grpc = grpc.get_trace_settings(model_name="simple", as_json=True)["settings"]
        assert {k: v["value"] for k, v in over_grpc.items()} == {
            k: (v if isinstance(v, list) else [v]) for k, v in model.items()
        }
        assert http.get_trace_settings()["trace_count"] == "-1"
        with pytest.raises(InferenceServerException, match="can not be updated"):
            http.update_trace_settings(settings={"trace_file": str(tmp_path / "other.json")})
        with pytest.raises(InferenceServerException, match="unknown model"):
            http.get_trace_settings(model_name="nope")

        for index in range(5):  # the 5th is beyond the model's trace count
            infer_simple(http, f"req-{index}")
        files = [tmp_path / "trace.json.0", tmp_path / "trace.json.1"]
        wait_for(files)
        traces = read_traces(files)
        assert sorted(t["request_id"] for t in traces.values()) == [f"req-{i}" for i in range(4)]
        for trace in traces.values():
            assert (trace["model_name"], trace["model_version"]) == ("simple", 1)
            names = [name for name, _ in trace["timestamps"]]
            assert names == HTTP_ORDER
            stamps = [ns for _, ns in trace["timestamps"]]
            assert stamps == sorted(stamps), trace
        assert http.get_trace_settings(model_name="simple")["trace_count"] == "0"

        # Clearing the model's count (gRPC: no values) makes it follow the global
        # setting again; with log_frequency 0 its traces go to the main file at exit.
        grpc.update_trace_settings(model_name="simple", settings={"trace_count": None})
        http.update_trace_settings(settings={"log_frequency": "0"})
        assert http.get_trace_settings(model_name="simple")["trace_count"] == "-1"
        infer_simple(http, "last")
        http.update_trace_settings(settings={"trace_level": ["OFF"]})
        infer_simple(http, "untraced")
        http.close()
        grpc.close()
        assert proc.stop() == 0, proc.output()
        main = read_traces([trace_file])
        assert [t["request_id"] for t in main.values()] == ["last"]
        assert max(main) > max(traces)  # trace ids keep increasing
    finally:
        proc.close()
    # --allow-metrics=false: nothing listens on the metrics port.
    import socket

    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proc.metrics_port), timeout=2).close()


async def test_opentelemetry_mode_exports_spans():
    """Mode opentelemetry (only where the SDK is installed): one trace becomes the
    InferRequest, model and compute spans, with the timestamps as events."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = TraceManager(
        TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=1, mode="opentelemetry"),
        span_processor=SimpleSpanProcessor(exporter),
    )
    assert tracing.active  # no trace file needed in this mode
    assert tracing.settings()["trace_mode"] == "opentelemetry"
    model = _Model("simple")
    request = _Request("otel-1")
    trace = tracing.start(model, request)
    request.arrival_time = trio.current_time()
    trace.compute(trio.current_time(), trio.current_time(), 0, 0)
    tracing.finish(trace, model, request)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"InferRequest", "simple", "compute"}
    assert spans["simple"].attributes["triton.request_id"] == "otel-1"
    assert spans["simple"].parent.span_id == spans["InferRequest"].context.span_id
    assert spans["compute"].parent.span_id == spans["simple"].context.span_id
    assert [e.name for e in spans["compute"].events] == list(ORDER[2:6])
    assert [e.name for e in spans["simple"].events] == [
        "REQUEST_START",
        "QUEUE_START",
        "REQUEST_END",
    ]


async def test_opentelemetry_nests_child_traces_under_their_parents_model_span():
    """server src/tracer.cc Trace::StartSpan: a child trace (an ensemble's step,
    a BLS request given the request's trace) is a span of its parent's model
    span and has no InferRequest root of its own (qa/L0_trace
    opentelemetry_unittest, bls_simple: 6 spans, one root). Spans end as their
    request ends, a child's before its parent's, as Triton's do: qa/L0_trace's
    ``bsp_schedule_delay=0`` step counts more than one export of a BLS request's
    spans, which one export of the whole tree at its end would not give."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = TraceManager(
        TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=1, mode="opentelemetry"),
        span_processor=SimpleSpanProcessor(exporter),
    )
    bls, ensemble, simple, late = _Model("bls"), _Model("ens"), _Model("simple"), _Model("late")
    top = tracing.start(bls, _Request("r"))
    middle = tracing.start_child(ensemble, top, _Request())
    leaf = tracing.start_child(simple, middle, _Request())
    after = tracing.start_child(late, top, _Request())
    tracing.finish(leaf, simple, _Request())
    assert [span.name for span in exporter.get_finished_spans()] == ["simple"]
    tracing.finish(middle, ensemble, _Request())
    tracing.finish(top, bls, _Request())
    assert [span.name for span in exporter.get_finished_spans()][1:] == [
        "ens",
        "bls",
        "InferRequest",
    ]
    tracing.finish(after, late, _Request())
    spans = exporter.get_finished_spans()
    assert len({span.context.trace_id for span in spans}) == 1
    by_id = {span.context.span_id: span.name for span in spans}
    parents = sorted(
        (span.name, by_id.get(span.parent.span_id) if span.parent else None) for span in spans
    )
    assert parents == [
        ("InferRequest", None),
        ("bls", "InferRequest"),
        ("ens", "bls"),
        ("late", "bls"),
        ("simple", "ens"),
    ]
    assert {span.attributes["triton.trace_parent_id"] for span in spans if span.name == "ens"} == {
        top.id
    }


async def test_opentelemetry_trace_context_is_the_model_spans(tmp_path):
    """server src/tracer.cc:568-585, :710-730: at REQUEST_START Triton sets the
    trace's context to its model span's W3C traceparent as JSON, which
    python_backend hands to the model (``request.trace().get_context()``,
    src/python_be.cc:292-303); a child's span hangs from that span. In mode
    triton a trace has no context (qa/L0_trace check_pbe_trace_context)."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trionserve.observability.trace.frontend import FrontendStamps

    exporter = InMemorySpanExporter()
    tracing = TraceManager(
        TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=1, mode="opentelemetry"),
        span_processor=SimpleSpanProcessor(exporter),
    )
    model, step = _Model("bls"), _Model("simple")
    stamps = FrontendStamps()
    stamps.take_context(b"00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01", b"k=v,a=b")
    top = tracing.start(model, _Request("r"), stamps)
    child = tracing.start_child(step, top, _Request())
    contexts = [json.loads(trace.context) for trace in (top, child)]
    # The client's tracestate goes with the context (its spans inherit it).
    assert all(context["tracestate"] == "k=v,a=b" for context in contexts)
    version, trace_id, span_id, flags = contexts[0]["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", "0af7651916cd43dd8448eb211c12666c", "01")
    assert contexts[1]["traceparent"].split("-")[1] == trace_id
    tracing.finish(child, step, _Request())
    tracing.finish(top, model, _Request("r"))
    stamps.release()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert f"{spans['bls'].context.span_id:016x}" == span_id
    assert spans["simple"].parent.span_id == spans["bls"].context.span_id
    assert f"{spans['simple'].context.span_id:016x}" == contexts[1]["traceparent"].split("-")[2]
    assert spans["InferRequest"].parent.span_id == 0xB7AD6B7169242424
    assert spans["bls"].parent.span_id == spans["InferRequest"].context.span_id
    assert {span.context.trace_state.to_header() for span in spans.values()} == {"k=v,a=b"}
    # A tracestate only with a valid traceparent, dropped past 512 characters;
    # one that is not W3C's format is left out of the context.
    valid = "00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01"
    for parent, state, kept in (
        ("00-bad", "k=v", None),
        (valid, "k=" + "v" * 511, None),
        (valid, "k=" + "v" * 200, "k=" + "v" * 200),
    ):
        stamps = FrontendStamps()
        stamps.take_context(parent, state)
        assert stamps.tracestate == kept
    stamps = FrontendStamps()
    stamps.take_context(valid, "not a member")
    assert "tracestate" not in json.loads(tracing.start(model, _Request(), stamps).context)
    plain = TraceManager(
        TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=1, file=str(tmp_path / "t.json"))
    )
    assert plain.start(_Model(), _Request()).context is None


async def test_every_resource_setting_is_a_resource_attribute():
    """server src/tracer.cc:517: each opentelemetry,resource=<key>=<value> given
    (qa/L0_trace gives test.key and service.name) is an attribute of the spans'
    resource."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    config = parse_trace_config(
        [
            "mode=opentelemetry",
            "level=TIMESTAMPS",
            "rate=1",
            "opentelemetry,resource=test.key=test.value",
            "opentelemetry,resource=service.name=test_triton",
        ]
    )
    tracing = TraceManager(config, span_processor=SimpleSpanProcessor(exporter))
    model = _Model("simple")
    tracing.finish(tracing.start(model, _Request("r")), model, _Request("r"))
    attributes = exporter.get_finished_spans()[0].resource.attributes
    assert attributes["test.key"] == "test.value"
    assert attributes["service.name"] == "test_triton"


async def test_opentelemetry_traces_a_request_under_its_clients_context():
    """server src/tracer.cc GetTraceStartOptions / SampleTrace: in mode
    opentelemetry a request whose client sent a valid W3C traceparent is traced
    whatever the rate and count (rate 0: only those; qa/L0_trace's "OTel WAR"),
    its InferRequest span a child of the client's span in the client's trace."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trionserve.observability.trace.frontend import FrontendStamps, valid_traceparent

    given = "00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01"
    assert valid_traceparent(given.encode()) == given
    for bad in ("ff" + given[2:], given.replace("0af7", "zzzz"), "00-" + "0" * 32 + given[35:], ""):
        assert valid_traceparent(bad) is None
    exporter = InMemorySpanExporter()
    tracing = TraceManager(
        TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=0, mode="opentelemetry"),
        span_processor=SimpleSpanProcessor(exporter),
    )
    assert tracing.active  # the frontends look for a context
    model = _Model("simple")
    assert tracing.start(model, _Request("plain"), FrontendStamps()) is None
    stamps = FrontendStamps()
    stamps.traceparent = valid_traceparent(given)
    trace = tracing.start(model, _Request("traced"), stamps)
    assert trace is not None
    tracing.finish(trace, model, _Request("traced"))
    stamps.release()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    root = spans["InferRequest"]
    assert root.parent is not None and root.parent.span_id == 0xB7AD6B7169242424
    assert root.context.trace_id == 0x0AF7651916CD43DD8448EB211C12666C
    assert spans["simple"].parent.span_id == root.context.span_id


def test_a_batch_larger_than_the_queue_is_capped_and_drops_are_logged_as_tritons(monkeypatch):
    """qa/L0_trace starts the server with bsp_max_queue_size=1 (the default
    batch is 512, which the Python SDK refuses: the server did not start) and
    greps opentelemetry-cpp's warning for a dropped span."""
    import logging

    from trionserve.observability.trace import opentelemetry_exporter as otel
    from trionserve.observability.trace.settings import OTEL_DEFAULTS

    options = otel.batch_options({**OTEL_DEFAULTS, "bsp_max_queue_size": "1"})
    assert options == {
        "max_queue_size": 1,
        "schedule_delay_millis": 5000,
        "max_export_batch_size": 1,
    }
    assert otel.batch_options(dict(OTEL_DEFAULTS))["max_export_batch_size"] == 512
    # bsp_schedule_delay=0 (the SDK refuses 0): as soon as it can.
    assert (
        otel.batch_options({**OTEL_DEFAULTS, "bsp_schedule_delay": "0"})["schedule_delay_millis"]
        == 1
    )
    seen: list[str] = []

    class Recorder:
        def warning(self, event, **fields):
            seen.append(event)

    monkeypatch.setattr(otel, "log", Recorder())
    otel.report_dropped_spans()
    otel.report_dropped_spans()  # once
    sdk = logging.getLogger("opentelemetry.sdk._shared_internal")
    sdk.warning("Queue full, dropping %s.", "span")
    sdk.warning("Exception while exporting %s.", "span")
    assert seen == ["BatchSpanProcessor queue is full - dropping span."]


def test_a_collector_url_without_a_scheme_is_http():
    """L0_trace's url=localhost:10000/v1/traces: Triton's exporter (curl) takes it
    as http; the Python exporter needs the scheme spelled out."""
    from trionserve.observability.trace.opentelemetry_exporter import otlp_endpoint

    assert otlp_endpoint("localhost:10000/v1/traces") == "http://localhost:10000/v1/traces"
    assert otlp_endpoint("https://collector:4318/v1/traces") == "https://collector:4318/v1/traces"
    assert otlp_endpoint("http://localhost:4318/v1/traces") == "http://localhost:4318/v1/traces"


async def test_tensors_level_records_inputs_and_outputs():
    from trionserve.core.inference import InferenceResponse, Tensor

    tracing = manager(level=frozenset({"TENSORS"}), rate=1)
    model = _Model()
    request = _Request("t")
    request.inputs = {
        "X": Tensor("X", "INT32", np.array([[1, 2, 3]], np.int32)),
        "S": Tensor("S", "BYTES", np.array([b"a", b"b"], dtype=np.object_)),
    }
    trace = tracing.start(model, request)
    response = InferenceResponse("m", "1", "t", [Tensor("Y", "FP32", np.array([0.5], np.float32))])
    tracing.finish(trace, model, request, response)
    objects = json.loads("[" + trace.setting.buffer[0] + "]")
    tensors = [(o["activity"], o["tensor"]) for o in objects if "activity" in o]
    assert tensors == [
        ("TENSOR_QUEUE_INPUT", {"name": "X", "data": "1,2,3", "shape": "1,3", "dtype": "INT32"}),
        ("TENSOR_QUEUE_INPUT", {"name": "S", "data": '"a","b"', "shape": "2", "dtype": "BYTES"}),
        ("TENSOR_BACKEND_OUTPUT", {"name": "Y", "data": "0.5", "shape": "1", "dtype": "FP32"}),
    ]
    assert objects[0] == {"id": trace.id, "model_name": "m", "model_version": 1, "request_id": "t"}
    assert not any("timestamps" in o for o in objects)  # TENSORS alone: no timestamps


async def test_a_writer_behind_keeps_the_main_trace_file_whole(tmp_path):
    """More chunks than the writer's queue holds, before it takes any: the rest are
    written in place while the queued ones wait. The file is closed after every
    chunk is written (a close written in place would have ended the file before the
    queued chunks reopened it and truncated it)."""
    path = tmp_path / "trace.json"
    writer = TraceFileWriter()
    file = writer.file(str(path))
    chunks = 600  # the queue holds 256
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        for index in range(chunks):
            writer.write(file, json.dumps({"id": index}), indexed=False)
        await writer.aclose()
        nursery.cancel_scope.cancel()
    objects = json.loads(path.read_text())
    assert sorted(o["id"] for o in objects) == list(range(chunks))


def test_an_ensembles_steps_are_traced_as_its_children(tmp_path):
    # core InferenceTrace::SpawnChildTrace: each step request of a traced ensemble
    # request has a trace of its own, the next id, "parent_id" the ensemble's
    # (qa/L0_cmdline_trace's ensemble cases); each trace, the ensemble's too,
    # records its inputs and its response's outputs.
    trace_file = tmp_path / "trace.json"
    proc = ServerProcess(
        args=[
            f"--trace-config=triton,file={trace_file}",
            "--trace-config=level=TIMESTAMPS",
            "--trace-config=level=TENSORS",
            "--trace-config=rate=1",
        ]
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        http = httpclient.InferenceServerClient(proc.http_url)
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        http.infer("simple_ensemble", inputs, request_id="7")
        http.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()
    entries = json.loads(trace_file.read_text())
    heads = sorted((e for e in entries if "model_name" in e), key=lambda e: e["id"])
    assert heads[0] == {
        "id": 1,
        "model_name": "simple_ensemble",
        "model_version": 1,
        "request_id": "7",
    }
    assert heads[1:] == [
        {"id": n, "model_name": "simple", "model_version": 1, "request_id": "7", "parent_id": 1}
        for n in (2, 3)
    ]
    outputs = [e["id"] for e in entries if e.get("activity") == "TENSOR_BACKEND_OUTPUT"]
    inputs_traced = [e["id"] for e in entries if e.get("activity") == "TENSOR_QUEUE_INPUT"]
    assert sorted(outputs) == [1, 1, 2, 2, 3, 3]
    assert sorted(inputs_traced) == [1, 1, 2, 2, 3, 3]
