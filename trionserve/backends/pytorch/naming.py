"""PyTorch backend's naming conventions: how config tensors meet forward()'s
arguments and results, and the data types it carries (pure: no torch needed).

Triton's pytorch backend (``src/libtorch.cc``: the ``<name>__<index>`` naming
convention, ModelState's input and output validation) decides these the same way;
:mod:`trionserve.backends.pytorch.backend` describes the rules, and
:mod:`trionserve.backends.pytorch.torch_aoti` reuses them for PyTorch 2 models.
"""

from __future__ import annotations

from dataclasses import dataclass

from trionserve.core.errors import InvalidArgument

# Config data types the backend can carry, as torch dtype attribute names. Like
# Triton's, it has no unsigned types above 8 bits; BYTES would need List[str].
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
    """How config inputs become forward() arguments."""

    as_dict: bool  # forward takes one Dict[str, Tensor] holding every input
    positions: dict[str, int]  # config input name -> argument position


def bind_inputs(
    model: str, config_inputs: list[str], arguments: list[tuple[str, str]]
) -> InputBinding:
    """Match config inputs to forward's ``(name, type kind)`` arguments (self excluded)."""
    if not config_inputs:
        raise InvalidArgument(
            f"model '{model}': the PyTorch backend cannot read a TorchScript model's "
            "inputs; list them in config.pbtxt (no input was given)"
        )
    if len(arguments) == 1 and arguments[0][1] == "DictType":
        return InputBinding(True, {name: i for i, name in enumerate(config_inputs)})
    for arg_name, kind in arguments:
        if kind != "TensorType":
            raise InvalidArgument(
                f"model '{model}': forward() argument '{arg_name}' is a {kind}; the "
                "PyTorch backend supports Tensor arguments or a single "
                "Dict(str, Tensor) argument"
            )
    if len(arguments) != len(config_inputs):
        raise InvalidArgument(
            f"unable to load model '{model}', configuration expects "
            f"{len(config_inputs)} inputs, model provides {len(arguments)}"
        )
    names = [a for a, _ in arguments]
    if all(name in names for name in config_inputs):
        return InputBinding(False, {name: names.index(name) for name in config_inputs})
    indices = [i for i in map(name_index, config_inputs) if i is not None]
    if len(indices) == len(config_inputs):
        if sorted(indices) != list(range(len(arguments))):
            raise InvalidArgument(
                f"model '{model}': input indices {sorted(indices)} do not match "
                f"forward()'s {len(arguments)} arguments"
            )
        return InputBinding(False, dict(zip(config_inputs, indices)))
    return InputBinding(False, {name: i for i, name in enumerate(config_inputs)})


def bind_outputs(model: str, config_outputs: list[str]) -> dict[str, int]:
    """Config output name -> position in the returned tuple."""
    if not config_outputs:
        raise InvalidArgument(
            f"model '{model}': the PyTorch backend cannot read a TorchScript model's "
            "outputs; list them in config.pbtxt (no output was given)"
        )
    indices = [i for i in map(name_index, config_outputs) if i is not None]
    if len(indices) == len(config_outputs):
        return dict(zip(config_outputs, indices))
    return {name: i for i, name in enumerate(config_outputs)}


def config_type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


def check_data_types(model: str, kind: str, entries) -> None:
    for entry in entries:
        type_name = config_type_name(entry.data_type)
        if type_name == "TYPE_STRING":
            raise InvalidArgument(
                f"model '{model}': {kind} '{entry.name}' is TYPE_STRING; the PyTorch "
                "backend does not support BYTES tensors"
            )
        if type_name not in TORCH_DTYPES:
            raise InvalidArgument(
                f"unsupported datatype {type_name} for {kind} '{entry.name}' for model '{model}'"
            )
