"""What Triton's own QA suites check that earlier tests did not (issue 28).

Real servers on free loopback ports, real ``tritonclient`` (HTTP and gRPC): the
method of the infer route, the protocol-only parameters a model never sees,
forwarded headers with Triton's reserved names, and an ONNX model whose
configuration does not match it refused at load with onnxruntime_backend's words.
"""

from __future__ import annotations

import http.client
import json
import shutil
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.repository import python_model, write_model
from tests.serverproc import EXAMPLES, ServerProcess

# OUTPUT0: the request's parameters as JSON, as python_backend's request.parameters().
PARAMS_MODEL = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                out = np.array([request.parameters().encode()], dtype=np.object_)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
            return responses
    """
)
PARAMS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

# The examples' identity_fp32 graph (INPUT0 -> OUTPUT0, FP32 [batch, n]) under
# configurations that each get one thing wrong.
IDENTITY_IO = {
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
}
MISMATCHES = {
    "no_such_input": (
        {"input": [{"name": "INPUT9", "data_type": "TYPE_FP32", "dims": [-1]}]},
        "unexpected inference input 'INPUT9', allowed inputs are: INPUT0",
    ),
    "no_such_output": (
        {"output": [{"name": "OUTPUT9", "data_type": "TYPE_FP32", "dims": [-1]}]},
        "unexpected inference output 'OUTPUT9', allowed outputs are: OUTPUT0",
    ),
    "input_dtype": (
        {"input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [-1]}]},
        "unable to load model 'input_dtype', configuration expects datatype TYPE_INT32 "
        "for input 'INPUT0', model provides TYPE_FP32",
    ),
    "output_shape": (
        {"output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1, 4]}]},
        "model 'output_shape', tensor 'OUTPUT0': the model expects 2 dimensions (shape "
        "[-1,-1]) but the model configuration specifies 3 dimensions",
    ),
    "no_inputs": (
        {"input": [], "output": []},
        "unable to load model 'no_inputs', configuration expects 0 inputs, model provides 1",
    ),
}


# An ensemble whose one step calls a model no repository has.
ENSEMBLE_CONFIG = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "no_such_model" model_version: -1
  input_map { key: "INPUT0" value: "IN" }
  output_map { key: "OUTPUT0" value: "OUT" }
} ] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("qa-parity")
    python_model(repo, "params", PARAMS_CONFIG, PARAMS_MODEL)
    shutil.copytree(EXAMPLES / "identity_fp32", repo / "identity_fp32")
    write_model(repo, "ens_missing_step", ENSEMBLE_CONFIG, versions=[1])
    for name in MISMATCHES:
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(EXAMPLES / "identity_fp32" / "1" / "model.onnx", repo / name / "1")
    process = ServerProcess(
        repo,
        args=[
            "--model-control-mode=explicit",
            "--load-model=params",
            "--load-model=identity_fp32",
            "--strict-model-config=true",
            "--http-header-forward-pattern=.*",
            "--grpc-header-forward-pattern=.*",
        ],
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.close()


@pytest.fixture
def http_client(server):
    client = httpclient.InferenceServerClient(server.http_url)
    yield client
    client.close()


@pytest.fixture
def grpc_client(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


def request(server, method: str, path: str, body: bytes = b"", headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize(
    "path", ["/v2/models/identity_fp32/infer", "/v2/models/identity_fp32/versions/1/infer"]
)
def test_infer_with_another_method_is_405(server, path):
    # Triton's src/http_server.cc HandleInfer: EVHTP_RES_METHNALLOWED.
    for method in ("GET", "PUT", "DELETE"):
        status, body = request(server, method, path)
        assert status == 405, (method, body)
        assert "error" in json.loads(body)
    status, _ = request(server, "GET", "/v2/models/identity_fp32/infer_nothing")
    assert status == 404


def params_input(module, value: float = 1.0):
    tensor = module.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.float32))
    return tensor


def model_parameters(result) -> dict:
    return json.loads(result.as_numpy("OUTPUT0")[0])


def test_binary_data_output_is_not_a_model_parameter(http_client):
    """tritonclient asks for binary outputs with binary_data_output; Triton keeps it
    in its HTTP server (src/http_server.cc ParseJsonTritonParams), so the model's
    request parameters hold only what the client set."""
    result = http_client.infer("params", [params_input(httpclient)], parameters={"mine": 7})
    parameters = model_parameters(result)
    assert parameters.get("mine") == 7
    assert "binary_data_output" not in parameters


@pytest.mark.parametrize(
    "name", ["sequence_id", "priority", "headers", "binary_data_output", "triton_anything"]
)
def test_a_forwarded_header_with_a_reserved_name_is_refused(http_client, grpc_client, name):
    # src/http_server.cc ForEachHeader, src/grpc/infer_handler.h
    # ForwardHeadersAsParameters; qa/L0_parameters test_headers_reserved_rejected.
    expected = f"Header '{name}' is reserved for Triton usage and cannot be forwarded."
    with pytest.raises(InferenceServerException) as info:
        http_client.infer("params", [params_input(httpclient)], headers={name: "x"})
    assert info.value.status() == "400" and expected in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        grpc_client.infer("params", [params_input(grpcclient)], headers={name: "x"})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert expected in info.value.message()


def test_other_forwarded_headers_reach_the_model(http_client, grpc_client):
    result = http_client.infer("params", [params_input(httpclient)], headers={"x-tenant": "a"})
    assert model_parameters(result)["x-tenant"] == "a"
    # Whole, trailing blanks included, as Triton's libevhtp hands them on
    # (qa/L0_parameters parameters_test.py test_headers).
    value = 'a "quoted" string with a backslash\\ '
    result = http_client.infer("params", [params_input(httpclient)], headers={"x-text": value})
    assert model_parameters(result)["x-text"] == value
    result = grpc_client.infer("params", [params_input(grpcclient)], headers={"x-tenant": "b"})
    assert model_parameters(result)["x-tenant"] == "b"


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_an_onnx_config_that_does_not_match_its_model_fails_to_load(http_client, grpc_client, name):
    """Refused at load with onnxruntime_backend's words naming the tensor
    (src/onnxruntime.cc ValidateInputs / ValidateOutputs), instead of loading READY
    and failing every request; "no_inputs" is a config that
    --strict-model-config=true leaves incomplete."""
    change, message = MISMATCHES[name]
    config = {"name": name, "platform": "onnxruntime_onnx", "max_batch_size": 8, **IDENTITY_IO}
    config.update(change)
    with pytest.raises(InferenceServerException) as info:
        http_client.load_model(name, config=json.dumps(config))
    assert info.value.status() == "400"
    assert message in info.value.message()
    assert f"failed to load '{name}'" in info.value.message()
    assert not http_client.is_model_ready(name)
    with pytest.raises(InferenceServerException) as info:
        grpc_client.load_model(name, config=json.dumps(config))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert message in info.value.message()


def test_a_matching_onnx_config_loads_under_strict_config(http_client):
    config = {"name": "no_inputs", "platform": "onnxruntime_onnx", "max_batch_size": 8}
    http_client.load_model("no_inputs", config=json.dumps({**config, **IDENTITY_IO}))
    try:
        data = np.arange(4, dtype=np.float32).reshape(1, 4)
        tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(data)
        result = http_client.infer("no_inputs", [tensor])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    finally:
        http_client.unload_model("no_inputs")


def test_an_ensemble_whose_step_is_in_no_repository_is_a_poll_failure(http_client, grpc_client):
    """Triton polls an ensemble's steps with it (core model_repository_manager.cc
    PollModels), so a step no repository has fails the ensemble's load INTERNAL
    "failed to poll from model repository"."""
    expected = "failed to load 'ens_missing_step', failed to poll from model repository"
    with pytest.raises(InferenceServerException) as info:
        http_client.load_model("ens_missing_step")
    assert info.value.status() == "500"
    assert info.value.message().startswith(expected)
    assert "no_such_model" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        grpc_client.load_model("ens_missing_step")
    assert info.value.status() == "StatusCode.INTERNAL"
