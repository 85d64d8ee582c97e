"""The frontends' trace timestamps (HTTP_RECV_START ... GRPC_SEND_END,
INFER_RESPONSE_COMPLETE): in the trace file in Triton's order on a real server
with tritonclient's HTTP and gRPC clients, taken only while tracing is on, and
a trace written once both the data plane and the frontend are done with it."""

from __future__ import annotations

import json
from http.client import HTTPConnection

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.e2e.test_trace import GRPC_ORDER, HTTP_ORDER, ORDER, _Model, _Request, manager
from tests.repository import python_model, write_model
from tests.serverproc import EXAMPLES, ServerProcess
from trionserve.observability.trace.frontend import FrontendStamps
from trionserve.observability.trace.manager import TraceManager
from trionserve.observability.trace.settings import TraceConfig
from trionserve.protocol.http.h1 import H1Connection, HttpServerOptions


def _infer(module, client, model: str, request_id: str) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    client.infer(model, inputs, request_id=request_id)


def _traces(entries: list[dict]) -> dict[int, dict]:
    """Each trace's head and its timestamps as (name, ns) in file order; where in
    the file its head came among its timestamps (``head_at``)."""
    traces: dict[int, dict] = {}
    for entry in entries:
        trace = traces.setdefault(entry["id"], {"stamps": []})
        if "model_name" in entry:
            trace.update(entry, head_at=len(trace["stamps"]))
        for stamp in entry.get("timestamps", []):
            trace["stamps"].append((stamp["name"], stamp["ns"]))
    return traces


def test_trace_files_carry_the_frontends_timestamps_in_tritons_order(tmp_path):
    trace_file = tmp_path / "trace.json"
    proc = ServerProcess(
        args=[
            f"--trace-config=triton,file={trace_file}",
            "--trace-config=level=TIMESTAMPS",
            "--trace-config=rate=3",
        ]
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        http = httpclient.InferenceServerClient(proc.http_url)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.grpc_port}")
        # Rate 3: every 3rd request is traced; each trace gets its own
        # request's stamps, never those of a request that was not sampled.
        for index in range(6):
            _infer(httpclient, http, "simple", f"http-{index}")
            _infer(grpcclient, grpc, "simple", f"grpc-{index}")
        # An ensemble's steps are traced as its children, with no frontend
        # stamps of their own (only the request the frontend made has them).
        http.update_trace_settings(settings={"trace_rate": "1"})
        _infer(httpclient, http, "simple_ensemble", "ensemble")
        # The generate extension is traced as infer is (src/http_server.cc
        # HandleGenerate starts its trace the same way).
        body = json.dumps({"id": "generate", "INPUT0": "hi"})
        connection = HTTPConnection("127.0.0.1", proc.http_port, timeout=30)
        connection.request("POST", "/v2/models/identity_bytes/generate", body)
        assert connection.getresponse().status == 200
        connection.close()
        # A gRPC stream's requests: each with its own GRPC_WAITREAD pair and a
        # GRPC_SEND pair per response (src/grpc/stream_infer_handler.cc).
        responses: list = []
        grpc.start_stream(callback=lambda result, error: responses.append(error or result))
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for index in range(2):
            inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(a)
            grpc.async_stream_infer("simple", inputs, request_id=f"stream-{index}")
        grpc.stop_stream()
        assert len(responses) == 2 and not any(isinstance(r, Exception) for r in responses)
        http.close()
        grpc.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()
    traces = _traces(json.loads(trace_file.read_text()))
    by_request: dict[str, list[dict]] = {}
    for trace in traces.values():
        by_request.setdefault(trace["request_id"], []).append(trace)
    sampled = sorted(r for r in by_request if r.startswith(("http", "grpc")))
    assert sampled == ["grpc-2", "grpc-5", "http-1", "http-4"]
    for request_id in sampled:
        (trace,) = by_request[request_id]
        names = [name for name, _ in trace["stamps"]]
        if request_id.startswith("http"):
            assert names == HTTP_ORDER, trace
            assert trace["head_at"] == 2  # the head follows the RECV pair
        else:
            assert names == GRPC_ORDER, trace
            assert trace["head_at"] == 0
        ns = dict(trace["stamps"])
        prefix = "HTTP_RECV" if request_id.startswith("http") else "GRPC_WAITREAD"
        send = "HTTP_SEND" if request_id.startswith("http") else "GRPC_SEND"
        # One clock: the frontend's timestamps frame the data plane's.
        assert ns[f"{prefix}_START"] <= ns[f"{prefix}_END"] <= ns["REQUEST_START"]
        assert ns["COMPUTE_END"] <= ns["INFER_RESPONSE_COMPLETE"] <= ns["REQUEST_END"]
        assert ns["REQUEST_END"] <= ns[f"{send}_START"] <= ns[f"{send}_END"]
    ensemble = sorted(by_request["ensemble"], key=lambda t: t["id"])
    assert [t["model_name"] for t in ensemble] == ["simple_ensemble", "simple", "simple"]
    names = [name for name, _ in ensemble[0]["stamps"]]
    assert names[:2] == ["HTTP_RECV_START", "HTTP_RECV_END"]
    assert names[-2:] == ["HTTP_SEND_START", "HTTP_SEND_END"]
    for child in ensemble[1:]:
        assert child["parent_id"] == ensemble[0]["id"]
        assert [name for name, _ in child["stamps"]] == list(ORDER)
    for request_id in ("stream-0", "stream-1"):
        (trace,) = by_request[request_id]
        assert [name for name, _ in trace["stamps"]] == GRPC_ORDER, trace
        ns = dict(trace["stamps"])
        assert ns["GRPC_WAITREAD_START"] <= ns["GRPC_WAITREAD_END"] <= ns["REQUEST_START"]
        # A stream's responses are sent as they come, within the request's life.
        assert ns["INFER_RESPONSE_COMPLETE"] <= ns["GRPC_SEND_START"] <= ns["GRPC_SEND_END"]
    (generate,) = by_request["generate"]
    names = [name for name, _ in generate["stamps"]]
    assert names[:3] == ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START"]
    assert names[-4:] == ["INFER_RESPONSE_COMPLETE", "REQUEST_END", *HTTP_ORDER[-2:]]


