"""``backend: "minimal"`` and ``backend: "recommended"``: the two backends of Triton's
backend tutorial (triton-inference-server/backend ``examples/backends/``).

minimal (``minimal/src/minimal.cc``, ``TRITONBACKEND_ModelInstanceExecute``
233-430): no configuration check; the batch's ``IN0`` is gathered, logged
("model <m>: requests in batch <n>", "batched IN0 value: [ ... ]") and returned
as INT32 ``OUT0`` of shape ``[-1, 4]`` (``[4]`` without batching), each request
getting its own rows.

recommended (``recommended/src/recommended.cc``): load (``ValidateModelConfig``,
248-325) takes exactly one input and one output of one datatype and one shape,
with no ``reshape`` (UNSUPPORTED); execute (476-746) returns the input, under
the output's name, with the batch logged as minimal logs it.
"""

from __future__ import annotations

import numpy as np

from trionserve.backends.base import ExecuteResult, InstanceSpec, ModelContext
from trionserve.backends.reference.common import (
    ReferenceBackend,
    ReferenceInstance,
    ReferenceModel,
    log,
    refuse,
    shape_string,
)
from trionserve.backends.reference.identity import config_type_name
from trionserve.core import datatypes
from trionserve.core.errors import InvalidArgument, Unimplemented
from trionserve.core.inference import InferenceRequest, Tensor


def _typed_string(arrays: list[np.ndarray]) -> str:
    """BufferAsTypedString: the batch's elements in brackets."""
    values = [str(v) for array in arrays for v in array.reshape(-1).tolist()]
    return "[ " + " ".join(values) + " ]"


class _Copy(ReferenceInstance):
    """Returns one input, batched, as one output (minimal and recommended)."""

    input_name = "IN0"
    output_name = "OUT0"
    wire = "INT32"
    dims: list[int] = [4]

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        log.info(f"model {self.context.name}: requests in batch {len(requests)}")
        arrays = []
        results: ExecuteResult = []
        batching = self.context.config.max_batch_size > 0
        for request in requests:
            tensor = request.inputs.get(self.input_name)
            if tensor is None:
                results.append(InvalidArgument(f"input '{self.input_name}' not found"))
                continue
            arrays.append(tensor.data)
            shape = list(tensor.shape)
            expected = ([shape[0]] if batching and shape else []) + [
                s if d == -1 else d for s, d in zip(shape[1:] if batching else shape, self.dims)
            ]
            data = tensor.data
            if list(data.shape) != expected and data.size == int(np.prod(expected)):
                data = data.reshape(expected)
            if list(data.shape) != expected:
                results.append(
                    InvalidArgument(
                        f"input '{self.input_name}' of shape {shape_string(shape)} cannot be "
                        f"returned as output '{self.output_name}' of shape "
                        f"{shape_string(expected)}"
                    )
                )
                continue
            if self.wire != tensor.datatype and self.wire == "INT32":
                data = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.int32).reshape(
                    expected
                )
            results.append(self.response(request, [Tensor(self.output_name, self.wire, data)]))
        log.info(f"batched {self.input_name} value: {_typed_string(arrays)}")
        return results


class MinimalBackend(ReferenceBackend):
    name = "minimal"

    def load(self, context: ModelContext) -> ReferenceModel:
        return ReferenceModel(lambda spec: _Copy(context, spec))


class RecommendedBackend(ReferenceBackend):
    name = "recommended"

    def load(self, context: ModelContext) -> ReferenceModel:
        config = context.config
        refuse(config, len(config.input) == 1, "model configuration must have 1 input")
        refuse(config, len(config.output) == 1, "model configuration must have 1 output")
        tensor_in, tensor_out = config.input[0], config.output[0]
        in_type = config_type_name(tensor_in.data_type)
        out_type = config_type_name(tensor_out.data_type)
        refuse(
            config,
            in_type == out_type,
            f"expected input and output datatype to match, got {in_type} and {out_type}",
        )
        if tensor_in.HasField("reshape"):
            raise Unimplemented("reshape not supported for input tensor")
        if tensor_out.HasField("reshape"):
            raise Unimplemented("reshape not supported for output tensor")
        refuse(
            config,
            list(tensor_in.dims) == list(tensor_out.dims),
            "expected input and output shape to match, got "
            f"{shape_string(tensor_in.dims)} and {shape_string(tensor_out.dims)}",
        )

        def make(spec: InstanceSpec) -> _Copy:
            instance = _Copy(context, spec)
            instance.input_name = tensor_in.name
            instance.output_name = tensor_out.name
            instance.wire = datatypes.BY_CONFIG[in_type].wire
            instance.dims = list(tensor_in.dims)
            return instance

        return ReferenceModel(make)
