"""Batch inputs and batch outputs (a config's ``batch_input`` / ``batch_output``):
the tensors built from a batch's shapes, each kind against the values Triton's
backend library gives (src/backend_input_collector.cc ProcessBatchInput,
src/backend_output_responder.cc ProcessBatchOutput), and a real ONNX model and a
real TorchScript module fed and scattered by their backends' instances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper

from trionserve._generated import model_config_pb2 as mc
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.batch_io import BatchTensors
from trionserve.backends.batch_tensors import build_responses, split_outputs
from trionserve.core.errors import InternalError, InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.repository.config import normalize_model_config


def _config(batch_io: str, *, dims: str = "[ -1 ]", out_dims: str = "[ -1 ]") -> mc.ModelConfig:
    config = text_format.Parse(
        f"""
        name: "ragged"
        max_batch_size: 4
        input [ {{ name: "RAGGED" data_type: TYPE_FP32 dims: {dims} allow_ragged_batch: true }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: {out_dims} }} ]
        {batch_io}
        """,
        mc.ModelConfig(),
    )
    normalize_model_config(config)
    return config


def _batch_input(kind: str, data_type: str = "TYPE_FP32") -> str:
    return (
        f'batch_input [ {{ kind: {kind} target_name: "BI" data_type: {data_type} '
        'source_input: "RAGGED" } ]'
    )


def _request(shape: tuple[int, ...], value: float | None = None) -> InferenceRequest:
    fill = float(shape[-1]) if value is None else value
    data = np.full(shape, fill, dtype=np.float32)
    request = InferenceRequest(
        "ragged", id=str(shape), inputs={"RAGGED": Tensor("RAGGED", "FP32", data)}
    )
    request.batch_size = shape[0]  # as validation sets it
    return request


# Element counts 2, 4, 1, 3, as L0_batch_input sends them.
COUNTS = [(1, 2), (1, 4), (1, 1), (1, 3)]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("BATCH_ELEMENT_COUNT", [2, 4, 1, 3]),
        ("BATCH_ACCUMULATED_ELEMENT_COUNT", [2, 6, 7, 10]),
        ("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", [0, 2, 6, 7, 10]),
    ],
)
def test_element_counts_are_one_per_request(kind, expected):
    tensors = BatchTensors("ragged", _config(_batch_input(kind)))
    built = tensors.input_tensors([_request(s) for s in COUNTS])["BI"]
    assert built.dtype == np.float32
    assert built.tolist() == expected


def test_element_counts_count_the_batch_dimension_and_every_request_not_item():
    tensors = BatchTensors(
        "ragged", _config(_batch_input("BATCH_ELEMENT_COUNT", "TYPE_INT32"), dims="[ -1, -1 ]")
    )
    built = tensors.input_tensors([_request((2, 3, 1)), _request((1, 1, 5))])["BI"]
    assert built.dtype == np.int32
    assert built.tolist() == [6, 5]  # two requests, 2*3*1 and 1*1*5 elements


def test_max_element_count_is_the_shape():
    tensors = BatchTensors("ragged", _config(_batch_input("BATCH_MAX_ELEMENT_COUNT_AS_SHAPE")))
    built = tensors.input_tensors([_request(s) for s in COUNTS])["BI"]
    assert built.shape == (4,)


def test_item_shape_has_a_row_per_batch_item():
    tensors = BatchTensors("ragged", _config(_batch_input("BATCH_ITEM_SHAPE"), dims="[ -1, -1 ]"))
    requests = [_request((2, 1, 2)), _request((1, 1, 2)), _request((1, 2, 2))]
    built = tensors.input_tensors(requests)["BI"]
    assert built.tolist() == [[1, 2], [1, 2], [1, 2], [2, 2]]


def test_item_shape_flatten_is_one_dimension():
    tensors = BatchTensors(
        "ragged", _config(_batch_input("BATCH_ITEM_SHAPE_FLATTEN"), dims="[ -1, -1 ]")
    )
    requests = [_request(s) for s in [(1, 4, 1), (1, 1, 2), (1, 1, 2), (1, 2, 2)]]
    built = tensors.input_tensors(requests)["BI"]
    assert built.tolist() == [4, 1, 1, 2, 1, 2, 2, 2]


def test_item_shape_of_sources_of_different_ranks_is_refused_naming_them():
    tensors = BatchTensors("ragged", _config(_batch_input("BATCH_ITEM_SHAPE"), dims="[ -1 ]"))
    with pytest.raises(InvalidArgument, match=r"same rank.*\[1, 2\], \[1, 2, 3\]"):
        tensors.input_tensors([_request((1, 2)), _request((1, 2, 3))])


def test_one_batch_input_can_feed_several_model_inputs():
    config = _config(
        'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: [ "A", "B" ] '
        'data_type: TYPE_INT32 source_input: "RAGGED" } ]'
    )
    tensors = BatchTensors("ragged", config)
    assert tensors.input_names == ["A", "B"]
    built = tensors.input_tensors([_request((1, 2))])
    assert built["A"].tolist() == built["B"].tolist() == [2]


SCATTER = (
    'batch_output [ { target_name: "OUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE '
    'source_input: "RAGGED" } ]'
)


def test_a_batch_output_is_scattered_with_each_source_input_shape():
    tensors = BatchTensors("ragged", _config(SCATTER))
    requests = [_request(s) for s in COUNTS]
    flat = np.concatenate([r.inputs["RAGGED"].data.reshape(-1) for r in requests])
    per_request = split_outputs({"OUT": flat, "OTHER": np.arange(4)}, requests, tensors)
    assert [p["OUT"].tolist() for p in per_request] == [[[2, 2]], [[4] * 4], [[1]], [[3] * 3]]
    # Other outputs are still sliced along the batch dimension.
    assert [p["OTHER"].tolist() for p in per_request] == [[0], [1], [2], [3]]
    # A batch of one is scattered too: the output takes the input's shape.
    alone = split_outputs({"OUT": flat[:2]}, requests[:1], tensors)
    assert alone[0]["OUT"].shape == (1, 2)


def test_a_fixed_output_dimension_stays_in_the_scatter():
    tensors = BatchTensors("ragged", _config(SCATTER, dims="[ -1, -1 ]", out_dims="[ -1, 2 ]"))
    requests = [_request((1, 3, 5)), _request((2, 1, 7))]
    per_request = split_outputs({"OUT": np.arange(10.0)}, requests, tensors)
    assert per_request[0]["OUT"].shape == (1, 3, 2)
    assert per_request[1]["OUT"].tolist() == [[[6.0, 7.0]], [[8.0, 9.0]]]


def test_a_batch_output_too_small_for_the_requests_fails_the_batch_naming_it():
    tensors = BatchTensors("ragged", _config(SCATTER))
    requests = [_request((1, 2)), _request((1, 4))]
    with pytest.raises(InternalError, match=r"output 'OUT' .* has 5 elements.*need at least 6"):
        build_responses(
            requests, "ragged", "1", {"OUT": np.zeros(5)}, {"OUT": "FP32"}, None, tensors
        )


# -- a real ONNX model, run by the ONNX Runtime backend's instance ---------------


def _ragged_onnx(path: Path) -> None:
    """OUT = RAGGED (identity, flat); OFFSETS = the batch input BI as a column."""
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["RAGGED"], ["OUT"]),
            helper.make_node("Unsqueeze", ["BI", "AXES"], ["OFFSETS"]),
        ],
        "ragged",
        [
            helper.make_tensor_value_info("RAGGED", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("BI", TensorProto.FLOAT, ["m"]),
        ],
        [
            helper.make_tensor_value_info("OUT", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("OFFSETS", TensorProto.FLOAT, ["m", 1]),
        ],
        initializer=[helper.make_tensor("AXES", TensorProto.INT64, [1], [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _onnx_instance(tmp_path: Path, batch_io: str):
    from trionserve.backends.onnxruntime.backend import OnnxRuntimeBackend

    (tmp_path / "1").mkdir()
    _ragged_onnx(tmp_path / "1" / "model.onnx")
    config = text_format.Parse(
        f"""
        name: "ragged" platform: "onnxruntime_onnx" max_batch_size: 4
        input [ {{ name: "RAGGED" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }},
                 {{ name: "OFFSETS" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        {batch_io}
        """,
        mc.ModelConfig(),
    )
    normalize_model_config(config)
    context = ModelContext("ragged", 1, config, tmp_path, tmp_path / "1")
    model = OnnxRuntimeBackend().load(context)
    return model.create_instance(InstanceSpec("ragged_0_0", "ragged_0", "KIND_CPU", 0))


def test_onnx_runtime_feeds_batch_inputs_and_scatters_batch_outputs(tmp_path):
    instance = _onnx_instance(
        tmp_path, _batch_input("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO") + "\n" + SCATTER
    )
    requests = [_request(s) for s in COUNTS]
    responses = instance.execute(requests)
    assert all(isinstance(r, InferenceResponse) for r in responses), responses
    outs = [{t.name: t.data for t in r.outputs} for r in responses]
    assert [o["OUT"].tolist() for o in outs] == [[[2, 2]], [[4] * 4], [[1]], [[3] * 3]]
    # OFFSETS is not a batch output: sliced by batch size, one offset per request.
    assert [o["OFFSETS"].tolist() for o in outs] == [[[0]], [[2]], [[6]], [[7]]]


def test_onnx_runtime_fails_a_batch_missing_a_batch_input_source(tmp_path):
    instance = _onnx_instance(tmp_path, _batch_input("BATCH_ELEMENT_COUNT") + "\n" + SCATTER)
    request = InferenceRequest("ragged", id="x", inputs={})
    request.batch_size = 1
    (result,) = instance.execute([request])
    assert isinstance(result, InvalidArgument)
    assert "input 'RAGGED'" in str(result)


# -- the PyTorch backend's argument binding ----------------------------------------


def test_torchscript_batch_inputs_are_forward_arguments_by_the_inputs_convention():
    from trionserve.backends.pytorch.naming import bind_inputs

    arguments = [("BATCH_INPUT", "TensorType"), ("SIZES", "TensorType"), ("RAGGED", "TensorType")]
    binding = bind_inputs("m", ["RAGGED"], arguments, batch_inputs=["SIZES", "BATCH_INPUT"])
    assert binding.positions == {"RAGGED": 2, "SIZES": 1, "BATCH_INPUT": 0}
    # Config order when names do not match: batch inputs after the config's inputs.
    plain = [("a", "TensorType"), ("b", "TensorType")]
    binding = bind_inputs("m", ["X"], plain, batch_inputs=["Y"])
    assert binding.positions == {"X": 0, "Y": 1}
    with pytest.raises(InvalidArgument, match="expects 3 inputs, model provides 2"):
        bind_inputs("m", ["X"], plain, batch_inputs=["Y", "Z"])


def test_torchscript_config_without_inputs_or_outputs_gets_the_backends_words():
    # qa/L0_model_config autofill_noplatform/pytorch/too_few_{inputs,outputs}:
    # pytorch_backend src/pt/model_instance_state.cc:1363 and :1494, its words.
    from trionserve.backends.pytorch.naming import bind_inputs, bind_outputs

    plain = [("a", "TensorType"), ("b", "TensorType")]
    with pytest.raises(InvalidArgument) as info:
        bind_inputs("m", [], plain)
    assert info.value.message == (
        "unable to load model 'm', configuration expects 0 inputs, model provides 2"
    )
    with pytest.raises(InvalidArgument) as info:
        bind_outputs("m", [])
    assert info.value.message == (
        "model 'm': model configuration must contain at least one output, none were specified."
    )


def test_torchscript_instance_gets_ragged_and_batch_inputs_and_scatters(tmp_path):
    torch = pytest.importorskip("torch")
    from trionserve.backends.pytorch.backend import PyTorchBackend

    class Ragged(torch.nn.Module):
        def forward(self, OFFSETS: torch.Tensor, RAGGED: torch.Tensor):  # noqa: N803
            # One row per request: its offset, then the ragged tensor doubled.
            return OFFSETS.reshape(-1, 1)[: OFFSETS.shape[0] - 1], RAGGED * 2

    (tmp_path / "1").mkdir()
    torch.jit.script(Ragged()).save(str(tmp_path / "1" / "model.pt"))
    config = text_format.Parse(
        """
        name: "ragged" backend: "pytorch" max_batch_size: 4
        input [ { name: "RAGGED" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
        output [ { name: "START" data_type: TYPE_FP32 dims: [ 1 ] },
                 { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
        batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "OFFSETS"
                        data_type: TYPE_FP32 source_input: "RAGGED" } ]
        batch_output [ { target_name: "OUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE
                         source_input: "RAGGED" } ]
        """,
        mc.ModelConfig(),
    )
    normalize_model_config(config)
    context = ModelContext("ragged", 1, config, tmp_path, tmp_path / "1")
    model = PyTorchBackend().load(context)
    instance = model.create_instance(InstanceSpec("ragged_0_0", "ragged_0", "KIND_CPU", 0))
    responses = instance.execute([_request(s) for s in COUNTS])
    assert all(isinstance(r, InferenceResponse) for r in responses), responses
    outs = [{t.name: t.data.tolist() for t in r.outputs} for r in responses]
    assert [o["START"] for o in outs] == [[[0]], [[2]], [[6]], [[7]]]
    assert [o["OUT"] for o in outs] == [[[4, 4]], [[8] * 4], [[2]], [[6] * 3]]


def test_a_ragged_input_is_still_validated_against_its_dims_and_batch_size():
    from trionserve.core.validation import ModelSignature, validate_request

    config = _config("", dims="[ -1, 2 ]")
    config.input.add(name="OTHER", data_type=mc.TYPE_FP32, dims=[1])
    signature = ModelSignature.from_config(config)

    def ragged(shape: tuple[int, ...], other_batch: int = 1) -> InferenceRequest:
        other = np.zeros((other_batch, 1), dtype=np.float32)
        inputs = {
            "RAGGED": Tensor("RAGGED", "FP32", np.zeros(shape, dtype=np.float32)),
            "OTHER": Tensor("OTHER", "FP32", other),
        }
        return InferenceRequest("ragged", id="r", inputs=inputs)

    validate_request(ragged((1, 5, 2)), signature)  # any length where the dims say -1
    with pytest.raises(
        InvalidArgument, match=r"unexpected shape for input 'RAGGED'.*got \[1,5,3\]"
    ):
        validate_request(ragged((1, 5, 3)), signature)
    with pytest.raises(InvalidArgument, match="batch size 2 does not match"):
        validate_request(ragged((1, 5, 2), other_batch=2), signature)


def test_item_shape_kinds_need_a_model_that_batches():
    config = _config(_batch_input("BATCH_ITEM_SHAPE"))
    config.max_batch_size = 0
    with pytest.raises(InvalidArgument, match=r"BATCH_ITEM_SHAPE for 'RAGGED' needs a model"):
        BatchTensors("ragged", config)


def test_a_pytorch_2_program_gets_batch_inputs_by_name(tmp_path):
    torch = pytest.importorskip("torch")
    from trionserve.backends.pytorch.backend import PyTorchBackend

    class Counts(torch.nn.Module):
        def forward(self, RAGGED: torch.Tensor, COUNTS: torch.Tensor):  # noqa: N803
            return COUNTS.reshape(-1, 1), RAGGED + 1

    n = torch.export.Dim("n")
    m = torch.export.Dim("m")
    program = torch.export.export(
        Counts(),
        (torch.zeros(4), torch.zeros(2, dtype=torch.int32)),
        dynamic_shapes=({0: n}, {0: m}),
    )
    (tmp_path / "1").mkdir()
    torch.export.save(program, str(tmp_path / "1" / "model.pt2"))
    config = text_format.Parse(
        """
        name: "ragged" platform: "torch_aoti" max_batch_size: 4
        default_model_filename: "model.pt2"
        input [ { name: "ARGS[0]" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
        output [ { name: "RESULT[0]" data_type: TYPE_INT32 dims: [ 1 ] },
                 { name: "RESULT[1]" data_type: TYPE_FP32 dims: [ -1 ] } ]
        batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "ARGS[1]"
                        data_type: TYPE_INT32 source_input: "ARGS[0]" } ]
        batch_output [ { target_name: "RESULT[1]" kind: BATCH_SCATTER_WITH_INPUT_SHAPE
                         source_input: "ARGS[0]" } ]
        """,
        mc.ModelConfig(),
    )
    normalize_model_config(config)
    context = ModelContext("ragged", 1, config, tmp_path, tmp_path / "1")
    instance = (
        PyTorchBackend()
        .load(context)
        .create_instance(InstanceSpec("ragged_0_0", "ragged_0", "KIND_CPU", 0))
    )

    def request(length: int) -> InferenceRequest:
        data = np.full((1, length), float(length), dtype=np.float32)
        r = InferenceRequest(
            "ragged", id=str(length), inputs={"ARGS[0]": Tensor("ARGS[0]", "FP32", data)}
        )
        r.batch_size = 1
        return r

    responses = instance.execute([request(3), request(2)])
    assert all(isinstance(r, InferenceResponse) for r in responses), responses
    outs = [{t.name: t.data.tolist() for t in r.outputs} for r in responses]
    assert [o["RESULT[0]"] for o in outs] == [[[3]], [[2]]]
    assert [o["RESULT[1]"] for o in outs] == [[[4, 4, 4]], [[3, 3]]]
