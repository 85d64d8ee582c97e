"""Prometheus metrics: scraped from a real server and parsed with prometheus-client.

Counters must move by exactly what was sent (successes and failures apart), agree
with the statistics extension, and the pending count must show queued requests.
"""

from __future__ import annotations

import http.client
import json
import re
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.helpers import metric_samples, metrics_text, simple_inputs
from tests.serverproc import EXAMPLES, ServerProcess
from trionserve.observability.metrics import (
    FirstResponseHistogram,
    parse_metrics_config,
)

# -- units --------------------------------------------------------------------------------


def test_metrics_config_settings():
    assert parse_metrics_config([]) == {}
    assert parse_metrics_config(["histogram_latencies=true", "counter_latencies=false"]) == {
        "histogram_latencies": True,
        "counter_latencies": False,
    }
    assert parse_metrics_config(["summary_latencies=true", "summary_quantiles=0.5:0.05"]) == {
        "summary_latencies": True,
        "summary_quantiles": ((0.5, 0.05),),
    }
    # Read as Triton's std::stod reads them: qa/L0_metrics passes "0.0.1".
    assert parse_metrics_config(["summary_quantiles=0.1:0.0.1,0.7:0.01"]) == {
        "summary_quantiles": ((0.1, 0.0), (0.7, 0.01)),
    }
    for bad in (
        "histogram_latencies",
        "histogram_latencies=maybe",
        "nope=1",
        "summary_latencies=yes please",
        "summary_quantiles=0.5",
        "summary_quantiles=x:0.1",
        "summary_quantiles=1:0.1",
    ):
        with pytest.raises(ValueError):
            parse_metrics_config([bad])


def test_first_response_histogram_buckets_are_cumulative():
    histogram = FirstResponseHistogram([500, 100])
    for ms in (1, 100, 101, 700):
        histogram.observe(ms)
    assert histogram.buckets() == [("100", 2), ("500", 3), ("+Inf", 4)]
    assert histogram.count == 4 and histogram.sum == 902


# -- end to end ----------------------------------------------------------------------------

GATED_CONFIG = """
name: "gated"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
parameters { key: "gate" value: { string_value: "%s" } }
"""

# Waits until the gate file exists; IN < 0 fails the request in the backend.
GATED_MODEL = """
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.gate = config["parameters"]["gate"]["string_value"]

    def execute(self, requests):
        deadline = time.monotonic() + 30
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if value[0] < 0:
                raise ValueError("negative input")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value * 2)]))
        return responses
"""

