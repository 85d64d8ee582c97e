"""Ensembles end to end: a real server, a temporary repository, the official tritonclient.

The image pipeline has the shape of Triton's preprocess -> model -> postprocess
ensembles: a Python model turns raw HWC pixels into a normalised NCHW tensor, an
ONNX classifier (made here with the onnx helper API) scores it, and a Python model
turns logits into class and probability. The server runs in EXPLICIT mode, so
loading an ensemble loads its composing models. The last tests run the server
in-process with a gated test backend, so that parallel branches and cancelled
steps are observed with events, not timing.
"""

from __future__ import annotations

import queue
import shutil
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.repository import python_model, write_model
from tests.serverproc import EXAMPLES, ServerProcess, free_port
from trionserve.backends.base import Backend, ModelContext
from trionserve.backends.batch_tensors import build_response
from trionserve.core.errors import InvalidArgument
from trionserve.server import Server, ServerOptions

SIZE = 8  # the classifier's input is SIZE x SIZE
WEIGHTS = np.array(
    [[1.0, -1.0, 0.5, 0.0], [0.0, 2.0, -1.0, 1.0], [-1.0, 0.5, 1.0, 2.0]], np.float32
)
BIAS = np.array([0.1, 0.0, -0.1, 0.2], np.float32)

PREPROCESS = """
import numpy as np
import triton_python_backend_utils as pb_utils

SIZE = 8


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            height, width, _ = image.shape
            rows = np.arange(SIZE) * height // SIZE
            cols = np.arange(SIZE) * width // SIZE
            scaled = image[rows][:, cols].astype(np.float32) / 255.0
            pixels = np.ascontiguousarray(scaled.transpose(2, 0, 1)[np.newaxis])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", pixels)]))
        return responses
"""

POSTPROCESS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
            exp = np.exp(logits - logits.max(axis=1, keepdims=True))
            probabilities = exp / exp.sum(axis=1, keepdims=True)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("CLASS", probabilities.argmax(axis=1).astype(np.int32)),
                pb_utils.Tensor("SCORE", probabilities.max(axis=1).astype(np.float32)),
            ]))
        return responses
"""

# Stands where the classifier stands and refuses every image.
REJECT = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(error=pb_utils.TritonError("reject: image too dark"))
            for _ in requests
        ]
"""

REPEAT = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().copy()
            sender = request.get_response_sender()
            threading.Thread(target=self.respond, args=(values, sender)).start()
        return None

    def respond(self, values, sender):
        for value in values:
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([value], np.int32)),
            ]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

SQUARE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() ** 2
            )])
            for r in requests
        ]
"""


def tensors(kind: str, entries: list[tuple[str, str, str]]) -> str:
    return (
        f"{kind} [ "
        + ", ".join(f'{{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in entries)
        + " ]"
    )


def steps(*entries: tuple[str, dict, dict]) -> str:
    """ensemble_scheduling from (model, input_map, output_map) entries."""
    text = []
    for model, inputs, outputs in entries:
        maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
        maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
        text.append(f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}')
    return "ensemble_scheduling { step [ " + ", ".join(text) + " ] }"


def write(repository: Path, name: str, config: str) -> None:
    """Model ``name`` with ``config`` after its name, and an empty version 1."""
    write_model(repository, name, f'name: "{name}"\n{config}\n', versions=[1])


def python_step(repository: Path, name: str, inputs, outputs, source: str, extra="") -> None:
    """A Python model of ``inputs`` and ``outputs`` ((name, type, dims) each)."""
    config = (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n{tensors("input", inputs)}\n'
        f"{tensors('output', outputs)}\ninstance_group [ {{ kind: KIND_CPU }} ]\n{extra}\n"
    )
    python_model(repository, name, config, source)


def ensemble(
    repository: Path, name: str, inputs, outputs, scheduling: str, extra="", max_batch_size: int = 0
) -> None:
    write(
        repository,
        name,
        f'platform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
        f"{tensors('input', inputs)}\n{tensors('output', outputs)}\n{scheduling}\n{extra}",
    )


def classifier_onnx() -> onnx.ModelProto:
    """logits = mean over H and W of the image, times WEIGHTS, plus BIAS."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input"], ["mean"], axes=[2, 3], keepdims=0),
            helper.make_node("MatMul", ["mean", "weights"], ["product"]),
            helper.make_node("Add", ["product", "bias"], ["logits"]),
        ],
        "classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        initializer=[
            helper.make_tensor("weights", TensorProto.FLOAT, [3, 4], WEIGHTS.flatten()),
            helper.make_tensor("bias", TensorProto.FLOAT, [4], BIAS),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


