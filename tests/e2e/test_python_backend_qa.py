"""Python-backend behaviour that Triton's qa/L0_backend_python checks (issue 28).

Real server, real ``tritonclient``, real stub processes: what a model sees in
``sys.argv``; ``pb_utils.TritonError`` codes as HTTP and gRPC statuses; a gRPC
stream opened with ``triton_grpc_error: true`` ended by a model's error; a model
whose stub died is not ready until the next request restarts it; a model's
``is_ready()`` consulted by the readiness API.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.test_model_control_http import post
from tests.repository import python_model
from tests.serverproc import ServerProcess, http_client, serving

IDENTITY = """
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

IDENTITY_MODEL = """
import os
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.argv = list(sys.argv)

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", value)
            response_parameters = {"argv": repr(self.argv), "pid": os.getpid()}
            responses.append(pb_utils.InferenceResponse([out], parameters=response_parameters))
        return responses
"""

MODELS: dict[str, tuple[str, str]] = {}

MODELS["identity"] = (IDENTITY, IDENTITY_MODEL)

# unittest.main() in a model parses sys.argv, as the QA models do
# (qa/L0_backend_python/argument_validation): stub arguments would be test names.
MODELS["unittest_main"] = (
    IDENTITY,
    """
import unittest

import triton_python_backend_utils as pb_utils


class Passing(unittest.TestCase):
    def test_passes(self):
        pass


class TritonPythonModel:
    def initialize(self, args):
        self.ok = unittest.main("model", exit=False).result.wasSuccessful()

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", value * int(self.ok))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
""",
)

# Wrong argument types raise TypeError, as python_backend's pybind11 API raises
# them (qa/L0_backend_python/argument_validation); list items that are not
# tensors and DLPack misuse raise TritonModelException.
MODELS["arguments"] = (
    IDENTITY,
    """
import numpy as np
import triton_python_backend_utils as pb_utils

ARRAY = np.zeros([2], np.int32)
TENSOR = pb_utils.Tensor("INPUT0", ARRAY)
CASES = [
    (TypeError, lambda: pb_utils.InferenceRequest(
        model_name=None, inputs=[TENSOR], requested_output_names=["O"])),
    (TypeError, lambda: pb_utils.InferenceRequest(
        model_name="m", inputs=None, requested_output_names=["O"])),
    (TypeError, lambda: pb_utils.InferenceRequest(
        model_name="m", inputs=[TENSOR], requested_output_names=[None])),
    (TypeError, lambda: pb_utils.InferenceRequest(
        model_name="m", inputs=[TENSOR], requested_output_names=["O"], correlation_id=None)),
    (TypeError, lambda: pb_utils.InferenceRequest(
        model_name="m", inputs=[TENSOR], requested_output_names=["O"], request_id=None)),
    (pb_utils.TritonModelException, lambda: pb_utils.InferenceRequest(
        model_name="m", inputs=[None], requested_output_names=["O"])),
    (TypeError, lambda: pb_utils.InferenceResponse(output_tensors=None)),
    (pb_utils.TritonModelException, lambda: pb_utils.InferenceResponse(output_tensors=[None])),
    (TypeError, lambda: pb_utils.Tensor(None, ARRAY)),
    (TypeError, lambda: pb_utils.Tensor("OUTPUT0", None)),
    (pb_utils.TritonModelException, lambda: pb_utils.Tensor.from_dlpack("OUTPUT0", None)),
    (pb_utils.TritonModelException, lambda: pb_utils.Tensor.from_dlpack("", None)),
    (TypeError, lambda: pb_utils.Logger.log("message", None)),
    (TypeError, lambda: pb_utils.Logger.log("message", 1)),
    (TypeError, lambda: pb_utils.Logger.log_info(None)),
]


class TritonPythonModel:
    def initialize(self, args):
        self.wrong = []
        for number, (expected, call) in enumerate(CASES):
            try:
                call()
            except expected:
                continue
            except Exception as exc:
                self.wrong.append(f"{number}: {type(exc).__name__}")
            else:
                self.wrong.append(f"{number}: nothing raised")
        pb_utils.Logger.log("level unspecified")
        pb_utils.Logger.log("a warning", pb_utils.Logger.WARNING)
        pb_utils.InferenceResponse(output_tensors=[])
        pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[])

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", value)
            responses.append(
                pb_utils.InferenceResponse([out], parameters={"wrong": ", ".join(self.wrong)})
            )
        return responses
""",
)

