"""System shared memory extension over HTTP with tritonclient's shared memory utils."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.serverproc import ServerProcess


@pytest.fixture(scope="module")
def shm_server():
    server = ServerProcess(args=["--allow-client-shm=true"])
    try:
        server.wait_ready()
        yield server
        assert server.stop() == 0
    finally:
        server.close()


@pytest.fixture
def regions():
    handles = []

    def create(name: str, size: int):
        handle = shm.create_shared_memory_region(name, f"/{name}_{os.getpid()}", size)
        handles.append(handle)
        return handle, f"/{name}_{os.getpid()}"

    yield create
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def test_infer_with_inputs_and_outputs_in_shared_memory(shm_server, regions):
    client = httpclient.InferenceServerClient(shm_server.http_url)
    client.unregister_system_shared_memory()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 5, dtype=np.int32)
    in_handle, in_key = regions("trionserve_in", 128)
    out_handle, out_key = regions("trionserve_out", 128)
    shm.set_shared_memory_region(in_handle, [a, b])
    client.register_system_shared_memory("input_data", in_key, 128)
    client.register_system_shared_memory("output_data", out_key, 128)

    status = {r["name"]: r for r in client.get_system_shared_memory_status()}
    assert status["input_data"]["byte_size"] == 128
    assert status["output_data"]["key"] == out_key

    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory("input_data", 64)
    inputs[1].set_shared_memory("input_data", 64, offset=64)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=True),
    ]
    outputs[0].set_shared_memory("output_data", 64)
    outputs[1].set_shared_memory("output_data", 64, offset=64)
    result = client.infer("simple", inputs, outputs=outputs)
    # As Triton: an output in shared memory carries no parameters and no data.
    assert set(result.get_output("OUTPUT0")) == {"name", "datatype", "shape"}
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]), a + b)
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=64), a - b
    )

    # Out-of-bounds windows are rejected with a message naming the region.
    bad = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), inputs[1]]
    bad[0].set_shared_memory("input_data", 64, offset=100)
    with pytest.raises(InferenceServerException, match="out of bounds"):
        client.infer("simple", bad)
    with pytest.raises(InferenceServerException, match="exceeds"):
        client.register_system_shared_memory("too_big", in_key, 4096)

    client.unregister_system_shared_memory("input_data")
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["output_data"]
    with pytest.raises(InferenceServerException, match="'input_data' is not registered"):
        client.infer("simple", inputs, outputs=outputs)
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []
    client.close()


def test_client_shared_memory_is_off_by_default(http_client, regions):
    _, key = regions("trionserve_off", 64)
    with pytest.raises(InferenceServerException, match="--allow-client-shm=true"):
        http_client.register_system_shared_memory("r", key, 64)
    assert "system_shared_memory" not in http_client.get_server_metadata()["extensions"]


@pytest.mark.parametrize("other", ["data", "binary_data_size"])
def test_input_with_data_and_shared_memory_is_400(shm_server, regions, other):
    """As Triton (http_server.cc ValidateInputContentType): an input sets exactly
    one of 'data', 'binary_data_size', 'shared_memory_region'."""
    import http.client
    import json

    client = httpclient.InferenceServerClient(shm_server.http_url)
    handle, key = regions("trionserve_both", 128)
    shm.set_shared_memory_region(handle, [np.arange(32, dtype=np.int32)])
    client.register_system_shared_memory("both_data", key, 128)
    window = {"shared_memory_region": "both_data", "shared_memory_byte_size": 64}
    first = {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": window}
    if other == "data":
        first["data"] = list(range(16))
    else:
        first["parameters"] = {**window, "binary_data_size": 64}
    second = {
        "name": "INPUT1",
        "shape": [1, 16],
        "datatype": "INT32",
        "parameters": {**window, "shared_memory_offset": 64},
    }
    header = json.dumps({"inputs": [first, second]}).encode()
    body = header + (b"\0" * 64 if other == "binary_data_size" else b"")
    connection = http.client.HTTPConnection("127.0.0.1", shm_server.http_port, timeout=30)
    try:
        connection.request(
            "POST",
            "/v2/models/simple/infer",
            body=body,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        response = connection.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        connection.close()
        client.unregister_system_shared_memory()
        client.close()
    assert status == 400, answer
    assert "Input 'INPUT0' must set only one of" in answer["error"]
    assert f"But set '{other}' 'shared_memory_region'" in answer["error"]
