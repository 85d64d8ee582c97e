"""The PyTorch backend: TorchScript models made here, served by a real server and
checked with tritonclient against torch's own outputs; the server without torch."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import trio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.repository import write_model
from tests.serverproc import ServerProcess
from trionserve.backends.pytorch import backend as pytorch
from trionserve.backends.pytorch import device as pytorch_device
from trionserve.backends.pytorch import naming as pytorch_naming
from trionserve.core.errors import InvalidArgument
from trionserve.server import Server, ServerOptions

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

if HAS_TORCH:
    import torch

    class AddMul(torch.nn.Module):
        """Two inputs, two outputs: addressed as INPUT__<i> / OUTPUT__<i>."""

        def forward(self, x, y):
            return x + 2 * y, x * y - 1

    class ScaleShift(torch.nn.Module):
        """Inputs addressed by forward()'s argument names."""

        def forward(self, offset, values):
            return values * 3.0 + offset.to(values.dtype), values.sum(dim=1, keepdim=True)

    class Identity(torch.nn.Module):
        """Returns its input itself: the output is a view of the input's memory."""

        def forward(self, x):
            return x

    class Shout(torch.nn.Module):
        """BYTES in and out: a List[str] argument and a List[str] result."""

        def forward(self, words: list[str]) -> tuple[list[str], torch.Tensor]:
            lengths = torch.tensor([len(w) for w in words], dtype=torch.int64)
            return [w.upper() + "!" for w in words], lengths

    class Words(torch.nn.Module):
        """One BYTES output: a List[str] result alone (not a tuple of outputs)."""

        def forward(self, words: list[str]) -> list[str]:
            return [w + w for w in words]

    class Accumulate(torch.nn.Module):
        """A sequence model with implicit state: the data input, the state input and
        the START / READY controls are forward()'s four arguments."""

        def forward(self, value, state, start, ready):
            total = value + state * (1 - start)
            return total, total

    class DictModel(torch.nn.Module):
        """A Dict[str, Tensor] in, a Dict[str, Tensor] out."""

        def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            a, b = inputs["a"], inputs["b"]
            return {"product": a * b, "maximum": torch.maximum(a, b)}


def tensor(name: str, data_type: str, dims: str) -> str:
    return f'{{ name: "{name}" data_type: {data_type} dims: [ {dims} ] }}'


def config(name: str, inputs: list[str], outputs: list[str], extra: str = "") -> str:
    return (
        f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n'
        f"input [ {', '.join(inputs)} ]\noutput [ {', '.join(outputs)} ]\n{extra}"
    )


def torchscript_model(repository, name: str, module, config_text: str) -> None:
    """Model ``name``: ``module`` scripted as version 1's model.pt (bytes torch
    cannot load when None)."""
    version = write_model(repository, name, config_text, versions=[1]) / "1"
    if module is not None:
        torch.jit.script(module).save(str(version / "model.pt"))
    else:
        (version / "model.pt").write_bytes(b"not loaded")


