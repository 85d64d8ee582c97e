"""Ragged batching end to end: a real server, an ONNX model built here, requests of
different lengths batched together with the official tritonclient; the model is
given batch inputs that say where each request's elements are, and its output is
scattered back to each request in the shape of its input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from tests.serverproc import ServerProcess

CONFIG = """
name: "ragged"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "RAGGED" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [
  { name: "DOUBLED" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "START" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }
]
batch_input [
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "OFFSETS"
    data_type: TYPE_FP32 source_input: "RAGGED" },
  { kind: BATCH_ELEMENT_COUNT target_name: "COUNTS"
    data_type: TYPE_INT32 source_input: "RAGGED" }
]
batch_output [
  { target_name: "DOUBLED" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "RAGGED" }
]
# Holds requests up to 10 s: the batch leaves when four have come.
dynamic_batching { max_queue_delay_microseconds: 10000000 }
"""


def ragged_onnx() -> onnx.ModelProto:
    """DOUBLED = 2 * RAGGED (flat, all requests); START = each request's offset
    (OFFSETS without its last entry) and COUNT = its element count, as columns."""
    axes = helper.make_tensor("AXES", TensorProto.INT64, [1], [1])
    two = helper.make_tensor("TWO", TensorProto.FLOAT, [], [2.0])
    starts = helper.make_tensor("STARTS", TensorProto.INT64, [1], [0])
    ends = helper.make_tensor("ENDS", TensorProto.INT64, [1], [-1])
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["RAGGED", "TWO"], ["DOUBLED"]),
            helper.make_node("Slice", ["OFFSETS", "STARTS", "ENDS"], ["FIRST"]),
            helper.make_node("Unsqueeze", ["FIRST", "AXES"], ["START"]),
            helper.make_node("Unsqueeze", ["COUNTS", "AXES"], ["COUNT"]),
        ],
        "ragged",
        [
            helper.make_tensor_value_info("RAGGED", TensorProto.FLOAT, ["elements"]),
            helper.make_tensor_value_info("OFFSETS", TensorProto.FLOAT, ["offsets"]),
            helper.make_tensor_value_info("COUNTS", TensorProto.INT32, ["requests"]),
        ],
        [
            helper.make_tensor_value_info("DOUBLED", TensorProto.FLOAT, ["elements"]),
            helper.make_tensor_value_info("START", TensorProto.FLOAT, ["requests", 1]),
            helper.make_tensor_value_info("COUNT", TensorProto.INT32, ["requests", 1]),
        ],
        initializer=[axes, two, starts, ends],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("ragged_repository")
    (repository / "ragged" / "1").mkdir(parents=True)
    onnx.save(ragged_onnx(), str(repository / "ragged" / "1" / "model.onnx"))
    (repository / "ragged" / "config.pbtxt").write_text(CONFIG)
    proc = ServerProcess(repository)
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def test_requests_of_different_lengths_share_one_batch(server):
    lengths = [2, 4, 1, 3]
    client = httpclient.InferenceServerClient(server.http_url, concurrency=4)
    try:
        jobs = []
        for length in lengths:
            data = np.arange(length, dtype=np.float32).reshape(1, length) + 10 * length
            infer_input = httpclient.InferInput("RAGGED", [1, length], "FP32")
            infer_input.set_data_from_numpy(data)
            jobs.append((data, client.async_infer("ragged", [infer_input])))
        results = [(data, job.get_result()) for data, job in jobs]
        stats = client.get_inference_statistics("ragged")["model_stats"][0]
    finally:
        client.close()
    # One execution of four requests.
    assert stats["execution_count"] == 1
    assert stats["inference_count"] == 4
    # Each request's output has its own input's shape and values, doubled.
    for data, result in results:
        np.testing.assert_array_equal(result.as_numpy("DOUBLED"), data * 2)
    # The batch inputs told the model where each request's elements were, in the
    # order the requests were batched: offsets 0, 2, 6, 7 for lengths 2, 4, 1, 3.
    starts = {int(r.as_numpy("COUNT")[0, 0]): float(r.as_numpy("START")[0, 0]) for _, r in results}
    assert sorted(starts) == [1, 2, 3, 4]
    offsets = sorted(starts.values())
    assert offsets[0] == 0.0
    by_offset = [count for count, _ in sorted(starts.items(), key=lambda item: item[1])]
    assert np.diff(offsets).tolist() == by_offset[:-1]
