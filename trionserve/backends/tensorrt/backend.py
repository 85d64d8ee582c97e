"""TensorRT backend: platform ``tensorrt_plan``: serialized engines run on a CUDA stream.

``model.plan`` is deserialised with the TensorRT 10 runtime once per instance, on
the instance's GPU; each instance owns an execution context and a CUDA stream. A
batch is copied to device buffers (cupy arrays, or torch CUDA tensors when cupy is
missing), bound by tensor name, run with ``execute_async_v3`` and copied back.
Auto-complete reads inputs, outputs and the maximum batch size from the engine, as
Triton's tensorrt backend does. ``optimization { cuda { graphs: true } }`` captures
CUDA graphs of the engine when an instance loads, as Triton's tensorrt backend does
(src/instance_state.cc: InitializeCudaGraph, BuildCudaGraph): which ones in
:func:`trionserve.backends.cuda.graphs.tensorrt_graph_shapes`, capture and replay in
:class:`TensorRTInstance`. TensorRT needs a GPU: on a host without one, or without
the tensorrt package, the model is UNAVAILABLE with a reason naming what is
missing. Every CUDA library is imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.backends.cuda.buffers import device_buffers
from trionserve.backends.cuda.graphs import tensorrt_graph_shapes
from trionserve.backends.tensorrt.engine import (
    complete_config,
    deserialize,
    engine_tensors,
    missing_requirements,
    require,
)
from trionserve.backends.tensorrt.instance import TensorRTInstance
from trionserve.core.errors import InvalidArgument, TritonError, Unavailable

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

__all__ = ["TensorRTBackend", "TensorRTModel", "missing_requirements"]


class TensorRTBackend(Backend):
    name = "tensorrt"

    def default_model_filename(self) -> str:
        return "model.plan"

    def auto_complete_config(
        self, config: ModelConfig, model_path: Path, max_batch_size_set: bool
    ) -> None:
        require(config.name)
        buffers = device_buffers()
        with buffers.device(0):
            engine = deserialize(config.name, model_path)
            tensors = engine_tensors(engine)
        complete_config(config, tensors, max_batch_size_set)

    def load(self, context: ModelContext) -> TensorRTModel:
        require(context.name)
        filename = context.config.default_model_filename or self.default_model_filename()
        path = context.version_dir / filename
        if not path.is_file():
            raise Unavailable(
                f"model file '{filename}' not found in version {context.version} "
                f"of model '{context.name}' ({context.version_dir.name}/)"
            )
        return TensorRTModel(context, path)


class TensorRTModel:
    """A plan file and its config; each instance deserializes it on its own GPU."""

    def __init__(self, context: ModelContext, path: Path) -> None:
        self.context = context
        self.path = path

    def create_instance(self, spec: InstanceSpec) -> TensorRTInstance:
        if spec.kind not in ("KIND_GPU", "KIND_MODEL"):
            raise InvalidArgument(
                f"instance '{spec.name}' of model '{self.context.name}' is {spec.kind}; "
                "the TensorRT backend supports only KIND_GPU and KIND_MODEL"
            )
        buffers = device_buffers()
        with buffers.device(spec.device_id):
            engine = deserialize(self.context.name, self.path)
            instance = TensorRTInstance(self.context, spec, buffers, engine)
            try:
                shapes = tensorrt_graph_shapes(self.context.config, instance.opt_shapes)
            except TritonError:
                instance.close()
                raise
            if shapes:
                instance.capture_graphs(shapes)
            return instance

    def unload(self) -> None:
        pass