def test_requests_are_timed_at_their_start_only_while_tracing_is_on():
    tracing = manager()
    h1 = H1Connection(HttpServerOptions(tracing=tracing))
    request = b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n\r\n"
    h1.receive_data(request)
    assert h1.requests[-1].began == 0  # OFF: no clock is read
    tracing.update("", {"trace_level": ["TIMESTAMPS"], "trace_rate": ["1"]})
    assert tracing.active

    async def timed() -> int:
        h1.receive_data(request)
        return h1.requests[-1].began

    assert trio.run(timed) > 0


def _frontend_trace(tracing: TraceManager, stamps: FrontendStamps):
    model, request = _Model(), _Request("r")
    trace = tracing.start(model, request, stamps)
    assert trace is not None and trace.frontend is stamps
    return trace, model, request


@pytest.mark.parametrize("frontend_first", [False, True])
async def test_a_frontends_trace_is_written_once_both_sides_are_done(frontend_first):
    """As Triton's Trace is written when its last reference goes (src/tracer.cc
    ~Trace): whichever of the data plane and the frontend finishes last writes it."""
    tracing = manager(level=frozenset({"TIMESTAMPS"}), rate=1)
    stamps = FrontendStamps([("HTTP_RECV_START", 1), ("HTTP_RECV_END", 2)])
    trace, model, request = _frontend_trace(tracing, stamps)
    buffer = trace.setting.buffer
    if frontend_first:
        stamps.release()  # e.g. the client went away: no SEND stamps
        assert buffer == []
        tracing.finish(trace, model, request)
    else:
        tracing.finish(trace, model, request)
        assert buffer == []
        stamps.stamp("HTTP_SEND_START")
        stamps.release()
    (text,) = buffer
    names = [o["timestamps"][0]["name"] for o in json.loads(f"[{text}]") if "timestamps" in o]
    expected = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "REQUEST_END"]
    assert names == expected + ([] if frontend_first else ["HTTP_SEND_START"])
    stamps.release()  # idempotent: written once
    assert len(buffer) == 1
    assert trace.setting.inflight == 0