MODELS = {
    # Outputs listed out of order: OUTPUT__<i> picks the tuple element, not the order.
    "pt_addmul": lambda: config(
        "pt_addmul",
        [tensor("INPUT__0", "TYPE_FP32", "16"), tensor("INPUT__1", "TYPE_FP32", "16")],
        [tensor("OUTPUT__1", "TYPE_FP32", "16"), tensor("OUTPUT__0", "TYPE_FP32", "16")],
    ),
    # Inputs listed in the reverse of forward()'s order: matched by argument name.
    "pt_named": lambda: config(
        "pt_named",
        [tensor("values", "TYPE_FP32", "4"), tensor("offset", "TYPE_INT32", "4")],
        [tensor("scaled", "TYPE_FP32", "4"), tensor("total", "TYPE_FP32", "1")],
    ),
    "pt_dict": lambda: config(
        "pt_dict",
        [tensor("a", "TYPE_INT64", "3"), tensor("b", "TYPE_INT64", "3")],
        [tensor("maximum", "TYPE_INT64", "3"), tensor("product", "TYPE_INT64", "3")],
    ),
    "pt_bytes": lambda: config(
        "pt_bytes",
        [tensor("INPUT__0", "TYPE_STRING", "16"), tensor("INPUT__1", "TYPE_FP32", "16")],
        [tensor("OUTPUT__0", "TYPE_FP32", "16"), tensor("OUTPUT__1", "TYPE_FP32", "16")],
    ),
    "pt_no_io": lambda: 'name: "pt_no_io"\nplatform: "pytorch_libtorch"\n',
    # Triton's libtorch_nobatch_zero_1_object (qa/common/gen_qa_identity_models.py).
    "pt_strings": lambda: (
        'name: "pt_strings"\nplatform: "pytorch_libtorch"\nmax_batch_size: 0\n'
        f"input [ {tensor('INPUT__0', 'TYPE_STRING', '-1')} ]\n"
        f"output [ {tensor('OUTPUT__0', 'TYPE_STRING', '-1')}, "
        f"{tensor('OUTPUT__1', 'TYPE_INT64', '-1')} ]\n"
    ),
    "pt_words": lambda: (
        'name: "pt_words"\nplatform: "pytorch_libtorch"\nmax_batch_size: 0\n'
        f"input [ {tensor('INPUT__0', 'TYPE_STRING', '-1')} ]\n"
        f"output [ {tensor('OUTPUT__0', 'TYPE_STRING', '-1')} ]\n"
    ),
    # As qa/common/gen_qa_implicit_models.py's libtorch_nobatch_sequence_int32.
    "pt_sequence": lambda: (
        'name: "pt_sequence"\nplatform: "pytorch_libtorch"\nmax_batch_size: 0\n'
        "sequence_batching { control_input [\n"
        '  { name: "START__2" control [ { kind: CONTROL_SEQUENCE_START '
        "int32_false_true: [ 0, 1 ] } ] },\n"
        '  { name: "READY__3" control [ { kind: CONTROL_SEQUENCE_READY '
        "int32_false_true: [ 0, 1 ] } ] } ]\n"
        '  state [ { input_name: "INPUT_STATE__1" output_name: "OUTPUT_STATE__1" '
        "data_type: TYPE_INT32 dims: [ 1 ] initial_state: { data_type: TYPE_INT32 "
        'dims: [ 1 ] zero_data: true name: "zero" } } ] }\n'
        f"input [ {tensor('INPUT__0', 'TYPE_INT32', '1')} ]\n"
        f"output [ {tensor('OUTPUT__0', 'TYPE_INT32', '1')} ]\n"
    ),
}


@pytest.fixture(scope="module")
def modules():
    if not HAS_TORCH:
        pytest.skip("torch is not installed")
    return {
        "pt_addmul": AddMul(),
        "pt_named": ScaleShift(),
        "pt_dict": DictModel(),
        "pt_bytes": AddMul(),
        "pt_no_io": AddMul(),
        "pt_strings": Shout(),
        "pt_words": Words(),
        "pt_sequence": Accumulate(),
    }


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory, modules):
    repository = tmp_path_factory.mktemp("pytorch_repository")
    for name, make_config in MODELS.items():
        torchscript_model(repository, name, modules[name], make_config())
    proc = ServerProcess(repository, args=["--exit-on-error=false"])
    try:
        proc.wait_ready()
        client = httpclient.InferenceServerClient(proc.http_url)
        yield client
        client.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def expected(module, *args):
    with torch.inference_mode():
        result = module(*(torch.from_numpy(a) for a in args))
    if isinstance(result, dict):
        return {k: v.numpy() for k, v in result.items()}
    return [t.numpy() for t in result]


def infer(client, model: str, arrays: dict[str, tuple[str, np.ndarray]], outputs=None):
    inputs = []
    for name, (datatype, array) in arrays.items():
        item = httpclient.InferInput(name, list(array.shape), datatype)
        item.set_data_from_numpy(array)
        inputs.append(item)
    requested = [httpclient.InferRequestedOutput(o) for o in outputs] if outputs else None
    return client.infer(model, inputs, outputs=requested)


@needs_torch
@pytest.mark.parametrize("batch", [1, 8])
def test_index_named_tensors_match_torch(torch_server, modules, batch):
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 16), dtype=np.float32)
    y = rng.standard_normal((batch, 16), dtype=np.float32)
    result = infer(torch_server, "pt_addmul", {"INPUT__0": ("FP32", x), "INPUT__1": ("FP32", y)})
    out0, out1 = expected(modules["pt_addmul"], x, y)
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), out0, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), out1, rtol=1e-6)
    assert result.as_numpy("OUTPUT__0").shape == (batch, 16)