MODELS["error_code"] = (
    """
max_batch_size: 0
input [ { name: "ERROR_CODE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
""",
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "ERROR_CODE").as_numpy()[0]
            name = name.decode()
            code = getattr(pb_utils.TritonError, name)
            error = pb_utils.TritonError("error code: " + name, code)
            responses.append(pb_utils.InferenceResponse(error=error))
        return responses
""",
)

# Every second request fails (qa/python_models/execute_grpc_error).
MODELS["every_second_fails"] = (
    IDENTITY,
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.count = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.count += 1
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", value)
            error = None if self.count % 2 else pb_utils.TritonError("the second one fails")
            responses.append(pb_utils.InferenceResponse([out], error))
        return responses
""",
)

READINESS_MODEL = """
import asyncio
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]))
        return responses

{is_ready}
"""

READINESS = {
    "ready_true": "    def is_ready(self):\n        return True\n",
    "ready_false": "    def is_ready(self):\n        return False\n",
    "ready_raises": "    def is_ready(self):\n        raise RuntimeError('not today')\n",
    "ready_not_bool": "    def is_ready(self):\n        return 'yes'\n",
    "ready_coroutine": (
        "    async def is_ready(self):\n        await asyncio.sleep(0)\n        return True\n"
    ),
}
for _name, _source in READINESS.items():
    MODELS[_name] = (IDENTITY, READINESS_MODEL.format(is_ready=_source))


