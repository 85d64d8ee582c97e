"""The gRPC API through the official tritonclient.grpc, against a real server."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.helpers import simple_inputs
from tests.serverproc import EXAMPLES, ServerProcess


def grpc_url(server) -> str:
    return f"127.0.0.1:{server.grpc_port}"


@pytest.fixture
def grpc_client(server):
    client = grpcclient.InferenceServerClient(grpc_url(server))
    yield client
    client.close()


def expect_status(call, status: str) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == f"StatusCode.{status}", (
        info.value.status(),
        info.value.message(),
    )
    return info.value


# ------------------------------------------------------------ health and metadata


def test_health(grpc_client):
    assert grpc_client.is_server_live()
    assert grpc_client.is_server_ready()
    assert grpc_client.is_model_ready("simple")
    assert grpc_client.is_model_ready("simple", "1")
    assert not grpc_client.is_model_ready("simple", "2")
    assert not grpc_client.is_model_ready("no_such_model")


def test_server_metadata(grpc_client):
    metadata = grpc_client.get_server_metadata()
    assert metadata.name == "triton"
    assert metadata.version
    assert "binary_tensor_data" in metadata.extensions
    assert grpc_client.get_server_metadata(as_json=True)["name"] == "triton"


def test_model_metadata(grpc_client):
    metadata = grpc_client.get_model_metadata("simple")
    assert metadata.name == "simple"
    assert list(metadata.versions) == ["1"]
    assert metadata.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("INPUT0", "INT32", [-1, 16]),
        ("INPUT1", "INT32", [-1, 16]),
    ]
    assert [t.name for t in metadata.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert grpc_client.get_model_metadata("simple", "1") == metadata
    expect_status(lambda: grpc_client.get_model_metadata("nope"), "NOT_FOUND")


def test_model_config_is_what_config_pbtxt_says(grpc_client):
    text = (EXAMPLES / "simple" / "config.pbtxt").read_text()
    written = text_format.Parse(text, model_config_pb2.ModelConfig())
    served = grpc_client.get_model_config("simple").config
    assert isinstance(served, model_config_pb2.ModelConfig)
    for field, value in written.ListFields():
        assert getattr(served, field.name) == value, field.name
    # ...and what the server completed, as over HTTP.
    assert served.backend == "onnxruntime"
    assert served.version_policy.latest.num_versions == 1
    assert served.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    as_json = grpc_client.get_model_config("simple", as_json=True)["config"]
    assert as_json["max_batch_size"] == 8


def test_auto_completed_config(grpc_client):
    config = grpc_client.get_model_config("identity_bytes").config
    assert [i.name for i in config.input] == ["INPUT0"]
    assert config.input[0].data_type == model_config_pb2.TYPE_STRING
    assert list(config.input[0].dims) == [-1]


# ------------------------------------------------------------------------ inference


@pytest.mark.parametrize("batch", [1, 8])
def test_infer_simple(grpc_client, batch):
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.full((batch, 16), 3, dtype=np.int32)
    result = grpc_client.infer("simple", simple_inputs(a, b, grpcclient), request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response.id == "req-7"
    assert response.model_name == "simple"
    assert response.model_version == "1"


def test_infer_selected_output_and_version(grpc_client):
    a = np.ones((2, 16), dtype=np.int32)
    result = grpc_client.infer(
        "simple",
        simple_inputs(a, a, grpcclient),
        model_version="1",
        outputs=[grpcclient.InferRequestedOutput("OUTPUT1")],
    )
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((2, 16)))


def test_infer_large_fp32_identity(grpc_client):
    data = np.random.default_rng(1).random((1, 1_000_000), dtype=np.float32)
    infer_input = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    infer_input.set_data_from_numpy(data)
    result = grpc_client.infer("identity_fp32", [infer_input])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


def test_infer_bytes_identity(grpc_client):
    data = np.array([[b"hello", b"", "wörld".encode()]], dtype=np.object_)
    infer_input = grpcclient.InferInput("INPUT0", [1, 3], "BYTES")
    infer_input.set_data_from_numpy(data)
    out = grpc_client.infer("identity_bytes", [infer_input]).as_numpy("OUTPUT0")
    assert out.shape == (1, 3)
    assert out.reshape(-1).tolist() == [b"hello", b"", "wörld".encode()]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_compressed_request(grpc_client, algorithm):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = grpc_client.infer(
        "simple", simple_inputs(a, a, grpcclient), compression_algorithm=algorithm
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


def test_typed_contents_over_the_wire(server):
    """InferTensorContents instead of raw_input_contents (not what tritonclient sends)."""
    with grpc.insecure_channel(grpc_url(server)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="simple", id="typed")
        for name, values in (("INPUT0", range(16)), ("INPUT1", [2] * 16)):
            tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
            tensor.contents.int_contents.extend(values)
        response = stub.ModelInfer(request)
    result = grpcclient.InferResult(response)
    assert response.id == "typed"
    np.testing.assert_array_equal(
        result.as_numpy("OUTPUT0"), np.arange(16, dtype=np.int32).reshape(1, 16) + 2
    )


def test_unknown_method_is_unimplemented(server):
    with grpc.insecure_channel(grpc_url(server)) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as info:
            call(b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "NoSuchMethod" in info.value.details()


def test_concurrent_requests_all_answered(grpc_client):
    results = queue.Queue()
    for i in range(64):
        a = np.full((1, 16), i, dtype=np.int32)
        grpc_client.async_infer(
            "simple",
            simple_inputs(a, a, grpcclient),
            partial_callback(results, i),
            request_id=str(i),
        )
    seen = {}
    for _ in range(64):
        i, result, error = results.get(timeout=60)
        assert error is None, error
        seen[i] = result
    for i, result in seen.items():
        assert result.get_response().id == str(i)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2 * i))


def partial_callback(results: queue.Queue, tag):
    def callback(result, error):
        results.put((tag, result, error))

    return callback


# --------------------------------------------------- bad input: same as over HTTP


def _bad_cases():
    """(id, model, version, inputs builder, outputs builder, HTTP status, gRPC status)."""
    a = np.ones((1, 16), dtype=np.int32)
    short = np.ones((1, 8), dtype=np.int32)
    big = np.ones((9, 16), dtype=np.int32)

    def extra(m):
        inputs = simple_inputs(a, a, m) + [m.InferInput("INPUT9", [1, 16], "INT32")]
        inputs[2].set_data_from_numpy(a)
        return inputs

    def wrong_type(m):
        x = m.InferInput("INPUT0", [1, 16], "FP32")
        x.set_data_from_numpy(a.astype(np.float32))
        return [x, simple_inputs(a, a, m)[1]]

    ok = lambda m: simple_inputs(a, a, m)  # noqa: E731
    return [
        ("unknown-model", "nope", "", ok, None, "404", "NOT_FOUND"),
        ("unknown-version", "simple", "3", ok, None, "404", "NOT_FOUND"),
        ("bad-version", "simple", "x1", ok, None, "400", "INVALID_ARGUMENT"),
        ("unexpected-input", "simple", "", extra, None, "400", "INVALID_ARGUMENT"),
        (
            "missing-input",
            "simple",
            "",
            lambda m: simple_inputs(a, a, m)[:1],
            None,
            "400",
            "INVALID_ARGUMENT",
        ),
        ("wrong-datatype", "simple", "", wrong_type, None, "400", "INVALID_ARGUMENT"),
        (
            "wrong-shape",
            "simple",
            "",
            lambda m: simple_inputs(short, short, m),
            None,
            "400",
            "INVALID_ARGUMENT",
        ),
        (
            "batch-too-big",
            "simple",
            "",
            lambda m: simple_inputs(big, big, m),
            None,
            "400",
            "INVALID_ARGUMENT",
        ),
        (
            "unexpected-output",
            "simple",
            "",
            ok,
            lambda m: [m.InferRequestedOutput("OUT")],
            "400",
            "INVALID_ARGUMENT",
        ),
    ]


@pytest.mark.parametrize(
    "model,version,make_inputs,make_outputs,http_status,grpc_status",
    [case[1:] for case in _bad_cases()],
    ids=[case[0] for case in _bad_cases()],
)
def test_bad_input_gets_the_same_error_as_over_http(
    server, grpc_client, model, version, make_inputs, make_outputs, http_status, grpc_status
):
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException) as http_info:
            http.infer(
                model,
                make_inputs(httpclient),
                model_version=version,
                outputs=make_outputs(httpclient) if make_outputs else None,
            )
    finally:
        http.close()
    error = expect_status(
        lambda: grpc_client.infer(
            model,
            make_inputs(grpcclient),
            model_version=version,
            outputs=make_outputs(grpcclient) if make_outputs else None,
        ),
        grpc_status,
    )
    assert http_info.value.status() == http_status
    assert error.message() == http_info.value.message()
    # The server keeps serving after every bad request.
    a = np.ones((1, 16), dtype=np.int32)
    assert (
        grpc_client.infer("simple", simple_inputs(a, a, grpcclient)).as_numpy("OUTPUT0") is not None
    )


# ------------------------------------------------------------------------ streaming


def test_stream_several_requests_and_an_error_that_does_not_end_it(grpc_client):
    responses = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for i in range(6):
            a = np.full((1, 16), i, dtype=np.int32)
            if i == 3:  # a bad request in the middle of the stream
                grpc_client.async_stream_infer(
                    "nope", simple_inputs(a, a, grpcclient), request_id="bad"
                )
            else:
                grpc_client.async_stream_infer(
                    "simple", simple_inputs(a, a, grpcclient), request_id=str(i)
                )
    finally:
        grpc_client.stop_stream()  # half-closes; waits for every response
    got = [responses.get(timeout=30) for _ in range(6)]
    assert responses.empty()
    errors = [e for r, e in got if e is not None]
    assert [e.message() for e in errors] == ["Request for unknown model: 'nope' is not found"]
    results = {r.get_response().id: r for r, e in got if r is not None}
    assert sorted(results) == ["0", "1", "2", "4", "5"]
    for key, result in results.items():
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2 * int(key)))
        # Every stream response says it is its request's last (Triton does, asked or not).
        assert result.get_response().parameters["triton_final_response"].bool_param is True


def test_stream_of_large_requests_round_trips(grpc_client):
    """Large requests on a stream (their raw contents cut out of the messages
    before protobuf parses the rest) come back exactly, each as its request's."""
    rng = np.random.default_rng(5)
    sent = {str(i): rng.random((1, 150_528 * (i + 1)), dtype=np.float32) for i in range(3)}
    responses = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for key, data in sent.items():
            infer_input = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
            infer_input.set_data_from_numpy(data)
            grpc_client.async_stream_infer("identity_fp32", [infer_input], request_id=key)
    finally:
        grpc_client.stop_stream()
    got = [responses.get(timeout=30) for _ in sent]
    assert [error for _, error in got] == [None] * len(sent)
    for result, _ in got:
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), sent[result.get_response().id])


