"""An ensemble checked against its composing models' configs, in Triton's words and
order (core src/ensemble_scheduler/ensemble_utils.cc ValidateEnsembleConfig)."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from trionserve._generated import model_config_pb2 as mc
from trionserve.backends.ensemble import plan_ensemble
from trionserve.backends.ensemble_graph import validate_ensemble
from trionserve.core.errors import InvalidArgument, NotFound
from trionserve.core.validation import ModelSignature


def tensor(name: str, dtype: str = "TYPE_FP32", dims: str = "4") -> str:
    return f'{{ name: "{name}" data_type: {dtype} dims: [ {dims} ] }}'


def model(name: str, inputs: list[str], outputs: list[str], extra: str = "") -> mc.ModelConfig:
    return text_format.Parse(
        f'name: "{name}" backend: "identity" {extra} '
        f"input [ {', '.join(inputs)} ] output [ {', '.join(outputs)} ]",
        mc.ModelConfig(),
    )


def step(model_name: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model_name}" model_version: -1 {" ".join(maps)} }}'


def ensemble(inputs: list[str], outputs: list[str], steps: list[str], extra="") -> mc.ModelConfig:
    return model(
        "pipe",
        inputs,
        outputs,
        f'platform: "ensemble" {extra} ensemble_scheduling {{ step [ {", ".join(steps)} ] }}',
    )


SCALE = model("scale", [tensor("X")], [tensor("Y")], "max_batch_size: 8")
DECOUPLED = "model_transaction_policy { decoupled: true }"


def test_an_ensemble_output_is_the_first_shape_a_step_output_must_match():
    """Triton makes nodes of the ensemble's own outputs before any step, so the
    ensemble is named first and the step second."""
    config = ensemble(
        [tensor("IN")],
        [tensor("OUT", dims="8")],
        [step("scale", {"X": "IN"}, {"Y": "OUT"})],
        "max_batch_size: 8",
    )
    with pytest.raises(InvalidArgument) as caught:
        validate_ensemble(config, [SCALE])
    assert caught.value.message == (
        "in ensemble pipe, ensemble tensor OUT: inconsistent shape: [-1,8] is inferred from "
        "model pipe while [-1,4] is inferred from model scale"
    )


def test_the_first_model_a_tensor_is_inferred_from_is_named_first():
    """A tensor read by two steps, written by none of them yet: the first reader
    sets its type, the second disagrees."""
    ints = model("ints", [tensor("X", "TYPE_INT32")], [tensor("Y", "TYPE_INT32")])
    config = ensemble(
        [tensor("IN")],
        [tensor("OUT"), tensor("OUT2", "TYPE_INT32")],
        [
            step("first", {"X": "IN"}, {"Y": "mid"}),
            step("scale", {"X": "mid"}, {"Y": "OUT"}),
            step("ints", {"X": "mid"}, {"Y": "OUT2"}),
        ],
    )
    first = model("first", [tensor("X")], [tensor("Y")])
    with pytest.raises(InvalidArgument) as caught:
        validate_ensemble(config, [first, model("scale", [tensor("X")], [tensor("Y")]), ints])
    assert caught.value.message == (
        "in ensemble pipe, ensemble tensor mid: inconsistent data type: TYPE_FP32 is inferred "
        "from model first while TYPE_INT32 is inferred from model ints"
    )


def test_batching_and_non_batching_models_share_a_tensor_by_full_shape():
    """[-1,4] with a batch dimension is [-1,4] without one (the full shapes agree)."""
    flat = model("flat", [tensor("X", dims="-1, 4")], [tensor("Y", dims="-1, 4")])
    config = ensemble(
        [tensor("IN")],
        [tensor("OUT")],
        [step("scale", {"X": "IN"}, {"Y": "mid"}), step("flat", {"X": "mid"}, {"Y": "OUT"})],
        "max_batch_size: 4",
    )
    assert validate_ensemble(config, [SCALE, flat]) is False


def test_the_ensemble_input_reshape_is_its_shape_between_steps():
    config = ensemble(
        [tensor("IN", dims="2, 2") + ""],
        [tensor("OUT")],
        [step("scale", {"X": "IN"}, {"Y": "OUT"})],
        "max_batch_size: 8",
    )
    config.input[0].reshape.shape.extend([4])
    assert validate_ensemble(config, [SCALE]) is False


def test_a_model_batching_less_than_the_ensemble():
    config = ensemble([tensor("IN")], [tensor("OUT")], [step("scale", {"X": "IN"}, {"Y": "OUT"})])
    config.max_batch_size = 16
    with pytest.raises(InvalidArgument, match=r"^ensemble pipe allows maximum batch size 16, "):
        validate_ensemble(config, [SCALE])


def branching(join_inputs: dict[str, str]) -> tuple[mc.ModelConfig, list[mc.ModelConfig]]:
    """Two decoupled steps from one input, then a step joining ``join_inputs``."""
    burst = model("burst", [tensor("X", dims="1")], [tensor("Y", dims="1")], DECOUPLED)
    join = model(
        "join",
        [tensor("A", dims="1"), tensor("B", dims="1")],
        [tensor("C", dims="1"), tensor("D", dims="1")],
    )
    config = ensemble(
        [tensor("IN", dims="1")],
        [tensor("OUT", dims="1")],
        [
            step("burst", {"X": "IN"}, {"Y": "b1"}),
            step("burst", {"X": "IN"}, {"Y": "b2"}),
            step("join", join_inputs, {"C": "c", "D": "d"}),
            step("join", {"A": "c", "B": "d"}, {"C": "OUT"}),
        ],
    )
    return config, [burst, burst, join, join]


def test_a_step_reading_two_decoupled_branches_is_refused():
    config, models = branching({"A": "b1", "B": "b2"})
    with pytest.raises(InvalidArgument) as caught:
        validate_ensemble(config, models)
    assert caught.value.message == (
        "in ensemble pipe, step of model 'join' receives inputs originated from different "
        "decoupled models"
    )


def test_outputs_of_one_step_carry_one_decoupled_label():
    """A decoupled step's two outputs are one branch: a step may read both, and
    the ensemble is decoupled."""
    pair = model(
        "pair", [tensor("X", dims="1")], [tensor("Y", dims="1"), tensor("Z", dims="1")], DECOUPLED
    )
    join = model("join", [tensor("A", dims="1"), tensor("B", dims="1")], [tensor("C", dims="1")])
    config = ensemble(
        [tensor("IN", dims="1")],
        [tensor("OUT", dims="1")],
        [
            step("pair", {"X": "IN"}, {"Y": "y", "Z": "z"}),
            step("join", {"A": "y", "B": "z"}, {"C": "OUT"}),
        ],
    )
    assert validate_ensemble(config, [pair, join]) is True


def test_an_ensemble_output_joining_two_decoupled_branches_is_refused():
    """The ensemble's outputs meet in one sink: outputs of two decoupled steps
    cannot be answered together (the sink is named after the ensemble)."""
    burst = model("burst", [tensor("X", dims="1")], [tensor("Y", dims="1")], DECOUPLED)
    config = ensemble(
        [tensor("IN", dims="1")],
        [tensor("O1", dims="1"), tensor("O2", dims="1")],
        [step("burst", {"X": "IN"}, {"Y": "O1"}), step("burst", {"X": "IN"}, {"Y": "O2"})],
    )
    with pytest.raises(InvalidArgument, match="step of model 'pipe' receives inputs originated"):
        validate_ensemble(config, [burst, burst])


class Versions:
    """Composing models by name (each one is SCALE); ``loaded`` versions of each."""

    def __init__(self, loaded: dict[str, set[int]]) -> None:
        self.loaded = loaded

    def model(self, name: str, version: int | None, namespace: str):
        versions = self.loaded.get(name, set())
        if not versions or (version is not None and version not in versions):
            raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")
        return self

    config = SCALE
    signature = ModelSignature.from_config(SCALE)


def test_a_step_naming_a_version_that_is_not_loaded():
    config = ensemble([tensor("IN")], [tensor("OUT")], [step("scale", {"X": "IN"}, {"Y": "OUT"})])
    config.ensemble_scheduling.step[0].model_version = 2
    with pytest.raises(InvalidArgument) as caught:
        plan_ensemble(config, 1, Versions({"scale": {1}}).model)
    assert caught.value.message.startswith(
        "ensemble 'pipe' depends on 'scale' whose required version 2 is not loaded."
    )
    with pytest.raises(InvalidArgument, match="^ensemble 'pipe' depends on 'scale' which has no"):
        plan_ensemble(config, 1, Versions({}).model)
    assert plan_ensemble(config, 1, Versions({"scale": {1, 2}}).model).steps[0].model_version == 2
