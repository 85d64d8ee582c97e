"""Server-wide behaviours that Triton clients check (issue 17, items 8, 10, 11, 12, 15, 16).

Real servers on free loopback ports, real ``tritonclient`` (HTTP and gRPC): the
server's name and extensions, model-load errors (status and wording), model names
that are not a model directory, BYTES tensors through the ONNX Runtime and Python
backends, and the types of the Prometheus counters.
"""

from __future__ import annotations

import http.client
import json
import shutil
import textwrap
from urllib.parse import quote

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.repository import python_model, write_model
from tests.serverproc import EXAMPLES, ServerProcess, serving

# python_backend's qa/python_models/response_parameters, as a user would write it:
# the response parameters come as JSON in the request; digit keys become ints.
RESPONSE_PARAMETERS_MODEL = textwrap.dedent(
    """
    import json

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                text = pb_utils.get_input_tensor_by_name(request, "PARAMETERS").as_numpy()[0][0]
                out = pb_utils.Tensor("OUTPUT", np.array([[text]], dtype=np.object_))
                try:
                    params = json.loads(text)
                    if isinstance(params, dict):
                        params = {int(k) if k.isdigit() else k: v for k, v in params.items()}
                    response = pb_utils.InferenceResponse([out], parameters=params)
                except Exception as e:
                    error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                    response = pb_utils.InferenceResponse(error=error)
                responses.append(response)
            return responses
    """
)

BYTES_IO_CONFIG = """
backend: "python"
max_batch_size: 0
input [ {{ name: "{input}" data_type: TYPE_STRING dims: [ -1, -1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_STRING dims: [ -1, -1 ] }} ]
instance_group [ {{ kind: KIND_CPU }} ]
"""

# Returns its BYTES input unchanged, element by element, checking that each is bytes.
IDENTITY_BYTES_MODEL = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                data = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
                assert all(isinstance(v, bytes) for v in data.reshape(-1)), data
                out = pb_utils.Tensor("OUTPUT", data)
                responses.append(pb_utils.InferenceResponse([out]))
            return responses
    """
)

BROKEN_ONNX_CONFIG = """
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("server-parity")
    for name in ("simple", "identity_bytes"):
        shutil.copytree(EXAMPLES / name, repo / name)
    python_model(
        repo,
        "response_parameters",
        BYTES_IO_CONFIG.format(input="PARAMETERS"),
        RESPONSE_PARAMETERS_MODEL,
    )
    python_model(
        repo, "identity_bytes_py", BYTES_IO_CONFIG.format(input="INPUT"), IDENTITY_BYTES_MODEL
    )
    write_model(repo, "broken", BROKEN_ONNX_CONFIG, {"1/model.onnx": b"not an onnx file"})
    loaded = ("simple", "identity_bytes", "response_parameters", "identity_bytes_py")
    process = ServerProcess(
        repo,
        args=[
            "--model-control-mode=explicit",
            *(f"--load-model={name}" for name in loaded),
            "--allow-client-shm=true",
        ],
    )
    try:
        process.wait_ready()
        process.repository = repo
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


# -- server metadata: name (item 16) and extensions (item 10) -------------------------

# Triton's list, in its order: core src/server.cc, InferenceServer::InferenceServer.
TRITON_EXTENSIONS = [
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "cuda_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
]


def test_server_metadata_names_the_server_triton_and_lists_tritons_extensions(
    http_client, grpc_client
):
    expected = [*TRITON_EXTENSIONS, "generate"]  # generate: ours, beside Triton's
    metadata = http_client.get_server_metadata()
    assert metadata["name"] == "triton"
    assert metadata["extensions"] == expected
    reply = grpc_client.get_server_metadata()
    assert reply.name == "triton"
    assert list(reply.extensions) == expected


SHM_DISABLED = (
    "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
)