def test_stream_with_empty_final_response_flag(grpc_client):
    responses = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    a = np.ones((1, 16), dtype=np.int32)
    try:
        grpc_client.async_stream_infer(
            "simple",
            simple_inputs(a, a, grpcclient),
            request_id="f",
            enable_empty_final_response=True,
        )
    finally:
        grpc_client.stop_stream()
    result, error = responses.get(timeout=30)
    assert error is None
    response = result.get_response()
    assert response.id == "f"
    assert response.parameters["triton_final_response"].bool_param is True
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


def test_asyncio_client_unary_and_stream(server):
    async def run():
        client = aiogrpcclient.InferenceServerClient(grpc_url(server))
        try:
            assert await client.is_server_live()
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            result = await client.infer("simple", simple_inputs(a, a, aiogrpcclient))
            unary = result.as_numpy("OUTPUT0")

            async def requests():
                for i in range(4):
                    b = np.full((1, 16), i, dtype=np.int32)
                    yield {
                        "model_name": "simple",
                        "inputs": simple_inputs(b, b, aiogrpcclient),
                        "request_id": f"a{i}",
                    }

            streamed = {}
            async for stream_result, error in client.stream_infer(requests()):
                assert error is None, error
                streamed[stream_result.get_response().id] = stream_result.as_numpy("OUTPUT0")
                if len(streamed) == 4:
                    break
            return unary, streamed
        finally:
            await client.close()

    unary, streamed = asyncio.run(run())
    np.testing.assert_array_equal(unary, np.arange(16).reshape(1, 16) * 2)
    assert sorted(streamed) == ["a0", "a1", "a2", "a3"]
    for i in range(4):
        np.testing.assert_array_equal(streamed[f"a{i}"], np.full((1, 16), 2 * i))


