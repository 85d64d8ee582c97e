"""gRPC ModelInfer answers written by the instance's thread
(protocol/grpc/answer.py) with the real ``tritonclient.grpc`` client: small
answers come from the thread, large ones from the loop, on one connection call
after call and with calls concurrent; every call one outcome, the statistics
and in-flight counts exact, a drain that does not wait for a next call.
In-process server, real sockets, the blocking test backend."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import trio
import trio.testing
import tritonclient.grpc as grpcclient

from tests.blocking_backend import BACKENDS, GATE, repository_fixture, wait_entered
from tests.e2e.test_grpc_cancellation import in_thread
from tests.e2e.test_thread_answers import Writes
from tests.serverproc import free_port
from tests.unit.test_grpc_thread_answer import Client
from trionserve._generated import grpc_service_pb2 as pb
from trionserve.protocol.grpc.answer import CallAnswer
from trionserve.protocol.grpc.options import GrpcOptions
from trionserve.server import Server, ServerOptions

# Every execution goes straight through; the dynamic batcher can tell its instance's
# thread that nothing waits.
repository = repository_fixture(config="dynamic_batching { }", released=True)


@pytest.fixture
def writes(monkeypatch):
    """Each CallAnswer.write: (the thread's name, whether it wrote it whole);
    the client may have an answer before its write returns (``counted``)."""
    calls = Writes()
    real = CallAnswer.write

    def write(self, request, response):
        whole = real(self, request, response)
        calls.record(threading.current_thread().name, whole)
        return whole

    monkeypatch.setattr(CallAnswer, "write", write)
    return calls


def make_server(repository) -> Server:
    return Server(
        ServerOptions(
            model_repositories=[repository],
            allow_http=False,
            grpc_address="127.0.0.1",
            grpc_port=free_port(),
            grpc=GrpcOptions(),
            allow_metrics=False,
            exit_timeout_secs=20.0,
        ),
        backends=BACKENDS,
    )


def infer(client: grpcclient.InferenceServerClient, values: np.ndarray, request_id: str):
    tensor = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    result = client.infer("blocking", [tensor], request_id=request_id)
    return result.get_response().id, result.as_numpy("OUTPUT0")


def calls_in_turn(url: str, sizes: list[int]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    with grpcclient.InferenceServerClient(url) as client:
        out = []
        for index, size in enumerate(sizes):
            values = np.arange(size, dtype=np.float32).reshape(1, size) + index
            request_id, output = infer(client, values, f"r{index}")
            out.append((request_id, values, output))
        return out


def statistics(url: str) -> dict:
    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics("blocking", as_json=True)
    return stats["model_stats"][0]["inference_stats"]


async def test_small_answers_come_from_the_thread_and_large_ones_from_the_loop(repository, writes):
    server = make_server(repository)
    url = f"127.0.0.1:{server.options.grpc_port}"
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            # 64 B, 4 KB, 600 KB (past the client's frame size: the loop's), 4 KB
            sizes = [16, 1024, 150_000, 1024, 16, 16]
            answers = await in_thread(calls_in_turn, url, sizes)
            for index, (request_id, values, output) in enumerate(answers):
                assert request_id == f"r{index}"
                np.testing.assert_array_equal(output, values)
            await writes.counted(len(sizes))
            whole = [name.startswith("instance ") and done for name, done in writes]
            # (The first call may find the loop still writing the connection's
            # first frames, its SETTINGS ack: then it is the loop's too.)
            assert len(writes) == len(sizes) and whole[1:] == [True, False, True, True, True]
            stats = await in_thread(statistics, url)  # (its read sweeps the reports)
            assert int(stats["success"]["count"]) == len(sizes)
            model = server.dataplane.model("blocking", None)
            await model.idle.wait()
            assert model.inflight == 0
            server.shutdown()


async def test_concurrent_calls_each_get_their_own_answer(repository, writes):
    # Four clients calling in turn on connections of their own, and four
    # threads calling at once on one shared connection (the thread answers only
    # what its connection's state allows, the loop the rest): every call its
    # own answer, the counts exact.
    server = make_server(repository)
    url = f"127.0.0.1:{server.options.grpc_port}"

    def many(url: str) -> list:
        with grpcclient.InferenceServerClient(url) as shared, ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(calls_in_turn, url, [64 + n] * 10) for n in range(4)]
            singles = []
            for n in range(20):
                values = np.full((1, 32 + n), float(n), dtype=np.float32)
                singles.append((values, pool.submit(infer, shared, values, f"s{n}")))
            return [job.result() for job in jobs] + [
                [(job.result()[0], values, job.result()[1])] for values, job in singles
            ]

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            results = await in_thread(many, url)
            ids = []
            for answers in results:
                for request_id, values, output in answers:
                    ids.append(request_id)
                    np.testing.assert_array_equal(output, values)
            assert len(ids) == 60 and sorted(ids[40:]) == sorted(f"s{n}" for n in range(20))
            stats = await in_thread(statistics, url)
            assert int(stats["success"]["count"]) == 60
            model = server.dataplane.model("blocking", None)
            await model.idle.wait()
            assert model.inflight == 0
            server.shutdown()


async def test_a_drain_does_not_wait_for_the_clients_next_call(repository, writes):
    # The last answer's report waits for a sweep that nothing the client sends
    # brings (a plain h2 client: grpc core's sends a WINDOW_UPDATE and a PING
    # after each answer, which sweep): the gRPC transport's tick makes it, so
    # the model's in-flight count reaches 0 and a drain does not wait.
    GATE.reset()  # the execution waits for the test
    server = make_server(repository)
    values = np.ones((1, 8), dtype=np.float32)
    request = pb.ModelInferRequest(model_name="blocking", id="last")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 8])
    request.raw_input_contents.append(values.tobytes())
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", server.options.grpc_port))
            client = Client(sock)
            client.h2.initiate_connection()
            stream_id = await client.call(request.SerializeToString())
            await wait_entered()
            await trio.testing.wait_all_tasks_blocked()  # the call waits for its outcome
            GATE.release.set()
            await client.until(lambda: client.ended(stream_id))
            answer = pb.ModelInferResponse.FromString(client.answer(stream_id))
            assert client.status(stream_id) == b"0" and answer.id == "last"
            await writes.counted(1)
            assert [done for _, done in writes] == [True]
            model = server.dataplane.model("blocking", None)
            await model.idle.wait()  # swept without a next call
            assert model.statistics.success.count == 1
            server.shutdown()
            sock.close()
