"""Batch inputs and batch outputs: the tensors a backend builds from the shape of a
whole batch (a model config's ``batch_input`` and ``batch_output``).

A model that takes a ragged input (``allow_ragged_batch``: requests of different
shapes, concatenated flat into one dimension, see
:func:`~trionserve.backends.batch_tensors.gather_inputs`) cannot tell where one
request's elements end; its ``batch_input`` tensors tell it, and its
``batch_output`` cuts an output of the whole batch back into each request's
shape. Triton's backend library builds both for the backends that use it (ONNX
Runtime, PyTorch, TensorRT, TensorFlow); its Python backend does not
(python_backend's source never reads ``batch_input``): a Python model sees each
request's own tensors.

What each kind holds, as Triton's ``BackendInputCollector::BatchInputShape`` and
``ProcessBatchInput`` (backend repository, src/backend_input_collector.cc) and
``BackendOutputResponder::ProcessBatchOutput`` (src/backend_output_responder.cc)
build it; "element count" is the count of the source input's full shape, its
batch dimension included, and there is one entry per *request* (not per batch
item) unless said otherwise:

- ``BATCH_ELEMENT_COUNT``: ``[requests]``, each request's element count;
- ``BATCH_ACCUMULATED_ELEMENT_COUNT``: ``[requests]``, the running sum of those;
- ``BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO``: ``[requests + 1]``, 0 then the
  running sum (the offsets of each request's elements in the ragged tensor);
- ``BATCH_MAX_ELEMENT_COUNT_AS_SHAPE``: ``[largest element count]``, only its
  shape means anything (Triton leaves the data unset; it is zeros here);
- ``BATCH_ITEM_SHAPE``: ``[batch items, rank - 1]``, each batch item's shape
  without the batch dimension (a request of batch size 2 gives two rows);
- ``BATCH_ITEM_SHAPE_FLATTEN``: the same values in one dimension.
- batch output ``BATCH_SCATTER_WITH_INPUT_SHAPE``: the output's shape (batch
  dimension first) with every ``-1`` taken from the source input's shape at the
  same index, request by request; each request gets the next that many elements
  of the output, in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from trionserve.core.errors import InternalError, InvalidArgument

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.core.inference import InferenceRequest

_ELEMENT_COUNT = "BATCH_ELEMENT_COUNT"
_ACCUMULATED = "BATCH_ACCUMULATED_ELEMENT_COUNT"
_ACCUMULATED_WITH_ZERO = "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO"
_MAX_AS_SHAPE = "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE"
_ITEM_SHAPE = "BATCH_ITEM_SHAPE"
_ITEM_SHAPE_FLATTEN = "BATCH_ITEM_SHAPE_FLATTEN"

# The data types a batch input may have (the config validation refuses others).
_DTYPES: dict[str, np.dtype] = {"TYPE_FP32": np.dtype(np.float32), "TYPE_INT32": np.dtype(np.int32)}


@dataclass(frozen=True, slots=True)
class BatchInput:
    """One ``batch_input`` entry: what to build, from which input, under which names."""

    kind: str
    targets: tuple[str, ...]
    dtype: np.dtype
    source: str


@dataclass(frozen=True, slots=True)
class BatchOutput:
    """A ``BATCH_SCATTER_WITH_INPUT_SHAPE`` output: its shape, batch dimension
    first (``-1`` where the source input's shape decides), and that input."""

    shape: tuple[int, ...]
    source: str


class BatchTensors:
    """A model's batch inputs and batch outputs, read once from its config."""

    def __init__(self, model_name: str, config: ModelConfig) -> None:
        from trionserve._generated.model_config_pb2 import BatchInput as BatchInputConfig
        from trionserve._generated.model_config_pb2 import DataType

        self.model_name = model_name
        self._reshape = {
            i.name: tuple(i.reshape.shape) for i in config.input if i.HasField("reshape")
        }
        self.inputs = tuple(
            BatchInput(
                BatchInputConfig.Kind.Name(entry.kind),
                tuple(entry.target_name),
                _DTYPES[DataType.Name(entry.data_type)],
                entry.source_input[0],
            )
            for entry in config.batch_input
        )
        for built in self.inputs:
            if built.kind in (_ITEM_SHAPE, _ITEM_SHAPE_FLATTEN) and config.max_batch_size <= 0:
                # Triton assumes the first dimension is the batch ("ragged input is
                # only set for batching enabled model"); without batching it is any
                # size a client sends, and so would be the tensor built from it.
                raise InvalidArgument(
                    f"model '{model_name}': batch input {built.kind} for "
                    f"'{built.source}' needs a model that batches (max_batch_size > 0)"
                )
        batch_dim = (-1,) if config.max_batch_size > 0 else ()
        outputs = {o.name: o for o in config.output}
        self.outputs: dict[str, BatchOutput] = {}
        for scatter in config.batch_output:
            for target in scatter.target_name:
                output = outputs[target]
                dims = output.reshape.shape if output.HasField("reshape") else output.dims
                self.outputs[target] = BatchOutput((*batch_dim, *dims), scatter.source_input[0])

    @property
    def input_names(self) -> list[str]:
        """The model inputs the batch inputs feed, in config order."""
        return [name for entry in self.inputs for name in entry.targets]

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)

    def input_tensors(self, requests: Sequence[InferenceRequest]) -> dict[str, np.ndarray]:
        """The batch inputs of a batch of ``requests``, by model input name."""
        tensors: dict[str, np.ndarray] = {}
        for entry in self.inputs:
            shapes = [self._shape(request, entry.source) for request in requests]
            array = _build(entry.kind, shapes).astype(entry.dtype, copy=False)
            for target in entry.targets:
                tensors[target] = array
        return tensors

    def scatter(
        self, name: str, array: np.ndarray, requests: Sequence[InferenceRequest]
    ) -> list[np.ndarray]:
        """Batch output ``name`` of the whole batch cut into each request's part."""
        spec = self.outputs[name]
        flat = array.reshape(-1)
        parts = []
        start = 0
        for request in requests:
            source = self._shape(request, spec.source)
            if len(source) < len(spec.shape):
                raise InternalError(
                    f"batch output '{name}' of model '{self.model_name}' has shape "
                    f"{list(spec.shape)}, which input '{spec.source}' of shape "
                    f"{list(source)} cannot fill in"
                )
            shape = tuple(s if d == -1 else d for d, s in zip(spec.shape, source, strict=False))
            stop = start + math.prod(shape)
            if stop > flat.size:
                raise InternalError(
                    f"output '{name}' of model '{self.model_name}' has {flat.size} "
                    f"elements; scattered with the shapes of input '{spec.source}' "
                    f"the batch's requests need at least {stop}"
                )
            parts.append(flat[start:stop].reshape(shape))
            start = stop
        return parts

    def _shape(self, request: InferenceRequest, name: str) -> tuple[int, ...]:
        """The shape the backend sees of input ``name`` of ``request``: the request's,
        with the config's reshape applied after the batch dimension."""
        tensor = request.inputs.get(name)
        if tensor is None:
            raise InvalidArgument(
                f"input '{name}' for model '{self.model_name}' is the source of a batch "
                "input or output and must be given"
            )
        shape = tuple(tensor.data.shape)
        target = self._reshape.get(name)
        if target is None:
            return shape
        batched = request.batch_size > 0
        return tensor.data.reshape(((shape[0],) + target) if batched else target).shape


