"""The in-process API (trionserve.api): no sockets, except the one test that
attaches the HTTP, gRPC and metrics frontends to a running in-process server."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import queue
import shutil
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.repository import python_model
from trionserve import api

try:
    import cupy
except ImportError:
    cupy = None
from trionserve.actors.watcher import ControlMode
from trionserve.protocol.http.frontend import HttpOptions
from trionserve.server import ServerOptions

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_repository"

STREAM_CONFIG = """
name: "stream"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# N responses, then the final flag alone; for N < 0, one response and an error.
STREAM_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(max(n, 1) if n < 0 else n):
                out = pb_utils.Tensor("I", np.array([i], np.int32))
                sender.send(pb_utils.InferenceResponse([out]))
            if n < 0:
                error = pb_utils.TritonError("stream broke on purpose")
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

GATED_CONFIG = """
name: "gated"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "GATE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Sends 0, then waits for the file named by GATE (then sends 1) or for the
# request's cancellation; then ends the stream.
GATED_MODEL = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            gate = pb_utils.get_input_tensor_by_name(request, "GATE").as_numpy()[0].decode()
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("I", np.array([0], np.int32))]))
            deadline = time.monotonic() + 60
            while not os.path.exists(gate) and not sender.is_cancelled():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            if os.path.exists(gate):
                out = pb_utils.Tensor("I", np.array([1], np.int32))
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """simple (ONNX), add_sub_python, identity_bytes, identity_fp32 from the
    examples; stream and gated (decoupled Python models)."""
    root = tmp_path_factory.mktemp("api") / "models"
    root.mkdir()
    for name in ("simple", "add_sub_python", "identity_bytes", "identity_fp32", "accumulate"):
        shutil.copytree(EXAMPLES / name, root / name)
    python_model(root, "stream", STREAM_CONFIG, STREAM_MODEL)
    python_model(root, "gated", GATED_CONFIG, GATED_MODEL)
    return root


@pytest.fixture(scope="module")
def server(repository):
    """One blocking in-process server for the module (EXPLICIT: identity_fp32 is
    left for the load/unload test)."""
    options = api.Options(
        model_repository=repository,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        startup_models=[
            "simple",
            "add_sub_python",
            "identity_bytes",
            "accumulate",
            "stream",
            "gated",
        ],
        exit_timeout=20,
    )
    with api.Server(options) as server:
        yield server
    assert server.exit_code == 0


def pair(n: int = 1) -> tuple[np.ndarray, np.ndarray]:
    a = np.arange(16 * n, dtype=np.int32).reshape(n, 16)
    return a, np.full((n, 16), 3, dtype=np.int32)


def only(responses) -> api.InferenceResponse:
    responses = list(responses)
    assert len(responses) == 1 and responses[0].final
    return responses[0]


def trionserve_threads() -> set[threading.Thread]:
    """The threads running in-process cores (the module's server's among them)."""
    return {t for t in threading.enumerate() if t.name == "trionserve-core"}


def child_pids() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # a thread that just ended
            continue
        pids.update(int(pid) for pid in children)
    return pids


# -- inference ----------------------------------------------------------------


def test_onnx_model_answers_numpy(server):
    a, b = pair(2)
    response = only(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}))
    np.testing.assert_array_equal(response.outputs["OUTPUT0"], a + b)
    np.testing.assert_array_equal(response.outputs["OUTPUT1"], a - b)
    assert np.from_dlpack(response.outputs["OUTPUT0"]).dtype == np.int32
    assert (response.model.name, response.model.version) == ("simple", 1)


def test_request_object_and_fields(server):
    model = server.model("simple", 1)
    a, b = pair()
    request = model.create_request(inputs={"INPUT0": a, "INPUT1": b}, request_id="r-7")
    response = only(model.infer(request))
    assert response.request_id == "r-7"
    np.testing.assert_array_equal(response.outputs["OUTPUT0"], a + b)


def test_dlpack_and_list_inputs(server):
    import torch

    a, b = pair()
    inputs = {"INPUT0": torch.from_numpy(a.copy()), "INPUT1": b}
    response = only(server.model("simple").infer(inputs=inputs))
    np.testing.assert_array_equal(response.outputs["OUTPUT0"], a + b)
    response = only(server.model("identity_bytes").infer(inputs={"INPUT0": [["x", "yz"]]}))
    assert response.outputs["OUTPUT0"].to_bytes_array().tolist() == [[b"x", b"yz"]]
    # A list of ints is INT64, as numpy makes it (and Triton's package): refused by
    # an INT32 model with the datatypes named.
    with pytest.raises(api.InvalidArgumentError, match="'INT64'.*expects 'INT32'"):
        list(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b.tolist()}))


def test_python_backend_model(server):
    a, b = pair(3)
    response = only(server.model("add_sub_python").infer(inputs={"INPUT0": a, "INPUT1": b}))
    np.testing.assert_array_equal(response.outputs["OUTPUT1"], a - b)


def test_bytes_tensors_from_str_and_bytes(server):
    model = server.model("identity_bytes")
    for values in (np.array([["hé", "x"]]), np.array([[b"a\x00b", b""]], dtype=object)):
        response = only(model.infer(inputs={"INPUT0": values}))
        out = response.outputs["OUTPUT0"].to_bytes_array()
        assert out.dtype == object
        expected = [v.encode() if isinstance(v, str) else v for v in values.reshape(-1)]
        assert list(out.reshape(-1)) == expected


def test_decoupled_model_streams(server):
    model = server.model("stream")
    responses = list(model.infer(inputs={"N": np.array([4], np.int32)}))
    # Four responses, then the final flag alone: an empty final response (Triton's).
    assert [int(np.from_dlpack(r.outputs["I"])[0]) for r in responses[:4]] == [0, 1, 2, 3]
    assert [r.final for r in responses] == [False] * 4 + [True]
    assert responses[-1].outputs == {}


def test_decoupled_error_raises_or_is_returned(server):
    model = server.model("stream")
    iterator = model.infer(inputs={"N": np.array([-1], np.int32)})
    assert int(np.from_dlpack(next(iterator).outputs["I"])[0]) == 0
    with pytest.raises(api.TritonError, match="stream broke on purpose"):
        next(iterator)
    responses = list(model.infer(inputs={"N": np.array([-1], np.int32)}, raise_on_error=False))
    assert len(responses) == 2
    assert responses[-1].final and "stream broke on purpose" in str(responses[-1].error)


@pytest.mark.timeout(40)  # the gated model gives up waiting after 60 s
def test_cancel_ends_a_streaming_request(server, tmp_path):
    model = server.model("gated")
    gate = tmp_path / "never"
    iterator = model.infer(inputs={"GATE": np.array([str(gate)])})
    assert int(np.from_dlpack(next(iterator).outputs["I"])[0]) == 0
    iterator.cancel()
    with pytest.raises(api.CancelledError):
        next(iterator)
    # The model saw the cancellation and is free again: the next request runs.
    gate.write_text("open")
    responses = list(model.infer(inputs={"GATE": np.array([str(gate)])}))
    assert [int(np.from_dlpack(r.outputs["I"])[0]) for r in responses[:2]] == [0, 1]


def test_sequence_with_correlation_id_and_flags(server):
    model = server.model("accumulate")
    start, end = api.RequestFlag.SEQUENCE_START, api.RequestFlag.SEQUENCE_END
    sums = []
    for value, flags in ((3, start), (4, 0), (5, end)):
        response = only(
            model.infer(
                inputs={"INPUT": np.array([[value]], np.int32)}, correlation_id=41, flags=flags
            )
        )
        sums.append(int(np.from_dlpack(response.outputs["OUTPUT"])[0, 0]))
    assert sums == [3, 7, 12]


def test_threads_call_at_once(server):
    """Many threads share the core: every answer is the right one."""
    failures = []

    def work(offset: int) -> None:
        model = server.model("simple")
        for i in range(20):
            a = np.full((1, 16), offset * 100 + i, np.int32)
            b = np.ones((1, 16), np.int32)
            out = only(model.infer(inputs={"INPUT0": a, "INPUT1": b})).outputs["OUTPUT0"]
            if not np.array_equal(out, a + b):
                failures.append((offset, i))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == [] and not any(t.is_alive() for t in threads)


def test_asyncio_async_infer(server, tmp_path):
    """Triton's async_infer, for asyncio code: streams, raises, and a cancelled
    asyncio task cancels its request."""

    async def main() -> None:
        stream = server.model("stream").async_infer(inputs={"N": np.array([3], np.int32)})
        responses = [r async for r in stream]
        assert [int(np.from_dlpack(r.outputs["I"])[0]) for r in responses[:3]] == [0, 1, 2]
        assert responses[-1].final
        with pytest.raises(api.NotFoundError):
            await server.model("nope").async_infer(inputs={}).__anext__()
        gate = tmp_path / "gate"
        gated = server.model("gated")
        iterator = gated.async_infer(inputs={"GATE": np.array([str(gate)])})
        assert int(np.from_dlpack((await iterator.__anext__()).outputs["I"])[0]) == 0
        waiting = asyncio.ensure_future(iterator.__anext__())
        await asyncio.sleep(0)  # one loop turn: the task now waits for the model
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # The model saw the cancellation and takes the next request.
        gate.write_text("open")
        follow_up = gated.async_infer(inputs={"GATE": np.array([str(gate)])})
        # Within the gated model's own 60 s: it was not left waiting.
        rest = await asyncio.wait_for(_collect(follow_up), 40)
        assert [int(np.from_dlpack(r.outputs["I"])[0]) for r in rest[:2]] == [0, 1]

    asyncio.run(main())


async def _collect(responses) -> list:
    return [r async for r in responses]


# -- errors -------------------------------------------------------------------------


def test_errors_carry_triton_exception_types(server):
    a, b = pair()
    with pytest.raises(api.NotFoundError, match="nope"):
        list(server.model("nope").infer(inputs={"INPUT0": a}))
    with pytest.raises(api.InvalidArgumentError, match="INPUT1"):
        list(server.model("simple").infer(inputs={"INPUT0": a}))
    with pytest.raises(api.InvalidArgumentError, match="INPUT0"):
        list(server.model("simple").infer(inputs={"INPUT0": a.astype(np.float32), "INPUT1": b}))
    with pytest.raises(api.InvalidArgumentError, match="shape"):
        list(server.model("simple").infer(inputs={"INPUT0": a[:, :8], "INPUT1": b[:, :8]}))
    with pytest.raises(api.InvalidArgumentError, match="element 0 is int"):
        server.model("identity_bytes").infer(inputs={"INPUT0": np.array([[1]], dtype=object)})
    with pytest.raises(api.InvalidArgumentError, match="reserved"):
        server.model("simple").infer(inputs={}, parameters={"triton_x": 1})
    with pytest.raises(api.InvalidArgumentError, match="model version"):
        server.model("simple", 0)
    with pytest.raises(api.NotFoundError):
        server.model("nope").metadata()
    assert isinstance(api.UnavailableError("x"), api.TritonError)
    # The server is unharmed.
    only(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}))


def test_raise_on_error_false_returns_the_error(server):
    (response,) = list(server.model("nope").infer(inputs={}, raise_on_error=False))
    assert isinstance(response.error, api.NotFoundError) and response.final


# -- metadata, config, statistics, lifecycle -----------------------------------------


def test_server_and_model_metadata(server):
    assert server.live() and server.ready()
    assert server.metadata()["name"] == "triton"
    assert "model_repository" in server.metadata()["extensions"]
    model = server.model("simple")
    assert model.ready()
    metadata = model.metadata()
    assert metadata["versions"] == ["1"]
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]
    assert metadata["inputs"][0]["shape"] == [-1, 16]
    config = model.config()
    assert config["max_batch_size"] == 8 and config["input"][0]["data_type"] == "TYPE_INT32"
    assert server.model("stream").config()["model_transaction_policy"]["decoupled"] is True


def test_statistics_count_inferences(server):
    model = server.model("add_sub_python")
    before = model.statistics()["model_stats"][0]["inference_count"]
    a, b = pair(2)
    only(model.infer(inputs={"INPUT0": a, "INPUT1": b}))
    stats = model.statistics()["model_stats"]
    assert [s["name"] for s in stats] == ["add_sub_python"]
    assert stats[0]["inference_count"] == before + 2
    assert stats[0]["inference_stats"]["success"]["count"] >= 1


def test_models_index(server):
    models = server.models()
    assert models[("simple", 1)].state == "READY"
    assert models["simple"].version == -1
    assert ("identity_fp32", -1) in models  # in the repository, not loaded
    assert ("identity_fp32", -1) not in server.models(exclude_not_ready=True)
    with pytest.raises(KeyError):
        models["nope"]


def test_load_with_config_then_unload(server):
    model = server.load("identity_fp32")
    assert model.ready()
    x = np.linspace(0, 1, 8, dtype=np.float32).reshape(1, 8)
    response = only(model.infer(inputs={"INPUT0": x}))
    np.testing.assert_array_equal(response.outputs["OUTPUT0"], x)
    config = model.config()
    config["parameters"] = {"note": {"string_value": "reloaded"}}
    server.load("identity_fp32", config=config)
    assert model.config()["parameters"]["note"]["string_value"] == "reloaded"
    server.unload("identity_fp32")
    assert not model.ready()
    with pytest.raises(api.UnavailableError):
        list(model.infer(inputs={"INPUT0": x}))
    assert server.models()[("identity_fp32", 1)].state == "UNAVAILABLE"


def test_load_refused_outside_explicit_mode(repository):
    with (
        api.Server(model_repository=repository) as other,
        pytest.raises(api.UnavailableError, match="explicit"),
    ):
        other.unload("simple")


def test_startup_failure_raises_and_leaves_no_thread(tmp_path):
    root = tmp_path / "models"
    shutil.copytree(EXAMPLES / "simple", root / "simple")
    (root / "simple" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    threads = trionserve_threads()
    server = api.Server(model_repository=root)
    with pytest.raises(api.InternalError, match="failed to load all models"):
        server.start()
    assert trionserve_threads() == threads
    with pytest.raises(api.InvalidArgumentError, match="not started"):
        server.model("simple")


def test_not_ready_in_time(tmp_path):
    root = tmp_path / "models"
    shutil.copytree(EXAMPLES / "simple", root / "simple")
    (root / "simple" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    threads = trionserve_threads()
    server = api.Server(model_repository=root, exit_on_error=False)
    with pytest.raises(api.UnavailableError, match="Timeout before ready"):
        server.start(wait_until_ready=True, timeout=0.2)
    assert trionserve_threads() == threads


# -- shutdown ----------------------------------------------------------------------------


def test_stop_drains_in_flight_requests(repository, tmp_path):
    """stop() refuses new requests at once, lets the one in flight finish and the
    open sequence go on to its end, then ends the core's thread and the Python
    models' stub processes."""
    children_before = child_pids()
    threads = trionserve_threads()
    server = api.Server(
        model_repository=repository,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        startup_models=["gated", "simple", "accumulate"],
    ).start(wait_until_ready=True)
    assert child_pids() - children_before  # the gated model's stub
    gate = tmp_path / "gate"
    iterator = server.model("gated").infer(inputs={"GATE": np.array([str(gate)])})
    assert int(np.from_dlpack(next(iterator).outputs["I"])[0]) == 0
    accumulate = server.model("accumulate")

    def add(value: int, **sequence) -> int:
        inputs = {"INPUT": np.array([[value]], np.int32)}
        response = only(accumulate.infer(inputs=inputs, correlation_id=5, **sequence))
        return int(np.from_dlpack(response.outputs["OUTPUT"])[0, 0])

    assert add(2, flags=api.RequestFlag.SEQUENCE_START) == 2
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    while server.ready():  # until stop() has begun the drain
        pass
    a, b = pair()
    with pytest.raises(api.UnavailableError, match="shutting down"):
        list(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}))
    with pytest.raises(api.UnavailableError, match="shutting down"):
        add(1, flags=api.RequestFlag.SEQUENCE_START)  # a new sequence
    assert add(3) == 5  # the open sequence goes on
    gate.write_text("open")
    rest = list(iterator)
    assert [int(np.from_dlpack(r.outputs["I"])[0]) for r in rest[:1]] == [1] and rest[-1].final
    assert stopping.is_alive()  # the sequence is still open
    assert add(4, flags=api.RequestFlag.SEQUENCE_END) == 9
    stopping.join(30)
    assert not stopping.is_alive()
    assert server.exit_code == 0
    assert trionserve_threads() == threads
    assert child_pids() <= children_before
    with pytest.raises(api.InvalidArgumentError, match="not started"):
        server.ready()


