"""The Python backend end to end: Triton-style model.py files, a real server, tritonclient.

One server serves a temporary repository of Python models written the way Triton
users write them (plus the ONNX ``simple`` for BLS): add/sub, a model that raises,
one that calls ``os._exit(1)``, one that hangs, one that keeps crashing, BLS
models (sync and async), a decoupled model, an auto-completed model, and two
models that cannot load.
"""

from __future__ import annotations

import json
import queue
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.repository import python_model
from tests.serverproc import EXAMPLES, ServerProcess

I32_16 = """
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { kind: KIND_CPU } ]
"""

ECHO = """
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

# An echo model whose behaviour for INPUT0 == 1 is the body of ``special``.
ECHO_MODEL = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if value[0] == 1:
{special}
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value.copy())])
            )
        return responses
"""

MODELS: dict[str, tuple[str, str]] = {}

MODELS["errors"] = (
    ECHO,
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            if value == 1:
                raise ValueError("deliberate failure in execute")
            if value == 2:
                error = pb_utils.TritonError("value 2 is not allowed", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            out = pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy() * 10)
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
""",
)
MODELS["sender"] = (
    ECHO,
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    \"\"\"Not decoupled, yet answers through response senders (Triton 24.06+).\"\"\"

    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if value[0] != 1:  # for 1: forget to answer
                request.get_response_sender().send(
                    pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value + 1)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        return None
""",
)
MODELS["crash"] = (ECHO, ECHO_MODEL.format(special="                os._exit(1)"))
MODELS["hang"] = (
    ECHO + 'parameters { key: "execute-timeout-seconds" value: { string_value: "1" } }\n',
    ECHO_MODEL.format(special="                time.sleep(3600)"),
)
MODELS["doomed"] = (
    ECHO + 'parameters { key: "stub-max-restarts" value: { string_value: "1" } }\n',
    ECHO_MODEL.format(special="                os._exit(3)"),
)
MODELS["add_sub"] = (
    I32_16,
    (EXAMPLES / "add_sub_python" / "1" / "model.py").read_text(),
)
MODELS["bls_sync"] = (
    I32_16,
    """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            target = json.loads(request.parameters()).get("target")
            if target:
                bls = pb_utils.InferenceRequest(
                    model_name=target, requested_output_names=["OUTPUT0"], inputs=request.inputs()
                )
                response = bls.exec()
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            outputs = []
            for model, name in (("simple", "OUTPUT0"), ("add_sub", "OUTPUT1")):
                bls = pb_utils.InferenceRequest(
                    model_name=model, requested_output_names=[name], inputs=request.inputs()
                )
                response = bls.exec()
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                outputs.append(pb_utils.get_output_tensor_by_name(response, name))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
""",
)
MODELS["bls_async"] = (
    I32_16,
    """
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            pending = [
                pb_utils.InferenceRequest(
                    model_name=model, requested_output_names=[name], inputs=request.inputs()
                ).async_exec()
                for model, name in (("add_sub", "OUTPUT0"), ("simple", "OUTPUT1"))
            ]
            first, second = await asyncio.gather(*pending)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(first, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(second, "OUTPUT1"),
            ]))
        return responses
""",
)
MODELS["repeat"] = (
    """
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU } ]
""",
    """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = __import__("json").loads(args["model_config"])
        assert pb_utils.using_decoupled_model_transaction_policy(config)

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().copy()
            sender = request.get_response_sender()
            threading.Thread(target=self.respond, args=(values, sender)).start()
        return None

    def respond(self, values, sender):
        for index, value in enumerate(values):
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([value], np.int32)),
                pb_utils.Tensor("IDX", np.array([index], np.uint32)),
            ]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
""",
)
MODELS["bls_decoupled"] = (
    """
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [
  { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU } ]
""",
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            bls = pb_utils.InferenceRequest(
                model_name="repeat", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
            )
            total, count = 0, 0
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                if out is not None:
                    total += int(out.as_numpy()[0])
                    count += 1
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([total], np.int32)),
                pb_utils.Tensor("COUNT", np.array([count], np.int32)),
            ]))
        return responses
