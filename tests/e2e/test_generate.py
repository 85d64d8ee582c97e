"""The generate extension: the sans-I/O mapping, and /generate and /generate_stream
on a real server (examples' identity_bytes and simple, and decoupled Python models)."""

from __future__ import annotations

import http.client
import json
import textwrap

import numpy as np
import pytest

from tests.serverproc import EXAMPLES, ServerProcess
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceResponse, Tensor
from trionserve.core.validation import ModelSignature, TensorSpec
from trionserve.protocol.http import generate as generate_codec

# -- the mapping ------------------------------------------------------------------------


def signature(max_batch_size: int = 0, **inputs: tuple[str, tuple[int, ...]]) -> ModelSignature:
    return ModelSignature(
        "m",
        max_batch_size,
        {name: TensorSpec(name, dt, dims) for name, (dt, dims) in inputs.items()},
        {},
    )


def decode(body: dict, sig: ModelSignature):
    return generate_codec.decode_generate_request(json.dumps(body).encode(), "m", None, sig)


def test_fields_named_like_inputs_become_tensors_and_the_rest_parameters():
    sig = signature(
        8, TEXT=("BYTES", (1,)), N=("INT32", (-1,)), T=("FP32", (1,)), FLAG=("BOOL", (1,))
    )
    request = decode(
        {
            "id": "42",
            "TEXT": "hello",
            "N": [1, 2, 3],
            "temperature": 0.5,
            "stream": False,
            "parameters": {"T": 0.25, "FLAG": True, "top_k": 3, "name": "x"},
        },
        sig,
    )
    assert request.id == "42"
    assert request.parameters == {"temperature": 0.5, "stream": False, "top_k": 3, "name": "x"}
    text = request.inputs["TEXT"]
    assert (text.datatype, text.shape, text.data.tolist()) == ("BYTES", (1, 1), [[b"hello"]])
    n = request.inputs["N"]
    assert n.data.dtype == np.int32 and n.shape == (1, 3) and n.data.tolist() == [[1, 2, 3]]
    assert request.inputs["T"].data.dtype == np.float32
    assert request.inputs["T"].shape == (1, 1)
    assert request.inputs["FLAG"].data.tolist() == [[True]]


def test_shapes_fill_fixed_dims_then_the_innermost_variable_one():
    fit = generate_codec.fit_shape
    assert fit("X", [-1, 16], 16) == [1, 16]
    assert fit("X", [-1, -1], 5) == [1, 5]
    assert fit("X", [-1, 2, -1], 6) == [1, 2, 3]
    assert fit("X", [4], 4) == [4]
    with pytest.raises(InvalidArgument, match="can not convert input 'X'"):
        fit("X", [-1, 16], 5)
    with pytest.raises(InvalidArgument, match="can not convert input 'X'"):
        fit("X", [2], 3)


@pytest.mark.parametrize(
    "body, message",
    [
        # TritonJson's words, as Triton reads a generate input.
        ({"N": "seven"}, "attempt to access JSON non-signed-integer as signed-integer"),
        ({"N": [1.5]}, "attempt to access JSON non-signed-integer as signed-integer"),
        ({"N": [[1, 2]]}, "value or a flat array"),
        ({"TEXT": 3}, "attempt to access JSON non-string as string"),
        ({"TEXT": {"USER": "a"}}, "attempt to access JSON non-string as string"),
        ({"other": [1, 2]}, "parameter 'other' has invalid type"),
        ({"other": None}, "parameter 'other' has invalid type"),
        ({"parameters": 3}, "Expected JSON object for keyword: 'parameters'"),
        ({"id": 7}, "Unable to parse 'id'"),
        (
            {"N": [1], "parameters": {"N": [2]}},
            "Converting keyword: 'parameters': input 'N' already exists in request",
        ),
        ({"parameters": {"nested": {"a": 1}}}, "Converting keyword: 'parameters': parameter"),
    ],
)
def test_bad_generate_requests_name_the_field(body, message):
    sig = signature(0, TEXT=("BYTES", (1,)), N=("INT32", (-1,)))
    with pytest.raises(InvalidArgument, match=message):
        decode(body, sig)