@needs_torch
@pytest.mark.parametrize("batch", [1, 8])
def test_forward_argument_names_match_torch(torch_server, modules, batch):
    rng = np.random.default_rng(10 + batch)
    values = rng.standard_normal((batch, 4), dtype=np.float32)
    offset = rng.integers(-5, 5, (batch, 4), dtype=np.int32)
    result = infer(
        torch_server, "pt_named", {"values": ("FP32", values), "offset": ("INT32", offset)}
    )
    scaled, total = expected(modules["pt_named"], offset, values)
    np.testing.assert_allclose(result.as_numpy("scaled"), scaled, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("total"), total, rtol=1e-5)


@needs_torch
@pytest.mark.parametrize("batch", [1, 8])
def test_dict_input_and_output_match_torch(torch_server, modules, batch):
    rng = np.random.default_rng(20 + batch)
    a = rng.integers(-100, 100, (batch, 3), dtype=np.int64)
    b = rng.integers(-100, 100, (batch, 3), dtype=np.int64)
    result = infer(torch_server, "pt_dict", {"a": ("INT64", a), "b": ("INT64", b)})
    with torch.inference_mode():
        want = modules["pt_dict"]({"a": torch.from_numpy(a), "b": torch.from_numpy(b)})
    np.testing.assert_array_equal(result.as_numpy("product"), want["product"].numpy())
    np.testing.assert_array_equal(result.as_numpy("maximum"), want["maximum"].numpy())


@needs_torch
def test_requested_output_only(torch_server):
    x = np.ones((2, 16), dtype=np.float32)
    result = infer(
        torch_server,
        "pt_addmul",
        {"INPUT__0": ("FP32", x), "INPUT__1": ("FP32", 2 * x)},
        outputs=["OUTPUT__1"],
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), np.ones((2, 16)))
    assert result.as_numpy("OUTPUT__0") is None


@needs_torch
def test_metadata_and_config_are_not_auto_completed(torch_server):
    metadata = torch_server.get_model_metadata("pt_addmul")
    assert metadata["platform"] == "pytorch_libtorch"
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT__0", "INPUT__1"]
    assert metadata["inputs"][0]["shape"] == [-1, 16]
    config = torch_server.get_model_config("pt_addmul")
    assert config["backend"] == "pytorch"
    assert [o["name"] for o in config["output"]] == ["OUTPUT__1", "OUTPUT__0"]


@needs_torch
def test_unservable_configs_are_unavailable_with_reasons(torch_server):
    rows = {row["name"]: row for row in torch_server.get_model_repository_index()}
    assert rows["pt_bytes"]["state"] == "UNAVAILABLE"
    # A BYTES input is a List[str] of one dimension, batch included (Triton's
    # ValidateInputs); this one is batched with dims [16].
    assert (
        "Triton only supports 1 dimensional List of String as input for 'INPUT__0' for "
        "model 'pt_bytes'" in rows["pt_bytes"]["reason"]
    )
    # TorchScript records no tensor metadata: like Triton, nothing is auto-completed.
    assert rows["pt_no_io"]["state"] == "UNAVAILABLE"
    # pytorch_backend's count check (src/pt/model_instance_state.cc:1363), its words.
    assert (
        "unable to load model 'pt_no_io', configuration expects 0 inputs, model provides 2"
        in rows["pt_no_io"]["reason"]
    )
    with pytest.raises(InferenceServerException):
        infer(torch_server, "pt_bytes", {"INPUT__1": ("FP32", np.ones((1, 16), np.float32))})
    assert torch_server.is_model_ready("pt_addmul")