""",
)
MODELS["auto"] = (
    "",  # no tensors, no max_batch_size: auto_complete_config fills them
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [4]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)
            ])
            for r in requests
        ]
""",
)
MODELS["introspect"] = (
    """
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 2 } ]
""",
    """
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from .helper import GREETING  # a file beside model.py, imported as Triton allows


class TritonPythonModel:
    def initialize(self, args):
        self.args = args

    def execute(self, requests):
        responses = []
        for request in requests:
            words = [w.decode() for w in pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()]
            if "slow" in words:
                time.sleep(0.3)
            report = {
                "args": {k: v for k, v in self.args.items() if k != "model_config"},
                "words": words,
                "pid": os.getpid(),
                "request_id": request.request_id(),
                "parameters": json.loads(request.parameters()),
                "model_dir": pb_utils.get_model_dir(),
                "requested": request.requested_output_names(),
                "greeting": GREETING,
            }
            out = np.array([json.dumps(report).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
""",
)
MODELS["bad_initialize"] = (
    ECHO,
    """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("cannot find the weights")

    def execute(self, requests):
        return []
""",
)
MODELS["conda_env"] = (
    ECHO + 'parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "env.tar.gz" } }\n',
    MODELS["errors"][1],
)


# Files beside model.py in a version directory.
EXTRA_FILES = {"introspect": {"helper.py": 'GREETING = "hello from helper.py"\n'}}


MODELS["send_then_raise"] = (
    """
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
""",
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for value in pb_utils.get_input_tensor_by_name(request, "IN").as_numpy():
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.array([value], np.int32)),
                ]))
        raise ValueError("after the responses")
