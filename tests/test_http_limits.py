"""HTTP request shapes and limits against a real server on real sockets: raw binary
requests, inputs that name both data and shared memory, body limits, compression
caps, connection limits, malformed JSON and HTTP framing."""

from __future__ import annotations

import http.client
import json
import textwrap

import numpy as np
import pytest

from tests.serverproc import EXAMPLES, ServerProcess

# Sums and counts the bytes of its one UINT8 input (any length): a large input
# answered with a small output.
COUNT_BYTES_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            counts = np.array([data.size, int(data.sum(dtype=np.int64))], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("COUNTS", counts)]))
        return responses
'''

COUNT_BYTES_CONFIG = """
name: "count_bytes"
backend: "python"
max_batch_size: 0
input [ { name: "RAW", data_type: TYPE_UINT8, dims: [ -1 ] } ]
output [ { name: "COUNTS", data_type: TYPE_INT64, dims: [ 2 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    model = repository / "count_bytes"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(COUNT_BYTES_CONFIG)
    (model / "1" / "model.py").write_text(textwrap.dedent(COUNT_BYTES_MODEL))
    proc = ServerProcess(EXAMPLES, repository)
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def post(server, path: str, body, headers: dict | None = None, chunked: bool = False):
    """(status, headers, body) of one POST on a fresh connection."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers=headers or {},
                           encode_chunked=chunked)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


RAW = {"Inference-Header-Content-Length": "0"}


def test_raw_binary_request_is_the_only_input(server):
    """Inference-Header-Content-Length: 0: the whole body is the data of the
    model's one input, its shape deduced from the configuration (Triton core
    infer_request.cc, Normalize)."""
    data = np.arange(6, dtype=np.float32)
    status, _, body = post(server, "/v2/models/identity_fp32/infer", data.tobytes(), RAW)
    assert status == 200, body
    (output,) = json.loads(body)["outputs"]
    assert (output["name"], output["shape"]) == ("OUTPUT0", [1, 6])
    assert output["data"] == data.tolist()


def test_raw_binary_request_of_tens_of_mib_in_chunks(server):
    payload = np.random.default_rng(7).integers(0, 256, 24 << 20, dtype=np.uint8)
    raw = payload.tobytes()
    pieces = (raw[i:i + (1 << 20)] for i in range(0, len(raw), 1 << 20))
    status, _, body = post(server, "/v2/models/count_bytes/infer", pieces, RAW, chunked=True)
    assert status == 200, body
    (output,) = json.loads(body)["outputs"]
    assert output["data"] == [payload.size, int(payload.sum(dtype=np.int64))]


def test_raw_binary_request_to_a_model_with_two_inputs_is_400(server):
    status, _, body = post(server, "/v2/models/simple/infer", b"\0" * 128, RAW)
    assert status == 400
    assert "Raw request must only have 1 input" in json.loads(body)["error"]
    assert "got 2 inputs in 'simple' model configuration" in json.loads(body)["error"]


def test_raw_binary_request_of_the_wrong_size_is_400(server):
    status, _, body = post(server, "/v2/models/identity_fp32/infer", b"\0" * 7, RAW)
    assert status == 400
    assert "input 'INPUT0'" in json.loads(body)["error"]