def test_program_exiting_without_stop_drains_and_leaves_no_process(repository):
    """A program that never calls stop(): the server stops at interpreter exit,
    and the Python model's stub process ends with it."""
    program = textwrap.dedent(
        f"""
        import os, sys
        import numpy as np
        from trionserve import api

        server = api.Server(model_repository={str(repository)!r},
                            model_control_mode=api.ModelControlMode.EXPLICIT,
                            startup_models=["add_sub_python"]).start(wait_until_ready=True)
        a = np.ones((1, 16), np.int32)
        (response,) = server.model("add_sub_python").infer(inputs={{"INPUT0": a, "INPUT1": a}})
        children = []
        for task in os.listdir(f"/proc/{{os.getpid()}}/task"):
            try:
                children += open(f"/proc/{{os.getpid()}}/task/{{task}}/children").read().split()
            except FileNotFoundError:  # a thread that just ended
                pass
        total = int(np.from_dlpack(response.outputs["OUTPUT0"]).sum())
        print(total, " ".join(sorted(set(children))))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    total, *stubs = result.stdout.split()
    assert total == "32" and stubs
    for pid in stubs:
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), f"stub {pid} left"


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


# -- Trio-native ---------------------------------------------------------------------------


async def test_trio_api_streams_and_drains(repository, tmp_path):
    gate = tmp_path / "gate"
    async with api.open_server(
        model_repository=repository,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        startup_models=["simple", "stream", "gated"],
    ) as server:
        assert server.ready()
        a, b = pair()
        responses = [
            r async for r in server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})
        ]
        np.testing.assert_array_equal(responses[0].outputs["OUTPUT0"], a + b)
        received = []
        async for response in server.model("stream").infer(inputs={"N": np.array([3], np.int32)}):
            if not response.final:
                received.append(int(np.from_dlpack(response.outputs["I"])[0]))
        assert received == [0, 1, 2]
        async with server.model("gated").infer(inputs={"GATE": np.array([str(gate)])}) as stream:
            assert int(np.from_dlpack((await stream.__anext__()).outputs["I"])[0]) == 0
            server.stop()  # the drain begins; this request may finish
            assert not server.ready()
            with pytest.raises(api.UnavailableError, match="shutting down"):
                await server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}).__anext__()
            gate.write_text("open")
            rest = [r async for r in stream]
        assert int(np.from_dlpack(rest[0].outputs["I"])[0]) == 1 and rest[-1].final
    assert server.core.exit_code == 0


async def test_trio_api_closing_a_stream_cancels_its_request(repository, tmp_path):
    async with api.open_server(
        model_repository=repository,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        startup_models=["gated"],
    ) as server:
        model = server.model("gated")
        gate = tmp_path / "gate"
        with trio.fail_after(30):
            async with model.infer(inputs={"GATE": np.array([str(gate)])}) as stream:
                await stream.__anext__()
            # Closed early: the model saw the cancellation and takes the next request.
            gate.write_text("open")
            responses = [r async for r in model.infer(inputs={"GATE": np.array([str(gate)])})]
        assert int(np.from_dlpack(responses[1].outputs["I"])[0]) == 1
        assert model.statistics()["model_stats"][0]["inference_stats"]["success"]["count"] >= 1


# -- HTTP without a socket ------------------------------------------------------------------


def test_http_request_answers_as_the_http_frontend(server):
    """KServe v2 over http_request: tritonclient's own codec builds the binary
    request and reads the binary answer; no socket."""
    import tritonclient.http as httpclient

    ready = server.http_request("GET", "/v2/health/ready")
    assert (ready.status, ready.body) == (200, b"")
    a, b = pair()
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    outputs = [httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
    body, length = httpclient.InferenceServerClient.generate_request_body(inputs, outputs)
    headers = [("Inference-Header-Content-Length", str(length))]
    answer = server.http_request("POST", "/v2/models/simple/infer", headers, body)
    assert answer.status == 200
    result = httpclient.InferenceServerClient.parse_response_body(
        answer.body, header_length=int(answer.header("inference-header-content-length"))
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    # JSON, and errors with the frontend's status codes.
    request = {"inputs": [{"name": "N", "shape": [1], "datatype": "INT32", "data": [2]}]}
    missing = server.http_request("POST", "/v2/models/nope/infer", (), json.dumps(request).encode())
    assert missing.status == 404 and "nope" in json.loads(missing.body)["error"]
    decoupled = server.http_request("POST", "/v2/models/stream/infer", (), json.dumps(request))
    assert decoupled.status == 501
    assert server.http_request("GET", "/v2/nowhere").status == 404


def test_http_request_streams_generate_stream(server):
    answer = server.http_request(
        "POST", "/v2/models/stream/generate_stream", body=json.dumps({"N": [3]}).encode()
    )
    assert answer.status == 200 and answer.header("content-type").startswith("text/event-stream")
    events = [json.loads(chunk.decode().removeprefix("data: ")) for chunk in answer.stream]
    assert [event["I"] for event in events] == [0, 1, 2]


def test_server_options_and_the_body_limit(repository):
    options = ServerOptions(
        model_repositories=[repository],
        model_control_mode=ControlMode.EXPLICIT,
        load_models=["simple"],
        http=HttpOptions(max_input_size=100),
    )
    with api.Server(options) as server:
        assert server.metadata()["name"] == "triton"
        answer = server.http_request("POST", "/v2/models/simple/infer", body=b"x" * 101)
        assert answer.status == 400
        assert json.loads(answer.body)["error"] == (
            "request JSON size of 101 bytes exceeds the maximum allowed input size of "
            "100 bytes. Use --http-max-input-size to increase the limit."
        )


# -- network frontends on the same core ----------------------------------------------------


def test_http_frontend_attached_to_a_running_server(repository):
    import tritonclient.http as httpclient

    with api.Server(
        model_repository=repository,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        startup_models=["simple"],
    ) as server:
        a, b = pair()
        only(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}))
        ((host, port),) = server.attach_http("127.0.0.1", 0)
        client = httpclient.InferenceServerClient(f"{host}:{port}")
        try:
            assert client.is_server_ready()
            inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer("simple", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            # One core: the in-process call and the HTTP call count in the same statistics.
            stats = client.get_inference_statistics("simple")["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] == 2
        finally:
            client.close()
    with pytest.raises(ConnectionError):
        import socket

        socket.create_connection((host, port), timeout=5).close()


def test_grpc_and_metrics_frontends_attached_to_a_running_server(repository):
    """gRPC and /metrics attached to a core started without them serve the same
    core (one set of statistics), and close with it."""
    import urllib.request

    import tritonclient.grpc as grpcclient

    with api.Server(
        model_repository=repository,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        startup_models=["simple"],
    ) as server:
        a, b = pair()
        only(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}))
        ((host, port),) = server.attach_grpc("127.0.0.1", 0)
        ((metrics_host, metrics_port),) = server.attach_metrics("127.0.0.1", 0)
        client = grpcclient.InferenceServerClient(f"{host}:{port}")
        try:
            assert client.is_server_ready()
            inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer("simple", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
            stats = client.get_inference_statistics("simple", as_json=True)["model_stats"][0]
            assert int(stats["inference_stats"]["success"]["count"]) == 2
            url = f"http://{metrics_host}:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as answer:
                text = answer.read().decode()
            assert 'nv_inference_request_success{model="simple",version="1"} 2' in text
        finally:
            client.close()
    import socket

    for closed in (port, metrics_port):
        with pytest.raises(ConnectionError):
            socket.create_connection(("127.0.0.1", closed), timeout=5).close()


# -- Triton's tritonserver names: Tensor outputs, response queues, metrics -----------


def test_outputs_are_tensors_read_without_a_copy(server):
    a, b = pair()
    response = only(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}))
    out = response.outputs["OUTPUT0"]
    assert isinstance(out, api.Tensor)
    assert out.data_type == api.DataType.INT32 and list(out.shape) == [1, 16]
    assert out.memory_type == api.MemoryType.CPU and out.memory_type_id == 0
    first, second = np.from_dlpack(out), np.from_dlpack(out)
    assert first.ctypes.data == second.ctypes.data == out.data_ptr
    np.testing.assert_array_equal(first, a + b)
    # A tensor goes back in as an input, and BYTES come back as strings.
    echoed = only(server.model("simple").infer(inputs={"INPUT0": out, "INPUT1": b}))
    np.testing.assert_array_equal(np.from_dlpack(echoed.outputs["OUTPUT0"]), a + 2 * b)
    strings = api.Tensor.from_string_array([["hé", "x"]])
    text = only(server.model("identity_bytes").infer(inputs={"INPUT0": strings}))
    assert text.outputs["OUTPUT0"].to_string_array().tolist() == [["hé", "x"]]


def test_output_memory_type(server):
    a, b = pair()
    for memory in ("cpu", "CPU:0", api.MemoryType.CPU, (api.MemoryType.CPU, 0)):
        (response,) = server.model("simple").infer(
            inputs={"INPUT0": a, "INPUT1": b}, output_memory_type=memory
        )
        assert response.outputs["OUTPUT0"].memory_type == api.MemoryType.CPU
    with pytest.raises(api.InvalidArgumentError, match="Memory type unsupported not supported"):
        server.model("simple").infer(
            inputs={"INPUT0": a, "INPUT1": b}, output_memory_type="unsupported"
        )


@pytest.mark.skipif(cupy is not None, reason="checks the error when cupy is absent")
def test_gpu_output_memory_without_cupy_is_an_error_of_the_request(server):
    a, b = pair()
    responses = server.model("simple").infer(
        inputs={"INPUT0": a, "INPUT1": b}, output_memory_type="gpu"
    )
    with pytest.raises(api.InvalidArgumentError, match="cupy"):
        list(responses)
    only(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}))


def test_response_queue_gets_responses_without_iterating(server):
    """Triton's response_queue: every response is put into the queue as it
    arrives, whether or not the iterator is read; the iterator yields them too."""
    responses: queue.SimpleQueue = queue.SimpleQueue()
    iterators = [
        server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}, response_queue=responses)
        for a, b in (pair(), pair(2))
    ]
    got = sorted(
        (responses.get(timeout=30) for _ in iterators),
        key=lambda r: len(np.from_dlpack(r.outputs["OUTPUT0"])),
    )
    assert [np.from_dlpack(r.outputs["OUTPUT0"]).shape[0] for r in got] == [1, 2]
    for iterator in iterators:
        assert only(iterator).final
    assert responses.empty()
    # An error is a response in the queue, and raised by the iterator.
    failing = server.model("nope").infer(inputs={}, response_queue=responses)
    assert isinstance(responses.get(timeout=30).error, api.NotFoundError)
    with pytest.raises(api.NotFoundError):
        list(failing)


def test_asyncio_response_queue(server):
    async def main() -> None:
        responses: asyncio.Queue = asyncio.Queue()
        stream = server.model("stream").async_infer(
            inputs={"N": np.array([2], np.int32)}, response_queue=responses
        )
        queued = [await asyncio.wait_for(responses.get(), 30) for _ in range(3)]
        assert [r.final for r in queued] == [False, False, True]
        assert [r async for r in stream] == queued
        assert responses.empty()

    asyncio.run(main())


def test_response_queue_is_refused_in_the_trio_api(repository):
    async def main() -> None:
        async with api.open_server(
            model_repository=repository,
            model_control_mode=api.ModelControlMode.EXPLICIT,
        ) as trio_server:
            with pytest.raises(api.InvalidArgumentError, match="response_queue"):
                trio_server.model("simple").infer(inputs={}, response_queue=queue.SimpleQueue())

    trio.run(main)


def test_metrics_are_tritons_prometheus_text(server):
    a, b = pair()
    line = 'nv_inference_request_success{model="simple",version="1"}'

    def count() -> float:
        text = server.metrics()
        (value,) = [row.split()[-1] for row in text.splitlines() if row.startswith(line)]
        return float(value)

    before = count()
    only(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}))
    assert count() == before + 1
    assert "# TYPE nv_inference_request_success counter" in server.metrics(
        api.MetricFormat.PROMETHEUS
    )


def test_model_properties(server):
    assert server.model("simple").batch_properties() == api.ModelBatchFlag.FIRST_DIM
    assert server.model("stream").batch_properties() == api.ModelBatchFlag.UNKNOWN
    assert server.model("stream").transaction_properties() == api.ModelTxnPropertyFlag.DECOUPLED
    assert server.model("simple").transaction_properties() == api.ModelTxnPropertyFlag.ONE_TO_ONE


def test_start_up_errors_are_tritons_exception_types(tmp_path):
    with pytest.raises(api.InvalidArgumentError, match="not started"):
        api.Server().ready()
    with pytest.raises(TypeError, match="server_id"):
        api.Server(server_id=1).start()
    with pytest.raises(api.InvalidArgumentError, match="Model repository must be specified"):
        api.Server(model_repository=None).start()
    with pytest.raises(api.InternalError, match="failed to stat file"):
        api.Server(model_repository=tmp_path / "missing").start()


def test_inference_holds_no_memory_per_request(server):
    """Traced Python memory stops growing once the first requests have filled the
    interpreter's caches: of two windows of 600 requests, each output read through
    numpy.from_dlpack, the second adds less than 100 bytes a request (a response kept
    alive is 1.6 kilobytes). The interpreter's free lists (tuples, frames) keep
    blocks traced to where they were first allocated and fill over the first
    windows, by how the threads interleave: a leak grows in every window, they do
    not."""
    model = server.model("simple")
    a, b = pair()

    def infer(n: int) -> None:
        for _ in range(n):
            for response in model.infer(inputs={"INPUT0": a, "INPUT1": b}):
                for name in ("OUTPUT0", "OUTPUT1"):
                    assert np.from_dlpack(response.outputs[name]).shape == (1, 16)

    def growth(n: int) -> int:
        gc.collect()
        before, _ = tracemalloc.get_traced_memory()
        infer(n)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before

    infer(20)
    tracemalloc.start()
    try:
        infer(200)
        windows = [growth(600), growth(600)]
    finally:
        tracemalloc.stop()
    assert windows[-1] < 600 * 100, f"{windows} bytes more in two windows of 600 requests"


async def test_a_failed_load_inside_open_server_raises_its_own_error_alone(tmp_path):
    # Leaving the block with the error unloads what the load had registered while
    # the server's nursery is being cancelled; that unload must not start work in
    # the registry's closed nursery (it did: an ExceptionGroup with "Nursery is
    # closed to new arrivals" beside the load's error).
    python_model(
        tmp_path,
        "broken",
        'backend: "python"',
        textwrap.dedent(
            """
            class TritonPythonModel:
                @staticmethod
                def auto_complete_config(config):
                    raise RuntimeError("no configuration here")
            """
        ),
    )
    options = api.Options(
        model_repository=tmp_path, model_control_mode=api.ModelControlMode.EXPLICIT
    )
    with pytest.raises(api.InvalidArgumentError, match="no configuration here"):
        async with api.open_server(options) as srv:
            await srv.load("broken")