@needs_torch
def test_bytes_tensors_are_lists_of_strings(torch_server):
    # TorchScript upper-cases ASCII only and its len() counts bytes: the UTF-8 text
    # reaches the model as the client sent it.
    words = np.array([b"abc", "h\u00e9llo".encode(), b""], dtype=object)
    result = infer(torch_server, "pt_strings", {"INPUT__0": ("BYTES", words)})
    assert result.as_numpy("OUTPUT__0").tolist() == [b"ABC!", "H\u00e9LLO!".encode(), b"!"]
    assert result.as_numpy("OUTPUT__1").tolist() == [3, 6, 0]  # len() counts UTF-8 bytes
    # A List[str] result alone is one output (gen_qa_reshape_models' object model).
    result = infer(torch_server, "pt_words", {"INPUT__0": ("BYTES", words)})
    assert result.as_numpy("OUTPUT__0").tolist() == [b"abcabc", "h\u00e9llo".encode() * 2, b""]
    with pytest.raises(InferenceServerException, match="not UTF-8"):
        infer(torch_server, "pt_strings", {"INPUT__0": ("BYTES", np.array([b"\xff"], object))})


@needs_torch
def test_a_sequence_model_takes_its_controls_and_state_as_arguments(torch_server):
    def step(value: int, start: bool, end: bool) -> int:
        inputs = [httpclient.InferInput("INPUT__0", [1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([value], np.int32))
        result = torch_server.infer(
            "pt_sequence", inputs, sequence_id=7, sequence_start=start, sequence_end=end
        )
        return int(result.as_numpy("OUTPUT__0")[0])

    assert [step(1, True, False), step(2, False, False), step(3, False, True)] == [1, 3, 6]
    assert step(5, True, True) == 5  # a new sequence starts from the zero state


# -- Triton's naming rules, unit-tested -----------------------------------------------


def test_name_index_follows_triton():
    assert pytorch_naming.name_index("INPUT__0") == 0
    assert pytorch_naming.name_index("OUTPUT__12") == 12
    assert pytorch_naming.name_index("INPUT0") is None
    assert pytorch_naming.name_index("my__input__0") is None  # digits must follow the first "__"
    assert pytorch_naming.name_index("INPUT__") is None


def test_bind_inputs_conventions():
    args = [("x", "TensorType"), ("y", "TensorType")]
    by_name = pytorch_naming.bind_inputs("m", ["y", "x"], args)
    assert by_name.positions == {"y": 1, "x": 0}
    by_index = pytorch_naming.bind_inputs("m", ["IN__1", "IN__0"], args)
    assert by_index.positions == {"IN__1": 1, "IN__0": 0}
    in_order = pytorch_naming.bind_inputs("m", ["b", "a"], args)
    assert in_order.positions == {"b": 0, "a": 1}
    as_dict = pytorch_naming.bind_inputs("m", ["a", "b", "c"], [("inputs", "DictType")])
    assert as_dict.as_dict
    with pytest.raises(InvalidArgument, match="configuration expects 1 inputs, model provides 2"):
        pytorch_naming.bind_inputs("m", ["x"], args)
    with pytest.raises(InvalidArgument, match="Tensor .or List.str.. arguments"):
        pytorch_naming.bind_inputs("m", ["x", "n"], [("x", "TensorType"), ("n", "IntType")])
    # A List[str] argument takes a BYTES input.
    strings = pytorch_naming.bind_inputs("m", ["x", "s"], [("x", "TensorType"), ("s", "ListType")])
    assert strings.positions == {"x": 0, "s": 1}
    # A sequence model's controls and states are arguments too (Triton counts them).
    four = [(n, "TensorType") for n in ("a", "b", "c", "d")]
    sequence = pytorch_naming.bind_inputs(
        "m", ["IN__0"], four, controls=["START__2", "READY__3"], states=["STATE__1"]
    )
    assert sequence.positions == {"IN__0": 0, "STATE__1": 1, "START__2": 2, "READY__3": 3}
    with pytest.raises(InvalidArgument, match="configuration expects 4 inputs, model provides 2"):
        pytorch_naming.bind_inputs(
            "m", ["IN__0"], args, controls=["START__2", "READY__3"], states=["STATE__1"]
        )
    with pytest.raises(InvalidArgument, match="'START' does not follow <name>__<index>"):
        pytorch_naming.bind_inputs("m", ["IN__0"], args, controls=["START"])
    with pytest.raises(InvalidArgument, match="state but not all inputs and outputs follow"):
        pytorch_naming.bind_inputs("m", ["x"], args, states=["STATE__1"])
    assert pytorch_naming.bind_outputs("m", ["OUT__0"], ["STATE__1"]) == {
        "OUT__0": 0,
        "STATE__1": 1,
    }
    assert pytorch_naming.bind_outputs("m", ["OUT__1", "OUT__0"]) == {"OUT__1": 1, "OUT__0": 0}
    assert pytorch_naming.bind_outputs("m", ["b", "a"]) == {"b": 0, "a": 1}


@needs_torch
def test_cpu_inputs_are_shared_with_numpy_unless_read_only(tmp_path, modules):
    from trionserve.backends.base import InstanceSpec, ModelContext
    from trionserve.repository.config import read_model_config

    torchscript_model(tmp_path, "pt_addmul", modules["pt_addmul"], MODELS["pt_addmul"]())
    model_config, _ = read_model_config(tmp_path / "pt_addmul")
    context = ModelContext(
        "pt_addmul", 1, model_config, tmp_path / "pt_addmul", tmp_path / "pt_addmul" / "1"
    )
    loaded = pytorch.PyTorchBackend().load(context)
    instance = loaded.create_instance(InstanceSpec("pt_addmul_0", "pt_addmul", "KIND_CPU", 0))
    writable = np.ones((2, 16), dtype=np.float32)
    assert instance._to_tensor("INPUT__0", writable).data_ptr() == writable.ctypes.data
    body = np.frombuffer(bytes(128), dtype=np.float32).reshape(2, 16)  # read-only view
    assert instance._to_tensor("INPUT__0", body).data_ptr() != body.ctypes.data
    instance.close()


@needs_torch
def test_outputs_that_alias_an_input_outlive_the_reused_input_buffers(tmp_path):
    """Batches are gathered into two input buffers used in turn; an output that is a
    view of its input (a model that returns it) is copied out, or the batch after
    next would overwrite a response not yet sent."""
    from trionserve.backends.base import InstanceSpec, ModelContext
    from trionserve.core.inference import InferenceRequest, Tensor
    from trionserve.repository.config import read_model_config

    text = config(
        "pt_identity",
        [tensor("INPUT__0", "TYPE_FP32", "4")],
        [tensor("OUTPUT__0", "TYPE_FP32", "4")],
    )
    torchscript_model(tmp_path, "pt_identity", Identity(), text)
    model_config, _ = read_model_config(tmp_path / "pt_identity")
    context = ModelContext(
        "pt_identity", 1, model_config, tmp_path / "pt_identity", tmp_path / "pt_identity" / "1"
    )
    instance = (
        pytorch.PyTorchBackend()
        .load(context)
        .create_instance(InstanceSpec("pt_identity_0", "pt_identity", "KIND_CPU", 0))
    )

    def batch(value: float) -> list:
        requests = []
        for _ in range(2):
            data = np.full((1, 4), value, dtype=np.float32)
            r = InferenceRequest(
                "pt_identity", inputs={"INPUT__0": Tensor("INPUT__0", "FP32", data)}
            )
            r.batch_size = 1
            requests.append(r)
        return requests

    first = instance.execute(batch(1.0))
    for value in (2.0, 3.0):  # the second of these reuses the first batch's buffer
        instance.execute(batch(value))
    for response in first:
        np.testing.assert_array_equal(response.outputs[0].data, np.ones((1, 4)))
    instance.close()


# -- a server without torch ------------------------------------------------------------


async def test_without_torch_the_model_is_unavailable(tmp_path, monkeypatch):
    """Simulates a missing torch in-process: the lazy import raises ImportError."""

    def no_torch():
        raise ModuleNotFoundError("No module named 'torch'")

    monkeypatch.setattr(pytorch_device, "_import_torch", no_torch)
    torchscript_model(tmp_path, "pt_addmul", None, MODELS["pt_addmul"]())
    options = ServerOptions(
        model_repositories=[tmp_path],
        allow_http=False,
        allow_grpc=False,
        allow_metrics=False,
        exit_on_error=False,
    )
    server = Server(options)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        rows = server.registry.index()
        server.shutdown()
    [row] = [r for r in rows if r["name"] == "pt_addmul"]
    assert row["state"] == "UNAVAILABLE"
    assert "torch, which is not installed" in row["reason"]
