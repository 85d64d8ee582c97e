"""A TensorRT engine as the backend reads it: the runtime (one per process), a plan
deserialized, the engine's tensors (duck-typed over ``ICudaEngine``, so testable
with a fake) and the configuration auto-completed from them, as Triton's
tensorrt backend does (src/model_state.cc: AutoCompleteConfig)."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trionserve.backends.cuda.devices import gpu_count
from trionserve.core.errors import InvalidArgument, Unavailable

if TYPE_CHECKING:
    from tensorrt import ICudaEngine, Runtime

    from trionserve._generated.model_config_pb2 import (
        DataType,
        ModelConfig,
        ModelInput,
        ModelOutput,
    )

# TensorRT DataType member names -> Triton config datatypes.
_TRT_TYPES = {
    "FLOAT": "TYPE_FP32",
    "HALF": "TYPE_FP16",
    "BF16": "TYPE_BF16",
    "INT8": "TYPE_INT8",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "BOOL": "TYPE_BOOL",
    "UINT8": "TYPE_UINT8",
}


def missing_requirements() -> list[str]:
    """What this host lacks to run TensorRT plans; empty when nothing is missing."""
    missing = []
    if gpu_count() == 0:
        missing.append("no CUDA GPU is visible on this host")
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("the tensorrt package is not installed")
    if importlib.util.find_spec("cupy") is None and importlib.util.find_spec("torch") is None:
        missing.append("neither cupy nor torch is installed for GPU buffers")
    return missing


def require(model: str) -> None:
    missing = missing_requirements()
    if missing:
        raise Unavailable(
            f"model '{model}' (platform tensorrt_plan) cannot run on this host: "
            + "; ".join(missing)
        )


@functools.cache
def _runtime() -> Runtime:
    """One TensorRT logger and runtime per process, as TensorRT recommends."""
    import tensorrt

    return tensorrt.Runtime(tensorrt.Logger(tensorrt.Logger.WARNING))


def deserialize(model: str, path: Path) -> ICudaEngine:
    engine = _runtime().deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise InvalidArgument(
            f"model '{model}': TensorRT could not deserialize {path.parent.name}/"
            f"{path.name} (built by another TensorRT version or for another GPU?)"
        )
    return engine


# -- what the engine says (duck-typed over ICudaEngine, so testable with a fake) -----


@dataclass(frozen=True, slots=True)
class EngineTensor:
    name: str
    is_input: bool
    shape: tuple[int, ...]  # -1 for dynamic dimensions
    data_type: str  # Triton config name, "" when Triton has none
    max_batch: int | None  # optimization profile 0's largest dim 0 (inputs)
    is_shape_tensor: bool
    opt_shape: tuple[int, ...] | None = None  # profile 0's "opt" shape (inputs)


def engine_tensors(engine: ICudaEngine) -> list[EngineTensor]:
    tensors = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        is_input = engine.get_tensor_mode(name).name == "INPUT"
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        is_shape_tensor = bool(engine.is_shape_inference_io(name))
        max_batch, opt_shape = None, shape if is_input else None
        dynamic = is_input and -1 in shape and not is_shape_tensor
        if dynamic and engine.num_optimization_profiles > 0:
            _, opt, largest = engine.get_tensor_profile_shape(name, 0)
            opt_shape = tuple(int(d) for d in opt)
            if shape[0] == -1:
                max_batch = int(largest[0])
        data_type = _TRT_TYPES.get(engine.get_tensor_dtype(name).name, "")
        tensors.append(
            EngineTensor(name, is_input, shape, data_type, max_batch, is_shape_tensor, opt_shape)
        )
    return tensors


def _engine_max_batch(tensors: list[EngineTensor]) -> int:
    """Largest batch every input allows, or 0 when a tensor has no dynamic dim 0."""
    if not all(t.shape and t.shape[0] == -1 for t in tensors if not t.is_shape_tensor):
        return 0
    limits = [t.max_batch for t in tensors if t.is_input and t.max_batch is not None]
    return min(limits) if limits else 0


def complete_config(
    config: ModelConfig, tensors: list[EngineTensor], max_batch_size_set: bool
) -> None:
    """Fill max_batch_size, inputs and outputs from the engine, like Triton."""
    from trionserve._generated import model_config_pb2 as mc

    by_name = {t.name: t for t in tensors}
    engine_max = _engine_max_batch(tensors)
    # Dims in the config hint at batching: one dimension fewer than the engine's.
    declared: list[ModelInput | ModelOutput] = [*config.input, *config.output]
    hints = {
        len(by_name[e.name].shape) == len(e.dims) + 1
        for e in declared
        if e.dims and e.name in by_name and not by_name[e.name].is_shape_tensor
    }
    if len(hints) > 1:
        raise InvalidArgument(
            f"unable to autofill for '{config.name}', model tensor configurations "
            "are contradicting each other in terms of whether batching is supported"
        )
    if hints == {True} and engine_max == 0:
        raise InvalidArgument(
            f"autofill failed for model '{config.name}': model tensor shape "
            "configuration hints for dynamic batching but the underlying engine "
            "doesn't support batching"
        )
    if hints == {False}:
        engine_max = 0
    if not max_batch_size_set:
        config.max_batch_size = engine_max
    elif config.max_batch_size > engine_max:
        raise InvalidArgument(
            f"autofill failed for model '{config.name}': configuration specified "
            f"max-batch {config.max_batch_size} but TensorRT engine only supports "
            f"max-batch {engine_max}"
        )
    if (
        config.max_batch_size > 1
        and not config.HasField("dynamic_batching")
        and not config.HasField("sequence_batching")
    ):
        config.dynamic_batching.SetInParent()  # Triton turns it on for such engines
    skip = 1 if config.max_batch_size > 0 else 0
    for entries, is_input in ((config.input, True), (config.output, False)):
        known = {e.name: e for e in entries}
        for t in tensors:
            if t.is_input != is_input:
                continue
            entry = known.get(t.name)
            if entry is None:
                if known:
                    continue  # the config chose its own tensors
                entry = entries.add(name=t.name)
            if entry.data_type == mc.TYPE_INVALID and t.data_type:
                entry.data_type = config_data_type(t.data_type)
            if not entry.dims and not entry.HasField("reshape"):
                dims = list(t.shape[skip:])
                if not dims:  # dims may not be empty: a scalar is [1] reshaped to []
                    entry.reshape.SetInParent()
                    dims = [1]
                entry.dims.extend(dims)


# -- the backend ------------------------------------------------------------------------


def config_data_type(name: str) -> DataType:
    """The config's data type for its name (``TYPE_FP32``)."""
    from trionserve._generated.model_config_pb2 import DataType

    # The protobuf stubs type EnumTypeWrapper.Value as int; it is a DataType value.
    return DataType.Value(name)  # type: ignore[return-value]


def type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)
