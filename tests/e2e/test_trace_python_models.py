"""Trace mode opentelemetry seen from Python models: the trace context a model is
handed (``request.trace().get_context()``), the spans of the BLS requests it
makes with its request's trace, and the trace of a request cancelled while its
model runs it, on a real server core with real Python backend instances (its
own process, and in-process), the spans caught by an in-memory exporter."""

from __future__ import annotations

import json
import os
import socket
import tempfile

import numpy as np
import pytest
import trio
import trio.testing

from tests.repository import python_model
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.observability.trace import manager as trace_manager
from trionserve.observability.trace.settings import TraceConfig
from trionserve.server import Server, ServerOptions

pytest.importorskip("opentelemetry.sdk")

CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] }]
"""
IN_PROCESS = 'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'
# The model's context, and that of the model it calls with its request's trace.
OUTER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            called = pb_utils.InferenceRequest(
                model_name="inner",
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
                requested_output_names=["OUTPUT0"],
                trace=request.trace(),
            ).exec()
            if called.has_error():
                raise pb_utils.TritonModelException(called.error().message())
            inner = pb_utils.get_output_tensor_by_name(called, "OUTPUT0").as_numpy()[0]
            mine = request.trace().get_context() or ""
            out = np.array([mine.encode(), inner], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
"""
INNER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", np.array([(r.trace().get_context() or "").encode()],
                                                     dtype=np.object_))]
            )
            for r in requests
        ]
"""


def _server(repository, monkeypatch, exporter, http_port: int | None = None) -> Server:
    """A server core on ``repository`` (with its HTTP frontend on ``http_port``
    when given), tracing every request in mode opentelemetry into ``exporter``."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    class _Tracing(trace_manager.TraceManager):
        def __init__(self, config):
            super().__init__(config, span_processor=SimpleSpanProcessor(exporter))

    monkeypatch.setattr("trionserve.server.TraceManager", _Tracing)
    return Server(
        ServerOptions(
            model_repositories=[repository],
            allow_http=http_port is not None,
            http_address="127.0.0.1",
            http_port=http_port or 0,
            allow_grpc=False,
            allow_metrics=False,
            exit_timeout_secs=10.0,
            trace=TraceConfig(level=frozenset({"TIMESTAMPS"}), rate=1, mode="opentelemetry"),
        )
    )


def _request(model: str) -> InferenceRequest:
    return InferenceRequest(
        model, inputs={"INPUT0": Tensor("INPUT0", "INT32", np.array([1], np.int32))}
    )