DECOUPLED_CONFIG = """
name: "repeat"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

DECOUPLED_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for index in range(count):
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.array([index], np.int32))
                ]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    return tmp_path_factory.mktemp("gate") / "open"


@pytest.fixture(scope="module")
def server(tmp_path_factory, gate):
    root = tmp_path_factory.mktemp("metrics_models")
    for name, config, source in (
        ("gated", GATED_CONFIG % gate, GATED_MODEL),
        ("repeat", DECOUPLED_CONFIG, DECOUPLED_MODEL),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(source))
    proc = ServerProcess(
        root,
        EXAMPLES,
        args=[
            "--metrics-config=histogram_latencies=true",
            "--metrics-config=summary_latencies=true",
            "--metrics-interval-ms=50",
        ],
    )
    try:
        proc.wait_ready(path="/v2/health/ready")  # every frontend listens
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


@pytest.fixture
def client(server):
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    yield client
    client.close()


def value(samples, name: str, model: str, **labels) -> float:
    key = (name, tuple(sorted({"model": model, "version": "1", **labels}.items())))
    return samples[key]


def gated_input(value: int):
    infer_input = httpclient.InferInput("IN", [1], "INT32")
    infer_input.set_data_from_numpy(np.array([value], np.int32))
    return [infer_input]


def test_counters_move_by_exactly_what_was_sent(server, client):
    before = metric_samples(server.metrics_port)
    for _ in range(5):
        client.infer("simple", simple_inputs())
    for _ in range(3):
        with pytest.raises(InferenceServerException, match="unexpected shape"):
            client.infer("simple", simple_inputs(np.ones((1, 8), np.int32)))
    after = metric_samples(server.metrics_port)

    def moved(name, **labels):
        return value(after, name, "simple", **labels) - value(before, name, "simple", **labels)

    assert moved("nv_inference_request_success") == 5
    assert moved("nv_inference_count") == 5
    assert moved("nv_inference_exec_count") == 5
    # Requests that fail validation are failures of the model (reason OTHER).
    assert moved("nv_inference_request_failure", reason="OTHER") == 3
    for reason in ("REJECTED", "CANCELED", "BACKEND"):
        assert moved("nv_inference_request_failure", reason=reason) == 0
    assert moved("nv_inference_request_duration_us") > 0
    assert moved("nv_inference_compute_infer_duration_us") > 0
    assert moved("nv_inference_queue_duration_us") >= 0
    # The counters are the statistics extension's, never a second count.
    stats = client.get_inference_statistics("simple")["model_stats"][0]["inference_stats"]
    assert value(after, "nv_inference_request_success", "simple") == stats["success"]["count"]
    assert (
        value(after, "nv_inference_request_failure", "simple", reason="OTHER")
        == (stats["fail"]["count"])
    )
    assert value(after, "nv_inference_queue_duration_us", "simple") == stats["queue"]["ns"] // 1000


def test_pending_count_and_backend_failures(server, client, gate):
    """With the only instance held by the gate, one request executes and the
    others wait in the queue: the pending count shows them."""
    before = metric_samples(server.metrics_port)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.infer, "gated", gated_input(v)) for v in (1, 2, 3, -1)]
        deadline = time.monotonic() + 30
        while (
            value(
                metric_samples(server.metrics_port), "nv_inference_pending_request_count", "gated"
            )
            != 3
        ):
            assert time.monotonic() < deadline, "the queued requests never showed as pending"
            time.sleep(0.02)
        gate.touch()
        outcomes = []
        for future in futures:
            try:
                outcomes.append(int(future.result().as_numpy("OUT")[0]))
            except InferenceServerException as exc:
                outcomes.append(str(exc))
    assert outcomes[:3] == [2, 4, 6]
    assert "negative input" in outcomes[3]
    after = metric_samples(server.metrics_port)
    assert value(after, "nv_inference_pending_request_count", "gated") == 0
    succeeded = value(after, "nv_inference_request_success", "gated") - value(
        before, "nv_inference_request_success", "gated"
    )
    failed = value(after, "nv_inference_request_failure", "gated", reason="BACKEND") - value(
        before, "nv_inference_request_failure", "gated", reason="BACKEND"
    )
    assert (succeeded, failed) == (3, 1)
    queued = value(after, "nv_inference_queue_duration_us", "gated") - value(
        before, "nv_inference_queue_duration_us", "gated"
    )
    assert queued > 0  # three requests waited behind the gate


def test_first_response_histogram_for_a_decoupled_model(server):
    import tritonclient.grpc as grpcclient

    before = metric_samples(server.metrics_port)
    results = []
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: results.append(error or result))
    try:
        for count in (2, 3):
            infer_input = grpcclient.InferInput("IN", [1], "INT32")
            infer_input.set_data_from_numpy(np.array([count], np.int32))
            client.async_stream_infer("repeat", [infer_input])
    finally:
        client.stop_stream()
        client.close()
    assert len(results) == 5 and not any(isinstance(r, Exception) for r in results)
    after = metric_samples(server.metrics_port)
    name = "nv_inference_first_response_histogram_ms"
    # One observation per request (its first response), not per response.
    assert value(after, name + "_count", "repeat") - value(before, name + "_count", "repeat") == 2
    assert value(after, name + "_bucket", "repeat", le="+Inf") == value(
        after, name + "_count", "repeat"
    )
    assert value(after, name + "_sum", "repeat") > value(before, name + "_sum", "repeat")
    # The decoupled executions count as successes too.
    assert (
        value(after, "nv_inference_request_success", "repeat")
        - value(before, "nv_inference_request_success", "repeat")
        == 2
    )


def test_first_response_histogram_for_a_model_that_is_not_decoupled(server, client):
    # Triton observes every request's first response, decoupled or not
    # (core src/infer_response.cc InferenceResponse::UpdateResponseMetrics).
    name = "nv_inference_first_response_histogram_ms"
    before = metric_samples(server.metrics_port)
    for _ in range(4):
        client.infer("simple", simple_inputs())
    after = metric_samples(server.metrics_port)
    counted = value(after, name + "_count", "simple") - value(before, name + "_count", "simple")
    assert counted == 4
    assert value(after, name + "_bucket", "simple", le="+Inf") == value(
        after, name + "_count", "simple"
    )


SUMMARIES = (
    "nv_inference_request_summary_us",
    "nv_inference_queue_summary_us",
    "nv_inference_compute_input_summary_us",
    "nv_inference_compute_infer_summary_us",
    "nv_inference_compute_output_summary_us",
)
TRITON_QUANTILES = ("0.5", "0.9", "0.95", "0.99", "0.999")


def test_latency_summaries_with_tritons_quantiles(server, client):
    before = metric_samples(server.metrics_port)
    for _ in range(20):
        client.infer("simple", simple_inputs())
    after = metric_samples(server.metrics_port)
    for name in SUMMARIES:
        count = value(after, name + "_count", "simple") - value(before, name + "_count", "simple")
        assert count == 20, name
        quantiles = [value(after, name, "simple", quantile=q) for q in TRITON_QUANTILES]
        assert all(q == q and q >= 0 for q in quantiles), (name, quantiles)  # no NaN
        assert quantiles == sorted(quantiles), (name, quantiles)
        # Every observation is at most the sum of all of them.
        assert quantiles[-1] <= value(after, name + "_sum", "simple"), name
    # The summaries' sums agree with the counters (each observation is rounded
    # down to whole microseconds, the counter once).
    for summary, counter in (
        ("nv_inference_request_summary_us", "nv_inference_request_duration_us"),
        ("nv_inference_queue_summary_us", "nv_inference_queue_duration_us"),
        ("nv_inference_compute_infer_summary_us", "nv_inference_compute_infer_duration_us"),
    ):
        total = value(after, counter, "simple")
        count = value(after, summary + "_count", "simple")
        assert total - count <= value(after, summary + "_sum", "simple") <= total
    # The request takes longer than its compute.
    assert value(after, SUMMARIES[0], "simple", quantile="0.5") >= value(
        after, SUMMARIES[3], "simple", quantile="0.5"
    )
    text = metrics_text(server.metrics_port)
    assert "# TYPE nv_inference_request_summary_us summary" in text
    assert 'nv_inference_request_summary_us{model="simple",quantile="0.999",version="1"}' in text
    assert "nv_cache_hit_summary_per_model" not in text  # no model has the cache


def test_process_and_cpu_metrics_and_other_paths(server):
    samples = metric_samples(server.metrics_port)
    names = {name for name, _ in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names
    assert {"nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"} <= names
    assert (
        0 < samples[("nv_cpu_memory_used_bytes", ())] <= samples[("nv_cpu_memory_total_bytes", ())]
    )
    connection = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=10)
    connection.request("GET", "/v2/health/ready")
    response = connection.getresponse()
    assert response.status == 404
    assert "error" in json.loads(response.read())


def test_metrics_text_uses_tritons_names(server):
    text = metrics_text(server.metrics_port)
    assert 'nv_inference_request_success{model="simple",version="1"} ' in text
    assert 'nv_inference_request_failure{model="simple",reason="BACKEND",version="1"} ' in text
    assert "nv_inference_request_success_total" not in text


# Triton's counter families (core src/metrics.cc, prometheus::BuildCounter) that a
# server without a response cache or GPUs exposes.
TRITON_COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
)


@pytest.mark.parametrize("accept", [None, "application/openmetrics-text; version=1.0.0"])
def test_tritons_counters_are_typed_counter_under_tritons_names(server, accept):
    """What a scraper reading types sees: ``# TYPE <name> counter``, samples ``<name>``."""
    connection = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=10)
    connection.request("GET", "/metrics", headers={"Accept": accept} if accept else {})
    response = connection.getresponse()
    text = response.read().decode()
    # Triton answers in the text format whatever is asked; so do we.
    assert response.getheader("content-type") == "text/plain; version=0.0.4; charset=utf-8"
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for name in TRITON_COUNTERS:
        assert types.get(name) == "counter", (name, types.get(name))
        assert re.search(rf'^{name}{{model="simple",.*version="1"}} \d', text, re.MULTILINE), name
    assert "_total{" not in text.replace("process_cpu_seconds_total", "")
    assert types["nv_inference_pending_request_count"] == "gauge"
    assert types["process_cpu_seconds_total"] == "counter"  # prometheus-client's own

    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in TRITON_COUNTERS:
        assert families[name].type == "counter", name
        assert families[name].samples, name