IMAGE_IN = [("IMAGE", "TYPE_UINT8", "-1, -1, 3")]
PIXELS = [("PIXELS", "TYPE_FP32", f"1, 3, {SIZE}, {SIZE}")]
LOGITS = [("LOGITS", "TYPE_FP32", "-1, 4")]
LABELS = [("CLASS", "TYPE_INT32", "-1"), ("SCORE", "TYPE_FP32", "-1")]
I32_16 = [("INPUT0", "TYPE_INT32", "16"), ("INPUT1", "TYPE_INT32", "16")]
OUT_16 = [("OUTPUT0", "TYPE_INT32", "16"), ("OUTPUT1", "TYPE_INT32", "16")]
PIPELINE = (
    ("preprocess", {"IMAGE": "IMAGE"}, {"PIXELS": "pixels"}),
    ("classifier", {"input": "pixels"}, {"logits": "logits"}),
    ("postprocess", {"LOGITS": "logits"}, {"CLASS": "CLASS", "SCORE": "SCORE"}),
)
SIMPLE = {"INPUT0": "INPUT0", "INPUT1": "INPUT1"}

# Broken ensembles and the load error each must give.
BROKEN = {
    "bad_cycle": (
        [("INPUT0", "TYPE_INT32", "16")],
        [("OUTPUT0", "TYPE_INT32", "16")],
        steps(
            ("simple", {"INPUT0": "INPUT0", "INPUT1": "b"}, {"OUTPUT0": "a", "OUTPUT1": "OUTPUT0"}),
            ("simple", {"INPUT0": "a", "INPUT1": "INPUT0"}, {"OUTPUT0": "b", "OUTPUT1": "unused"}),
        ),
        # Triton's words (model_config_utils.cc ValidateEnsembleSchedulingConfig).
        "output 'OUTPUT0' for ensemble 'bad_cycle' is not written: at least one of its "
        "depending tensors, ",
    ),
    "bad_unmapped_output": (
        I32_16,
        OUT_16,
        steps(("simple", SIMPLE, {"OUTPUT0": "OUTPUT0"})),
        "ensemble output 'OUTPUT1' for ensemble bad_unmapped_output' is not used",
    ),
    "bad_missing_model": (
        I32_16,
        OUT_16,
        steps(
            ("simple", SIMPLE, {"OUTPUT0": "a", "OUTPUT1": "b"}),
            (
                "no_such_model",
                {"INPUT0": "a", "INPUT1": "b"},
                {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"},
            ),
        ),
        "contains models that are not available or ambiguous: no_such_model",
    ),
    "bad_datatype": (
        [("INPUT0", "TYPE_FP32", "16"), ("INPUT1", "TYPE_INT32", "16")],
        OUT_16,
        steps(("simple", SIMPLE, {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"})),
        # Triton's words (core ensemble_utils.cc ValidateTensorConsistency).
        "in ensemble bad_datatype, ensemble tensor INPUT0: inconsistent data type: TYPE_FP32 "
        "is inferred from model bad_datatype while TYPE_INT32 is inferred from model simple",
    ),
    "bad_shape": (
        I32_16,
        [("OUTPUT0", "TYPE_INT32", "8"), ("OUTPUT1", "TYPE_INT32", "16")],
        steps(("simple", SIMPLE, {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"})),
        "in ensemble bad_shape, ensemble tensor OUTPUT0: inconsistent shape: [-1,8] is "
        "inferred from model bad_shape while [-1,16] is inferred from model simple",
    ),
}


def make_repository(repository: Path) -> None:
    python_step(repository, "preprocess", IMAGE_IN, PIXELS, PREPROCESS)
    python_step(repository, "postprocess", LOGITS, LABELS, POSTPROCESS)
    python_step(
        repository,
        "reject",
        [("input", "TYPE_FP32", f"-1, 3, {SIZE}, {SIZE}")],
        [("logits", "TYPE_FP32", "-1, 4")],
        REJECT,
    )
    write(
        repository,
        "classifier",
        'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
        + tensors("input", [("input", "TYPE_FP32", f"3, {SIZE}, {SIZE}")])
        + "\n"
        + tensors("output", [("logits", "TYPE_FP32", "4")]),
    )
    onnx.save(classifier_onnx(), str(repository / "classifier" / "1" / "model.onnx"))
    ensemble(repository, "image_pipeline", IMAGE_IN, LABELS, steps(*PIPELINE))
    ensemble(
        repository,
        "reject_pipeline",
        IMAGE_IN,
        LABELS,
        steps(PIPELINE[0], ("reject", {"input": "pixels"}, {"logits": "logits"}), PIPELINE[2]),
    )

    shutil.copytree(EXAMPLES / "simple", repository / "simple")
    # Two branches from the same inputs, joined by a third step.
    ensemble(
        repository,
        "branches",
        I32_16,
        OUT_16,
        steps(
            ("simple", SIMPLE, {"OUTPUT0": "sum"}),
            ("simple", {"INPUT0": "INPUT1", "INPUT1": "INPUT0"}, {"OUTPUT1": "reverse_diff"}),
            (
                "simple",
                {"INPUT0": "sum", "INPUT1": "reverse_diff"},
                {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"},
            ),
        ),
        max_batch_size=8,
    )
    # No batch dimension of its own, over a batching model (Triton adds and strips
    # a batch of 1, core ensemble_scheduler.cc ReshapeTensorDims).
    ensemble(
        repository,
        "unbatched",
        I32_16,
        OUT_16,
        steps(("simple", SIMPLE, {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"})),
    )
    shutil.copytree(EXAMPLES / "identity_fp32", repository / "identity_fp32")
    ensemble(
        repository,
        "identity_chain",
        [("INPUT0", "TYPE_FP32", "-1, -1")],
        [("OUTPUT0", "TYPE_FP32", "-1, -1")],
        steps(
            ("identity_fp32", {"INPUT0": "INPUT0"}, {"OUTPUT0": "x"}),
            ("identity_fp32", {"INPUT0": "x"}, {"OUTPUT0": "OUTPUT0"}),
        ),
    )

    python_step(
        repository,
        "repeat",
        [("IN", "TYPE_INT32", "-1")],
        [("OUT", "TYPE_INT32", "1")],
        REPEAT,
        extra="model_transaction_policy { decoupled: true }",
    )
    python_step(
        repository, "square", [("IN", "TYPE_INT32", "1")], [("OUT", "TYPE_INT32", "1")], SQUARE
    )
    ensemble(
        repository,
        "stream_pipeline",
        [("VALUES", "TYPE_INT32", "-1")],
        [("SQUARES", "TYPE_INT32", "1")],
        steps(
            ("repeat", {"IN": "VALUES"}, {"OUT": "value"}),
            ("square", {"IN": "value"}, {"OUT": "SQUARES"}),
        ),
        extra="model_transaction_policy { decoupled: true }",
    )

    for name, (inputs, outputs, scheduling, _) in BROKEN.items():
        ensemble(repository, name, inputs, outputs, scheduling, max_batch_size=8)


STARTUP = ["image_pipeline", "reject_pipeline", "branches", "stream_pipeline", "unbatched"]


@pytest.fixture(scope="module")
def ensemble_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("ensembles")
    make_repository(repository)
    args = ["--model-control-mode=explicit", *(f"--load-model={n}" for n in STARTUP)]
    proc = ServerProcess(repository, args=args)
    try:
        proc.wait_ready(path="/v2/health/ready")
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


@pytest.fixture
def client(ensemble_server):
    client = httpclient.InferenceServerClient(ensemble_server.http_url, network_timeout=60)
    yield client
    client.close()


def expected_labels(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the pipeline should answer, computed here independently."""
    height, width, _ = image.shape
    rows = (np.arange(SIZE) * height) // SIZE
    cols = (np.arange(SIZE) * width) // SIZE
    small = image[np.ix_(rows, cols)].astype(np.float32) / 255.0
    logits = small.mean(axis=(0, 1)) @ WEIGHTS + BIAS
    probabilities = np.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    return np.array([probabilities.argmax()], np.int32), np.array([probabilities.max()], np.float32)


def image_input(image: np.ndarray):
    infer_input = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
    infer_input.set_data_from_numpy(image)
    return [infer_input]


def test_composing_models_load_with_the_ensemble(client):
    for name in ("image_pipeline", "preprocess", "classifier", "postprocess"):
        assert client.is_model_ready(name), name
    metadata = client.get_model_metadata("image_pipeline")
    assert metadata["platform"] == "ensemble"
    assert [o["name"] for o in metadata["outputs"]] == ["CLASS", "SCORE"]


@pytest.mark.parametrize("shape, seed", [((32, 48, 3), 1), ((17, 9, 3), 2), ((8, 8, 3), 3)])
def test_image_pipeline_answers_like_the_client_side_pipeline(client, shape, seed):
    image = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    result = client.infer("image_pipeline", image_input(image))
    label, score = expected_labels(image)
    np.testing.assert_array_equal(result.as_numpy("CLASS"), label)
    np.testing.assert_allclose(result.as_numpy("SCORE"), score, rtol=1e-5)
    assert result.get_response()["model_name"] == "image_pipeline"


def test_requested_output_only(client):
    image = np.full((4, 4, 3), 200, np.uint8)
    result = client.infer(
        "image_pipeline", image_input(image), outputs=[httpclient.InferRequestedOutput("SCORE")]
    )
    assert result.as_numpy("CLASS") is None
    np.testing.assert_allclose(result.as_numpy("SCORE"), expected_labels(image)[1], rtol=1e-5)


def test_statistics_count_the_ensemble_and_each_composing_model(client):
    models = ("image_pipeline", "preprocess", "classifier", "postprocess")

    def successes() -> dict[str, int]:
        return {
            name: client.get_inference_statistics(name)["model_stats"][0]["inference_stats"][
                "success"
            ]["count"]
            for name in models
        }

    before = successes()
    client.infer("image_pipeline", image_input(np.zeros((4, 4, 3), np.uint8)))
    after = successes()
    assert {name: after[name] - before[name] for name in models} == dict.fromkeys(models, 1)


def test_parallel_branches_join(client):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 5, np.int32)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("branches", inputs)
    # join: (a + b) + (b - a) and (a + b) - (b - a)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 2 * a)


def test_an_error_in_the_middle_step_reaches_the_client(client):
    image = np.zeros((8, 8, 3), np.uint8)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("reject_pipeline", image_input(image))
    message = str(caught.value)
    assert "reject: image too dark" in message
    assert "step 1 (model 'reject')" in message
    # The pipeline keeps serving after a failed request.
    assert client.is_model_ready("reject_pipeline")


def test_a_bad_request_is_refused_with_the_ensemble_named(client):
    infer_input = httpclient.InferInput("IMAGE", [4, 4], "UINT8")
    infer_input.set_data_from_numpy(np.zeros((4, 4), np.uint8))
    with pytest.raises(InferenceServerException, match="for model 'image_pipeline'"):
        client.infer("image_pipeline", [infer_input])


def test_decoupled_step_streams_into_the_next_step(ensemble_server):
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ensemble_server.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        infer_input = grpcclient.InferInput("VALUES", [3], "INT32")
        infer_input.set_data_from_numpy(np.array([2, 3, 4], np.int32))
        client.async_stream_infer("stream_pipeline", [infer_input], request_id="s1")
        received = []
        for _ in range(3):
            result, error = responses.get(timeout=30)
            assert error is None, error
            received.append(int(result.as_numpy("SQUARES")[0]))
        # In the order the decoupled step sent them, although the square step may answer
        # two in one turn of the event loop (see schedulers/ensemble_order.py).
        assert received == [4, 9, 16]
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_ensemble_fails_to_load_with_its_reason(client, name):
    with pytest.raises(InferenceServerException) as caught:
        client.load_model(name)
    assert BROKEN[name][3] in str(caught.value)
    assert name in str(caught.value)
    assert not client.is_model_ready(name)
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    assert rows[name]["state"] == "UNAVAILABLE"
    assert BROKEN[name][3] in rows[name]["reason"]


def test_unload_dependents_unloads_the_composing_models(client):
    client.load_model("identity_chain")
    assert client.is_model_ready("identity_fp32")
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    infer_input = httpclient.InferInput("INPUT0", [2, 3], "FP32")
    infer_input.set_data_from_numpy(data)
    result = client.infer("identity_chain", [infer_input])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    client.unload_model("identity_chain", unload_dependents=True)
    assert not client.is_model_ready("identity_chain")
    assert not client.is_model_ready("identity_fp32")


def test_an_ensemble_without_batching_serves_a_batching_step(client):
    a = np.arange(16, dtype=np.int32)
    b = np.full(16, 3, np.int32)
    inputs = [
        httpclient.InferInput("INPUT0", [16], "INT32"),
        httpclient.InferInput("INPUT1", [16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("unbatched", inputs)
    assert result.as_numpy("OUTPUT0").shape == (16,)  # the step's batch of 1 is gone
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    metadata = client.get_model_metadata("unbatched")
    assert metadata["inputs"][0]["shape"] == [16]


def test_example_simple_ensemble(http_client):
    """examples/model_repository/simple_ensemble (loaded in NONE mode by the session
    server): `simple` twice doubles both inputs."""
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 3, np.int32)
    inputs = [
        httpclient.InferInput("INPUT0", [2, 16], "INT32"),
        httpclient.InferInput("INPUT1", [2, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = http_client.infer("simple_ensemble", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 2 * b)


# -- in-process: parallelism and cancellation observed with events --------------------

GATE_BACKEND = "test_ensemble_gate"


class Gate:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = False


GATES: dict[str, Gate] = {}


class _GateInstance:
    def __init__(self, name: str) -> None:
        self.name = name

    def execute(self, requests):
        gate = GATES[self.name]
        gate.entered.set()
        gate.release.wait(timeout=30)
        if gate.fail:
            return [InvalidArgument(f"{self.name}: refused") for _ in requests]
        return [
            build_response(
                r, self.name, "1", {"OUTPUT0": r.inputs["INPUT0"].data}, {"OUTPUT0": "FP32"}
            )
            for r in requests
        ]

    def close(self) -> None:
        pass


class _GateModel:
    def __init__(self, context: ModelContext) -> None:
        self.name = context.name

    def create_instance(self, spec) -> _GateInstance:
        return _GateInstance(self.name)

    def unload(self) -> None:
        pass


class GateBackend(Backend):
    name = GATE_BACKEND

    def default_model_filename(self) -> str:
        return "model.txt"

    def auto_complete_config(self, config, model_path, max_batch_size_set) -> None:
        pass

    def load(self, context: ModelContext) -> _GateModel:
        return _GateModel(context)


BACKENDS = {GATE_BACKEND: GateBackend}

FP32_4 = [("INPUT0", "TYPE_FP32", "4")]


@pytest.fixture
def fork_repository(tmp_path):
    for name in ("left", "right"):
        write(
            tmp_path,
            name,
            f'backend: "{GATE_BACKEND}"\nmax_batch_size: 0\n'
            + tensors("input", FP32_4)
            + "\n"
            + tensors("output", [("OUTPUT0", "TYPE_FP32", "4")]),
        )
        (tmp_path / name / "1" / "model.txt").write_text("gate\n")
        GATES[name] = Gate()
    ensemble(
        tmp_path,
        "fork",
        FP32_4,
        [("LEFT", "TYPE_FP32", "4"), ("RIGHT", "TYPE_FP32", "4")],
        steps(
            ("left", {"INPUT0": "INPUT0"}, {"OUTPUT0": "LEFT"}),
            ("right", {"INPUT0": "INPUT0"}, {"OUTPUT0": "RIGHT"}),
        ),
    )
    yield tmp_path
    for gate in GATES.values():
        gate.release.set()  # never leave a worker thread blocked
    GATES.clear()


def fork_infer(port: int):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
    try:
        infer_input = httpclient.InferInput("INPUT0", [4], "FP32")
        infer_input.set_data_from_numpy(np.arange(4, dtype=np.float32))
        result = client.infer("fork", [infer_input])
        return result.as_numpy("LEFT"), result.as_numpy("RIGHT")
    except InferenceServerException as exc:
        return exc
    finally:
        client.close()


async def in_thread_wait(event: threading.Event) -> bool:
    return await trio.to_thread.run_sync(event.wait, 10)


async def serve_fork(repository: Path, body) -> object:
    """Serve ``repository`` in-process, send one request to 'fork' from a client
    thread and run ``body(answered)`` meanwhile; return the client's outcome."""
    server = Server(
        ServerOptions(
            model_repositories=[repository],
            http_address="127.0.0.1",
            http_port=free_port(),
            allow_grpc=False,
            allow_metrics=False,
            exit_timeout_secs=10.0,
        ),
        backends=BACKENDS,
    )
    port = server.options.http_port
    outcome: list = []
    answered = trio.Event()

    async def client() -> None:
        outcome.append(await trio.to_thread.run_sync(fork_infer, port))
        answered.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            async with trio.open_nursery() as clients:
                clients.start_soon(client)
                await body(answered)
            server.shutdown()
    return outcome[0]


async def test_parallel_branches_execute_at_the_same_time(fork_repository):
    async def body(answered):
        # Both branches are inside their backends, neither released yet.
        assert await in_thread_wait(GATES["left"].entered)
        assert await in_thread_wait(GATES["right"].entered)
        GATES["left"].release.set()
        GATES["right"].release.set()

    left, right = await serve_fork(fork_repository, body)
    np.testing.assert_array_equal(left, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(right, np.arange(4, dtype=np.float32))


async def test_a_failing_branch_ends_the_request_while_the_other_still_runs(fork_repository):
    GATES["left"].fail = True

    async def body(answered):
        # 'left' refuses only once 'right' is inside its backend: a refusal that came
        # first could end the request before 'right' had started (nothing to observe).
        assert await in_thread_wait(GATES["left"].entered)
        assert await in_thread_wait(GATES["right"].entered)
        GATES["left"].release.set()
        # The client has its answer while 'right' is still blocked in its backend
        # (which lets go by itself only after 30 s).
        with trio.fail_after(10):
            await answered.wait()
        assert not GATES["right"].release.is_set()
        GATES["right"].release.set()

    error = await serve_fork(fork_repository, body)
    assert isinstance(error, InferenceServerException)
    assert "left: refused" in str(error)
    assert "step 0 (model 'left')" in str(error)
