"""Python backend behaviour as Triton's python_backend defines it (issue 17, items 1-6).

Real server, real ``tritonclient``, upstream-style ``model.py`` files: BLS with names
given as ``bytes``; the response sender's rules on models that are not decoupled;
decoupled BLS (cancel, the trailing empty final response, overlapping
``async_exec``); a client's cancellation reaching a model at once; Triton's error
wording. Every wait on the models' side is an event with a bound, never a sleep
used as synchronization.
"""

from __future__ import annotations

import queue
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.test_python_backend import ECHO, i32_inputs
from tests.e2e.test_python_backend import MODELS as BASE_MODELS
from tests.repository import python_model
from tests.serverproc import EXAMPLES, ServerProcess

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)

DECOUPLED_ECHO = """
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

MODELS: dict[str, tuple[str, str]] = {
    name: BASE_MODELS[name] for name in ("add_sub", "repeat", "crash")
}

# python_backend's examples/bls: the model to call is named by a BYTES tensor.
MODELS["bls_bytes"] = (
    """
max_batch_size: 8
input [
  { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { kind: KIND_CPU } ]
""",
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0][0]
            assert isinstance(name, bytes), type(name)
            if not pb_utils.is_model_ready(name):
                raise pb_utils.TritonModelException(f"{name!r} is not ready")
            call = pb_utils.InferenceRequest(
                model_name=name,
                requested_output_names=[b"OUTPUT0", "OUTPUT1"],
                inputs=[
                    pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                    pb_utils.get_input_tensor_by_name(request, "INPUT1"),
                ],
                request_id=b"called-by-bytes",
            )
            response = call.exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            out0 = pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()
            out1 = pb_utils.get_output_tensor_by_name(response, "OUTPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor(b"OUTPUT0", out0), pb_utils.Tensor("OUTPUT1", out1),
            ]))
        return responses
""",
)

# Not decoupled; what it does with its response sender depends on INPUT0.
MODELS["sender_rules"] = (
    ECHO,
    """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def answer(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([value], np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.parked = None
        self.parked_ready = threading.Event()

    def execute(self, requests):
        (request,) = requests
        value = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
        sender = request.get_response_sender()
        if value == 0:
            # Answered later, from another thread, once request 1 came.
            self.parked = sender
            self.parked_ready.set()
            return None
        if value == 1:
            threading.Thread(target=self.answer_parked).start()
            return [answer(1)]
        if value == 2:
            sender.send(answer(2))
            sender.send(answer(99), FINAL)  # raises: one response only
            return None
        if value == 3:
            # The final flag without a response, from a thread after execute returned.
            threading.Thread(target=self.final_only, args=(sender,)).start()
            return None
        if value == 6:
            raise ValueError("six is not served")
        return [answer(value)]

    def answer_parked(self):
        if self.parked_ready.wait(30):
            self.parked.send(answer(0), FINAL)

    def final_only(self, sender):
        try:
            sender.send(flags=FINAL)
        except pb_utils.TritonModelException as exc:
            pb_utils.Logger.log_info(f"sender_rules refused: {exc}")
""",
)

# Decoupled: one response, then it waits for the cancellation and ends with CANCELLED.
MODELS["cancel_child"] = (
    DECOUPLED_ECHO,
    """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.respond, args=(request,)).start()
        return None

    def respond(self, request):
        sender = request.get_response_sender()
        sender.send(pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUTPUT0", np.array([1], np.int32))]))
        deadline = time.monotonic() + 30
        while not request.is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.005)
        if request.is_cancelled():
            error = pb_utils.TritonError("cancelled by the caller", pb_utils.TritonError.CANCELLED)
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        else:
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", np.array([-1], np.int32))]), flags=FINAL)
""",
)