def test_in_process_summaries_from_metrics_configuration():
    """Triton's Options.metrics_configuration reaches the summaries, and an attached
    metrics frontend exports them."""
    import urllib.request

    from trionserve import api

    settings = {"summary_latencies": "true", "summary_quantiles": "0.5:0.05,0.99:0.001"}
    with api.Server(
        model_repository=EXAMPLES,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        startup_models=["simple"],
        metrics_configuration={"": settings},
    ) as server:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for _ in range(3):
            list(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": a}))
        ((host, port),) = server.attach_metrics("127.0.0.1", 0)
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as answer:
            families = {f.name: f for f in text_string_to_metric_families(answer.read().decode())}
    samples = {
        (s.name, s.labels.get("quantile")): s.value
        for s in families["nv_inference_request_summary_us"].samples
    }
    assert samples[("nv_inference_request_summary_us_count", None)] == 3
    assert set(samples) == {
        ("nv_inference_request_summary_us", "0.5"),
        ("nv_inference_request_summary_us", "0.99"),
        ("nv_inference_request_summary_us_count", None),
        ("nv_inference_request_summary_us_sum", None),
    }
    assert (
        0
        < samples[("nv_inference_request_summary_us", "0.5")]
        <= samples[("nv_inference_request_summary_us", "0.99")]
    )
