"""The HTTP/REST API through the official tritonclient.http, against a real server."""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.helpers import expect_error, simple_inputs


def raw_post(server, path: str, body: bytes, headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_health(http_client):
    assert http_client.is_server_live()
    assert http_client.is_server_ready()
    assert http_client.is_model_ready("simple")
    assert http_client.is_model_ready("simple", "1")
    assert not http_client.is_model_ready("simple", "2")
    assert not http_client.is_model_ready("no_such_model")


def test_server_metadata(http_client):
    metadata = http_client.get_server_metadata()
    assert metadata["name"] == "triton"
    assert metadata["version"]
    assert "binary_tensor_data" in metadata["extensions"]


def test_model_metadata(http_client):
    metadata = http_client.get_model_metadata("simple")
    assert metadata["name"] == "simple"
    assert metadata["versions"] == ["1"]
    assert metadata["platform"] == "onnxruntime_onnx"
    assert metadata["inputs"] == [
        {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
        {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]},
    ]
    assert [o["name"] for o in metadata["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert http_client.get_model_metadata("simple", "1") == metadata


def test_model_config(http_client):
    config = http_client.get_model_config("simple")
    assert config["name"] == "simple"
    assert config["platform"] == "onnxruntime_onnx"
    assert config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 8
    assert config["input"][0]["name"] == "INPUT0"
    assert config["input"][0]["data_type"] == "TYPE_INT32"
    assert config["input"][0]["dims"] == [16]
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert config["instance_group"][0]["count"] == 1
    assert config["instance_group"][0]["kind"] == "KIND_CPU"


def test_auto_completed_config(http_client):
    """identity_bytes' config.pbtxt lists no tensors: they come from the ONNX file."""
    config = http_client.get_model_config("identity_bytes")
    assert [i["name"] for i in config["input"]] == ["INPUT0"]
    assert config["input"][0]["data_type"] == "TYPE_STRING"
    assert config["input"][0]["dims"] == [-1]
    assert config["output"][0]["data_type"] == "TYPE_STRING"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("batch", [1, 8])
def test_infer_simple(http_client, binary, batch):
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.full((batch, 16), 3, dtype=np.int32)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary),
    ]
    result = http_client.infer(
        "simple", simple_inputs(a, b, binary=binary), outputs=outputs, request_id="req-7"
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response["id"] == "req-7"
    assert response["model_name"] == "simple"
    assert response["model_version"] == "1"


def test_infer_selected_output_and_version(http_client):
    a = np.ones((2, 16), dtype=np.int32)
    result = http_client.infer(
        "simple",
        simple_inputs(a, a),
        model_version="1",
        outputs=[httpclient.InferRequestedOutput("OUTPUT1")],
    )
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((2, 16)))


def test_infer_default_outputs_binary(http_client):
    a = np.ones((1, 16), dtype=np.int32)
    result = http_client.infer("simple", simple_inputs(a, a))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
    assert result.get_output("OUTPUT0")["parameters"]["binary_data_size"] == 64


def test_infer_large_fp32_identity(http_client):
    data = np.random.default_rng(1).random((1, 1_000_000), dtype=np.float32)
    infer_input = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    infer_input.set_data_from_numpy(data)
    result = http_client.infer("identity_fp32", [infer_input])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_bytes_identity(http_client, binary):
    data = np.array([[b"hello", b"", "wörld".encode()]], dtype=np.object_)
    infer_input = httpclient.InferInput("INPUT0", [1, 3], "BYTES")
    infer_input.set_data_from_numpy(data, binary_data=binary)
    result = http_client.infer(
        "identity_bytes",
        [infer_input],
        outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)],
    )
    out = result.as_numpy("OUTPUT0")
    assert out.shape == (1, 3)
    as_bytes = [v if isinstance(v, bytes) else v.encode() for v in out.reshape(-1)]
    assert as_bytes == [b"hello", b"", "wörld".encode()]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_compressed(server, algorithm):
    client = httpclient.InferenceServerClient(server.http_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = client.infer(
        "simple",
        simple_inputs(a, a),
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
    client.close()


def test_bad_requests_get_clear_errors(http_client):
    a = np.ones((1, 16), dtype=np.int32)
    expect_error(
        lambda: http_client.infer("nope", simple_inputs(a, a)),
        "Request for unknown model: 'nope' is not found",
        404,
    )
    expect_error(
        lambda: http_client.infer("simple", simple_inputs(a, a), model_version="3"),
        "'simple' version 3 is not found",
        404,
    )
    extra = simple_inputs(a, a) + [httpclient.InferInput("INPUT9", [1, 16], "INT32")]
    extra[2].set_data_from_numpy(a)
    expect_error(
        lambda: http_client.infer("simple", extra),
        "unexpected inference input 'INPUT9' for model 'simple'",
        400,
    )
    expect_error(
        lambda: http_client.infer("simple", simple_inputs(a, a)[:1]),
        "missing required input(s) ['INPUT1']",
        400,
    )
    f = a.astype(np.float32)
    wrong_type = [httpclient.InferInput("INPUT0", [1, 16], "FP32"), simple_inputs(a, a)[1]]
    wrong_type[0].set_data_from_numpy(f)
    expect_error(
        lambda: http_client.infer("simple", wrong_type),
        "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'",
        400,
    )
    short = np.ones((1, 8), dtype=np.int32)
    expect_error(
        lambda: http_client.infer("simple", simple_inputs(short, short)),
        "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,8]",
        400,
    )
    big = np.ones((9, 16), dtype=np.int32)
    expect_error(
        lambda: http_client.infer("simple", simple_inputs(big, big)),
        "batch-size must be <= 8 for 'simple'",
        400,
    )
    expect_error(
        lambda: http_client.infer(
            "simple", simple_inputs(a, a), outputs=[httpclient.InferRequestedOutput("OUT")]
        ),
        "unexpected inference output 'OUT' for model 'simple'",
        400,
    )
    # The server keeps serving after every bad request.
    result = http_client.infer("simple", simple_inputs(a, a))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


def test_triton_parameter_keys_are_reserved(server, http_client):
    # As Triton's HTTP frontend (src/http_server.cc): no 'triton_' key is a client's,
    # not even the one gRPC streams accept.
    ones = [1] * 16
    for key in ("triton_secret", "triton_enable_empty_final_response"):
        body = {
            "parameters": {key: True},
            "inputs": [
                {"name": n, "datatype": "INT32", "shape": [1, 16], "data": ones}
                for n in ("INPUT0", "INPUT1")
            ],
        }
        status, reply = raw_post(server, "/v2/models/simple/infer", json.dumps(body).encode())
        assert status == 400, reply
        assert json.loads(reply)["error"] == (
            "parameter keys starting with 'triton_' are reserved for Triton usage and "
            "should not be specified."
        )
    a = np.ones((1, 16), dtype=np.int32)
    result = http_client.infer("simple", simple_inputs(a, a), parameters={"tritonish": 1})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


def test_malformed_bodies(server, http_client):
    status, body = raw_post(server, "/v2/models/simple/infer", b"{not json")
    assert status == 400
    assert "failed to parse the request JSON" in json.loads(body)["error"]

    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 16],
                    "datatype": "INT32",
                    "parameters": {"binary_data_size": 64},
                },
                {
                    "name": "INPUT1",
                    "shape": [1, 16],
                    "datatype": "INT32",
                    "parameters": {"binary_data_size": 64},
                },
            ]
        }
    ).encode()
    status, body = raw_post(
        server,
        "/v2/models/simple/infer",
        header + b"\0" * 100,  # 28 bytes short
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400
    assert "INPUT1" in json.loads(body)["error"]

    status, body = raw_post(
        server,
        "/v2/models/simple/infer",
        header + b"\0" * 128,
        {"Inference-Header-Content-Length": str(len(header) + 500)},
    )
    assert status == 400
    assert "Inference-Header-Content-Length" in json.loads(body)["error"]

    status, body = raw_post(server, "/v2/models/simple/versions/x1/infer", b"{}")
    assert status == 400
    assert "x1" in json.loads(body)["error"]

    a = np.ones((1, 16), dtype=np.int32)
    assert http_client.infer("simple", simple_inputs(a, a)).as_numpy("OUTPUT0") is not None


def test_unknown_route_is_json_404(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    connection.request("GET", "/v2/nothing/here")
    response = connection.getresponse()
    assert response.status == 404
    assert "error" in json.loads(response.read())
    connection.close()


def test_repository_index_and_control_mode_none(http_client):
    index = http_client.get_model_repository_index()
    names = {row["name"]: row for row in index}
    assert set(names) >= {"simple", "identity_fp32", "identity_bytes"}
    assert names["simple"]["state"] == "READY"
    assert names["simple"]["version"] == "1"
    # Triton's words first (qa/L0_http python_http_aio_test.py matches on them), then ours.
    for call in (http_client.load_model, http_client.unload_model):
        error = expect_error(lambda call=call: call("simple"), "model control mode NONE")
        assert "explicit model load / unload is not allowed if polling is enabled" in str(error)
    assert http_client.is_model_ready("simple")


def test_concurrent_requests_all_answered(server):
    """Many clients at once: every request gets its own correct answer."""
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    pending = []
    for i in range(64):
        a = np.full((1, 16), i, dtype=np.int32)
        pending.append((i, client.async_infer("simple", simple_inputs(a, a), request_id=str(i))))
    for i, job in pending:
        result = job.get_result()
        assert result.get_response()["id"] == str(i)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2 * i))
    client.close()


