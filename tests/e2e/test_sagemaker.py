"""SageMaker's endpoints (``--allow-sagemaker``): a real server, its SageMaker port,
a plain HTTP client (http.client, as Triton's qa/L0_sagemaker posts with requests),
each answer as Triton's src/sagemaker_server.cc gives it."""

from __future__ import annotations

import http.client
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.helpers import simple_inputs
from tests.serverproc import EXAMPLES, ServerProcess, free_port
from trionserve.cli.options import options_from_args
from trionserve.protocol.http.sagemaker import BINARY_MIME_TYPE

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.ones_like(A)


class SageMaker:
    def __init__(self, proc: ServerProcess, port: int) -> None:
        self.proc, self.port = proc, port

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict | None = None, port=None
    ) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=30)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            found = {key.lower(): value for key, value in response.getheaders()}
            return response.status, found, response.read()
        finally:
            connection.close()


def _start(repositories: list[Path], env: dict[str, str], *args: str) -> SageMaker:
    port = free_port()
    proc = ServerProcess(
        *repositories,
        args=["--allow-sagemaker=true", f"--sagemaker-port={port}", *args],
        env=env,
    )
    try:
        proc.wait_ready()
        deadline = time.monotonic() + 30  # the SageMaker port binds after HTTP's
        while proc.http_status(f"127.0.0.1:{port}", "/ping") is None:
            assert time.monotonic() < deadline, proc.output()
            time.sleep(0.05)
    except BaseException:
        proc.close()
        raise
    return SageMaker(proc, port)


@pytest.fixture(scope="module")
def sagemaker() -> Iterator[SageMaker]:
    server = _start([EXAMPLES], {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "simple"})
    try:
        yield server
        assert server.proc.stop() == 0, server.proc.output()
    finally:
        server.proc.close()


@pytest.fixture(scope="module")
def unready(tmp_path_factory) -> Iterator[SageMaker]:
    """No default model named; one model fails to load (so not ready)."""
    repository = tmp_path_factory.mktemp("repo")
    shutil.copytree(EXAMPLES / "identity_fp32", repository / "identity_fp32")
    (repository / "broken" / "1").mkdir(parents=True)
    (repository / "broken" / "config.pbtxt").write_text('backend: "no_such_backend"\n')
    server = _start([repository], {}, "--exit-on-error=false")
    try:
        yield server
    finally:
        server.proc.close()


def _json_body(binary_inputs: bool = False, binary_outputs: bool = False) -> tuple[bytes, int]:
    inputs = simple_inputs(A, B, binary=binary_inputs)
    outputs = [
        httpclient.InferRequestedOutput(name, binary_data=binary_outputs)
        for name in ("OUTPUT0", "OUTPUT1")
    ]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs)
    return body, len(body) if json_size is None else json_size


def test_ping_is_the_servers_readiness(sagemaker, unready):
    assert sagemaker.request("GET", "/ping")[::2] == (200, b"")
    status, _, body = unready.request("GET", "/ping")
    assert (status, body) == (400, b"")  # a model failed to load: not ready
    assert unready.proc.status("/v2/health/ready") == 400  # as the HTTP port says
    status, _, body = sagemaker.request("POST", "/ping")
    assert status == 405 and json.loads(body) == {"error": "Method Not Allowed"}


def test_invocations_json(sagemaker):
    body, _ = _json_body()
    status, headers, answer = sagemaker.request(
        "POST", "/invocations", body, {"Content-Type": "application/json"}
    )
    assert status == 200, answer
    assert headers["content-type"] == "application/json"
    outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
    assert outputs["OUTPUT0"] == (A + B).ravel().tolist()
    assert outputs["OUTPUT1"] == (A - B).ravel().tolist()
    assert json.loads(answer)["model_name"] == "simple"


def test_invocations_binary_tensors_size_their_json_in_the_content_type(sagemaker):
    body, json_size = _json_body(binary_inputs=True, binary_outputs=True)
    assert json_size < len(body)
    status, headers, answer = sagemaker.request(
        "POST", "/invocations", body, {"Content-Type": f"{BINARY_MIME_TYPE}{json_size}"}
    )
    assert status == 200, answer
    content_type = headers["content-type"]
    assert content_type.startswith(BINARY_MIME_TYPE)
    assert "inference-header-content-length" not in headers
    size = int(content_type[len(BINARY_MIME_TYPE) :])
    result = httpclient.InferenceServerClient.parse_response_body(answer, header_length=size)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


def test_inference_header_content_length_is_not_read(sagemaker):
    """SageMaker's GetInferenceHeaderLength reads only the content type: the
    KServe header leaves the whole binary body to be parsed as JSON."""
    body, json_size = _json_body(binary_inputs=True)
    status, _, answer = sagemaker.request(
        "POST", "/invocations", body, {"Inference-Header-Content-Length": str(json_size)}
    )
    assert status == 400 and "error" in json.loads(answer)
    # The same body with the size in SageMaker's content type is fine.
    headers = {"Content-Type": f"{BINARY_MIME_TYPE}{json_size}"}
    assert sagemaker.request("POST", "/invocations", body, headers)[0] == 200


