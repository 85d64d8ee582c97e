"""CUDA shared memory extension: handle decoding, errors without a GPU, GPU round trip."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from trionserve.core.cuda_shared_memory import (
    CUDA_IPC_HANDLE_SIZE,
    CudaSharedMemory,
    SharedMemoryResolver,
    cuda_unavailable_reason,
    decode_raw_handle,
)
from trionserve.core.errors import InvalidArgument, NotFound, Status, Unavailable
from trionserve.core.shared_memory import SystemSharedMemory

REASON = cuda_unavailable_reason()
HANDLE = bytes(range(CUDA_IPC_HANDLE_SIZE))
HANDLE_B64 = base64.b64encode(HANDLE).decode()


def _gpu_round_trip_skip_reason() -> str | None:
    if REASON is not None:
        return f"needs cupy and a CUDA device on the server side: {REASON}"
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401
    except Exception as exc:
        return f"tritonclient's cuda_shared_memory utils are not usable ({exc})"
    return None


# -- units ------------------------------------------------------------------------


def test_decode_raw_handle_as_tritonclient_sends_it():
    assert decode_raw_handle({"b64": HANDLE_B64}) == HANDLE


def test_decode_raw_handle_in_lines_as_the_cpp_client_sends_it():
    # tritonclient's C++ client (perf_analyzer) breaks base64 into 72-column lines.
    lines = "\n".join(HANDLE_B64[i : i + 72] for i in range(0, len(HANDLE_B64), 72)) + "\n"
    assert "\n" in lines.strip()
    assert decode_raw_handle({"b64": lines}) == HANDLE


@pytest.mark.parametrize(
    "value,fragment",
    [
        (None, '{"b64"'),
        (HANDLE_B64, '{"b64"'),
        ({"b64": 12}, '{"b64"'),
        ({"b64": "not base64!"}, "not valid base64"),
        ({"b64": base64.b64encode(b"short").decode()}, "64 bytes, got 5"),
    ],
)
def test_decode_raw_handle_rejects_malformed_handles(value, fragment):
    with pytest.raises(InvalidArgument) as info:
        decode_raw_handle(value)
    assert fragment in info.value.message


@pytest.mark.skipif(REASON is None, reason="this host has cupy and a GPU")
def test_registry_without_cuda():
    cuda = CudaSharedMemory(SystemSharedMemory())
    with pytest.raises(Unavailable) as info:
        cuda.register("r", HANDLE, 0, 64)
    assert info.value.status is Status.UNAVAILABLE
    assert "CUDA shared memory is unavailable" in info.value.message
    assert REASON in info.value.message
    assert cuda.status() == []
    cuda.unregister()  # all: nothing to do
    cuda.unregister("r")  # not registered: nothing to do, as in Triton
    assert "r" not in cuda
    with pytest.raises(NotFound, match="'r' is not registered"):
        cuda.status("r")


def test_resolver_sends_unknown_names_to_system_shared_memory():
    resolver = SharedMemoryResolver(SystemSharedMemory(), CudaSharedMemory())
    with pytest.raises(InvalidArgument, match="region 'nope' is not registered"):
        resolver.view("nope", 0, 4, "input 'INPUT0'")


# -- over the wire, on a host without cupy or a GPU --------------------------------


@pytest.fixture
def http_client(shm_server):
    client = httpclient.InferenceServerClient(shm_server.http_url)
    yield client
    client.close()


@pytest.fixture
def grpc_client(shm_server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{shm_server.grpc_port}")
    yield client
    client.close()


no_cuda = pytest.mark.skipif(REASON is None, reason="this host has cupy and a GPU")


@no_cuda
def test_http_register_without_cuda_is_unavailable(http_client):
    with pytest.raises(InferenceServerException) as info:
        http_client.register_cuda_shared_memory("r", HANDLE_B64, 0, 64)
    assert "CUDA shared memory is unavailable" in info.value.message()
    assert REASON in info.value.message()
    assert http_client.get_cuda_shared_memory_status() == []
    http_client.unregister_cuda_shared_memory()
    http_client.unregister_cuda_shared_memory("r")  # not registered: success, as in Triton
    # Listed all the same, as Triton lists it (core src/server.cc).
    assert "cuda_shared_memory" in http_client.get_server_metadata()["extensions"]


@no_cuda
def test_grpc_register_without_cuda_is_unavailable(grpc_client):
    with pytest.raises(InferenceServerException) as info:
        grpc_client.register_cuda_shared_memory("r", HANDLE_B64.encode(), 0, 64)
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert "CUDA shared memory is unavailable" in info.value.message()
    assert grpc_client.get_cuda_shared_memory_status().regions == {}
    grpc_client.unregister_cuda_shared_memory()
    grpc_client.unregister_cuda_shared_memory("r")  # not registered: success, as in Triton
    assert "cuda_shared_memory" in grpc_client.get_server_metadata().extensions


def test_grpc_register_checks_its_arguments_before_cuda(grpc_client):
    # Triton's qa/L0_grpc python_grpc_aio_test.py test_register_cuda_shared_memory:
    # an empty name and handle are "invalid args" (INVALID_ARGUMENT) whether or not
    # the host can open CUDA memory, as Triton's RegisterCUDASharedMemory checks.
    with pytest.raises(
        InferenceServerException, match="failed to register shared memory region.*invalid args"
    ) as info:
        grpc_client.register_cuda_shared_memory("", b"", 0, 0)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert grpc_client.get_cuda_shared_memory_status().regions == {}


def test_http_register_rejects_a_malformed_handle(http_client):
    # The handle is decoded before CUDA is asked for, so this holds on any host.
    with pytest.raises(InferenceServerException, match="64 bytes, got 5"):
        http_client.register_cuda_shared_memory("r", base64.b64encode(b"short").decode(), 0, 64)


def test_cuda_shm_needs_allow_client_shm(server):
    # The session's server (tests/conftest.py): started without --allow-client-shm,
    # so no test can have registered a region there; it must stop cleanly at the end.
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.get_cuda_shared_memory_status() == []
    with pytest.raises(InferenceServerException, match="--allow-client-shm"):
        client.register_cuda_shared_memory("r", HANDLE_B64, 0, 64)
    client.close()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert grpc.get_cuda_shared_memory_status().regions == {}
    with pytest.raises(InferenceServerException, match="--allow-client-shm"):
        grpc.register_cuda_shared_memory("r", HANDLE_B64.encode(), 0, 64)
    grpc.close()


# -- the real thing ------------------------------------------------------------------


@pytest.mark.skipif(
    _gpu_round_trip_skip_reason() is not None,
    reason=str(_gpu_round_trip_skip_reason()),
)
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_infer_with_inputs_and_outputs_in_cuda_shared_memory(shm_server, protocol):
    import tritonclient.utils.cuda_shared_memory as cudashm

    module = httpclient if protocol == "http" else grpcclient
    url = shm_server.http_url if protocol == "http" else f"127.0.0.1:{shm_server.grpc_port}"
    client = module.InferenceServerClient(url)
    client.unregister_cuda_shared_memory()
    client.unregister_system_shared_memory()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 5, dtype=np.int32)
    in_handle = cudashm.create_shared_memory_region("input_data", 128, 0)
    out_handle = cudashm.create_shared_memory_region("output_data", 128, 0)
    try:
        cudashm.set_shared_memory_region(in_handle, [a, b])
        client.register_cuda_shared_memory("input_data", cudashm.get_raw_handle(in_handle), 0, 128)
        client.register_cuda_shared_memory(
            "output_data", cudashm.get_raw_handle(out_handle), 0, 128
        )
        if protocol == "http":
            status = {r["name"]: r for r in client.get_cuda_shared_memory_status()}
            assert status["input_data"]["byte_size"] == 128
            assert status["output_data"]["device_id"] == 0
            assert "cuda_shared_memory" in client.get_server_metadata()["extensions"]
        else:
            status = client.get_cuda_shared_memory_status().regions
            assert status["input_data"].byte_size == 128
        # One namespace with system shared memory.
        with pytest.raises(InferenceServerException, match="already in manager"):
            client.register_cuda_shared_memory(
                "input_data", cudashm.get_raw_handle(in_handle), 0, 128
            )

        inputs = [
            module.InferInput("INPUT0", [1, 16], "INT32"),
            module.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_shared_memory("input_data", 64)
        inputs[1].set_shared_memory("input_data", 64, offset=64)
        outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("output_data", 64)
        outputs[1].set_shared_memory("output_data", 64, offset=64)
        client.infer("simple", inputs, outputs=outputs)
        # tritonclient reads a region from its start: both outputs, one per row.
        region = cudashm.get_contents_as_numpy(out_handle, np.int32, [2, 16])
        np.testing.assert_array_equal(region[0:1], a + b)
        np.testing.assert_array_equal(region[1:2], a - b)
        client.unregister_cuda_shared_memory()
        assert not (
            client.get_cuda_shared_memory_status()
            if protocol == "http"
            else client.get_cuda_shared_memory_status().regions
        )
    finally:
        cudashm.destroy_shared_memory_region(in_handle)
        cudashm.destroy_shared_memory_region(out_handle)
        client.close()