@pytest.mark.parametrize(
    "body, name",
    [
        (b'{"TEXT": "a", "N": [1], "TEXT": "b"}', "TEXT"),
        (b'{"TEXT": "a", "N": [1], "N": [2], "TEXT": "b"}', "N"),  # the first one named
    ],
)
def test_a_key_given_twice_is_refused_as_an_input_given_twice(body, name):
    """JSON with duplicate keys (qa/L0_http generate_endpoint_test.py
    test_duplicate_inputs): Triton's core refuses the second input with its words
    (infer_request.cc AddOriginalInput); Python's json would keep the last."""
    sig = signature(0, TEXT=("BYTES", (1,)), N=("INT32", (-1,)))
    with pytest.raises(InvalidArgument, match=f"input '{name}' already exists in request"):
        generate_codec.decode_generate_request(body, "m", None, sig)


def test_bytes_nested_deeper_than_tritons_cap_is_refused():
    # server src/common.h HTTP_MAX_JSON_NESTING_DEPTH, JsonBytesArrayByteSize
    sig = signature(0, TEXT=("BYTES", (-1,)))
    deep: object = "x"
    for _ in range(120):
        deep = [deep]
    with pytest.raises(
        InvalidArgument, match=r"JSON nesting depth exceeds maximum allowed limit \(100\)"
    ):
        decode({"TEXT": deep}, sig)


def test_not_json_is_an_invalid_argument():
    with pytest.raises(InvalidArgument, match="failed to parse the generate request JSON"):
        generate_codec.decode_generate_request(b"{nope", "m", None, signature())


def test_responses_map_outputs_to_fields():
    response = InferenceResponse(
        "m",
        "3",
        "",
        [
            Tensor("TEXT", "BYTES", np.array([[b"out"]], dtype=np.object_)),
            Tensor("SCORES", "FP32", np.array([[0.5, 1.5]], dtype=np.float32)),
            Tensor("COUNT", "INT64", np.array([7], dtype=np.int64)),
        ],
        {"finish_reason": "stop", "bytes": b"skipped"},
    )
    payload = generate_codec.encode_generate_response(response, "req-1")
    assert payload == {
        "id": "req-1",
        "model_name": "m",
        "model_version": "3",
        "finish_reason": "stop",
        "TEXT": "out",
        "SCORES": [0.5, 1.5],
        "COUNT": 7,
    }
    event = generate_codec.encode_event(payload)
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert json.loads(event[len(b"data: ") :]) == payload
    assert generate_codec.encode_error_event("boom") == b'data: {"error":"boom"}\n\n'


# -- end to end ----------------------------------------------------------------------------