def test_id_names_the_server_and_shared_memory_is_listed_and_refused(tmp_path):
    """Without --allow-client-shm both shared-memory extensions are still listed, as
    Triton's core lists them (src/server.cc); registering is refused with Triton's
    words and UNSUPPORTED's codes (src/http_server.cc HandleSystemSharedMemory,
    src/grpc/grpc_server.cc: 501, UNIMPLEMENTED)."""
    shutil.copytree(EXAMPLES / "simple", tmp_path / "simple")
    with serving(tmp_path, args=["--id=edge-7"]) as process:
        client = httpclient.InferenceServerClient(process.http_url)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{process.grpc_port}")
        try:
            metadata = client.get_server_metadata()
            assert list(grpc.get_server_metadata().extensions) == metadata["extensions"]
            for register in (
                lambda: client.register_system_shared_memory("r", "/trionserve_r", 64),
                lambda: client.register_cuda_shared_memory("r", "AAAA", 0, 64),
                lambda: client.unregister_system_shared_memory("r"),
            ):
                with pytest.raises(InferenceServerException) as info:
                    register()
                assert info.value.message() == SHM_DISABLED
                assert info.value.status() == "501"
            for register in (
                lambda: grpc.register_system_shared_memory("r", "/trionserve_r", 64),
                lambda: grpc.register_cuda_shared_memory("r", b"AAAA", 0, 64),
            ):
                with pytest.raises(InferenceServerException) as info:
                    register()
                assert info.value.message() == SHM_DISABLED
                assert info.value.status() == "StatusCode.UNIMPLEMENTED"
        finally:
            client.close()
            grpc.close()
    assert metadata["name"] == "edge-7"
    assert "sequence" in metadata["extensions"]
    assert "system_shared_memory" in metadata["extensions"]
    assert "cuda_shared_memory" in metadata["extensions"]


# -- model-load failures: status and wording (item 11) --------------------------------