# qa/python_models/iterative_sequence: IN responses counting down, one per execution;
# the request is rescheduled until the last.
ITERATIVE = """
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { iterative_sequence: true }
instance_group [ { kind: KIND_CPU } ]
"""
MODELS["countdown"] = (
    ITERATIVE,
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.remaining = {}
        self.executions = 0

    def execute(self, requests):
        for request in requests:
            self.executions += 1
            key = request.correlation_id()
            if key not in self.remaining:
                value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                self.remaining[key] = int(value[0])
            self.remaining[key] -= 1
            left = self.remaining[key]
            out = pb_utils.Tensor("OUTPUT0", np.array([left], np.int32))
            response = pb_utils.InferenceResponse([out], parameters={"executions": self.executions})
            sender = request.get_response_sender()
            if left <= 0:
                del self.remaining[key]
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(response)
        return None
""",
)

# qa/python_models/request_rescheduling_addsub: the first request is rescheduled once.
RESCHEDULE_ONCE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.executions += 1
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", value * 10)
            response = pb_utils.InferenceResponse([out], parameters={"executions": self.executions})
            if self.executions == 1:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                response = {returned}
            responses.append(response)
        return responses
"""
ITERATIVE_NOT_DECOUPLED = IDENTITY + "sequence_batching { iterative_sequence: true }\n"
MODELS["reschedule_once"] = (ITERATIVE_NOT_DECOUPLED, RESCHEDULE_ONCE.replace("{returned}", "None"))
MODELS["reschedule_with_response"] = (
    ITERATIVE_NOT_DECOUPLED,
    RESCHEDULE_ONCE.replace("{returned}", "response"),
)
MODELS["reschedule_not_iterative"] = (IDENTITY, RESCHEDULE_ONCE.replace("{returned}", "None"))


# BLS as qa/python_models/bls checks it: an error issuing the request is prefixed
# as python_backend's request_executor.cc prefixes it; a decoupled response
# iterator iterated again starts from its first response.
MODELS["bls_caller"] = (
    IDENTITY,
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        missing = pb_utils.InferenceRequest(
            model_name="no_such_model", inputs=[], requested_output_names=[]
        ).exec()
        countdown = pb_utils.InferenceRequest(
            model_name="countdown",
            inputs=[pb_utils.Tensor("INPUT0", np.array([3], np.int32))],
            requested_output_names=["OUTPUT0"],
        ).exec(decoupled=True)
        first = next(countdown)
        rounds = [[int(first.output_tensors()[0].as_numpy()[0])]]
        rounds[0] += [int(r.output_tensors()[0].as_numpy()[0]) for r in countdown]
        for _ in range(2):
            rounds.append([int(r.output_tensors()[0].as_numpy()[0]) for r in countdown])
        parameters = {"missing": missing.error().message(), "rounds": repr(rounds)}
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", value)
            responses.append(pb_utils.InferenceResponse([out], parameters=parameters))
        return responses
""",
)


# BLS outside execute (qa bls_init_error) and from a forked process (qa bls
# test_multiprocess uses a fork Pool).
MODELS["bls_places"] = (
    IDENTITY,
    """
import multiprocessing

import numpy as np
import triton_python_backend_utils as pb_utils


def call_identity(value):
    request = pb_utils.InferenceRequest(
        model_name="identity",
        inputs=[pb_utils.Tensor("INPUT0", np.array([value], np.int32))],
        requested_output_names=["OUTPUT0"],
    )
    return int(request.exec().output_tensors()[0].as_numpy()[0])


class TritonPythonModel:
    def initialize(self, args):
        try:
            call_identity(1)
            self.in_initialize = "no error"
        except pb_utils.TritonModelException as exc:
            self.in_initialize = str(exc)

    def execute(self, requests):
        try:
            with multiprocessing.get_context("fork").Pool(2) as pool:
                in_child = repr(pool.map(call_identity, [1, 2]))
        except Exception as exc:
            in_child = f"{type(exc).__name__}: {exc}"
        parameters = {
            "in_initialize": self.in_initialize,
            "in_child": in_child,
            "here": call_identity(7),
        }
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", value)
            responses.append(pb_utils.InferenceResponse([out], parameters=parameters))
        return responses
""",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("python_qa")
    for name, (config, source) in MODELS.items():
        python_model(root, name, f'name: "{name}"\nbackend: "python"\n' + config, source)
    args = ["--log-verbose=1", "--strict-readiness=false", "--model-control-mode=explicit"]
    proc = ServerProcess(root, args=[*args, "--load-model=*"])
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


@pytest.fixture
def client(server):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    yield client
    client.close()


@pytest.fixture
def grpc_client(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


def echo(client, model: str, value: int):
    infer_input = httpclient.InferInput("INPUT0", [1], "INT32")
    infer_input.set_data_from_numpy(np.array([value], dtype=np.int32))
    return client.infer(model, [infer_input])


# -- sys.argv ------------------------------------------------------------------------


def test_a_model_sees_the_argv_of_an_embedded_interpreter(client):
    # pb_stub.cc main starts Python with no arguments: sys.argv == [''].
    assert echo(client, "identity", 1).get_response()["parameters"]["argv"] == "['']"


def test_a_stub_process_is_found_by_triton_s_stub_name(client):
    # qa/L0_backend_python/model_readiness finds stubs with
    # pgrep -f triton_python_backend_stub; Triton's command line ends with the
    # instance's name.
    pid = echo(client, "identity", 1).get_response()["parameters"]["pid"]
    arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"triton_python_backend_stub" in arguments
    assert arguments[-2:] == [b"identity_0_0", b""]


def test_unittest_main_in_a_model_parses_no_stub_arguments(client):
    assert echo(client, "unittest_main", 2).as_numpy("OUTPUT0").tolist() == [2]


def test_wrong_argument_types_raise_what_python_backend_raises(client):
    assert echo(client, "arguments", 1).get_response()["parameters"]["wrong"] == ""


# -- error codes ---------------------------------------------------------------------

# pb_utils.TritonError code -> (gRPC status, HTTP status): server
# src/grpc/grpc_utils.cc GrpcStatusUtil::CodeToStatus, src/http_server.cc
# HttpCodeFromError.
ERROR_CODES = {
    "UNKNOWN": ("StatusCode.UNKNOWN", "400"),
    "INTERNAL": ("StatusCode.INTERNAL", "500"),
    "NOT_FOUND": ("StatusCode.NOT_FOUND", "404"),
    "INVALID_ARG": ("StatusCode.INVALID_ARGUMENT", "400"),
    "UNAVAILABLE": ("StatusCode.UNAVAILABLE", "503"),
    "UNSUPPORTED": ("StatusCode.UNIMPLEMENTED", "501"),
    "ALREADY_EXISTS": ("StatusCode.ALREADY_EXISTS", "400"),
    "CANCELLED": ("StatusCode.CANCELLED", "400"),
}


def test_each_error_code_has_triton_s_grpc_and_http_status(client, grpc_client):
    seen = {}
    for name in ERROR_CODES:
        data = np.array([name.encode()], dtype=np.object_)
        grpc_input = grpcclient.InferInput("ERROR_CODE", [1], "BYTES")
        grpc_input.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException) as grpc_info:
            grpc_client.infer("error_code", [grpc_input])
        assert str(grpc_info.value) == f"[{ERROR_CODES[name][0]}] error code: {name}"
        http_input = httpclient.InferInput("ERROR_CODE", [1], "BYTES")
        http_input.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException) as http_info:
            client.infer("error_code", [http_input])
        seen[name] = (grpc_info.value.status(), http_info.value.status())
    assert seen == ERROR_CODES


# -- triton_grpc_error ---------------------------------------------------------------


class Stream:
    def __init__(self, server, headers=None) -> None:
        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        self.client.start_stream(
            callback=lambda result, error: self.results.put((result, error)), headers=headers
        )

    def send(self, model: str, value: int) -> None:
        infer_input = grpcclient.InferInput("INPUT0", [1], "INT32")
        infer_input.set_data_from_numpy(np.array([value], dtype=np.int32))
        self.client.async_stream_infer(model, [infer_input])

    def next(self, timeout: float = 60):
        return self.results.get(timeout=timeout)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def test_triton_grpc_error_ends_the_stream_with_the_model_s_status(server):
    stream = Stream(server, headers={"triton_grpc_error": "true"})
    try:
        stream.send("every_second_fails", 1)
        result, error = stream.next()
        assert error is None and result.as_numpy("OUTPUT0").tolist() == [1]
        stream.send("every_second_fails", 2)
        result, error = stream.next()
        assert result is None
        assert error.status() == "StatusCode.INTERNAL"
        assert "the second one fails" in error.message()
        # The stream is over: a later request gets no answer on it.
        try:
            stream.send("every_second_fails", 3)
        except InferenceServerException:
            pass  # the client saw the stream end
        else:
            with pytest.raises(queue.Empty):
                stream.next(timeout=2)
    finally:
        stream.close()


def test_errors_before_the_model_stay_responses_on_a_triton_grpc_error_stream(server):
    # Triton ends the stream only for errors the model answered; a request it
    # could not issue (an unknown model) is still answered on the stream.
    stream = Stream(server, headers={"triton_grpc_error": "true"})
    try:
        stream.send("no_such_model", 1)
        _, error = stream.next()
        assert "no_such_model" in error.message()
        stream.send("identity", 5)
        result, error = stream.next()
        assert error is None and result.as_numpy("OUTPUT0").tolist() == [5]
    finally:
        stream.close()


def test_without_the_header_a_model_error_is_one_response(server):
    stream = Stream(server)
    try:
        outcomes = []
        for value in range(4):
            stream.send("every_second_fails", value)
            result, error = stream.next()
            outcomes.append(error is None)
        assert sorted(outcomes) == [False, False, True, True]
    finally:
        stream.close()


# -- readiness -----------------------------------------------------------------------


def wait_for_log(server, text: str, count: int = 1, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while server.output().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{server.output()}"
        time.sleep(0.05)


def test_a_killed_stub_makes_the_model_not_ready_until_the_next_request(
    server, client, grpc_client
):
    pid = int(echo(client, "identity", 1).get_response()["parameters"]["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_for_log(server, "stub process failed")
    assert not client.is_model_ready("identity")
    assert not grpc_client.is_model_ready("identity")
    text = "Model 'identity' version 1 is not ready: Stub process 'identity_0_0' is not healthy."
    assert server.output().count(text) == 2
    # The next request fails with the reason and restarts the stub.
    with pytest.raises(InferenceServerException) as info:
        echo(client, "identity", 2)
    assert "Stub process 'identity_0_0' is not healthy" in str(info.value)
    assert info.value.status() == "500"
    result = echo(client, "identity", 3)
    assert result.as_numpy("OUTPUT0").tolist() == [3]
    assert int(result.get_response()["parameters"]["pid"]) != pid
    assert client.is_model_ready("identity") and grpc_client.is_model_ready("identity")


def test_with_strict_readiness_a_dead_stub_makes_the_server_not_ready(tmp_path):
    # core server.cc InferenceServer::IsReady: strict readiness also asks every
    # READY model's instances.
    python_model(
        tmp_path, "identity", 'name: "identity"\nbackend: "python"\n' + IDENTITY, IDENTITY_MODEL
    )
    with serving(tmp_path, args=["--log-verbose=1"]) as proc, http_client(proc) as client:
        grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.grpc_port}")
        try:
            assert client.is_server_ready() and grpc_client.is_server_ready()
            pid = int(echo(client, "identity", 1).get_response()["parameters"]["pid"])
            os.kill(pid, signal.SIGKILL)
            wait_for_log(proc, "stub process failed")
            assert not client.is_server_ready()
            assert not grpc_client.is_server_ready()
            assert "failed runtime readiness check during server readiness" in proc.output()
            with pytest.raises(InferenceServerException):
                echo(client, "identity", 2)  # fails, and restarts the stub
            assert echo(client, "identity", 3).as_numpy("OUTPUT0").tolist() == [3]
            assert client.is_server_ready() and grpc_client.is_server_ready()
        finally:
            grpc_client.close()


@pytest.mark.parametrize(
    ("model", "ready"),
    [
        ("ready_true", True),
        ("ready_false", False),
        ("ready_raises", False),
        ("ready_not_bool", False),
        ("ready_coroutine", True),
    ],
)
def test_is_ready_of_the_model_is_consulted(client, grpc_client, model, ready):
    for _ in range(2):
        assert client.is_model_ready(model) is ready
        assert grpc_client.is_model_ready(model) is ready
        # Whatever it says, the model serves (Triton routes by lifecycle state).
        assert echo(client, model, 4).as_numpy("OUTPUT0").tolist() == [4]


# -- loading -------------------------------------------------------------------------


def load_with_model_py(server, name: str):
    config = {
        "name": name,
        "backend": "python",
        "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [1]}],
    }
    source = base64.b64encode(IDENTITY_MODEL.encode()).decode()
    body = {"parameters": {"config": json.dumps(config), "file:/1/model.py": source}}
    return post(server, f"/v2/repository/models/{quote(name, safe='')}/load", body)


def test_a_file_override_with_a_leading_slash_is_in_the_model_directory(server, client):
    # core filesystem.cc JoinPath: 'file:/1/model.py' is <model dir>/1/model.py.
    status, reply = load_with_model_py(server, "from_files")
    assert status == 200, reply
    assert echo(client, "from_files", 6).as_numpy("OUTPUT0").tolist() == [6]


def test_a_file_override_escaping_the_model_directory_is_refused(server):
    config = json.dumps({"name": "escape", "backend": "python"})
    source = base64.b64encode(b"x").decode()
    body = {"parameters": {"config": config, "file:1/../../model.py": source}}
    status, reply = post(server, "/v2/repository/models/escape/load", body)
    # INTERNAL "failed to poll": Triton refuses it while localizing the override
    # (core model_repository_manager.cc LocalizeRepoAgent, from InitializeModelInfo).
    assert status == 500 and "must stay within model directory" in reply["error"], reply
    assert "failed to poll from model repository" in reply["error"], reply


@pytest.mark.parametrize("name", ["model;test", "model$test", "model\\test", "model!test"])
def test_a_python_model_named_with_shell_characters_is_refused(server, client, name):
    status, reply = load_with_model_py(server, name)
    assert status == 400, reply
    assert "Invalid stub name: contains invalid characters" in reply["error"], reply
    assert not client.is_model_ready(name)


# -- request rescheduling ------------------------------------------------------------


def test_an_iterative_sequence_executes_a_rescheduled_request_again(server):
    # qa/L0_backend_python/request_rescheduling grpc_endpoint_test: no correlation
    # id, one response per execution, the request rescheduled until the last.
    stream = Stream(server)
    try:
        for value in (3, 2):
            stream.send("countdown", value)
            got = []
            for _ in range(value):
                result, error = stream.next()
                assert error is None, error
                got.append(result.as_numpy("OUTPUT0").tolist()[0])
            assert got == list(range(value - 1, -1, -1))
    finally:
        stream.close()


def test_a_rescheduled_request_of_a_model_that_is_not_decoupled(client):
    result = echo(client, "reschedule_once", 4)
    assert result.as_numpy("OUTPUT0").tolist() == [40]
    assert result.get_response()["parameters"]["executions"] == 2
    assert echo(client, "reschedule_once", 5).get_response()["parameters"]["executions"] == 3


def test_a_rescheduled_request_must_return_none(client):
    with pytest.raises(InferenceServerException) as info:
        echo(client, "reschedule_with_response", 1)
    assert (
        "Expected a None object in the execute function return list for reschduled request"
        in str(info.value)
    )


def test_rescheduling_without_an_iterative_sequence_is_refused(client):
    with pytest.raises(InferenceServerException) as info:
        echo(client, "reschedule_not_iterative", 1)
    assert "while the model is not configured to handle such a flag" in str(info.value)
    assert echo(client, "reschedule_not_iterative", 2).as_numpy("OUTPUT0").tolist() == [20]


# -- BLS -----------------------------------------------------------------------------


def test_bls_issue_errors_and_response_iterators_as_python_backend(client):
    parameters = echo(client, "bls_caller", 1).get_response()["parameters"]
    assert parameters["missing"] == (
        "Model no_such_model - Error when running inference: "
        "Request for unknown model: 'no_such_model' is not found"
    )
    assert parameters["rounds"] == repr([[2, 1, 0]] * 3)


def test_bls_outside_execute_and_from_a_forked_process_fails_at_once(client):
    parameters = echo(client, "bls_places", 1).get_response()["parameters"]
    # python_backend's words (infer_request.cc InferRequest::Exec).
    assert parameters["in_initialize"] == "BLS is only supported during the 'execute' function."
    # A forked child gets an error instead of waiting forever; the stub still serves.
    assert "not available in a process forked from the stub" in parameters["in_child"]
    assert parameters["here"] == 7
