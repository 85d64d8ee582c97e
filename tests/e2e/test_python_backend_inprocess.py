"""The Python backend inside an in-process server: decoupled responses through the
DataPlane, and a stub process killed from outside while it executes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import trio

from tests.serverproc import ServerProcess, free_port
from trionserve.backends.python.lane import Lane, decode
from trionserve.backends.python.process import TrioChannel
from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.server import Server, ServerOptions

STREAM_CONFIG = """
name: "stream"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Sends N responses from execute itself, then ends the stream; for N < 0 it sends
# one response and then an error.
STREAM_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(abs(n)):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("I", np.array([i], np.int32))]))
            if n < 0:
                error = pb_utils.TritonError("stream broke on purpose")
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

WAIT_CONFIG = """
name: "wait"
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters { key: "MARKER" value: { string_value: "%s" } }
"""

# Writes its pid to the marker file, then waits (for N == 1) until killed.
WAIT_MODEL = """
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = json.loads(args["model_config"])["parameters"]["MARKER"]["string_value"]

    def execute(self, requests):
        n = pb_utils.get_input_tensor_by_name(requests[0], "N").as_numpy()
        if n[0] == 1:
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("N", n.copy())])]
"""


BATCH_CONFIG = """
name: "batch"
backend: "python"
max_batch_size: 8
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 30000000 }
"""

# Answers each request with the number of requests its execute call received.
BATCH_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        size = np.array([[len(requests)]], np.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("N", size)]) for _ in requests]
"""


SPIN_CONFIG = """
name: "spin"
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters { key: "MARKER" value: { string_value: "%s" } }
"""

# In execute itself (the stub's main thread, which does not read the socket while
# it executes): writes "started" with its pid, then polls is_cancelled() and
# writes "seen" once it turned true.
SPIN_MODEL = """
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = json.loads(args["model_config"])["parameters"]["MARKER"]["string_value"]

    def execute(self, requests):
        with open(self.marker + ".started", "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not requests[0].is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.001)
        if requests[0].is_cancelled():
            with open(self.marker + ".seen", "w") as f:
                f.write("seen")
        n = pb_utils.get_input_tensor_by_name(requests[0], "N").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("N", n.copy())])]