DECOUPLED_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "INDEX" data_type: TYPE_INT32 dims: [ 1 ] }}
]
instance_group [ {{ kind: KIND_CPU }} ]
"""

# Sends COUNT responses "token-<i>". With a "gate" parameter it waits, after the
# first response, until that file exists; with "fail_after" it ends with an error
# after that many responses.
DECOUPLED_MODEL = """
import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            params = json.loads(request.parameters())
            sender = request.get_response_sender()
            threading.Thread(target=self.respond, args=(count, params, sender)).start()
        return None

    def respond(self, count, params, sender):
        for index in range(count):
            if index == params.get("fail_after"):
                error = pb_utils.TritonError("failed after %d responses" % index)
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("TEXT", np.array([("token-%d" % index).encode()], dtype=np.object_)),
                pb_utils.Tensor("INDEX", np.array([index], np.int32)),
            ]))
            if index == 0 and params.get("gate"):
                deadline = time.monotonic() + 30
                while not os.path.exists(params["gate"]):
                    if time.monotonic() > deadline:
                        error = pb_utils.TritonError("the gate never opened")
                        sender.send(pb_utils.InferenceResponse(error=error),
                                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                        return
                    time.sleep(0.005)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_models")
    (root / "tokens" / "1").mkdir(parents=True)
    (root / "tokens" / "config.pbtxt").write_text(DECOUPLED_CONFIG.format(name="tokens"))
    (root / "tokens" / "1" / "model.py").write_text(textwrap.dedent(DECOUPLED_MODEL))
    proc = ServerProcess(root, EXAMPLES)
    try:
        proc.wait_ready(path="/v2/health/ready")  # every frontend listens
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def post(server, path: str, body, timeout: float = 30) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    return connection.getresponse()


def events(response: http.client.HTTPResponse) -> list[dict]:
    """Every server-sent event of a generate_stream response, in order."""
    text = response.read().decode()
    chunks = [c for c in text.split("\n\n") if c]
    assert all(c.startswith("data: ") for c in chunks), text
    return [json.loads(c[len("data: ") :]) for c in chunks]


def test_generate_with_a_string_input(server):
    response = post(server, "/v2/models/identity_bytes/generate", {"id": "7", "INPUT0": "héllo"})
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("application/json")
    assert json.loads(response.read()) == {
        "id": "7",
        "model_name": "identity_bytes",
        "model_version": "1",
        "OUTPUT0": "héllo",
    }


def test_generate_with_array_inputs_and_a_version(server):
    a = list(range(16))
    response = post(
        server,
        "/v2/models/simple/versions/1/generate",
        {"INPUT0": a, "parameters": {"INPUT1": [1] * 16}},
    )
    assert response.status == 200
    payload = json.loads(response.read())
    assert payload["OUTPUT0"] == [x + 1 for x in a]
    assert payload["OUTPUT1"] == [x - 1 for x in a]


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_errors_before_inference_are_json_errors_with_a_status(server, endpoint):
    missing = post(server, f"/v2/models/nope/{endpoint}", {"INPUT0": "x"})
    assert missing.status == 404
    assert "nope" in json.loads(missing.read())["error"]
    bad = post(
        server, f"/v2/models/simple/{endpoint}", {"INPUT0": list(range(16)), "INPUT1": ["x"] * 16}
    )
    assert bad.status == 400
    assert bad.getheader("Content-Type") == "application/json"
    error = json.loads(bad.read())["error"]
    assert "input 'INPUT1'" in error and "non-signed-integer as signed-integer" in error
    shape = post(server, f"/v2/models/simple/{endpoint}", {"INPUT0": [1, 2], "INPUT1": [1, 2]})
    assert shape.status == 400
    assert "can not convert input" in json.loads(shape.read())["error"]


def test_generate_needs_exactly_one_response(server):
    one = post(server, "/v2/models/tokens/generate", {"COUNT": 1})
    assert one.status == 200
    assert json.loads(one.read())["TEXT"] == "token-0"
    several = post(server, "/v2/models/tokens/generate", {"COUNT": 3})
    assert several.status == 500
    assert "exactly 1 response" in json.loads(several.read())["error"]


def test_generate_stream_sends_each_response_as_an_event(server):
    response = post(server, "/v2/models/tokens/generate_stream", {"COUNT": 4, "id": "s1"})
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    got = events(response)
    assert [e["TEXT"] for e in got] == [f"token-{i}" for i in range(4)]
    assert [e["INDEX"] for e in got] == [0, 1, 2, 3]
    assert all(e["id"] == "s1" and e["model_name"] == "tokens" for e in got)


def test_generate_stream_sends_an_error_after_the_stream_started_as_an_event(server):
    response = post(server, "/v2/models/tokens/generate_stream", {"COUNT": 5, "fail_after": 2})
    assert response.status == 200
    got = events(response)
    assert [e.get("TEXT") for e in got[:2]] == ["token-0", "token-1"]
    assert got[2] == {"error": "failed after 2 responses"}
    assert len(got) == 3


def test_generate_stream_whose_first_response_is_an_error_answers_its_status(server):
    """The model's error as the first response sets the HTTP status, and the body is
    that error as the one event (server src/http_server.cc StartResponse;
    qa/L0_http generate_endpoint_test.py test_generate_stream_response_error)."""
    response = post(server, "/v2/models/tokens/generate_stream", {"COUNT": 5, "fail_after": 0})
    assert response.status == 500
    assert response.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    assert events(response) == [{"error": "failed after 0 responses"}]


def test_generate_stream_streams_before_the_model_finishes(server, tmp_path):
    """The first event arrives while the model is still held back by the gate:
    the body is streamed, not gathered (a gathered body would time out here)."""
    gate = tmp_path / "gate"
    response = post(
        server, "/v2/models/tokens/generate_stream", {"COUNT": 3, "gate": str(gate)}, timeout=10
    )
    assert response.status == 200
    first = b""
    while not first.endswith(b"\n\n"):
        chunk = response.read1(65536)
        assert chunk, "the stream ended before its first event"
        first += chunk
    assert json.loads(first[len(b"data: ") :])["TEXT"] == "token-0"
    gate.touch()
    rest = [json.loads(c[len("data: ") :]) for c in response.read().decode().split("\n\n") if c]
    assert [e["TEXT"] for e in rest] == ["token-1", "token-2"]


def test_server_metadata_lists_generate_and_trace(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    connection.request("GET", "/v2")
    extensions = json.loads(connection.getresponse().read())["extensions"]
    assert "generate" in extensions and "trace" in extensions