@pytest.mark.parametrize("mode", ["stub", "in_process"])
async def test_a_python_model_is_handed_its_requests_trace_context(tmp_path, monkeypatch, mode):
    """python_backend src/python_be.cc:292-303 hands the model the context core's
    tracer set at REQUEST_START (server src/tracer.cc:568-585): the W3C
    traceparent of the request's model span as JSON (qa/L0_trace
    trace_context.py: ``get_context()`` not None in mode opentelemetry). A BLS
    request given the request's trace (request_executor.cc:439-445) is its child:
    its span hangs from the span whose context the caller was handed."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    config = CONFIG
    if mode == "in_process":
        config += IN_PROCESS
    python_model(tmp_path, "outer", config, OUTER)
    python_model(tmp_path, "inner", config, INNER)
    exporter = InMemorySpanExporter()
    srv = _server(tmp_path, monkeypatch, exporter)
    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        response = await srv.dataplane.infer(_request("outer"))
        srv.shutdown()
    mine, inner = (json.loads(item) for item in response.outputs[0].data.tolist())
    _, trace_id, span_id, flags = mine["traceparent"].split("-")
    assert flags == "01" and inner["traceparent"].split("-")[1] == trace_id
    finished = exporter.get_finished_spans()
    assert sorted(span.name for span in finished) == [
        "InferRequest",
        "compute",
        "compute",
        "inner",
        "outer",
    ]
    spans = {span.name: span for span in finished}
    assert f"{spans['outer'].context.trace_id:032x}" == trace_id
    assert f"{spans['outer'].context.span_id:016x}" == span_id
    assert spans["inner"].parent.span_id == spans["outer"].context.span_id
    assert f"{spans['inner'].context.span_id:016x}" == inner["traceparent"].split("-")[2]


async def test_the_clients_trace_context_reaches_the_model_over_http(tmp_path, monkeypatch):
    """server src/tracer.cc GetTraceStartOptions: the HTTP frontend extracts the
    client's ``traceparent`` and ``tracestate`` (OpenTelemetry's HttpTraceContext);
    the model's context is in the client's trace, with its tracestate
    (PrepareTraceContext writes ``tracestate`` when the span has one)."""
    import tritonclient.http as httpclient
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trionserve.testing import free_port

    python_model(tmp_path, "inner", CONFIG + IN_PROCESS, INNER)
    port = free_port()
    srv = _server(tmp_path, monkeypatch, InMemorySpanExporter(), http_port=port)
    headers = {
        "traceparent": "00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01",
        "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
    }

    def infer() -> dict:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = httpclient.InferInput("INPUT0", [1], "INT32")
        tensor.set_data_from_numpy(np.array([1], np.int32))
        result = client.infer("inner", [tensor], headers=headers)
        client.close()
        return json.loads(result.as_numpy("OUTPUT0")[0])

    async with trio.open_nursery() as nursery:
        await nursery.start(srv.serve)
        context = await trio.to_thread.run_sync(infer)
        srv.shutdown()
    assert context["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c12666c"
    assert context["tracestate"] == headers["tracestate"]


# The cancelled request's model: in its execute it tells the test it runs (over
# the test's Unix socket) and waits until the test lets it go.
WAITING = """
import socket

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gate:
            gate.connect(%r)
            gate.sendall(b"in")
            gate.recv(1)
        out = np.array([b"done"], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]) for _ in requests]
"""


@pytest.mark.parametrize("mode", ["stub", "in_process"])
async def test_a_request_cancelled_while_its_model_runs_keeps_its_compute_span(
    tmp_path, monkeypatch, mode
):
    """core src/infer_request.cc:475-503: REQUEST_END is taken as the request is
    released, after the compute its backend reports, whether or not its client
    went away meanwhile (qa/L0_trace opentelemetry_unittest
    test_grpc_trace_all_input_required_model_cancel: a request cancelled while
    its Python model runs has its InferRequest, model and compute spans). The
    model span ends once the model is done with it, not as the client leaves."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    class Exporter(InMemorySpanExporter):
        """Sets ``ended`` as the trace's root span is exported (on the Trio thread)."""

        def __init__(self) -> None:
            super().__init__()
            self.ended = trio.Event()

        def export(self, spans):
            result = super().export(spans)
            if any(span.name == "InferRequest" for span in spans):
                self.ended.set()
            return result

    with tempfile.TemporaryDirectory() as short:  # a Unix socket path is short
        path = os.path.join(short, "gate")
        python_model(
            tmp_path,
            "waiting",
            CONFIG + (IN_PROCESS if mode == "in_process" else ""),
            WAITING % path,
        )
        exporter = Exporter()
        srv = _server(tmp_path, monkeypatch, exporter)
        request = _request("waiting")
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(path)
        listener.listen(1)
        async with trio.open_nursery() as nursery:
            await nursery.start(srv.serve)
            caller = trio.CancelScope()

            async def infer() -> None:
                with caller:
                    await srv.dataplane.infer(request)

            nursery.start_soon(infer)
            with trio.fail_after(60):
                model, _ = await listener.accept()
            with model:
                assert await model.recv(2) == b"in"
                caller.cancel()  # the client goes away while the model runs
                await trio.testing.wait_all_tasks_blocked()
                assert request.cancelled
                assert exporter.get_finished_spans() == ()  # not ended as the client left
                await model.send(b"g")
            with trio.fail_after(60):
                await exporter.ended.wait()
            srv.shutdown()
        listener.close()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert sorted(spans) == ["InferRequest", "compute", "waiting"]
    compute = [event.name for event in spans["compute"].events]
    assert compute == ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
    assert spans["compute"].parent.span_id == spans["waiting"].context.span_id
    assert spans["waiting"].end_time >= spans["compute"].end_time