# ---------------------------------------------------- repository and extensions


def test_repository_index_and_control_mode_none(server, grpc_client):
    index = grpc_client.get_model_repository_index()
    rows = {m.name: m for m in index.models}
    assert set(rows) >= {"simple", "identity_fp32", "identity_bytes"}
    assert rows["simple"].state == "READY"
    assert rows["simple"].version == "1"
    as_json = grpc_client.get_model_repository_index(as_json=True)
    assert {m["name"] for m in as_json["models"]} == set(rows)
    assert ready_models(server) >= {"simple", "identity_fp32", "identity_bytes"}
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        for action in ("load_model", "unload_model"):
            error = expect_status(
                lambda action=action: getattr(grpc_client, action)("simple"), "UNAVAILABLE"
            )
            with pytest.raises(InferenceServerException) as http_error:
                getattr(http, action)("simple")
            assert error.message() == http_error.value.message()
            assert "model control mode NONE" in error.message()
    finally:
        http.close()
    assert grpc_client.is_model_ready("simple")


def ready_models(server) -> set[str]:
    """RepositoryIndex with ready=true (tritonclient.grpc has no argument for it)."""
    with grpc.insecure_channel(grpc_url(server)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        index = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))
    assert all(m.state == "READY" for m in index.models)
    return {m.name for m in index.models}


