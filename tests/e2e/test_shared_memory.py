"""System shared memory extension over HTTP with tritonclient's shared memory utils."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException


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


def test_unregistering_a_region_never_registered_succeeds(shm_server, regions):
    """Triton's SharedMemoryManager::UnregisterHelper (server
    src/shared_memory_manager.cc) succeeds for a name it does not hold
    (qa/L0_shared_memory test_unregister_before_register), over HTTP and gRPC."""
    _, key = regions("trionserve_never", 8)
    client = httpclient.InferenceServerClient(shm_server.http_url)
    client.unregister_system_shared_memory()
    client.register_system_shared_memory("kept", key, 8)
    client.unregister_system_shared_memory("never_registered")
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["kept"]
    # A second registration of a name: Triton's words (shared_memory_manager.cc
    # RegisterSystemSharedMemory, qa/L0_shared_memory test_reregister_after_register).
    with pytest.raises(InferenceServerException, match="region 'kept' already in manager"):
        client.register_system_shared_memory("kept", key, 8)
    client.close()
    with grpcclient.InferenceServerClient(f"127.0.0.1:{shm_server.grpc_port}") as grpc_client:
        grpc_client.unregister_system_shared_memory("never_registered")
        grpc_client.unregister_cuda_shared_memory("never_registered")
        assert set(grpc_client.get_system_shared_memory_status().regions) == {"kept"}
        grpc_client.unregister_system_shared_memory()
        assert not grpc_client.get_system_shared_memory_status().regions


def test_a_region_larger_than_its_input_is_a_byte_size_mismatch(shm_server, regions):
    """A region of 128 bytes given for a [1,16] INT32 input: core's words (core
    src/infer_request.cc ValidateRequestInputs; qa/L0_shared_memory test_too_big_shm)."""
    in_handle, in_key = regions("trionserve_big", 128)
    shm.set_shared_memory_region(in_handle, [np.zeros((1, 32), dtype=np.int32)])
    client = httpclient.InferenceServerClient(shm_server.http_url)
    client.unregister_system_shared_memory()
    client.register_system_shared_memory("big", in_key, 128)
    expected = (
        "input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 128"
    )
    http_inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    http_inputs[0].set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
    http_inputs[1].set_shared_memory("big", 128)
    with pytest.raises(InferenceServerException, match=expected):
        client.infer("simple", http_inputs)
    client.close()
    with grpcclient.InferenceServerClient(f"127.0.0.1:{shm_server.grpc_port}") as grpc_client:
        grpc_inputs = [
            grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
            grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        grpc_inputs[0].set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
        grpc_inputs[1].set_shared_memory("big", 128)
        with pytest.raises(InferenceServerException, match=expected):
            grpc_client.infer("simple", grpc_inputs)
        grpc_client.unregister_system_shared_memory()


def test_client_shared_memory_is_off_by_default(http_client, regions):
    _, key = regions("trionserve_off", 64)
    with pytest.raises(InferenceServerException, match="--allow-client-shm=true"):
        http_client.register_system_shared_memory("r", key, 64)
    # Listed all the same, as Triton lists it (core src/server.cc).
    assert "system_shared_memory" in http_client.get_server_metadata()["extensions"]


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


def _simple_shm_io(module, region: str, out_region: str):
    inputs = [
        module.InferInput("INPUT0", [1, 16], "INT32"),
        module.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory(region, 64)
    inputs[1].set_shared_memory(region, 64, offset=64)
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(out_region, 64)
    outputs[1].set_shared_memory(out_region, 64, offset=64)
    return inputs, outputs


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("cut", ["input", "output"])
def test_region_truncated_after_registration_is_400_not_a_crash(shm_server, regions, protocol, cut):
    """A client can truncate a region's file at any time; a mapped byte past the end
    of its file would kill the server with SIGBUS (issue 18 item 1). The access is
    refused with a message naming the region, and the server keeps serving."""
    import tritonclient.grpc as grpcclient

    module = httpclient if protocol == "http" else grpcclient
    url = shm_server.http_url if protocol == "http" else f"127.0.0.1:{shm_server.grpc_port}"
    client = module.InferenceServerClient(url)
    in_handle, in_key = regions(f"trionserve_cut_in_{protocol}_{cut}", 128)
    _out_handle, out_key = regions(f"trionserve_cut_out_{protocol}_{cut}", 128)
    shm.set_shared_memory_region(in_handle, [np.arange(32, dtype=np.int32)])
    tag = f"{protocol}_{cut}"
    client.register_system_shared_memory(f"cut_in_{tag}", in_key, 128)
    client.register_system_shared_memory(f"cut_out_{tag}", out_key, 128)
    try:
        inputs, outputs = _simple_shm_io(module, f"cut_in_{tag}", f"cut_out_{tag}")
        client.infer("simple", inputs, outputs=outputs)  # whole: it works
        os.truncate(f"/dev/shm{in_key if cut == 'input' else out_key}", 16)
        with pytest.raises(InferenceServerException) as info:
            client.infer("simple", inputs, outputs=outputs)
        region = f"cut_in_{tag}" if cut == "input" else f"cut_out_{tag}"
        assert f"'{region}' is shorter than registered" in info.value.message()
        status = info.value.status()
        assert status in ("400", "StatusCode.INVALID_ARGUMENT"), status
        # The server is alive and serves the next request.
        assert client.is_server_live()
        plain = [
            module.InferInput("INPUT0", [1, 16], "INT32"),
            module.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        for tensor in plain:
            tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        assert client.infer("simple", plain).as_numpy("OUTPUT0").sum() == 32
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_key_that_is_a_symbolic_link_is_refused(shm_server, tmp_path):
    """shm_open never follows a link: a key linked to another file is refused and
    that file is never touched (issue 18 item 3)."""
    target = tmp_path / "victim"
    target.write_bytes(b"\0" * 128)
    link = f"/dev/shm/trionserve_link_{os.getpid()}"
    os.symlink(target, link)
    client = httpclient.InferenceServerClient(shm_server.http_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("linked", link[len("/dev/shm") :], 128)
        assert info.value.status() == "400"
        assert "linked" in info.value.message()
        assert client.get_system_shared_memory_status() == []
    finally:
        os.unlink(link)
        client.close()
    assert target.read_bytes() == b"\0" * 128


@pytest.mark.parametrize("key", ["../etc/passwd", "/a/b", "//x/", "/.."])
def test_key_outside_dev_shm_is_refused(shm_server, key):
    client = httpclient.InferenceServerClient(shm_server.http_url)
    try:
        with pytest.raises(InferenceServerException, match="invalid shared memory key"):
            client.register_system_shared_memory("outside", key, 16)
    finally:
        client.close()


def test_key_that_is_not_a_regular_file_is_refused(shm_server):
    """A directory or a FIFO in /dev/shm is no shared memory object."""
    path = f"/dev/shm/trionserve_fifo_{os.getpid()}"
    os.mkfifo(path)
    client = httpclient.InferenceServerClient(shm_server.http_url)
    try:
        with pytest.raises(InferenceServerException, match="not a shared memory object"):
            client.register_system_shared_memory("fifo", path[len("/dev/shm") :], 16)
    finally:
        os.unlink(path)
        client.close()


def test_a_key_that_does_not_exist_is_refused_in_tritons_words(shm_server):
    # server src/shared_memory_manager.cc OpenSharedMemoryRegion (INTERNAL there;
    # NOT_FOUND here: the client named it); qa/L0_grpc python_grpc_aio_test.py.
    client = httpclient.InferenceServerClient(shm_server.http_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("r", "/trionserve_no_such_key", 64)
    finally:
        client.close()
    assert "Unable to open shared memory region: '/trionserve_no_such_key'" in info.value.message()
    assert info.value.status() == "404"
