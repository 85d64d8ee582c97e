"""gRPC behaviours that Triton clients rely on, against a real server with tritonclient.grpc.

Stream final flags (Triton's src/grpc/stream_infer_handler.cc), what LogSettings
refuses (src/grpc/grpc_server.cc), inputs that name two sources of data.
"""

from __future__ import annotations

import queue
import shutil
import textwrap

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.helpers import simple_inputs
from tests.repository import python_model
from tests.serverproc import EXAMPLES, ServerProcess

REPEAT_MODEL = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        # N responses with OUT = 0..N-1, then the final flag on its own.
        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
                for i in range(n):
                    out = pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))
                    sender.send(pb_utils.InferenceResponse([out]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
    """
)

REPEAT_CONFIG = textwrap.dedent(
    """
    name: "repeat"
    backend: "python"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [{ name: "N" data_type: TYPE_INT32 dims: [1] }]
    output [{ name: "OUT" data_type: TYPE_INT32 dims: [1] }]
    """
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc-parity")
    shutil.copytree(EXAMPLES / "simple", root / "simple")
    python_model(root, "repeat", REPEAT_CONFIG, REPEAT_MODEL)
    process = ServerProcess(root)
    try:
        process.wait_ready(path="/v2/models/repeat/ready")
        yield process
    finally:
        process.close()


@pytest.fixture
def client(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


def stream(client, requests: list[dict]) -> list:
    """Send ``requests`` on one stream; every (result, error) received, in order."""
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        for spec in requests:
            client.async_stream_infer(**spec)
    finally:
        client.stop_stream()  # half-closes, waits for the server to end the stream
    out = []
    while not received.empty():
        out.append(received.get())
    return out


def repeat_inputs(n: int):
    tensor = grpcclient.InferInput("N", [1], "INT32")
    tensor.set_data_from_numpy(np.array([n], dtype=np.int32))
    return [tensor]


def flags(received) -> list[bool | None]:
    out = []
    for result, error in received:
        assert error is None, error
        final = result.get_response().parameters.get("triton_final_response")
        out.append(None if final is None else final.bool_param)
    return out


# -- ModelStreamInfer final flags (issue 17 item 13) -----------------------------------


@pytest.mark.parametrize("empty_final", [False, True])
def test_every_stream_response_of_a_plain_model_says_it_is_final(client, empty_final):
    received = stream(
        client,
        [
            {
                "model_name": "simple",
                "inputs": simple_inputs(np.ones((1, 16), np.int32), module=grpcclient),
                "request_id": "p",
                "enable_empty_final_response": empty_final,
            },
        ],
    )
    assert flags(received) == [True]


def test_decoupled_responses_carry_the_flag_without_asking(client):
    received = stream(client, [{"model_name": "repeat", "inputs": repeat_inputs(3)}])
    assert [int(r.as_numpy("OUT")[0]) for r, _ in received] == [0, 1, 2]
    # The bare final flag sends nothing unless asked: every flag stays false.
    assert flags(received) == [False, False, False]


def test_decoupled_n_responses_and_the_final_flag_give_n_plus_one(client):
    received = stream(
        client,
        [
            {
                "model_name": "repeat",
                "inputs": repeat_inputs(3),
                "request_id": "r",
                "enable_empty_final_response": True,
            },
        ],
    )
    assert flags(received) == [False, False, False, True]
    empty = received[-1][0].get_response()
    assert (empty.id, empty.model_name, len(empty.outputs)) == ("r", "repeat", 0)


# -- LogSettings (issue 18 item 2) ------------------------------------------------------


def test_log_file_cannot_be_set_over_grpc(client, server, tmp_path):
    target = tmp_path / "written-by-a-client.log"
    with pytest.raises(InferenceServerException) as info:
        client.update_log_settings({"log_file": str(target)})
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "log file location can not be updated through network protocol" in (info.value.message())
    assert not target.exists()
    # The other settings still change, and log_file is still reported.
    settings = client.update_log_settings({"log_verbose_level": 0}, as_json=True)["settings"]
    assert settings["log_file"]["string_param"] == ""


# -- inputs with two sources of data (issue 17 item 9) ---------------------------------


def test_contents_and_shared_memory_on_one_input_is_invalid(server):
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(range(16))
    params = request.inputs[0].parameters
    params["shared_memory_region"].string_param = "some_region"
    params["shared_memory_byte_size"].int64_param = 64
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "INPUT0" in info.value.details() and "shared memory" in info.value.details()


# -- message size limits (issue 18 items 4 and 5) -------------------------------------


def test_a_gzip_message_past_the_default_limit_is_resource_exhausted(server):
    """64 MiB and 1 KiB of zeros, gzip-compressed to about 65 KiB on the wire: the
    server stops decompressing at the limit instead of inflating it."""
    request = service_pb2.ModelInferRequest(model_name="simple")
    request.raw_input_contents.append(bytes(64 * 1024 * 1024 + 1024))
    with grpc.insecure_channel(
        f"127.0.0.1:{server.grpc_port}", compression=grpc.Compression.Gzip
    ) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max (67108864)" in info.value.details()
    assert "--grpc-max-message-size" in info.value.details()
    # The server goes on serving.
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert (
        client.infer("simple", simple_inputs(np.ones((1, 16), np.int32), module=grpcclient))
        .as_numpy("OUTPUT0")
        .tolist()[0][0]
        == 2
    )
    client.close()
