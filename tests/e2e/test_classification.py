"""Classification extension: top-k "score:index:label" outputs."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.serverproc import EXAMPLES, ServerProcess
from trionserve.core.classification import classify
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import Tensor


def test_classify_batched_with_labels():
    scores = np.array([[0.1, 0.9, 0.5, 0.7], [4.0, 3.0, 2.0, 1.0]], dtype=np.float32)
    result = classify(Tensor("OUT", "FP32", scores), 2, ["a", "b", "c", "d"], batched=True)
    assert result.datatype == "BYTES"
    assert result.data.tolist() == [
        [b"0.900000:1:b", b"0.700000:3:d"],
        [b"4.000000:0:a", b"3.000000:1:b"],
    ]


def test_classify_unbatched_without_labels_and_k_too_large():
    result = classify(Tensor("OUT", "INT32", np.array([3, 7, 5])), 5, None, batched=False)
    assert result.data.tolist() == [b"7.000000:1", b"5.000000:2", b"3.000000:0"]


def test_classification_over_http(tmp_path):
    model = tmp_path / "scores"
    shutil.copytree(EXAMPLES / "identity_fp32" / "1", model / "1")
    (model / "labels.txt").write_text("cat\ndog\nbird\nfish\n")
    (model / "config.pbtxt").write_text(
        """
        name: "scores"
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ]
                   label_filename: "labels.txt" } ]
        """
    )
    server = ServerProcess(tmp_path)
    try:
        server.wait_ready()
        client = httpclient.InferenceServerClient(server.http_url)
        data = np.array([[0.1, 0.9, 0.5, 0.7]], dtype=np.float32)
        infer_input = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        infer_input.set_data_from_numpy(data)
        for binary in (True, False):
            output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=3)
            result = client.infer("scores", [infer_input], outputs=[output])
            values = [
                v if isinstance(v, bytes) else v.encode()
                for v in result.as_numpy("OUTPUT0").reshape(-1)
            ]
            assert values == [b"0.900000:1:dog", b"0.700000:3:fish", b"0.500000:2:bird"]
            assert result.get_output("OUTPUT0")["datatype"] == "BYTES"
        # More than a million scores per item: refused with Triton's words
        # (qa/L0_parameters class_count_test.py test_classification_output_tensor_too_large).
        big = httpclient.InferInput("INPUT0", [1, 1_000_001], "FP32")
        big.set_data_from_numpy(np.ones((1, 1_000_001), dtype=np.float32))
        output = httpclient.InferRequestedOutput("OUTPUT0", class_count=1)
        with pytest.raises(InferenceServerException) as info:
            client.infer("scores", [big], outputs=[output])
        assert info.value.status() == "400"
        assert "classification output tensor too large" in info.value.message()
        client.close()
        assert server.stop() == 0
    finally:
        server.close()


@pytest.mark.parametrize("datatype", ["BYTES", "FP16", "BOOL", "BF16"])
def test_classify_refuses_what_triton_does_not_classify(datatype):
    # server src/classification.cc TopkClassifications: its datatype switch.
    data = np.array([b"a"], dtype=np.object_) if datatype == "BYTES" else np.zeros(3, np.float16)
    with pytest.raises(
        InvalidArgument,
        match=f"class result not available for output due to unsupported type '{datatype}'",
    ):
        classify(Tensor("OUT", datatype, data), 1, None, batched=False)


def test_classify_refuses_more_than_a_million_elements_per_item():
    # server src/classification.cc kMaxClassificationElements; qa/L0_parameters
    # class_count_test.py test_classification_output_tensor_too_large.
    scores = np.ones((2, 1_000_001), dtype=np.float32)
    with pytest.raises(InvalidArgument, match="classification output tensor too large"):
        classify(Tensor("OUT", "FP32", scores), 1, None, batched=True)
    result = classify(Tensor("OUT", "FP32", scores[:, :1_000_000]), 1, None, batched=True)
    assert result.data.shape == (2, 1)
