"""Dynamic batching end to end: a real server, ONNX models, the official tritonclient."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.serverproc import ServerProcess

SIMPLE_TENSORS = """
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
"""

MODELS = {
    # Waits up to 100 ms to gather a batch of 8.
    "batching": "dynamic_batching { max_queue_delay_microseconds: 100000 }",
    # Holds requests 500 ms for a batch of 8; at most two wait.
    "small_queue": """dynamic_batching {
        max_queue_delay_microseconds: 500000
        default_queue_policy { max_queue_size: 2 }
    }""",
    # Holds requests 5 s for a batch of 8; a request may ask to wait less.
    "timeouts": """dynamic_batching {
        max_queue_delay_microseconds: 5000000
        default_queue_policy {
            timeout_action: REJECT
            default_timeout_microseconds: 10000000
            allow_timeout_override: true
        }
    }""",
}


def simple_onnx() -> onnx.ModelProto:
    def tensor(name: str):
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 16])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [tensor("INPUT0"), tensor("INPUT1")],
        [tensor("OUTPUT0"), tensor("OUTPUT1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("batching_repository")
    model = simple_onnx()
    for name, batching in MODELS.items():
        (repository / name / "1").mkdir(parents=True)
        onnx.save(model, str(repository / name / "1" / "model.onnx"))
        (repository / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
            f"{SIMPLE_TENSORS}\n{batching}\n"
        )
    proc = ServerProcess(repository)
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def inputs_for(value: int):
    a = np.full((1, 16), value, dtype=np.int32)
    b = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a + b, a - b


def stats_of(client, model: str) -> dict:
    return client.get_inference_statistics(model)["model_stats"][0]


def test_concurrent_requests_are_batched_and_answered_correctly(server):
    client = httpclient.InferenceServerClient(server.http_url, concurrency=16)
    try:
        jobs = []
        for i in range(16):
            inputs, total, difference = inputs_for(i)
            jobs.append(
                (i, total, difference, client.async_infer("batching", inputs, request_id=str(i)))
            )
        for i, total, difference, job in jobs:
            result = job.get_result()
            assert result.get_response()["id"] == str(i)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), total)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), difference)
        stats = stats_of(client, "batching")
    finally:
        client.close()
    assert stats["inference_count"] == 16
    assert stats["inference_stats"]["success"]["count"] == 16
    assert stats["execution_count"] < stats["inference_count"]
    assert max(b["batch_size"] for b in stats["batch_stats"]) > 1
    executions = sum(b["compute_infer"]["count"] for b in stats["batch_stats"])
    assert executions == stats["execution_count"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"]) == 16
    assert stats["inference_stats"]["queue"]["ns"] > 0


def test_full_queue_rejects_with_unavailable(server):
    """Three requests for a queue of two: exactly one is refused, at once."""
    client = httpclient.InferenceServerClient(server.http_url, concurrency=3)
    try:
        jobs = [client.async_infer("small_queue", inputs_for(i)[0]) for i in range(3)]
        answered, refused = [], []
        for job in jobs:
            try:
                answered.append(job.get_result())
            except InferenceServerException as error:
                refused.append(error)
    finally:
        client.close()
    assert len(refused) == 1, [e.message() for e in refused]
    assert "Exceeds maximum queue size" in refused[0].message()
    assert refused[0].status() == "503"
    assert len(answered) == 2


def test_request_timeout_expires_in_the_queue(server):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=30)
    try:
        with pytest.raises(InferenceServerException) as info:
            # The batcher would hold it 5 s for more requests; it asked for 200 ms.
            client.infer("timeouts", inputs_for(1)[0], timeout=200_000)
        stats = stats_of(client, "timeouts")
    finally:
        client.close()
    assert "Request timeout expired" in info.value.message()
    assert info.value.status() == "503"
    assert stats["inference_stats"]["fail"]["count"] == 1
    assert stats["execution_count"] == 0
    # It failed after about its own timeout, not the 5 s delay or the 10 s default.
    assert 0.2e9 <= stats["inference_stats"]["fail"]["ns"] < 2e9