# BLS: cancel cancel_child's request after its first response.
MODELS["bls_cancel"] = (
    """
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 3 ] } ]
instance_group [ { kind: KIND_CPU } ]
""",
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="cancel_child", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
            )
            iterator = call.exec(decoupled=True)
            first = next(iterator)
            iterator.cancel()
            rest = list(iterator)
            last_error = rest[-1].error() if rest and rest[-1].has_error() else None
            value = int(pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()[0])
            summary = [value, 1 + len(rest), last_error.code() if last_error else 0]
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", np.array(summary, np.int32))]))
        return responses
""",
)

# BLS over `repeat` many times: how many responses each iterator gave, and
# whether the last was the empty final response.
MODELS["bls_count"] = (
    """
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "COUNTS" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU } ]
""",
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            counts = []
            for _ in range(30):
                call = pb_utils.InferenceRequest(
                    model_name="repeat", requested_output_names=["OUT"],
                    inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
                )
                received = list(call.exec(decoupled=True))
                empty_last = not received[-1].output_tensors()
                counts.append(len(received) if empty_last else -len(received))
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("COUNTS", np.array(counts, np.int32))]))
        return responses
""",
)

# Decoupled: each request answers once three of them are in the model at once.
MODELS["barrier_child"] = (
    DECOUPLED_ECHO,
    """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.barrier = threading.Barrier(3, timeout=20)

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.respond, args=(request,)).start()
        return None

    def respond(self, request):
        sender = request.get_response_sender()
        pb_utils.Logger.log_info("barrier_child: waiting")
        try:
            self.barrier.wait()
            value = 1
        except threading.BrokenBarrierError:
            value = 0
        sender.send(pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUTPUT0", np.array([value], np.int32))]), flags=FINAL)
""",
)

# async execute: three decoupled BLS calls at once (they only finish together).
MODELS["bls_gather"] = (
    ECHO,
    """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            calls = [
                pb_utils.InferenceRequest(
                    model_name="barrier_child", requested_output_names=["OUTPUT0"],
                    inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
                ).async_exec(decoupled=True)
                for _ in range(3)
            ]
            iterators = await asyncio.gather(*calls)
            total = 0
            for iterator in iterators:
                for response in iterator:
                    out = pb_utils.get_output_tensor_by_name(response, "OUTPUT0")
                    if out is not None:
                        total += int(out.as_numpy()[0])
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", np.array([total], np.int32))]))
        return responses
""",
)

# Decoupled async execute: one decoupled BLS call per request, iterated as
# upstream's models do (synchronously, in the coroutine).
MODELS["bls_async_stream"] = (
    DECOUPLED_ECHO,
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="barrier_child", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
            )
            iterator = await call.async_exec(decoupled=True)
            sender = request.get_response_sender()
            for response in iterator:
                out = pb_utils.get_output_tensor_by_name(response, "OUTPUT0")
                if out is not None:
                    sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
""",
)

# Decoupled: INPUT0 0 polls is_cancelled() before any response; 2 answers once a
# poller runs; 1 answers 1 once a poller saw its cancellation (0 after 20 s).
MODELS["poll_cancel"] = (
    DECOUPLED_ECHO,
    """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def answer(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([value], np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.polling = threading.Event()
        self.seen = threading.Event()

    def execute(self, requests):
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            target = {0: self.poll, 1: self.report, 2: self.report_polling}[value]
            threading.Thread(target=target, args=(request,)).start()
        return None

    def poll(self, request):
        self.polling.set()
        deadline = time.monotonic() + 30
        while not request.is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.005)
        if request.is_cancelled():
            self.seen.set()
        error = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
        request.get_response_sender().send(pb_utils.InferenceResponse(error=error), FINAL)

    def report_polling(self, request):
        polling = self.polling.wait(20)
        request.get_response_sender().send(answer(int(polling)), FINAL)

    def report(self, request):
        seen = self.seen.wait(20)
        request.get_response_sender().send(answer(int(seen)), FINAL)
""",
)

# Decoupled async execute that raises after its final response.
MODELS["raise_after_final"] = (
    DECOUPLED_ECHO,
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            request.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        raise RuntimeError("raised after the final response")
""",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("parity_models")
    shutil.copytree(EXAMPLES / "simple", root / "simple")
    for name, (config, source) in MODELS.items():
        python_model(root, name, f'name: "{name}"\nbackend: "python"\n' + config, source)
    proc = ServerProcess(root, args=["--exit-on-error=false"])
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


class Stream:
    """A gRPC stream whose results (or errors) are read in order."""

    def __init__(self, server) -> None:
        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, model: str, value: int, **kwargs) -> None:
        infer_input = grpcclient.InferInput("INPUT0", [1], "INT32")
        infer_input.set_data_from_numpy(np.array([value], dtype=np.int32))
        self.client.async_stream_infer(model, [infer_input], **kwargs)

    def next(self, timeout: float = 60):
        return self.results.get(timeout=timeout)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def echo(client, model: str, value: int):
    infer_input = httpclient.InferInput("INPUT0", [1], "INT32")
    infer_input.set_data_from_numpy(np.array([value], dtype=np.int32))
    return client.infer(model, [infer_input]).as_numpy("OUTPUT0").tolist()


