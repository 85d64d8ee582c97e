"""The control inputs of a sequence batcher's requests, and the null request that
fills an empty batch slot.

``sequence_batching.control_input`` asks for START, END, READY (as INT32, FP32 or
BOOL false/true values) and CORRID tensors; :class:`SequenceControls` makes them
for each request of a sequence (Triton core
``sequence_batch_scheduler/sequence_batch_scheduler.cc``:
SequenceBatchScheduler::CreateBooleanControlTensors,
SequenceBatch::CreateCorrelationIDControl and SetControlTensors). A
:class:`NullRequest` is the zero-input, READY-false filler of the direct
strategy's empty slots (the null request DirectSequenceBatch::BatcherThread adds).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np

from trionserve.core import datatypes
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.schedulers.sequence_state import CorrelationId, describe

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

_FLAG_KINDS = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY")


class NullRequest(InferenceRequest):
    """The filler of an empty batch slot: zero inputs, READY false. Its outcome is
    dropped and, as in Triton, it is not counted in the request statistics."""

    __slots__ = ()
    collect_stats = False


class SequenceControls:
    """The control tensors a model asks for in ``sequence_batching.control_input``."""

    def __init__(self, config: ModelConfig) -> None:
        from trionserve._generated.model_config_pb2 import DataType, ModelSequenceBatching

        kind_name = ModelSequenceBatching.Control.Kind.Name
        self._shape = (1, 1) if config.max_batch_size > 0 else (1,)
        # (kind, tensor name, wire datatype, (false array, true array))
        self._flags: list[tuple[str, str, str, tuple[np.ndarray, np.ndarray]]] = []
        self._corrid: tuple[str, datatypes.DataType] | None = None
        for control_input in config.sequence_batching.control_input:
            for control in control_input.control:
                kind = kind_name(control.kind)
                if kind not in _FLAG_KINDS:
                    data_type = datatypes.BY_CONFIG[DataType.Name(control.data_type)]
                    self._corrid = (control_input.name, data_type)
                    continue
                values: Seq[float]
                if control.int32_false_true:
                    wire, values = "INT32", control.int32_false_true
                elif control.fp32_false_true:
                    wire, values = "FP32", control.fp32_false_true
                else:
                    wire, values = "BOOL", control.bool_false_true
                dtype = datatypes.BY_WIRE[wire].numpy
                # The config check makes these exactly two: the false and the true value.
                false, true = (_constant(np.full(self._shape, v, dtype=dtype)) for v in values)
                self._flags.append((kind, control_input.name, wire, (false, true)))

    def check(self, correlation_id: CorrelationId, model: str) -> None:
        """Refuse a correlation id the CORRID control's datatype cannot carry."""
        if self._corrid is None or correlation_id == 0:
            return
        name, data_type = self._corrid
        if data_type.wire == "BYTES":
            return
        where = (
            f"model '{model}' feeds correlation IDs to its CONTROL_SEQUENCE_CORRID input "
            f"'{name}' as {data_type.config}"
        )
        if isinstance(correlation_id, str):
            raise InvalidArgument(
                f"inference request for sequence '{correlation_id}' has a string "
                f"correlation ID, but {where}; use an integer correlation ID"
            )
        info = np.iinfo(data_type.numpy)
        if not info.min <= correlation_id <= info.max:
            raise InvalidArgument(
                f"correlation ID {correlation_id} does not fit: {where} ({info.min}..{info.max})"
            )

    def tensors(
        self, *, start: bool, end: bool, ready: bool, correlation_id: CorrelationId | None
    ) -> dict[str, Tensor]:
        flags = {
            "CONTROL_SEQUENCE_START": start,
            "CONTROL_SEQUENCE_END": end,
            "CONTROL_SEQUENCE_READY": ready,
        }
        tensors = {}
        for kind, name, wire, arrays in self._flags:
            tensors[name] = Tensor(name, wire, arrays[flags[kind]])
        if self._corrid is not None:
            name, data_type = self._corrid
            if data_type.wire == "BYTES":
                value = b"" if correlation_id is None else describe(correlation_id).encode()
                array = np.empty(self._shape, dtype=object)
                array.fill(value)
            else:
                array = np.full(self._shape, correlation_id or 0, dtype=data_type.numpy)
            tensors[name] = Tensor(name, data_type.wire, array)
        return tensors


def _constant(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def zeros_like(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.object_:
        zeros = np.empty(array.shape, dtype=object)
        zeros.fill(b"")
        return zeros
    return np.zeros_like(array)