def _build(kind: str, shapes: Sequence[tuple[int, ...]]) -> np.ndarray:
    """The values of one batch input, from each request's source input shape."""
    counts = np.array([math.prod(shape) for shape in shapes], dtype=np.int64)
    if kind == _ELEMENT_COUNT:
        return counts
    if kind == _ACCUMULATED:
        return np.cumsum(counts)
    if kind == _ACCUMULATED_WITH_ZERO:
        return np.concatenate(([0], np.cumsum(counts)))
    if kind == _MAX_AS_SHAPE:
        return np.zeros(int(counts.max(initial=0)), dtype=np.int64)
    if kind in (_ITEM_SHAPE, _ITEM_SHAPE_FLATTEN):
        # "Assuming first dimension is batch size": one row per batch item.
        rank = len(shapes[0]) - 1 if shapes else 0
        if any(len(shape) != rank + 1 for shape in shapes):
            raise InvalidArgument(
                f"batch input {kind} needs its source input to have the same rank in "
                f"every request of a batch, got shapes {[list(s) for s in shapes]}"
            )
        items = np.repeat(
            np.array([shape[1:] for shape in shapes], dtype=np.int64).reshape(len(shapes), rank),
            [shape[0] for shape in shapes],
            axis=0,
        )
        return items if kind == _ITEM_SHAPE else items.reshape(-1)
    raise InternalError(f"unsupported batch input kind {kind}")


def split_batch_outputs(
    batch_tensors: BatchTensors | None,
    outputs: Mapping[str, np.ndarray],
    requests: Sequence[InferenceRequest],
) -> dict[str, list[np.ndarray]]:
    """Each batch output among ``outputs`` cut into the requests' parts."""
    if not batch_tensors or not batch_tensors.outputs:
        return {}
    return {
        name: batch_tensors.scatter(name, array, requests)
        for name, array in outputs.items()
        if name in batch_tensors.outputs
    }
