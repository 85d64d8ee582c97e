"""Model warmup (``model_warmup``): every instance runs every sample before the
model is READY; bad samples and failing warmups are load errors naming the cause.
A real server with real ONNX Runtime and Python-backend models."""

from __future__ import annotations

import json
import shutil
import struct
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.repository import python_model
from tests.serverproc import http_client, serving

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_repository"

RECORDER = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = []

    def execute(self, requests):
        batch = []
        for request in requests:
            if request.request_id().startswith("warmup_") and FAIL:
                raise RuntimeError("the weights are not warm")
            values = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            words = pb_utils.get_input_tensor_by_name(request, "W").as_numpy()
            batch.append([request.request_id(), values.tolist(), [w.decode() for w in words.flat]])
        self.seen.append(batch)
        report = np.array([json.dumps(self.seen).encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", report)]) for _ in requests]
"""

RECORDER_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 4
input [
  {{ name: "X" data_type: TYPE_INT32 dims: [ 3 ] }},
  {{ name: "W" data_type: TYPE_STRING dims: [ 2 ] }}
]
output [ {{ name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{warmup}
"""

ZERO_AND_FILE = """
model_warmup [
  {
    name: "zeros"
    batch_size: 2
    count: 2
    inputs { key: "X" value: { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } }
    inputs { key: "W" value: { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } }
  },
  {
    name: "from_files"
    batch_size: 1
    inputs { key: "X" value: { data_type: TYPE_INT32 dims: [ 3 ] input_data_file: "x.bin" } }
    inputs { key: "W" value: { data_type: TYPE_STRING dims: [ 2 ] input_data_file: "w.bin" } }
  }
]
"""

RANDOM_SIMPLE = """
model_warmup [ {
  name: "random"
  batch_size: 8
  inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
  inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
} ]
"""


def recorder(root: Path, name: str, warmup: str, fail: bool = False) -> Path:
    words = b"".join(struct.pack("<I", len(w)) + w for w in (b"hot", b"tea"))
    return python_model(
        root,
        name,
        RECORDER_CONFIG.format(name=name, warmup=warmup),
        textwrap.dedent(RECORDER).replace("FAIL", str(fail)),
        {"warmup/x.bin": np.array([7, 8, 9], dtype=np.int32).tobytes(), "warmup/w.bin": words},
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup")
    recorder(root, "recorder", ZERO_AND_FILE)
    recorder(root, "failing", ZERO_AND_FILE, fail=True)
    shutil.copytree(EXAMPLES / "simple", root / "simple_warm")
    config = (root / "simple_warm" / "config.pbtxt").read_text()
    (root / "simple_warm" / "config.pbtxt").write_text(
        config.replace('name: "simple"', 'name: "simple_warm"') + RANDOM_SIMPLE
    )
    bad = recorder(root, "too_big", ZERO_AND_FILE.replace("batch_size: 2", "batch_size: 5"))
    missing = recorder(root, "no_file", ZERO_AND_FILE)
    (missing / "warmup" / "x.bin").unlink()
    recorder(root, "escape", ZERO_AND_FILE.replace('"x.bin"', '"../config.pbtxt"'))
    assert bad.exists()
    with serving(root, args=["--exit-on-error=false"]) as proc, http_client(proc) as client:
        yield client


def test_every_sample_runs_before_ready(served):
    x = httpclient.InferInput("X", [1, 3], "INT32")
    x.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.int32))
    w = httpclient.InferInput("W", [1, 2], "BYTES")
    w.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=np.object_))
    seen = json.loads(served.infer("recorder", [x, w]).as_numpy("SEEN")[0])
    zeros = ["warmup_zeros", [[0, 0, 0]], ["", ""]]
    from_files = ["warmup_from_files", [[7, 8, 9]], ["hot", "tea"]]
    assert seen[:3] == [[zeros, zeros], [zeros, zeros], [from_files]]
    assert seen[3] == [["", [[1, 2, 3]], ["a", "b"]]]
    # Warmup is not inference: the statistics count only the client's request.
    stats = served.get_inference_statistics("recorder")["model_stats"][0]
    assert stats["inference_count"] == 1


def test_random_data_warms_an_onnx_model(served):
    assert served.is_model_ready("simple_warm")
    stats = served.get_inference_statistics("simple_warm")["model_stats"][0]
    assert stats["inference_count"] == 0


def test_failures_are_load_errors_with_the_cause(served):
    rows = {row["name"]: row for row in served.get_model_repository_index()}
    assert rows["failing"]["state"] == "UNAVAILABLE"
    assert "warmup sample 'zeros' on instance 'failing_0_0' failed" in rows["failing"]["reason"]
    assert "the weights are not warm" in rows["failing"]["reason"]
    assert rows["too_big"]["state"] == "UNAVAILABLE"
    assert "batch_size 5 exceeds max_batch_size 4" in rows["too_big"]["reason"]
    assert rows["no_file"]["state"] == "UNAVAILABLE"
    assert "cannot read warmup/x.bin" in rows["no_file"]["reason"]
    assert rows["escape"]["state"] == "UNAVAILABLE"
    assert "must name a file in the model's warmup/ directory" in rows["escape"]["reason"]
    assert served.is_model_ready("recorder")