async def test_stamps_go_with_one_trace_only():
    tracing = manager(level=frozenset({"TIMESTAMPS"}), rate=1)
    stamps = FrontendStamps(deferred=True)
    first, model, request = _frontend_trace(tracing, stamps)
    second = tracing.start(model, _Request("again"), stamps)
    assert second is not None and second.frontend is None and second.holders == 1
    released = FrontendStamps()
    released.release()
    late = tracing.start(model, _Request("late"), released)
    assert late is not None and late.frontend is None


async def test_opentelemetry_puts_the_frontends_timestamps_on_the_root_span():
    """Triton's Trace::CaptureTimestamp adds them to the root span (src/tracer.cc);
    qa/L0_trace opentelemetry_unittest checks the root span has exactly those."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = TraceManager(
        TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=1, mode="opentelemetry"),
        span_processor=SimpleSpanProcessor(exporter),
    )
    now = trio.current_time()
    stamps = FrontendStamps([("HTTP_RECV_START", int(now * 1e9) - 10)])
    stamps.before.append(("HTTP_RECV_END", int(now * 1e9) - 5))
    trace, model, request = _frontend_trace(tracing, stamps)
    request.arrival_time = trio.current_time()
    trace.compute(trio.current_time(), trio.current_time(), 0, 0)
    stamps.response_complete()
    tracing.finish(trace, model, request)
    # The model span (and its compute) end at REQUEST_END (src/tracer.cc
    # AddEvent: EndSpan on REQUEST_END); the root waits for the frontend.
    assert sorted(span.name for span in exporter.get_finished_spans()) == ["compute", "m"]
    stamps.stamp("HTTP_SEND_START")
    stamps.stamp("HTTP_SEND_END")
    stamps.release()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert [e.name for e in spans["InferRequest"].events] == [
        "HTTP_RECV_START",
        "HTTP_RECV_END",
        "INFER_RESPONSE_COMPLETE",
        "HTTP_SEND_START",
        "HTTP_SEND_END",
    ]
    assert [e.name for e in spans["m"].events] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    assert spans["InferRequest"].start_time < spans["m"].start_time
    assert spans["InferRequest"].end_time >= spans["m"].end_time


CUSTOM_IDENTITY = """
backend: "identity"
max_batch_size: 1024
input [{ name: "INPUT0", data_type: TYPE_INT32, dims: [ -1 ] }]
output [{ name: "OUTPUT0", data_type: TYPE_INT32, dims: [ -1 ] }]
instance_group [{ kind: KIND_CPU }]
parameters [
  { key: "enable_custom_tracing", value: { string_value: "true" } },
  { key: "nested_span_count", value: { string_value: "2" } }
]
"""


def test_the_identity_backend_reports_custom_activities(tmp_path):
    """identity_backend's example of a backend's own trace activities
    (src/identity.cc enable_custom_tracing; qa/L0_trace "Custom backend tracing")."""
    write_model(tmp_path / "models", "custom_identity_int32", CUSTOM_IDENTITY, versions=[1])
    trace_file = tmp_path / "trace.json"
    proc = ServerProcess(
        tmp_path / "models",
        args=[
            f"--trace-config=triton,file={trace_file}",
            "--trace-config=level=TIMESTAMPS",
            "--trace-config=rate=2",
        ],
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        http = httpclient.InferenceServerClient(proc.http_url)
        for index in range(2):  # the first is not sampled: no activities, no delay
            tensor = httpclient.InferInput("INPUT0", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[4]], np.int32))
            result = http.infer("custom_identity_int32", [tensor], request_id=str(index))
            assert result.as_numpy("OUTPUT0").tolist() == [[4]]
        http.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()
    (trace,) = _traces(json.loads(trace_file.read_text())).values()
    assert trace["request_id"] == "1"
    names = [name for name, _ in trace["stamps"]]
    custom = [name for name in names if name.startswith("CUSTOM")]
    assert custom == [
        "CUSTOM_ACTIVITY_START",
        "CUSTOM_ACTIVITY_END",
        "CUSTOM_SINGLE_ACTIVITY",
        "CUSTOM_ACTIVITY0_START",
        "CUSTOM_SINGLE_ACTIVITY",
        "CUSTOM_ACTIVITY1_START",
        "CUSTOM_SINGLE_ACTIVITY",
        "CUSTOM_ACTIVITY1_END",
        "CUSTOM_ACTIVITY0_END",
    ]
    # Reported during the execution, before the executor's compute timestamps.
    assert names.index("QUEUE_START") < names.index("CUSTOM_ACTIVITY_START")
    assert names.index("CUSTOM_ACTIVITY0_END") < names.index("COMPUTE_START")
    ns = dict(trace["stamps"])
    assert ns["CUSTOM_ACTIVITY_END"] - ns["CUSTOM_ACTIVITY_START"] >= 100_000_000


async def test_opentelemetry_makes_custom_activities_spans():
    """As Triton's span stack (src/tracer.cc Trace::AddEvent): X_START opens span
    X under the innermost open span, events go to the innermost, X_END closes it."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = TraceManager(
        TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=1, mode="opentelemetry"),
        span_processor=SimpleSpanProcessor(exporter),
    )
    model, request = _Model(), _Request("r")
    trace = tracing.start(model, request)
    assert trace is not None
    now = trace.events[0][1]
    for offset, name in enumerate(
        ["CUSTOM_ACTIVITY0_START", "CUSTOM_ACTIVITY1_START", "CUSTOM_SINGLE_ACTIVITY"]
        + ["CUSTOM_ACTIVITY1_END", "CUSTOM_ACTIVITY0_END"],
        start=1,
    ):
        trace.timestamp(name, now + offset)
    tracing.finish(trace, model, request)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"InferRequest", "m", "CUSTOM_ACTIVITY0", "CUSTOM_ACTIVITY1"}
    outer, inner = spans["CUSTOM_ACTIVITY0"], spans["CUSTOM_ACTIVITY1"]
    assert outer.parent.span_id == spans["m"].context.span_id
    assert inner.parent.span_id == outer.context.span_id
    assert [e.name for e in inner.events] == [
        "CUSTOM_ACTIVITY1_START",
        "CUSTOM_SINGLE_ACTIVITY",
        "CUSTOM_ACTIVITY1_END",
    ]
    assert [e.name for e in spans["m"].events] == ["REQUEST_START", "REQUEST_END"]


BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0", data_type: TYPE_INT32, dims: [ 1, 16 ] }]
output [{ name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 1, 16 ] }]
"""
BLS_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            inputs = [pb_utils.Tensor("INPUT0", x.as_numpy()), pb_utils.Tensor("INPUT1", x.as_numpy())]
            # One BLS request with the request's trace (its child), one without.
            for trace in (request.trace(), None):
                called = pb_utils.InferenceRequest(
                    model_name="simple", inputs=inputs, requested_output_names=["OUTPUT0"],
                    **({"trace": trace} if trace is not None else {}),
                )
                out = called.exec()
                if out.has_error():
                    raise pb_utils.TritonModelException(out.error().message())
            y = pb_utils.get_output_tensor_by_name(out, "OUTPUT0")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y.as_numpy())]))
        return responses
"""


@pytest.mark.parametrize("mode", ["stub", "in_process"])
def test_a_bls_request_given_the_requests_trace_is_traced_as_its_child(tmp_path, mode):
    """python_backend: ``InferenceRequest(..., trace=request.trace())`` makes the
    BLS request's trace a child of the calling request's (qa/L0_trace bls_simple:
    its BLS call to an ensemble, and the ensemble's step, each with parent_id);
    a request made inside the server is not sampled on its own."""
    config = BLS_CONFIG
    if mode == "in_process":
        config += 'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'
    python_model(tmp_path / "models", "bls", config, BLS_MODEL)
    trace_file = tmp_path / "trace.json"
    proc = ServerProcess(
        tmp_path / "models",
        EXAMPLES,
        args=[
            f"--trace-config=triton,file={trace_file}",
            "--trace-config=level=TIMESTAMPS",
            "--trace-config=rate=2",
        ],
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        http = httpclient.InferenceServerClient(proc.http_url)
        for index in range(2):
            tensor = httpclient.InferInput("INPUT0", [1, 16], "INT32")
            tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
            result = http.infer("bls", [tensor], request_id=f"bls-{index}")
            assert result.as_numpy("OUTPUT0").tolist() == [list(range(0, 32, 2))]
        http.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()
    heads = sorted(
        (e for e in json.loads(trace_file.read_text()) if "model_name" in e),
        key=lambda e: e["id"],
    )
    # Rate 2 samples the 2nd request the frontends receive: bls-1. A request a
    # model makes is never sampled on its own, as in Triton (only its frontends
    # sample): bls-0's two BLS requests and bls-1's one without its trace are
    # not traced; bls-1's one given its trace is its child.
    assert [(h["model_name"], h.get("request_id"), h.get("parent_id")) for h in heads] == [
        ("bls", "bls-1", None),
        ("simple", None, heads[0]["id"]),
    ]


FAILING_CONFIG = """
name: "failing"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
FAILING_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        error = pb_utils.TritonError("refused by the model")
        return [pb_utils.InferenceResponse(error=error) for _ in requests]
"""


def test_an_error_response_has_the_frontends_response_and_send_timestamps(tmp_path):
    """Triton's frontends take INFER_RESPONSE_COMPLETE and the SEND pair for a
    model's error response as for any other (server src/http_server.cc
    InferRequestClass::InferResponseComplete, src/grpc/infer_handler.cc
    ModelInferHandler::InferResponseComplete and Process at COMPLETE)."""
    python_model(tmp_path / "models", "failing", FAILING_CONFIG, FAILING_MODEL)
    trace_file = tmp_path / "trace.json"
    proc = ServerProcess(
        tmp_path / "models",
        args=[
            f"--trace-config=triton,file={trace_file}",
            "--trace-config=level=TIMESTAMPS",
            "--trace-config=rate=1",
        ],
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        http = httpclient.InferenceServerClient(proc.http_url)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.grpc_port}")
        for module, client in ((httpclient, http), (grpcclient, grpc)):
            tensor = module.InferInput("INPUT0", [1], "FP32")
            tensor.set_data_from_numpy(np.ones(1, dtype=np.float32))
            with pytest.raises(Exception, match="refused by the model"):
                client.infer("failing", [tensor], request_id=module.__name__)
        http.close()
        grpc.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()
    traces = {t["request_id"]: t for t in _traces(json.loads(trace_file.read_text())).values()}
    names = {request_id: [name for name, _ in t["stamps"]] for request_id, t in traces.items()}
    assert names["tritonclient.http"] == HTTP_ORDER
    assert names["tritonclient.grpc"] == GRPC_ORDER


def test_generate_stream_has_a_send_pair_per_response(tmp_path):
    """server src/http_server.cc GenerateRequestClass::SendChunkResponse: each
    response written as a chunk has its HTTP_SEND_START / HTTP_SEND_END (Triton
    takes them from libevhtp fields it does not fill for chunks, its own FIXME;
    here each is the chunk's write)."""
    import textwrap

    from tests.e2e.test_generate import DECOUPLED_CONFIG, DECOUPLED_MODEL

    root = tmp_path / "models"
    write_model(
        root,
        "tokens",
        DECOUPLED_CONFIG.format(name="tokens"),
        {"1/model.py": textwrap.dedent(DECOUPLED_MODEL)},
    )
    trace_file = tmp_path / "trace.json"
    proc = ServerProcess(
        root,
        args=[
            f"--trace-config=triton,file={trace_file}",
            "--trace-config=level=TIMESTAMPS",
            "--trace-config=rate=1",
        ],
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        connection = HTTPConnection("127.0.0.1", proc.http_port, timeout=30)
        body = json.dumps({"COUNT": 3, "id": "stream"})
        connection.request("POST", "/v2/models/tokens/generate_stream", body)
        response = connection.getresponse()
        assert response.status == 200
        assert response.read().count(b"data: ") == 3
        connection.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()
    (trace,) = _traces(json.loads(trace_file.read_text())).values()
    names = [name for name, _ in trace["stamps"]]
    assert names.count("HTTP_SEND_START") == names.count("HTTP_SEND_END") == 3
    assert names.count("INFER_RESPONSE_COMPLETE") == 3
    sends = [ns for name, ns in trace["stamps"] if name.startswith("HTTP_SEND")]
    assert sends == sorted(sends)