@pytest.mark.parametrize(
    "content_type, message",
    [
        ("application/vnd.sagemaker-triton.binary+json;json-header-size=abc", "Unable to parse"),
        (f"{BINARY_MIME_TYPE}99999", "inference header size should be in range (0, "),
        (f"text/plain; {BINARY_MIME_TYPE}5", "expect MIME type for binary data starts with"),
    ],
)
def test_a_bad_header_size_is_400_in_tritons_words(sagemaker, content_type, message):
    body, _ = _json_body(binary_inputs=True)
    status, headers, answer = sagemaker.request(
        "POST", "/invocations", body, {"Content-Type": content_type}
    )
    assert status == 400 and headers["content-type"] == "application/json"
    assert message in json.loads(answer)["error"]


def test_a_malformed_body_is_answered_as_the_http_port_answers_it(sagemaker):
    for body in (b"{not json", b'{"inputs": 5}', b'{"inputs": [{"name": "INPUT0"}]}'):
        status, _, answer = sagemaker.request("POST", "/invocations", body)
        http_status, _, http_answer = sagemaker.request(
            "POST", "/v2/models/simple/infer", body, port=sagemaker.proc.http_port
        )
        assert status == http_status and 400 <= status < 500, answer
        assert json.loads(answer) == json.loads(http_answer)


def test_no_default_model_is_the_unknown_models_error(unready):
    body, _ = _json_body()
    status, _, answer = unready.request("POST", "/invocations", body)
    name = "unspecified_SAGEMAKER_TRITON_DEFAULT_MODEL_NAME"
    assert name in json.loads(answer)["error"]
    http_status, _, http_answer = unready.request(
        "POST", f"/v2/models/{name}/infer", body, port=unready.proc.http_port
    )
    assert (status, json.loads(answer)) == (http_status, json.loads(http_answer))
    # The model is looked up before the body is read (L0_sagemaker posts 'dummy').
    status, _, answer = unready.request("POST", "/invocations", b"dummy")
    assert status == 404, answer
    expected = f"Request for unknown model: '{name}' is not found"
    assert json.loads(answer)["error"] == expected


def test_other_paths(sagemaker):
    assert sagemaker.request("GET", "/v2/health/ready")[::2] == (400, b"")
    assert sagemaker.request("GET", "/nothing")[::2] == (400, b"")
    assert sagemaker.request("PUT", "/models")[::2] == (400, b"")
    status, _, answer = sagemaker.request("GET", "/invocations")
    assert status == 405 and json.loads(answer) == {"error": "Method Not Allowed"}
    # The multi-model endpoint is served with the port, as by Triton's binary, with
    # no environment variable (tests/e2e/test_sagemaker_mme.py): nothing loaded.
    status, _, answer = sagemaker.request("GET", "/models")
    assert status == 200 and json.loads(answer) == {"models": []}, answer


# -- the flags (Triton's command_line_parser.cc:670-686, 976-1020) -----------------


def test_flags_and_environment(monkeypatch, capsys):
    repository = f"--model-repository={EXAMPLES}"
    assert options_from_args([repository]).sagemaker is None
    monkeypatch.setenv("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME", "simple")
    options = options_from_args([repository, "--allow-sagemaker=1"]).sagemaker
    assert options is not None
    assert (options.port, options.address, options.model_name) == (8080, "0.0.0.0", "simple")
    assert (options.ping_mode, options.inference_type) == ("ready", "infer")
    safe = ["--allow-sagemaker=true", "--sagemaker-safe-port-range=8000-8002"]
    assert options_from_args([repository, *safe]).sagemaker is not None
    for extra, message in (
        (
            [*safe, "--grpc-port=9001"],
            "The server cannot listen to GRPC requests at port 9001, allowed port range "
            "is [8000, 8002]",
        ),
        (["--allow-sagemaker=true", "--workers=2"], "--allow-sagemaker cannot be combined"),
    ):
        with pytest.raises(SystemExit):
            options_from_args([repository, *extra])
        assert message in capsys.readouterr().err
    # Another address than the SageMaker port's is not in the range's scope.
    options_from_args([repository, *safe, "--grpc-address=127.0.0.1", "--grpc-port=9001"])
    monkeypatch.setenv("SAGEMAKER_TRITON_INFERENCE_TYPE", "predict")
    with pytest.raises(SystemExit):
        options_from_args([repository, "--allow-sagemaker=true"])
    assert "invalid SAGEMAKER_TRITON_INFERENCE_TYPE 'predict'" in capsys.readouterr().err


def test_inference_type_generate(tmp_path):
    """SAGEMAKER_TRITON_INFERENCE_TYPE=generate: /invocations is the default model's
    generate endpoint (sagemaker_server.cc:165), answered as the HTTP port does."""
    shutil.copytree(EXAMPLES / "identity_bytes", tmp_path / "identity_bytes")
    env = {
        "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "identity_bytes",
        "SAGEMAKER_TRITON_INFERENCE_TYPE": "generate",
    }
    server = _start([tmp_path], env)
    try:
        body = json.dumps({"id": "7", "INPUT0": "héllo"}).encode()
        status, _, answer = server.request("POST", "/invocations", body)
        assert status == 200, answer
        assert json.loads(answer)["OUTPUT0"] == "héllo"
        http_answer = server.request(
            "POST", "/v2/models/identity_bytes/generate", body, port=server.proc.http_port
        )[2]
        assert json.loads(answer) == json.loads(http_answer)
        assert server.proc.stop() == 0
    finally:
        server.proc.close()
