"""A stub's lane with a batch posted behind the one it runs (lane.py SLOTS,
PipelinedAsyncBackendInstance): queued requests reach a busy stub without it
sleeping in between, each gets its own answer, and a stub that dies with two
batches in flight fails both and is restarted."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.serverproc import free_port
from trionserve.backends.python import lane
from trionserve.backends.python.instance import PythonInstance
from trionserve.backends.python.lane import SLOTS
from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.server import Server, ServerOptions

CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters { key: "MARKER" value: { string_value: "%s" } }
"""

# Answers N after 20 ms; N == 2 takes 300 ms; N == 1 writes the stub's pid to the
# marker file and waits until killed.
MODEL = """
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
        time.sleep(0.3 if n[0] == 2 else 0.02)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("N", n.copy())])]
"""


@pytest.fixture
def repository(tmp_path):
    (tmp_path / "models" / "slow" / "1").mkdir(parents=True)
    (tmp_path / "models" / "slow" / "config.pbtxt").write_text(CONFIG % (tmp_path / "marker"))
    (tmp_path / "models" / "slow" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    return tmp_path


def request(n: int) -> InferenceRequest:
    return InferenceRequest("slow", inputs={"N": Tensor("N", "INT32", np.array([n], np.int32))})


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


@pytest.fixture
def in_flight(monkeypatch):
    """How many executes were unanswered as each went on the lane."""
    counts: list[int] = []
    post = PythonInstance._post

    def counted(self, channel, call_id, entries):
        posted = post(self, channel, call_id, entries)
        if posted:
            counts.append(len(self._calls))
        return posted

    monkeypatch.setattr(PythonInstance, "_post", counted)
    return counts


async def test_queued_requests_are_posted_behind_the_running_one(repository, in_flight):
    async with trio.open_nursery() as nursery:
        server = await start(nursery, repository)
        answers: dict[int, list[int]] = {}

        async def infer(n: int) -> None:
            response = await server.dataplane.infer(request(n))
            answers[n] = response.outputs[0].data.tolist()

        with trio.fail_after(30):
            async with trio.open_nursery() as clients:
                for n in range(3, 11):
                    clients.start_soon(infer, n)
        assert answers == {n: [n] for n in range(3, 11)}
        # Some went on the lane while the stub ran another, never more than its slots.
        assert max(in_flight) == SLOTS
        assert len(in_flight) == 8
        stats = (await server.dataplane.model_statistics("slow", None))["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 8
        assert stats["execution_count"] == 8
        instance = server.registry.route("slow", None)._executors[0].instance
        assert not instance._calls and not instance._open
        assert instance._stub.endpoint.arena.in_use() == 0
        server.shutdown()


async def test_a_stub_killed_with_a_batch_behind_the_running_one_fails_both(repository, in_flight):
    marker = repository / "marker"
    async with trio.open_nursery() as nursery:
        server = await start(nursery, repository)
        instance = server.registry.route("slow", None)._executors[0].instance
        outcomes: dict[int, object] = {}

        async def infer(n: int) -> None:
            try:
                outcomes[n] = (await server.dataplane.infer(request(n))).outputs[0].data.tolist()
            except TritonError as exc:
                outcomes[n] = exc

        # 2 runs 300 ms in its submitting task; 1 (which never returns) and 5
        # queue meanwhile: 1 is posted once 2 is answered, and 5 behind it.
        nursery.start_soon(infer, 2)
        await trio.sleep(0.05)
        nursery.start_soon(infer, 1)
        await trio.sleep(0.05)
        nursery.start_soon(infer, 5)
        with trio.fail_after(30):
            while not marker.exists() or not marker.read_text():
                await trio.sleep(0.01)
            while len(instance._calls) < 2:
                await trio.sleep(0.01)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        with trio.fail_after(30):
            while len(outcomes) < 3:
                await trio.sleep(0.01)
        assert outcomes[2] == [2]
        for n in (1, 5):
            error = outcomes[n]
            assert isinstance(error, TritonError)
            assert "was killed by signal SIGKILL while executing" in error.message
        assert max(in_flight) == 2
        with trio.fail_after(30):
            response = await server.dataplane.infer(request(7))  # a new stub
        assert response.outputs[0].data.tolist() == [7]
        server.shutdown()


async def test_a_reply_that_cannot_be_read_fails_its_stub_not_the_model(repository, monkeypatch):
    """A reply taken from the lane that does not decode (as a torn slot header
    gave, lane.py) fails its request and restarts the stub: the model keeps
    serving (it failed, and answered 503 'has no available versions')."""
    decode = lane.decode
    broken: list[bytes] = []

    def decode_once_broken(body: bytes) -> tuple:
        if not broken:  # the server's first reply (the stub decodes in its own process)
            broken.append(body)
            raise EOFError("EOF read where object expected")
        return decode(body)

    monkeypatch.setattr(lane, "decode", decode_once_broken)
    async with trio.open_nursery() as nursery:
        server = await start(nursery, repository)
        instance = server.registry.route("slow", None)._executors[0].instance
        first = instance.pid
        with trio.fail_after(30), pytest.raises(TritonError) as failed:
            await server.dataplane.infer(request(3))
        assert broken
        assert (
            f"Stub process 'slow_0' is not healthy: the stub process sent a reply that "
            f"could not be read (message 1 on the lane ({len(broken[0])} bytes): "
            "EOF read where object expected) and was killed"
        ) in failed.value.message
        with trio.fail_after(30):
            response = await server.dataplane.infer(request(4))  # a new stub
        assert response.outputs[0].data.tolist() == [4]
        assert instance.pid not in (None, first)
        assert server.registry.route("slow", None)._executors[0].instance is instance
        server.shutdown()


PID_CONFIG = """
name: "pids"
backend: "python"
max_batch_size: 0
instance_group [ { count: 2 kind: KIND_CPU } ]
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Answers with its stub's pid once the other instance has executed too, or with
# minus its pid after 10 s without: instances that do not run at once (a batch
# kept behind another on one stub while the other idles, or the instances
# serialised in the server) answer a negative pid.
PID_MODEL = """
import os
import tempfile
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        directory = os.path.join(tempfile.gettempdir(), "pids-" + str(os.getppid()))
        os.makedirs(directory, exist_ok=True)
        open(os.path.join(directory, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 10
        while len(os.listdir(directory)) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        seen = len(os.listdir(directory)) >= 2
        pid = np.array([os.getpid() if seen else -os.getpid()], np.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("N", pid)]) for _ in requests]
"""


async def test_queued_requests_reach_both_instances(tmp_path, in_flight):
    (tmp_path / "models" / "pids" / "1").mkdir(parents=True)
    (tmp_path / "models" / "pids" / "config.pbtxt").write_text(PID_CONFIG)
    (tmp_path / "models" / "pids" / "1" / "model.py").write_text(textwrap.dedent(PID_MODEL))
    async with trio.open_nursery() as nursery:
        server = await start(nursery, tmp_path)
        pids: list[int] = []

        async def infer() -> None:
            data = np.array([0], np.int32)
            req = InferenceRequest("pids", inputs={"N": Tensor("N", "INT32", data)})
            pids.append(int((await server.dataplane.infer(req)).outputs[0].data[0]))

        with trio.fail_after(60):
            async with trio.open_nursery() as clients:
                for _ in range(8):
                    clients.start_soon(infer)
        shutil.rmtree(Path(tempfile.gettempdir()) / f"pids-{os.getpid()}")
        stubs = {e.instance.pid for e in server.registry.route("pids", None)._executors}
        assert len(stubs) == 2 and set(pids) == stubs  # (all positive: both ran at once)
        server.shutdown()
