"""Load-time check of an ONNX model against its configuration, as Triton's backend does.

Triton's onnxruntime_backend refuses, when an instance loads, a configuration that
does not match its model (``src/onnxruntime.cc``, ``ModelInstanceState``:
``ValidateInputs``, ``ValidateOutputs``, ``ValidateBooleanSequenceControl``,
``ValidateTypedSequenceControl``; ``src/onnxruntime_utils.cc``,
``CompareDimsSupported``; backend ``src/backend_common.cc``,
``CheckAllowedModelInput`` / ``CheckAllowedModelOutput``). Without the check such
a model would load READY and fail every request. The checks and their words are
Triton's, in its order, so the first mismatch named is the one Triton names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from trionserve.core.errors import InternalError, InvalidArgument

if TYPE_CHECKING:
    from onnxruntime import InferenceSession, NodeArg

    from trionserve._generated.model_config_pb2 import (
        ModelConfig,
        ModelInput,
        ModelOutput,
        ModelSequenceBatching,
    )

__all__ = ["validate_session"]

# Triton config datatypes -> onnxruntime's type strings
# (ModelConfigDataTypeToOnnxDataType).
_ORT_TYPE = {
    "TYPE_BOOL": "tensor(bool)",
    "TYPE_UINT8": "tensor(uint8)",
    "TYPE_UINT16": "tensor(uint16)",
    "TYPE_UINT32": "tensor(uint32)",
    "TYPE_UINT64": "tensor(uint64)",
    "TYPE_INT8": "tensor(int8)",
    "TYPE_INT16": "tensor(int16)",
    "TYPE_INT32": "tensor(int32)",
    "TYPE_INT64": "tensor(int64)",
    "TYPE_BF16": "tensor(bfloat16)",
    "TYPE_FP16": "tensor(float16)",
    "TYPE_FP32": "tensor(float)",
    "TYPE_FP64": "tensor(double)",
    "TYPE_STRING": "tensor(string)",
}
# onnxruntime's type strings -> TRITONSERVER_DataTypeString, as Triton words the
# model's side of a datatype mismatch ("model provides TYPE_BYTES").
_TRITON_TYPE = {ort: "TYPE_" + config[5:] for config, ort in _ORT_TYPE.items()}
_TRITON_TYPE["tensor(string)"] = "TYPE_BYTES"

_BOOLEAN_CONTROLS = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY")
_TYPED_CONTROLS = ("CONTROL_SEQUENCE_CORRID",)


class _Tensor:
    """What the session says of one input or output: its type string and dims
    (-1 for a symbolic or unknown dimension)."""

    __slots__ = ("dims", "type")

    def __init__(self, node: NodeArg) -> None:
        self.type: str = node.type
        self.dims = [d if isinstance(d, int) and d >= 0 else -1 for d in (node.shape or ())]


def _shape(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


def validate_session(config: ModelConfig, name: str, session: InferenceSession) -> None:
    """Raise InvalidArgument (or InternalError where Triton's backend says INTERNAL)
    naming the first way ``config`` does not match the ONNX ``session``'s model."""
    inputs = {n.name: _Tensor(n) for n in session.get_inputs()}
    initializers = {n.name: _Tensor(n) for n in session.get_overridable_initializers()}
    outputs = {n.name: _Tensor(n) for n in session.get_outputs()}

    expected = sum(1 for i in config.input if not i.optional) + len(config.batch_input)
    if config.HasField("sequence_batching"):
        batching = config.sequence_batching
        for kind in (*_BOOLEAN_CONTROLS, *_TYPED_CONTROLS):
            expected += _check_sequence_control(config, name, batching, kind, inputs)
        expected += len(batching.state)
    if len(inputs) != expected:
        raise InvalidArgument(
            f"unable to load model '{name}', configuration expects {expected} inputs, "
            f"model provides {len(inputs)}"
        )
    inputs.update(initializers)  # overridable initializers may be request inputs

    io: ModelInput | ModelOutput
    for io in config.input:
        if io.optional and config.max_batch_size != 0:
            raise InvalidArgument(
                f"unable to load model '{name}', optional input '{io.name}' is not "
                "supported for models that support batching"
            )
        tensor = _find(io.name, inputs, "input")
        _check_type(name, io.name, _type_name(io.data_type), tensor, "input")
        dims = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
        if io.optional and io.allow_ragged_batch:
            raise InvalidArgument(
                f"unable to load model '{name}', configuration expects model provides "
                f"input with shape [-1] for ragged input '{io.name}', which is not "
                "supported for optional input"
            )
        if io.allow_ragged_batch:
            if tensor.dims != [-1]:
                raise InvalidArgument(
                    f"unable to load model '{name}', configuration expects model "
                    f"provides input with shape [-1]  for ragged input '{io.name}', "
                    f"model provides {_shape(tensor.dims)}"
                )
        else:
            _check_dims(name, io.name, tensor.dims, dims, config.max_batch_size, exact=False)

    batch_outputs = {target for b in config.batch_output for target in b.target_name}
    for io in config.output:
        tensor = _find(io.name, outputs, "output")
        _check_type(name, io.name, _type_name(io.data_type), tensor, "output")
        dims = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
        if io.name not in batch_outputs:
            _check_dims(name, io.name, tensor.dims, dims, config.max_batch_size, exact=True)


def _find(io_name: str, tensors: dict[str, _Tensor], kind: str) -> _Tensor:
    tensor = tensors.get(io_name)
    if tensor is None:
        allowed = ", ".join(sorted(tensors))
        raise InvalidArgument(
            f"unexpected inference {kind} '{io_name}', allowed {kind}s are: {allowed}"
        )
    return tensor


def _check_type(name: str, io_name: str, dtype: str, tensor: _Tensor, kind: str) -> None:
    ort_type = _ORT_TYPE.get(dtype)
    if ort_type is None:
        raise InternalError(
            f"unsupported datatype {dtype} for {kind} '{io_name}' for model '{name}'"
        )
    if ort_type != tensor.type:
        provides = _TRITON_TYPE.get(tensor.type, tensor.type)
        raise InvalidArgument(
            f"unable to load model '{name}', configuration expects datatype {dtype} for "
            f"{kind} '{io_name}', model provides {provides}"
        )


def _check_dims(
    name: str, io_name: str, model: list[int], dims: list[int], max_batch_size: int, exact: bool
) -> None:
    if not model:  # a scalar: every configured dimension must be 1
        if any(d != 1 for d in dims):
            raise InvalidArgument(
                f"unable to load model '{name}', scalar tensor '{io_name}', should only "
                "provide 1 in the model configuration when the model doesn't support "
                f"batching. Model configuration provided: {_shape(dims)}."
            )
        return
    if max_batch_size > 0:
        if model[0] != -1:
            raise InvalidArgument(
                f"model '{name}', tensor '{io_name}': for the model to support batching "
                "the shape should have at least 1 dimension and the first dimension must "
                f"be -1; but shape expected by the model is {_shape(model)}"
            )
        full = [-1, *dims]
        if not _dims_match(model, full, exact):
            raise InvalidArgument(
                f"model '{name}', tensor '{io_name}': the model expects {len(model)} "
                f"dimensions (shape {_shape(model)}) but the model configuration specifies "
                f"{len(full)} dimensions (an initial batch dimension because "
                "max_batch_size > 0 followed by the explicit tensor shape, making "
                f"complete shape {_shape(full)})"
            )
    elif not _dims_match(model, dims, exact):
        raise InvalidArgument(
            f"model '{name}', tensor '{io_name}': the model expects {len(model)} "
            f"dimensions (shape {_shape(model)}) but the model configuration specifies "
            f"{len(dims)} dimensions (shape {_shape(dims)})"
        )


def _dims_match(model: list[int], dims: list[int], exact: bool) -> bool:
    if len(model) != len(dims):
        return False
    return all(m == d for m, d in zip(model, dims, strict=True) if exact or m != -1)


def _check_sequence_control(
    config: ModelConfig,
    name: str,
    batching: ModelSequenceBatching,
    kind: str,
    inputs: Mapping[str, _Tensor],
) -> int:
    """1 when the sequence batcher gives the model the ``kind`` control, after
    checking that the model has that input, with dims [1] and its datatype; else 0."""
    for control_input in batching.control_input:
        for control in control_input.control:
            if _kind_name(control.kind) != kind:
                continue
            tensor = inputs.get(control_input.name)
            if tensor is None:
                raise InternalError(
                    f"configuration specified sequence control '{control_input.name}', "
                    "but model does not provide that input"
                )
            debatched = tensor.dims[1:] if config.max_batch_size > 0 else tensor.dims
            if debatched != [1]:
                raise InvalidArgument(
                    f"unable to load model '{name}', sequence control "
                    f"'{control_input.name}' in model has dims {_shape(debatched)} but "
                    "dims [1] is expected"
                )
            dtype = _control_datatype(control)
            if _ORT_TYPE.get(dtype) != tensor.type:
                raise InvalidArgument(
                    f"unable to load model '{name}', sequence control "
                    f"'{control_input.name}', the model expects data-type "
                    f"{_onnx_type_name(tensor.type)} but the model "
                    f"configuration specifies data-type {dtype}"
                )
            return 1
    return 0


def _onnx_type_name(ort_type: str) -> str:
    """onnxruntime_backend's OnnxDataTypeName: ``tensor(float)`` -> ``FLOAT``."""
    return ort_type.removeprefix("tensor(").removesuffix(")").upper()


def _kind_name(kind: int) -> str:
    from trionserve._generated.model_config_pb2 import ModelSequenceBatching

    return ModelSequenceBatching.Control.Kind.Name(kind)


def _control_datatype(control: ModelSequenceBatching.Control) -> str:
    """The control tensor's datatype, as Triton's backend reads it."""
    if control.fp32_false_true:
        return "TYPE_FP32"
    if control.int32_false_true:
        return "TYPE_INT32"
    if control.bool_false_true:
        return "TYPE_BOOL"
    return _type_name(control.data_type)