def test_statistics_are_those_http_reports(server, grpc_client):
    a = np.ones((1, 16), dtype=np.int32)
    for _ in range(3):
        grpc_client.infer("simple", simple_inputs(a, a, grpcclient))
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        over_http = http.get_inference_statistics("simple")
    finally:
        http.close()
    over_grpc = grpc_client.get_inference_statistics("simple", as_json=True)
    (stats,) = over_grpc["model_stats"]
    (expected,) = over_http["model_stats"]
    assert stats["name"] == "simple" and stats["version"] == "1"
    assert int(stats["inference_count"]) >= 3
    assert int(stats["inference_count"]) == expected["inference_count"]
    assert int(stats["execution_count"]) == expected["execution_count"]
    success = stats["inference_stats"]["success"]
    assert int(success["count"]) == expected["inference_stats"]["success"]["count"]
    assert int(success["ns"]) == expected["inference_stats"]["success"]["ns"]
    every = grpc_client.get_inference_statistics()
    assert {"simple", "identity_fp32"} <= {s.name for s in every.model_stats}
    expect_status(lambda: grpc_client.get_inference_statistics("nope"), "NOT_FOUND")


def test_log_settings_round_trip_and_errors_as_over_http(server, grpc_client):
    before = grpc_client.get_log_settings(as_json=True)["settings"]
    assert before["log_verbose_level"]["uint32_param"] == 0
    assert before["log_info"]["bool_param"] is True
    try:
        updated = grpc_client.update_log_settings({"log_verbose_level": 1, "log_info": True})
        assert updated.settings["log_verbose_level"].uint32_param == 1
        assert grpc_client.get_log_settings().settings["log_verbose_level"].uint32_param == 1
    finally:
        grpc_client.update_log_settings({"log_verbose_level": 0})
    error = expect_status(
        lambda: grpc_client.update_log_settings({"log_colour": True}), "INVALID_ARGUMENT"
    )
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException) as http_error:
            http.update_log_settings({"log_colour": True})
    finally:
        http.close()
    assert error.message() == http_error.value.message() == "unknown log setting 'log_colour'"


def test_shared_memory_needs_allow_client_shm(grpc_client):
    assert grpc_client.get_system_shared_memory_status().regions == {}
    error = expect_status(
        lambda: grpc_client.register_system_shared_memory("r", "/nope", 64), "UNIMPLEMENTED"
    )
    assert "--allow-client-shm" in error.message()


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    """EXPLICIT model control over a copy of the examples, with client shared memory."""
    repository = tmp_path_factory.mktemp("repository")
    for name in ("simple", "identity_fp32"):
        shutil.copytree(EXAMPLES / name, repository / name)
    server = ServerProcess(
        repository,
        args=["--model-control-mode=explicit", "--load-model=simple", "--allow-client-shm=true"],
    )
    try:
        server.wait_ready()
        yield server
        assert server.stop() == 0, server.output()
    finally:
        server.close()


