"""PyTorch backend's naming conventions: how config tensors meet forward()'s
arguments and results, and the data types it carries (pure: no torch needed).

Triton's pytorch backend (``src/libtorch.cc``: the ``<name>__<index>`` naming
convention, ModelState's input and output validation) decides these the same way;
:mod:`trionserve.backends.pytorch.backend` describes the rules, and
:mod:`trionserve.backends.pytorch.torch_aoti` reuses them for PyTorch 2 models.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from trionserve.core.errors import InvalidArgument

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelTensorReshape

# Config data types the backend carries as tensors, as torch dtype attribute names.
# Like Triton's, it has no unsigned types above 8 bits; BYTES is a List[str].
TORCH_DTYPES = {
    "TYPE_BOOL": "bool",
    "TYPE_UINT8": "uint8",
    "TYPE_INT8": "int8",
    "TYPE_INT16": "int16",
    "TYPE_INT32": "int32",
    "TYPE_INT64": "int64",
    "TYPE_FP16": "float16",
    "TYPE_FP32": "float32",
    "TYPE_FP64": "float64",
    "TYPE_BF16": "bfloat16",
}
INDEX_DELIMITER = "__"


def name_index(name: str) -> int | None:
    """The index of a ``<name>__<index>`` tensor name, else None (Triton's rule:
    everything after the first ``__`` must be digits)."""
    head, sep, tail = name.partition(INDEX_DELIMITER)
    if not sep or not tail.isdigit():
        return None
    return int(tail)


@dataclass(frozen=True, slots=True)
class InputBinding:
    """How config inputs (and a sequence model's controls and states) become
    forward() arguments."""

    as_dict: bool  # forward takes one Dict[str, Tensor] holding every input
    positions: dict[str, int]  # input name -> argument position


def _indexed(model: str, name: str, what: str) -> int:
    index = name_index(name)
    if index is None:
        raise InvalidArgument(f"{what} '{name}' does not follow <name>__<index> naming convention.")
    return index


def bind_inputs(
    model: str,
    config_inputs: list[str],
    arguments: list[tuple[str, str]],
    *,
    controls: list[str] | None = None,
    states: list[str] | None = None,
    batch_inputs: list[str] | None = None,
) -> InputBinding:
    """Match config inputs to forward's ``(name, type kind)`` arguments (self excluded).

    A sequence model's control inputs (``controls``) and implicit state inputs
    (``states``) are forward() arguments too, as Triton's pytorch backend counts
    them (pytorch_backend src/pt/model_instance_state.cc, the instance's
    constructor: ``expected_input_cnt`` adds one per START/END/READY/CORRID control
    and one per state): a control is placed by its ``<name>__<index>``
    (ValidateBooleanSequenceControl / ValidateTypedSequenceControl), a state by the
    naming convention, which a model with states must follow
    (GetNamingConvention).

    ``batch_inputs`` (the targets of the config's ``batch_input``) are arguments
    too, placed by the convention the config's inputs chose (AddInputToMap, after
    ValidateInputs): by argument name, by ``<name>__<index>``, or in config order
    after the config's inputs.
    """
    controls = controls or []
    states = states or []
    batch_inputs = batch_inputs or []
    control_positions = {name: _indexed(model, name, "input") for name in controls}
    every = config_inputs + states
    if len(arguments) == 1 and arguments[0][1] == "DictType":
        positions = {name: i for i, name in enumerate(every + batch_inputs)}
        return InputBinding(True, {**positions, **control_positions})
    for arg_name, kind in arguments:
        if kind not in ("TensorType", "ListType"):
            raise InvalidArgument(
                f"model '{model}': forward() argument '{arg_name}' is a {kind}; the "
                "PyTorch backend supports Tensor (or List[str]) arguments or a single "
                "Dict(str, Tensor) argument"
            )
    expected = len(config_inputs) + len(controls) + len(states) + len(batch_inputs)
    if len(arguments) != expected:
        raise InvalidArgument(
            f"unable to load model '{model}', configuration expects "
            f"{expected} inputs, model provides {len(arguments)}"
        )
    names = [a for a, _ in arguments]
    indices = [name_index(name) for name in config_inputs]
    if all(name in names for name in config_inputs) and not states:
        unknown = [name for name in batch_inputs if name not in names]
        if unknown:
            raise InvalidArgument(
                f"model '{model}': batch input(s) {unknown} are not arguments of forward(), "
                f"whose arguments are {names}"
            )
        positions = {name: names.index(name) for name in config_inputs + batch_inputs}
    elif all(i is not None for i in indices):
        positions = {name: _indexed(model, name, "input") for name in every + batch_inputs}
    elif states:
        raise InvalidArgument(
            f"PyTorch model '{model}' is using sequence batching with state but not all "
            "inputs and outputs follow the <name>__<index> naming convention. "
        )
    else:
        positions = {name: i for i, name in enumerate(config_inputs + batch_inputs)}
    positions.update(control_positions)
    if sorted(positions.values()) != list(range(len(arguments))):
        raise InvalidArgument(
            f"model '{model}': input indices {sorted(positions.values())} do not match "
            f"forward()'s {len(arguments)} arguments"
        )
    return InputBinding(False, positions)


def bind_outputs(
    model: str, config_outputs: list[str], states: list[str] | None = None
) -> dict[str, int]:
    """Config output name (and implicit state output name) -> position in the
    returned tuple; a state output is placed by its ``<name>__<index>``, as
    ValidateOutputs reads it."""
    states = states or []
    if not config_outputs:
        # pytorch_backend src/pt/model_instance_state.cc ValidateOutputs:1494, its
        # words (the backend cannot read a TorchScript model's outputs).
        raise InvalidArgument(
            f"model '{model}': model configuration must contain at least one output, "
            "none were specified."
        )
    indices = [i for i in map(name_index, config_outputs) if i is not None]
    if len(indices) == len(config_outputs):
        positions = dict(zip(config_outputs, indices))
    elif states:
        raise InvalidArgument(
            f"PyTorch model '{model}' is using sequence batching with state but not all "
            "inputs and outputs follow the <name>__<index> naming convention. "
        )
    else:
        positions = {name: i for i, name in enumerate(config_outputs)}
    for name in states:
        index = name_index(name)
        if index is None:
            raise InvalidArgument(
                f"PyTorch model '{model}' is using sequence batching with state but state "
                f"'{name}' does not follow the <name>__<index> naming convention. "
            )
        positions.setdefault(name, index)
    return positions


class ConfigTensor(Protocol):
    """A tensor of a config as its type is checked: an input, an output, or a
    sequence state read as one."""

    @property
    def name(self) -> str: ...
    @property
    def data_type(self) -> int: ...
    @property
    def dims(self) -> Sequence[int]: ...
    @property
    def reshape(self) -> ModelTensorReshape: ...
    def HasField(self, field_name: str, /) -> bool: ...  # noqa: N802 (protobuf's name)


def config_type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


def check_data_types(
    model: str,
    kind: str,
    entries: Iterable[ConfigTensor],
    *,
    strings: bool = False,
    batching: bool = False,
) -> None:
    """Each tensor's type is one the backend carries. With ``strings`` (TorchScript),
    TYPE_STRING is a ``List[str]`` of one dimension, batch included, as Triton's
    ValidateInputs / ValidateOutputs allow it."""
    for entry in entries:
        type_name = config_type_name(entry.data_type)
        if type_name == "TYPE_STRING":
            if not strings:
                raise InvalidArgument(
                    f"model '{model}': {kind} '{entry.name}' is TYPE_STRING; PyTorch 2 "
                    "models do not take BYTES tensors"
                )
            dims = list(entry.reshape.shape) if entry.HasField("reshape") else list(entry.dims)
            if len(dims) + (1 if batching else 0) > 1:
                raise InvalidArgument(
                    f"Triton only supports 1 dimensional List of String as {kind} for "
                    f"'{entry.name}' for model '{model}'"
                )
            continue
        if type_name not in TORCH_DTYPES:
            raise InvalidArgument(
                f"unsupported datatype {type_name} for {kind} '{entry.name}' for model '{model}'"
            )