def wait_for_log(server, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while text not in server.output():
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{server.output()}"
        time.sleep(0.05)
    return server.output()


# -- 1. names given as bytes -------------------------------------------------------------


def test_bls_takes_the_model_name_as_bytes(client):
    name = httpclient.InferInput("MODEL_NAME", [1, 1], "BYTES")
    name.set_data_from_numpy(np.array([[b"add_sub"]], dtype=np.object_))
    result = client.infer("bls_bytes", [name, *i32_inputs(A, B)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


# -- 2. the response sender of a model that is not decoupled -----------------------------


def test_one_response_sent_later_from_another_thread(client, server):
    other = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    try:
        with ThreadPoolExecutor(1) as pool:
            parked = pool.submit(echo, other, "sender_rules", 0)
            assert echo(client, "sender_rules", 1) == [1]
            assert parked.result(timeout=60) == [0]
    finally:
        other.close()


def test_a_second_response_is_refused_and_the_first_stands(client):
    assert echo(client, "sender_rules", 2) == [2]


def test_a_final_flag_without_a_response_fails_the_request(client, server):
    with pytest.raises(InferenceServerException) as info:
        echo(client, "sender_rules", 3)
    assert "Non-decoupled model cannot send complete final before sending a response" in (
        str(info.value)
    )
    wait_for_log(server, "sender_rules refused: Unable to send response.")


def test_sender_rules_over_a_grpc_stream(server):
    stream = Stream(server)
    try:
        for value in (2, 3, 7):
            stream.send("sender_rules", value)
        outcomes = []
        for _ in range(3):
            result, error = stream.next()
            outcomes.append(
                str(error) if error is not None else result.as_numpy("OUTPUT0").tolist()
            )
        assert outcomes[0] == [2]
        assert "cannot send complete final before sending a response" in outcomes[1]
        assert outcomes[2] == [7]  # nothing else came for the first two
    finally:
        stream.close()


# -- 3. decoupled BLS ------------------------------------------------------------------------


def test_response_iterator_cancel_cancels_the_called_request(client):
    # [first value, responses received, code of the last one's error]
    assert echo(client, "bls_cancel", 5) == [1, 2, 7]  # 7: TritonError.CANCELLED


def test_the_empty_final_response_always_reaches_the_iterator(client):
    infer_input = httpclient.InferInput("IN", [3], "INT32")
    infer_input.set_data_from_numpy(np.array([4, 5, 6], dtype=np.int32))
    counts = client.infer("bls_count", [infer_input]).as_numpy("COUNTS").tolist()
    assert counts == [4] * 30  # three responses and the empty final one, every time


def test_async_exec_of_decoupled_calls_overlap(client, server):
    assert echo(client, "bls_gather", 1) == [3]
    # Three requests, three executes of an async decoupled model: the later ones'
    # BLS calls are made while the first waits for its first response
    # (barrier_child answers all three at once).
    stream = Stream(server)
    try:
        waiting = server.output().count("barrier_child: waiting")
        stream.send("bls_async_stream", 1)
        # The first call waits in barrier_child before the other two are sent.
        deadline = time.monotonic() + 30
        while server.output().count("barrier_child: waiting") == waiting:
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        stream.send("bls_async_stream", 1)
        stream.send("bls_async_stream", 1)
        for _ in range(3):
            result, error = stream.next()
            assert error is None, error
            assert result.as_numpy("OUTPUT0").tolist() == [1]
    finally:
        stream.close()


# -- 4. cancellation reaches the model at once -------------------------------------------------


def test_a_client_cancel_reaches_a_model_that_has_not_responded(server):
    poller, observer = Stream(server), Stream(server)
    try:
        poller.send("poll_cancel", 0)
        observer.send("poll_cancel", 2)
        result, error = observer.next()
        assert error is None and result.as_numpy("OUTPUT0").tolist() == [1]
        poller.close(cancel=True)
        observer.send("poll_cancel", 1)
        result, error = observer.next()
        assert error is None, error
        assert result.as_numpy("OUTPUT0").tolist() == [1], "the model never saw the cancel"
    finally:
        observer.close()


# -- 6. Triton's wording ------------------------------------------------------------------


def test_an_exception_after_the_final_response_is_logged(server):
    stream = Stream(server)
    try:
        stream.send("raise_after_final", 4)
        result, error = stream.next()
        assert error is None and result.as_numpy("OUTPUT0").tolist() == [4]
    finally:
        stream.close()
    output = wait_for_log(server, "raised after the final response")
    assert "RuntimeError" in output


def test_execute_errors_name_the_model_instance_as_triton_does(client, server):
    with pytest.raises(InferenceServerException) as info:
        echo(client, "sender_rules", 6)
    assert str(info.value.message()).startswith(
        "Failed to process the request(s) for model 'sender_rules_0_0', message: "
    ), info.value.message()
    assert "six is not served" in info.value.message()
    wait_for_log(server, "six is not served")  # and logged, as Triton's stub does
    with pytest.raises(InferenceServerException) as info:
        echo(client, "crash", 1)
    assert info.value.message().startswith(
        "Failed to process the request(s) for model instance 'crash_0_0', message: "
        "Stub process 'crash_0_0' is not healthy"
    ), info.value.message()


# -- 5. shutdown with open requests and stuck stubs --------------------------------------

# Decoupled: holds its request open for ever (never sends the final flag).
HOLD_OPEN = """
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.held = []

    def execute(self, requests):
        self.held.extend(requests)
        pb_utils.Logger.log_info("hold_open: holding a request")
        return None

    def finalize(self):
        threading.Event().wait()
"""

# Never returns from execute, and never finalizes.
STUCK = """
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        pb_utils.Logger.log_info("stuck: in execute")
        threading.Event().wait()

    def finalize(self):
        threading.Event().wait()
"""


def test_shutdown_honours_the_exit_timeout_with_open_requests_and_stuck_stubs(tmp_path):
    for name, config, source in (
        ("hold_open", DECOUPLED_ECHO, HOLD_OPEN),
        ("stuck", ECHO, STUCK),
    ):
        python_model(tmp_path, name, f'name: "{name}"\nbackend: "python"\n' + config, source)
    proc = ServerProcess(tmp_path, args=["--exit-timeout-secs=2"])
    stream = None
    try:
        proc.wait_ready()
        stream = Stream(proc)
        stream.send("hold_open", 1)
        stream.send("stuck", 1)
        wait_for_log(proc, "hold_open: holding a request")
        wait_for_log(proc, "stuck: in execute")
        # hold_open's finalize never returns: the stub timeout (30 s) would hold
        # the process well past the exit timeout (2 s).
        assert proc.stop(timeout=20) == 1, proc.output()
        assert "Exit timeout expired" in proc.output()
    finally:
        if stream is not None:
            stream.close()
        proc.close()
