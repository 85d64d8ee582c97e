"""Custom metrics from Python-backend models (``pb_utils.MetricFamily``), exposed on
the metrics endpoint of a real server; the rules checked from inside a model and,
directly, on the registry."""

from __future__ import annotations

import json
import re
import textwrap

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.helpers import metrics_text
from tests.serverproc import scrape_metrics, serving
from trionserve.observability.custom_metrics import (
    COUNTER,
    FAMILY_GONE,
    GAUGE,
    HISTOGRAM,
    CustomMetrics,
    MetricError,
)

MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def raises(action):
    try:
        action()
    except pb_utils.TritonModelException as exc:
        return str(exc)
    return None


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"]}
        # A metric lives no longer than its family: the model keeps both.
        self.requests_family = pb_utils.MetricFamily(
            name="custom_requests", description="requests seen",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.requests = self.requests_family.Metric(labels=labels)
        self.gauge_family = pb_utils.MetricFamily(
            name="custom_last_value", description="last value",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.last = self.gauge_family.Metric(labels=labels)
        self.latency_family = pb_utils.MetricFamily(
            name="custom_value_histogram", description="values",
            kind=pb_utils.MetricFamily.HISTOGRAM,
        )
        self.values = self.latency_family.Metric(
            labels=labels, buckets=[0.1, 1.0, 2.5, 5.0, 10.0]
        )
        counter_family = pb_utils.MetricFamily(
            name="custom_checks", description="first description",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        same = pb_utils.MetricFamily(
            name="custom_checks", description="second description",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        first, second = counter_family.Metric(), same.Metric()
        first.increment(7.5)
        doomed_family = pb_utils.MetricFamily(
            name="custom_doomed", description="deleted early",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        doomed = doomed_family.Metric()
        del doomed_family
        self.checks = {
            "shared_value": second.value(),
            "counter_negative": raises(lambda: first.increment(-1)),
            "counter_set": raises(lambda: first.set(3)),
            "counter_observe": raises(lambda: first.observe(3)),
            "gauge_observe": raises(lambda: self.last.observe(1)),
            "histogram_value": raises(self.values.value),
            "histogram_increment": raises(lambda: self.values.increment(1)),
            "histogram_no_buckets": raises(lambda: self.latency_family.Metric(labels={})),
            "histogram_unordered": raises(
                lambda: self.latency_family.Metric(labels={"x": "y"}, buckets=[2.5, 0.1])
            ),
            "other_kind": raises(lambda: pb_utils.MetricFamily(
                name="custom_checks", description="", kind=pb_utils.MetricFamily.GAUGE)),
            "bad_name": raises(lambda: pb_utils.MetricFamily(
                name="no spaces", description="", kind=pb_utils.MetricFamily.GAUGE)),
            "family_deleted": raises(lambda: doomed.set(1)),
        }
        self.keep = (counter_family, same, first, second)

    def execute(self, requests):
        responses = []
        for request in requests:
            value = float(pb_utils.get_input_tensor_by_name(request, "VALUE").as_numpy()[0])
            self.requests.increment(1)
            self.last.set(value)
            self.values.observe(value)
            checks = np.array([json.dumps(self.checks).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("CHECKS", checks),
                pb_utils.Tensor("COUNT", np.array([self.requests.value()], np.float64)),
            ]))
        return responses
"""

CONFIG = """
name: "metrics_model"
backend: "python"
max_batch_size: 0
input [ { name: "VALUE" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "CHECKS" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "COUNT" data_type: TYPE_FP64 dims: [ 1 ] }
]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("custom_metrics")
    model = repository / "metrics_model"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    args = ["--model-control-mode=explicit", "--load-model=metrics_model"]
    with serving(repository, args=args) as proc:
        yield proc


def infer(client, value: float) -> tuple[dict, float]:
    inputs = [httpclient.InferInput("VALUE", [1], "FP32")]
    inputs[0].set_data_from_numpy(np.array([value], dtype=np.float32))
    result = client.infer("metrics_model", inputs)
    return json.loads(result.as_numpy("CHECKS")[0]), float(result.as_numpy("COUNT")[0])


def test_counter_gauge_and_histogram_reach_the_metrics_endpoint(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        for value in (0.05, 1.5, 6.0):
            checks, count = infer(client, value)
    finally:
        client.close()
    assert count == 3.0
    families = scrape_metrics(server)
    labels = {"model": "metrics_model"}

    (requests,) = families["custom_requests"].samples
    assert (requests.labels, requests.value) == (labels, 3.0)
    assert families["custom_requests"].type == "counter"
    text = metrics_text(server.metrics_port)
    # Typed, under the name the model gave (Triton's), without a _total suffix.
    assert re.search(r"^# TYPE custom_requests counter$", text, re.MULTILINE)
    assert re.search(r'^custom_requests\{model="metrics_model"\} 3(\.0)?$', text, re.MULTILINE)
    (last,) = families["custom_last_value"].samples
    assert families["custom_last_value"].type == "gauge"
    assert (last.labels, last.value) == (labels, 6.0)

    histogram = families["custom_value_histogram"]
    assert histogram.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in histogram.samples if s.name.endswith("_bucket")}
    assert buckets == {"0.1": 1, "1": 1, "2.5": 2, "5": 2, "10": 3, "+Inf": 3}
    by_name = {s.name: s.value for s in histogram.samples}
    assert by_name["custom_value_histogram_count"] == 3
    assert by_name["custom_value_histogram_sum"] == pytest.approx(7.55)

    # Two families of one name are one family: the first description stays.
    assert families["custom_checks"].documentation == "first description"
    assert "custom_doomed" not in families  # its family object was deleted


def test_the_rules_hold_inside_the_model(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        checks, _ = infer(client, 1.0)
    finally:
        client.close()
    assert checks.pop("shared_value") == 7.5
    assert "cannot be decremented" in checks.pop("counter_negative")
    assert "cannot be set" in checks.pop("counter_set")
    assert "only a histogram can observe" in checks.pop("counter_observe")
    assert "only a histogram can observe" in checks.pop("gauge_observe")
    assert "no single value" in checks.pop("histogram_value")
    assert "can only observe" in checks.pop("histogram_increment")
    assert "needs buckets" in checks.pop("histogram_no_buckets")
    assert "strictly ascending" in checks.pop("histogram_unordered")
    assert "already exists as a counter" in checks.pop("other_kind")
    assert "invalid metric family name" in checks.pop("bad_name")
    assert checks.pop("family_deleted") == FAMILY_GONE
    assert checks == {}


def test_unloading_the_model_removes_its_families(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        infer(client, 2.0)
        assert "custom_requests" in scrape_metrics(server)
        client.unload_model("metrics_model")
        assert "custom_requests" not in scrape_metrics(server)
        client.load_model("metrics_model")
        _, count = infer(client, 2.0)
    finally:
        client.close()
    # A new stub starts its metrics afresh.
    assert count == 1.0
    (requests,) = scrape_metrics(server)["custom_requests"].samples
    assert requests.value == 1.0


# -- the registry on its own -----------------------------------------------------------


def test_references_keep_families_and_metrics_alive():
    metrics = CustomMetrics()
    family = metrics.create_family(1, "shared", "d", GAUGE)
    assert metrics.create_family(2, "shared", "other", GAUGE) == family
    key = metrics.create_metric(1, family, {"a": "b"}, None)
    assert metrics.create_metric(2, family, {"a": "b"}, None) == key
    metrics.update(family, key, "set", 4)
    metrics.release(1)  # owner 2 still holds the family and the metric
    assert metrics.update(family, key, "value", 0) == 4
    metrics.delete_metric(2, family, key)
    with pytest.raises(MetricError, match="deleted"):
        metrics.update(family, key, "value", 0)
    metrics.delete_family(2, family)
    with pytest.raises(MetricError) as error:
        metrics.update(family, key, "value", 0)
    assert str(error.value) == FAMILY_GONE
    assert list(metrics.collect()) == []


def test_invalid_labels_and_kinds_are_refused():
    metrics = CustomMetrics()
    with pytest.raises(MetricError, match="unknown kind"):
        metrics.create_family(1, "m", "d", 7)
    family = metrics.create_family(1, "m", "d", COUNTER)
    with pytest.raises(MetricError, match="label name"):
        metrics.create_metric(1, family, {"__reserved": "x"}, None)
    with pytest.raises(MetricError, match="must be a string"):
        metrics.create_metric(1, family, {"a": 1}, None)
    histogram = metrics.create_family(1, "h", "d", HISTOGRAM)
    assert metrics.create_metric(1, histogram, {}, []) == ()
    metrics.update(histogram, (), "observe", 3)
    (exposed,) = [m for m in metrics.collect() if m.name == "h"]
    assert {s.name: s.value for s in exposed.samples} == {
        "h_bucket": 1,
        "h_count": 1,
        "h_sum": 3.0,
    }


def test_a_release_message_needs_no_reply():
    metrics = CustomMetrics()
    family = metrics.create_family(5, "r", "d", GAUGE)
    reply = metrics.handle(
        5, {"op": "metric", "action": "family_delete", "call": None, "family": family}
    )
    assert reply is None
    assert list(metrics.collect()) == []
    reply = metrics.handle(
        5,
        {"op": "metric", "action": "value", "call": 9, "family": family, "labels": [], "value": 0},
    )
    assert reply == {"op": "metric_reply", "call": 9, "error": FAMILY_GONE}