def test_repository_load_and_unload(explicit_server):
    client = grpcclient.InferenceServerClient(grpc_url(explicit_server))
    try:
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["simple"].state == "READY"
        assert index["identity_fp32"].state == ""  # present, never loaded
        assert not client.is_model_ready("identity_fp32")

        client.load_model("identity_fp32")
        assert client.is_model_ready("identity_fp32")
        assert ready_models(explicit_server) == {"simple", "identity_fp32"}

        client.unload_model("identity_fp32")
        assert not client.is_model_ready("identity_fp32")
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["identity_fp32"].state == "UNAVAILABLE"

        override = '{"max_batch_size": 2}'
        client.load_model("simple", config=override)
        assert client.get_model_config("simple").config.max_batch_size == 2
        a = np.ones((3, 16), dtype=np.int32)
        error = expect_status(
            lambda: client.infer("simple", simple_inputs(a, a, grpcclient)), "INVALID_ARGUMENT"
        )
        assert "batch-size must be <= 2" in error.message()

        error = expect_status(lambda: client.load_model("no_such_model"), "INTERNAL")
        expected = "failed to load 'no_such_model', failed to poll from model repository"
        assert error.message().startswith(expected)
    finally:
        client.close()


def test_repository_load_with_file_overrides(explicit_server):
    """`file:<version>/<name>` parameters travel as bytes_param over gRPC."""
    client = grpcclient.InferenceServerClient(grpc_url(explicit_server))
    try:
        tensor_spec = {"data_type": "TYPE_FP32", "dims": [-1]}
        config = {
            "name": "from_files",
            "platform": "onnxruntime_onnx",
            "max_batch_size": 8,
            "input": [{"name": "INPUT0", **tensor_spec}],
            "output": [{"name": "OUTPUT0", **tensor_spec}],
        }
        model = (EXAMPLES / "identity_fp32" / "1" / "model.onnx").read_bytes()
        client.load_model(
            "from_files", config=json.dumps(config), files={"file:1/model.onnx": model}
        )
        assert client.is_model_ready("from_files")
        data = np.arange(5, dtype=np.float32).reshape(1, 5)
        tensor = grpcclient.InferInput("INPUT0", [1, 5], "FP32")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(
            client.infer("from_files", [tensor]).as_numpy("OUTPUT0"), data
        )
        error = expect_status(
            lambda: client.load_model("from_files", files={"file:1/model.onnx": model}),
            "INTERNAL",  # Triton: "failed to poll from model repository"
        )
        assert "'config' must be specified" in error.message()
        client.unload_model("from_files", unload_dependents=True)
        assert not client.is_model_ready("from_files")
    finally:
        client.close()


def test_system_shared_memory_over_grpc(explicit_server):
    client = grpcclient.InferenceServerClient(grpc_url(explicit_server))
    handles = []
    try:
        client.unregister_system_shared_memory()
        keys = {}
        for name in ("in", "out"):
            keys[name] = f"/trionserve_grpc_{name}_{os.getpid()}"
            handles.append(shm.create_shared_memory_region(name, keys[name], 128))
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        b = np.full((1, 16), 5, dtype=np.int32)
        shm.set_shared_memory_region(handles[0], [a, b])
        client.register_system_shared_memory("input_data", keys["in"], 128)
        client.register_system_shared_memory("output_data", keys["out"], 128)
        status = client.get_system_shared_memory_status().regions
        assert status["input_data"].byte_size == 128
        assert status["output_data"].key == keys["out"]
        expect_status(
            lambda: client.register_system_shared_memory("input_data", keys["in"], 128),
            "ALREADY_EXISTS",
        )

        inputs = [
            grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
            grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_shared_memory("input_data", 64)
        inputs[1].set_shared_memory("input_data", 64, offset=64)
        outputs = [
            grpcclient.InferRequestedOutput("OUTPUT0"),
            grpcclient.InferRequestedOutput("OUTPUT1"),
        ]
        outputs[0].set_shared_memory("output_data", 64)
        outputs[1].set_shared_memory("output_data", 64, offset=64)
        result = client.infer("simple", inputs, outputs=outputs)
        out0 = result.get_output("OUTPUT0")
        assert out0.parameters["shared_memory_region"].string_param == "output_data"
        assert out0.parameters["shared_memory_byte_size"].int64_param == 64
        sums = shm.get_contents_as_numpy(handles[1], np.int32, [1, 16])
        diffs = shm.get_contents_as_numpy(handles[1], np.int32, [1, 16], offset=64)
        np.testing.assert_array_equal(sums, a + b)
        np.testing.assert_array_equal(diffs, a - b)

        client.unregister_system_shared_memory("input_data")
        assert set(client.get_system_shared_memory_status().regions) == {"output_data"}
        error = expect_status(lambda: client.infer("simple", inputs), "INVALID_ARGUMENT")
        assert "shared memory region 'input_data' is not registered" in error.message()
        client.unregister_system_shared_memory()
    finally:
        client.close()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