"""


LONG_STREAM_CONFIG = """
name: "long_stream"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_UINT8 dims: [ -1 ] } ]
"""

# Sends N responses of 256 KiB from execute itself, one every 5 ms (a model
# producing them as it computes): 48 of them are 12 times the stub's 1 MiB arena.
LONG_STREAM_MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                data = np.full(256 * 1024, i % 256, np.uint8)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("I", data)]))
                time.sleep(0.005)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.fixture
def repository(tmp_path):
    for name, config, model in (
        ("stream", STREAM_CONFIG, STREAM_MODEL),
        ("wait", WAIT_CONFIG % (tmp_path / "marker"), WAIT_MODEL),
        ("batch", BATCH_CONFIG, BATCH_MODEL),
        ("spin", SPIN_CONFIG % (tmp_path / "spin"), SPIN_MODEL),
        ("long_stream", LONG_STREAM_CONFIG, LONG_STREAM_MODEL),
    ):
        (tmp_path / "models" / name / "1").mkdir(parents=True)
        (tmp_path / "models" / name / "config.pbtxt").write_text(config)
        (tmp_path / "models" / name / "1" / "model.py").write_text(textwrap.dedent(model))
    return tmp_path


def request(model: str, n: int) -> InferenceRequest:
    data = np.array([n], dtype=np.int32)
    return InferenceRequest(model, inputs={"N": Tensor("N", "INT32", data)})


async def start(nursery, repository) -> Server:
    options = ServerOptions(
        model_repositories=[repository / "models"],
        http_address="127.0.0.1",
        http_port=free_port(),
        allow_grpc=False,
        allow_metrics=False,
        exit_timeout_secs=20.0,
    )
    server = Server(options)
    await nursery.start(server.serve)
    return server


async def collect(server: Server, model: str, n: int) -> list:
    """The values received; asserts that only the last delivery is final (a last
    response and the final flag may arrive as one delivery or as two)."""
    received = []

    async def deliver(response, final: bool) -> None:
        value = None if response is None else int(response.outputs[0].data[0])
        received.append((value, final))

    await server.dataplane.infer_stream(request(model, n), deliver)
    finals = [final for _, final in received]
    assert finals[-1] and not any(finals[:-1])
    return [value for value, _ in received if value is not None]


async def test_decoupled_responses_stream_through_the_dataplane(repository):
    async with trio.open_nursery() as nursery:
        server = await start(nursery, repository)
        assert await collect(server, "stream", 3) == [0, 1, 2]
        assert await collect(server, "stream", 0) == []
        assert await collect(server, "stream", 50) == list(range(50))
        received = []

        async def deliver(response, final: bool) -> None:
            received.append(int(response.outputs[0].data[0]))

        with pytest.raises(TritonError, match="stream broke on purpose"):
            await server.dataplane.infer_stream(request("stream", -2), deliver)
        assert received == [0, 1]
        # Every request's input blocks went back to the server's arena.
        instance = server.registry.route("stream", None)._executors[0].instance
        assert instance._stub.endpoint.arena.in_use() == 0
        server.shutdown()


async def test_a_stub_killed_by_a_signal_fails_its_request_and_restarts(repository):
    marker = repository / "marker"
    async with trio.open_nursery() as nursery:
        server = await start(nursery, repository)
        outcome = {}

        async def infer() -> None:
            try:
                await server.dataplane.infer(request("wait", 1))
            except TritonError as exc:
                outcome["error"] = exc

        nursery.start_soon(infer)
        with trio.fail_after(30):
            while not marker.exists() or not marker.read_text():
                await trio.sleep(0.01)  # the stub writes its pid once it executes
        os.kill(int(marker.read_text()), signal.SIGKILL)
        with trio.fail_after(30):
            while "error" not in outcome:
                await trio.sleep(0.01)
        assert "instance 'wait_0'" in outcome["error"].message
        assert "was killed by signal SIGKILL while executing" in outcome["error"].message
        response = await server.dataplane.infer(request("wait", 5))
        assert response.outputs[0].data.tolist() == [5]
        server.shutdown()


async def test_a_dynamic_batch_crosses_to_the_stub_in_one_message(repository, monkeypatch):
    executes = []  # the number of requests in each execute, on the lane or the socket
    on_socket = TrioChannel.send
    on_lane = Lane.post

    async def send(channel, message: dict) -> None:
        if message["op"] == "execute":
            executes.append(len(message["requests"]))
        await on_socket(channel, message)

    def post(lane, body: bytes) -> bool:  # the server's posts: stubs are processes
        posted = on_lane(lane, body)
        if posted:
            executes.append(len(decode(body)[3]))
        return posted

    monkeypatch.setattr(TrioChannel, "send", send)
    monkeypatch.setattr(Lane, "post", post)
    async with trio.open_nursery() as nursery:
        server = await start(nursery, repository)
        sizes = []

        async def infer(n: int) -> None:
            data = np.array([[n]], dtype=np.int32)
            batched = InferenceRequest("batch", inputs={"N": Tensor("N", "INT32", data)})
            response = await server.dataplane.infer(batched)
            sizes.append(int(response.outputs[0].data[0][0]))

        with trio.fail_after(20):
            async with trio.open_nursery() as clients:
                for n in range(4):
                    clients.start_soon(infer, n)
        assert sizes == [4, 4, 4, 4]
        assert executes == [4]
        server.shutdown()


async def test_a_cancel_reaches_a_model_polling_in_execute(repository):
    started, seen = repository / "spin.started", repository / "spin.seen"
    async with trio.open_nursery() as nursery:
        server = await start(nursery, repository)
        scope = trio.CancelScope()

        async def infer() -> None:
            with scope:
                await server.dataplane.infer(request("spin", 1))

        nursery.start_soon(infer)
        with trio.fail_after(30):
            while not started.exists():
                await trio.sleep(0.01)  # the model is in execute
        scope.cancel()
        with trio.fail_after(30):
            while not seen.exists():
                await trio.sleep(0.01)
        server.shutdown()


def test_a_stub_busy_in_execute_ends_when_its_server_is_killed(repository):
    started = repository / "marker"  # the wait model sleeps in execute, reading nothing
    server = ServerProcess(repository / "models")
    try:
        server.wait_ready()
        infer = subprocess.Popen(
            [sys.executable, "-c", CLIENT % server.http_url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not started.exists() or not started.read_text():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.01)  # the model is in execute
        stub = int(started.read_text())
        server.kill()
        deadline = time.monotonic() + 30
        while _alive(stub):
            assert time.monotonic() < deadline, "the stub outlived its server"
            time.sleep(0.01)
        infer.kill()
        infer.wait()
    finally:
        server.close()


CLIENT = """
import numpy as np, tritonclient.http as httpclient
client = httpclient.InferenceServerClient("%s", network_timeout=120)
n = httpclient.InferInput("N", [1], "INT32")
n.set_data_from_numpy(np.array([1], np.int32))
client.infer("wait", [n])
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_model_streaming_from_execute_reuses_its_shared_memory(repository):
    async with trio.open_nursery() as nursery:
        server = await start(nursery, repository)
        received = []

        async def deliver(response, final: bool) -> None:
            if response is not None:
                received.append(int(response.outputs[0].data[0]))

        await server.dataplane.infer_stream(request("long_stream", 48), deliver)
        assert received == [i % 256 for i in range(48)]
        # The stub read the server's frees while it streamed, so its arena did
        # not grow to hold all 12 MiB (a segment per MiB) before execute returned.
        instance = server.registry.route("long_stream", None)._executors[0].instance
        assert len(instance._stub.endpoint.view._maps) <= 6
        server.shutdown()