""",
)


def make_repository(root: Path, names=None) -> Path:
    """A model repository with the named test models (all by default) and `simple`."""
    shutil.copytree(EXAMPLES / "simple", root / "simple")
    for name in names or MODELS:
        config, source = MODELS[name]
        files = {f"1/{filename}": text for filename, text in EXTRA_FILES.get(name, {}).items()}
        python_model(root, name, f'name: "{name}"\nbackend: "python"\n' + config, source, files)
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return make_repository(tmp_path_factory.mktemp("python_models"))


@pytest.fixture(scope="module")
def server(repository):
    proc = ServerProcess(repository, args=["--exit-on-error=false"])
    try:
        proc.wait_ready()
        yield proc
        code = proc.stop()
        assert code == 0, f"server exited with {code}:\n{proc.output()}"
        assert "add_sub_python: finalized" in proc.output()
    finally:
        proc.close()


@pytest.fixture
def client(server):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield client
    client.close()


def i32_inputs(a: np.ndarray, b: np.ndarray):
    inputs = [
        httpclient.InferInput("INPUT0", list(a.shape), "INT32"),
        httpclient.InferInput("INPUT1", list(b.shape), "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def echo(client, model: str, value: int):
    infer_input = httpclient.InferInput("INPUT0", [1], "INT32")
    infer_input.set_data_from_numpy(np.array([value], dtype=np.int32))
    return client.infer(model, [infer_input]).as_numpy("OUTPUT0")


A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def test_add_sub(client):
    result = client.infer("add_sub", i32_inputs(A, B))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    # A batch of 3 and only one requested output.
    a3, b3 = np.tile(A, (3, 1)), np.tile(B, (3, 1))
    result = client.infer(
        "add_sub", i32_inputs(a3, b3), outputs=[httpclient.InferRequestedOutput("OUTPUT1")]
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a3 - b3)
    assert result.as_numpy("OUTPUT0") is None


def test_large_tensors_grow_shared_memory(client):
    """A full batch, and BYTES tensors beyond the 1 MiB arenas, which then grow."""
    a = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    assert (
        client.infer("add_sub", i32_inputs(a, a)).as_numpy("OUTPUT0").tolist() == (2 * a).tolist()
    )
    words = np.array([b"a" * 800_000, b"b" * 900_000], dtype=np.object_)
    infer_input = httpclient.InferInput("INPUT0", [2], "BYTES")
    infer_input.set_data_from_numpy(words)
    report = json.loads(client.infer("introspect", [infer_input]).as_numpy("OUTPUT0")[0])
    assert [len(w) for w in report["words"]] == [800_000, 900_000]
    assert report["words"][1] == "b" * 900_000


def test_initialize_args_and_request_fields(client, repository):
    words = np.array([b"hello", "wörld".encode()], dtype=np.object_)
    infer_input = httpclient.InferInput("INPUT0", [2], "BYTES")
    infer_input.set_data_from_numpy(words)
    result = client.infer(
        "introspect", [infer_input], request_id="req-7", parameters={"answer": 42}
    )
    report = json.loads(result.as_numpy("OUTPUT0")[0])
    assert report["words"] == ["hello", "wörld"]
    assert report["request_id"] == "req-7"
    assert report["parameters"]["answer"] == 42
    assert report["requested"] == ["OUTPUT0"]
    assert report["greeting"] == "hello from helper.py"
    assert report["model_dir"] == str(repository / "introspect" / "1")
    args = report["args"]
    assert args["model_name"] == "introspect"
    assert args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_device_id"] == "0"
    assert args["model_instance_name"] in ("introspect_0_0", "introspect_0_1")
    assert args["model_repository"] == str(repository / "introspect")


def test_two_instances_are_two_processes(server):
    """Two requests at once on a model with two instances run in two stubs."""

    def call(_):
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
        try:
            infer_input = httpclient.InferInput("INPUT0", [1], "BYTES")
            infer_input.set_data_from_numpy(np.array([b"slow"], dtype=np.object_))
            return json.loads(client.infer("introspect", [infer_input]).as_numpy("OUTPUT0")[0])
        finally:
            client.close()

    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(call, range(2)))
    assert reports[0]["pid"] != reports[1]["pid"]
    assert {r["args"]["model_instance_name"] for r in reports} == {
        "introspect_0_0",
        "introspect_0_1",
    }


def test_execute_raising_fails_the_request_only(client):
    with pytest.raises(InferenceServerException) as info:
        echo(client, "errors", 1)
    message = str(info.value)
    assert "ValueError: deliberate failure in execute" in message
    assert "model.py" in message
    assert echo(client, "errors", 5).tolist() == [50]


def test_triton_error_in_a_response_reaches_the_client(client):
    with pytest.raises(InferenceServerException) as info:
        echo(client, "errors", 2)
    assert "value 2 is not allowed" in str(info.value)
    assert info.value.status() == "400"  # INVALID_ARG


def test_response_sender_in_a_model_that_is_not_decoupled(client):
    assert echo(client, "sender", 4).tolist() == [5]
    with pytest.raises(InferenceServerException) as info:
        echo(client, "sender", 1)
    assert "released the request without sending its final response" in str(info.value)


def test_os_exit_in_execute_fails_the_request_and_the_stub_restarts(client):
    assert echo(client, "crash", 7).tolist() == [7]
    with pytest.raises(InferenceServerException) as info:
        echo(client, "crash", 1)
    message = str(info.value)
    assert "crash_0_0" in message and "exited with code 1 while executing" in message
    # Other models are untouched, and the next request succeeds once restarted.
    assert (
        client.infer("add_sub", i32_inputs(A, B)).as_numpy("OUTPUT0").tolist() == (A + B).tolist()
    )
    assert echo(client, "crash", 8).tolist() == [8]
    assert client.is_server_live()


def test_hanging_execute_is_killed_after_the_timeout(client):
    with pytest.raises(InferenceServerException) as info:
        echo(client, "hang", 1)
    assert "did not return from execute within 1s" in str(info.value)
    assert echo(client, "hang", 4).tolist() == [4]


def test_a_stub_failing_again_and_again_makes_the_model_unavailable(client):
    # stub-max-restarts 1: the first crash restarts the stub, the second gives up.
    for _ in range(2):
        with pytest.raises(InferenceServerException) as info:
            echo(client, "doomed", 1)
        assert "exited with code 3 while executing" in str(info.value)
    # Not ready at once (its stub is gone), then the registry takes the failed
    # version out of service.
    assert not client.is_model_ready("doomed")

    def row() -> dict:
        return next(r for r in client.get_model_repository_index() if r["name"] == "doomed")

    deadline = time.monotonic() + 30
    while row()["state"] != "UNAVAILABLE" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not client.is_model_ready("doomed")
    entry = row()
    assert entry["state"] == "UNAVAILABLE"
    assert "failed 2 times in a row" in entry["reason"]
    assert "exited with code 3" in entry["reason"]
    with pytest.raises(InferenceServerException) as info:
        echo(client, "doomed", 5)
    assert info.value.status() == "503"
    assert echo(client, "errors", 3).tolist() == [30]


def test_bls_calls_onnx_and_python_models(client):
    result = client.infer("bls_sync", i32_inputs(A, B))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)  # simple
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)  # add_sub
    result = client.infer("bls_async", i32_inputs(A, B))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)  # add_sub
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)  # simple


def test_bls_error_is_a_response_error(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("bls_sync", i32_inputs(A, B), parameters={"target": "no_such_model"})
    assert "no_such_model" in str(info.value)
    assert info.value.status() == "404"


def test_bls_over_a_decoupled_model(client):
    infer_input = httpclient.InferInput("IN", [5], "INT32")
    infer_input.set_data_from_numpy(np.array([1, 2, 3, 4, 5], dtype=np.int32))
    result = client.infer("bls_decoupled", [infer_input])
    assert result.as_numpy("SUM").tolist() == [15]
    assert result.as_numpy("COUNT").tolist() == [5]


def test_auto_complete_config_fills_the_config(client):
    config = client.get_model_config("auto")
    assert config["max_batch_size"] == 4
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("X", "TYPE_FP32", [4])
    ]
    assert [o["name"] for o in config["output"]] == ["Y"]
    assert "dynamic_batching" in config
    x = np.ones((2, 4), dtype=np.float32)
    infer_input = httpclient.InferInput("X", [2, 4], "FP32")
    infer_input.set_data_from_numpy(x)
    assert client.infer("auto", [infer_input]).as_numpy("Y").tolist() == (2 * x).tolist()


def test_load_failures_name_the_cause(client):
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    assert rows["bad_initialize"]["state"] == "UNAVAILABLE"
    assert "RuntimeError: cannot find the weights" in rows["bad_initialize"]["reason"]
    assert "initialize" in rows["bad_initialize"]["reason"]
    assert rows["conda_env"]["state"] == "UNAVAILABLE"
    assert "EXECUTION_ENV_PATH 'env.tar.gz'" in rows["conda_env"]["reason"]
    assert "does not exist" in rows["conda_env"]["reason"]
    assert not client.is_model_ready("bad_initialize")


def test_responses_sent_before_execute_raised_reach_the_client_before_the_error(server):
    """A decoupled model sends responses from execute, then raises: the client
    gets them in order, then the error (the responses go on the stub's socket,
    the execute's outcome on the lane; the outcome waits for what went first)."""
    pytest.importorskip("trionserve.protocol.grpc.service")
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        for attempt in range(20):  # each time, the outcome may overtake the responses
            infer_input = grpcclient.InferInput("IN", [3], "INT32")
            infer_input.set_data_from_numpy(np.array([10, 20, 30], dtype=np.int32))
            client.async_stream_infer("send_then_raise", [infer_input], request_id=str(attempt))
            received = []
            while True:
                result, error = responses.get(timeout=30)
                if error is not None:
                    break
                received.append(int(result.as_numpy("OUT")[0]))
            assert received == [10, 20, 30]
            assert "after the responses" in str(error)
    finally:
        client.stop_stream()
        client.close()


def test_decoupled_model_streams_over_grpc(server):
    pytest.importorskip("trionserve.protocol.grpc.service")
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        infer_input = grpcclient.InferInput("IN", [4], "INT32")
        infer_input.set_data_from_numpy(np.array([10, 20, 30, 40], dtype=np.int32))
        client.async_stream_infer("repeat", [infer_input], request_id="r1")
        received = []
        while len(received) < 4:
            result, error = responses.get(timeout=30)
            assert error is None, error
            received.append((int(result.as_numpy("IDX")[0]), int(result.as_numpy("OUT")[0])))
        assert received == [(0, 10), (1, 20), (2, 30), (3, 40)]
    finally:
        client.stop_stream()
        client.close()


def test_decoupled_model_is_refused_by_single_response_infer_on_both_protocols(server, client):
    # Model policy is checked in the DataPlane's admission, so HTTP and gRPC refuse
    # the same request the same way: UNIMPLEMENTED (HTTP 501) with Triton's words
    # (src/http_server.cc CheckTransactionPolicy, src/grpc/infer_handler.cc), and
    # the model never runs.
    import tritonclient.grpc as grpcclient

    before = client.get_inference_statistics("repeat")["model_stats"][0]
    infer_input = httpclient.InferInput("IN", [2], "INT32")
    infer_input.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("repeat", [infer_input])
    assert info.value.status() == "501"
    assert info.value.message().startswith(
        "HTTP end point doesn't support models with decoupled transaction policy"
    ), info.value.message()
    assert "model 'repeat'" in info.value.message()

    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        grpc_input = grpcclient.InferInput("IN", [2], "INT32")
        grpc_input.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
        with pytest.raises(InferenceServerException) as info:
            grpc_client.infer("repeat", [grpc_input])
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"
        assert info.value.message().startswith(
            "ModelInfer RPC doesn't support models with decoupled transaction policy"
        ), info.value.message()
    finally:
        grpc_client.close()
    after = client.get_inference_statistics("repeat")["model_stats"][0]
    assert after["execution_count"] == before["execution_count"]
    assert after["inference_stats"]["fail"] == before["inference_stats"]["fail"]


def test_stubs_never_write_into_the_repository(server, repository):
    assert echo(httpclient.InferenceServerClient(server.http_url), "errors", 4).tolist() == [40]
    assert not list(repository.rglob("__pycache__"))
    assert not list(repository.rglob("*.pyc"))