def post(server, path: str, body: dict | None = None) -> tuple[int, str]:
    """POST ``path`` (already quoted) with a JSON body; (status, error message)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", path, body=json.dumps(body or {}))
        response = connection.getresponse()
        data = response.read()
        return response.status, (json.loads(data).get("error", "") if data else "")
    finally:
        connection.close()


def grpc_error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def test_a_model_not_in_the_repository_fails_to_load_with_500_in_tritons_words(server, grpc_client):
    # Triton: INTERNAL "failed to load 'unknown_model', failed to poll from model
    # repository" (core model_repository_manager.cc LoadUnloadModel;
    # qa/L0_lifecycle/lifecycle_test.py matches on it).
    expected = "failed to load 'nope', failed to poll from model repository"
    status, message = post(server, "/v2/repository/models/nope/load")
    assert status == 500 and message.startswith(expected), (status, message)
    error = grpc_error(lambda: grpc_client.load_model("nope"))
    assert error.status() == "StatusCode.INTERNAL"
    assert error.message().startswith(expected)


@pytest.mark.parametrize(
    "parameters",
    [
        # A path part longer than NAME_MAX (qa/L0_http http_test.py
        # test_load_oversized_file_parameter, the client's simple_*_model_control.py).
        {"file:" + "A" * 256: "YQ==", "config": "{}"},
        # Files without the config they replace the model directory with
        # (qa/L0_lifecycle lifecycle_test.py test_file_override).
        {"file:1/model.onnx": "YQ=="},
    ],
    ids=["path-part-too-long", "files-without-config"],
)
def test_a_file_override_that_cannot_be_written_is_a_poll_failure(server, grpc_client, parameters):
    """Triton localizes the override files while it polls the model (core
    model_repository_manager.cc InitializeModelInfo), so their failure is INTERNAL
    "failed to poll from model repository"; the server goes on serving."""
    expected = "failed to load 'identity_bytes', failed to poll from model repository"
    status, message = post(
        server, "/v2/repository/models/identity_bytes/load", {"parameters": parameters}
    )
    assert status == 500 and message.startswith(expected), (status, message)
    files = {k: b"a" for k in parameters if k.startswith("file:")}
    error = grpc_error(
        lambda: grpc_client.load_model(
            "identity_bytes", config=parameters.get("config"), files=files
        )
    )
    assert error.status() == "StatusCode.INTERNAL"
    assert error.message().startswith(expected)
    assert server.status("/v2/models/identity_bytes/ready") == 200


def test_a_model_that_fails_to_load_gets_400_and_invalid_argument(server, http_client, grpc_client):
    status, message = post(server, "/v2/repository/models/broken/load")
    assert status == 400 and message.startswith("failed to load 'broken'"), (status, message)
    error = grpc_error(lambda: grpc_client.load_model("broken"))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.message().startswith("failed to load 'broken'")
    (row,) = [r for r in http_client.get_model_repository_index() if r["name"] == "broken"]
    # Its config lists inputs and outputs, so the file is first read when the
    # version loads (Triton's onnxruntime backend skips auto-complete): the
    # version's reason is the runtime's error.
    assert row["state"] == "UNAVAILABLE" and "INVALID_PROTOBUF" in row["reason"]


def test_an_invalid_config_override_is_a_poll_failure(server, http_client, grpc_client):
    # Triton parses the override while it polls the model (InitializeModelInfo:
    # "Invalid config override"), so the load answers INTERNAL "failed to poll".
    expected = (
        "failed to load 'simple', failed to poll from model repository: invalid config override"
    )
    status, message = post(
        server, "/v2/repository/models/simple/load", {"parameters": {"config": "{not json"}}
    )
    assert status == 500 and message.startswith(expected), (status, message)
    error = grpc_error(lambda: grpc_client.load_model("simple", config='{"max_batch_size": "x"}'))
    assert error.status() == "StatusCode.INTERNAL"
    assert error.message().startswith(expected)
    assert http_client.is_model_ready("simple")  # a failed reload leaves it serving


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (
            "abc",
            (
                "failed to get model version from specified version string 'abc' "
                "(details: stol), version should be an integral value > 0"
            ),
        ),
        ("-1", "invalid model version specified '-1' , version should be an integral value > 0"),
    ],
)
def test_a_bad_version_string_is_refused_in_tritons_words(
    http_client, grpc_client, version, message
):
    # server src/common.cc, GetModelVersionFromString
    for client in (http_client, grpc_client):
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata("simple", model_version=version)
        assert message in info.value.message()
        assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ([], "Expect dict, got <class 'list'>"),
        ({"1": "int key"}, "Expect parameters keys to have type str, found type <class 'int'>"),
        (
            {"int": 2, "float": 0.5},
            "Expect parameters values to have type bool/int/str, found type <class 'float'>",
        ),
        (
            {"null": None},
            "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>",
        ),
    ],
)
def test_response_parameter_errors_use_python_backends_words(grpc_client, params, message):
    # python_backend src/pb_stub.cc PyParametersToJSON; server
    # qa/L0_backend_python/parameters/response_parameters_test.py checks these.
    tensor = grpcclient.InferInput("PARAMETERS", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[json.dumps(params)]], dtype=np.object_))
    error = grpc_error(lambda: grpc_client.infer("response_parameters", [tensor]))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert message in error.message()


def test_valid_response_parameters_reach_the_client(grpc_client):
    params = {"bool": True, "str": "Hello World!", "int": 1024}
    tensor = grpcclient.InferInput("PARAMETERS", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[json.dumps(params)]], dtype=np.object_))
    result = grpc_client.infer("response_parameters", [tensor])
    got = result.get_response().parameters
    assert (got["bool"].bool_param, got["str"].string_param, got["int"].int64_param) == (
        True,
        "Hello World!",
        1024,
    )


# -- names that are not a model directory (item 12) -----------------------------------

BAD_NAMES = ["../x", "../../etc", "/etc", "a/b", "a\0b", "..", ".", "", " "]


def index_names(http_client) -> list[str]:
    return sorted(row["name"] for row in http_client.get_model_repository_index())


@pytest.mark.parametrize("action", ["load", "unload"])
def test_names_that_are_no_model_directory_are_refused_and_never_indexed(
    server, http_client, grpc_client, action
):
    before = index_names(http_client)
    for name in BAD_NAMES:
        error = grpc_error(lambda name=name: getattr(grpc_client, f"{action}_model")(name))
        assert error.status() == "StatusCode.INVALID_ARGUMENT", (name, error)
        assert error.message().startswith(f"failed to {action} '{name}': "), error.message()
        if name.strip():
            path = f"/v2/repository/models/{quote(name, safe='')}/{action}"
            status, message = post(server, path)
            assert status == 400, (name, status, message)
            assert message.startswith(f"failed to {action} '{name}': "), message
    # tritonclient sends the name into the path as given: ../x is still refused, not 404.
    status, message = post(server, f"/v2/repository/models/../x/{action}")
    assert status == 400 and "path traversal" in message, (status, message)
    assert index_names(http_client) == before


def test_triton_wording_for_empty_and_traversing_names(grpc_client):
    # core src/model_repository_manager/model_repository_manager.cc, ValidateModelName
    assert grpc_error(lambda: grpc_client.load_model("")).message() == (
        "failed to load '': Model name cannot be empty. Please enter a valid name to deploy."
    )
    assert grpc_error(lambda: grpc_client.load_model("../x")).message() == (
        "failed to load '../x': invalid model name '../x', model name must not contain path "
        "traversal characters"
    )


def test_failed_loads_of_unknown_names_do_not_grow_the_index(http_client):
    before = index_names(http_client)
    for i in range(20):
        with pytest.raises(InferenceServerException):
            http_client.load_model(f"missing_{i}")
    assert index_names(http_client) == before


# -- BYTES tensors keep every byte, or are refused (item 8) ---------------------------

TEXT = [b"\x00\x01binary", "h\u00e9llo \u2713".encode(), b"", b"a\x00b\x00"]
NOT_UTF8 = b"\x00\x01binary\xff"


def bytes_input(module, name: str, values: list[bytes]):
    tensor = module.InferInput(name, [1, len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array([values], dtype=np.object_))
    return tensor


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_utf8_bytes_with_nul_round_trip_through_onnx_runtime(http_client, grpc_client, protocol):
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    result = client.infer("identity_bytes", [bytes_input(module, "INPUT0", TEXT)])
    assert result.as_numpy("OUTPUT0").tolist() == [TEXT]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bytes_onnx_runtime_would_alter_are_refused_naming_the_input(
    http_client, grpc_client, protocol
):
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    with pytest.raises(InferenceServerException) as info:
        client.infer("identity_bytes", [bytes_input(module, "INPUT0", [b"ok", NOT_UTF8])])
    assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    message = info.value.message()
    assert "input 'INPUT0' for model 'identity_bytes' is not valid UTF-8" in message
    assert "(element 1, byte 8)" in message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_python_backend_keeps_every_byte(http_client, grpc_client, protocol):
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    values = [NOT_UTF8, bytes(range(256)), b"", b"\xff\xfe\x00"]
    result = client.infer("identity_bytes_py", [bytes_input(module, "INPUT", values)])
    assert result.as_numpy("OUTPUT").tolist() == [values]


def test_in_one_onnx_batch_only_the_request_with_bad_bytes_fails():
    """The refusal is per request: the others in the same batch run."""
    from trionserve.actors.registry_entries import prepare_model
    from trionserve.backends.base import InstanceSpec, ModelContext
    from trionserve.backends.onnxruntime.backend import OnnxRuntimeBackend
    from trionserve.core.errors import InvalidArgument
    from trionserve.core.inference import InferenceRequest, Tensor

    model_dir = EXAMPLES / "identity_bytes"
    config = prepare_model(model_dir, True, None).config
    context = ModelContext("identity_bytes", 1, config, model_dir, model_dir / "1")
    instance = (
        OnnxRuntimeBackend()
        .load(context)
        .create_instance(InstanceSpec("identity_bytes_0_0", "identity_bytes_0", "KIND_CPU", 0))
    )

    def request(values):
        data = np.array([values], dtype=np.object_)
        tensors = {"INPUT0": Tensor("INPUT0", "BYTES", data)}
        made = InferenceRequest("identity_bytes", inputs=tensors)
        made.batch_size = 1  # as validation sets it
        return made

    results = instance.execute([request([b"a"]), request([NOT_UTF8]), request([b"\x00c"])])
    # onnxruntime gives str elements back; the frontends encode them as UTF-8.
    assert results[0].outputs[0].data.tolist() == [["a"]]
    assert isinstance(results[1], InvalidArgument)
    assert results[2].outputs[0].data.tolist() == [["\x00c"]]
    assert instance.execute([request([NOT_UTF8])])[0].status.name == "INVALID_ARGUMENT"