def test_log_file_cannot_be_changed_over_http(server, http_client, tmp_path):
    """As Triton since CVE-2024-0087 (http_server.cc HandleLogging): a log_file
    setting is refused with 501 and nothing is opened; null is ignored."""
    target = tmp_path / "written-by-a-client.log"
    before = http_client.get_log_settings()
    expect_error(
        lambda: http_client.update_log_settings({"log_file": str(target)}),
        "log file location can not be updated through network protocol",
        501,
    )
    assert not target.exists()
    assert http_client.get_log_settings() == before
    assert http_client.update_log_settings({"log_file": None, "log_info": None}) == before


@pytest.mark.parametrize("body", [b"{nope", b"[1]", b"<html>", b'{"log_info": "yes"}'])
def test_bad_log_settings_get_a_json_400(server, body):
    status, answer = raw_post(server, "/v2/logging", body, {"Content-Type": "text/html"})
    assert status == 400
    assert set(json.loads(answer)) == {"error"}


def test_logging_settings_round_trip(http_client):
    settings = http_client.get_log_settings()
    assert settings["log_info"] is True
    assert settings["log_verbose_level"] == 0
    updated = http_client.update_log_settings({"log_verbose_level": 1, "log_warning": False})
    assert updated["log_verbose_level"] == 1
    assert updated["log_warning"] is False
    assert http_client.get_log_settings() == updated
    expect_error(
        lambda: http_client.update_log_settings({"log_verbose_level": -2}),
        "'log_verbose_level' must be a non-negative integer",
        400,
    )
    expect_error(lambda: http_client.update_log_settings({"log_colour": 1}), "unknown log setting")
    restored = http_client.update_log_settings({"log_verbose_level": 0, "log_warning": True})
    assert restored == settings
