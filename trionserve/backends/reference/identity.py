"""``backend: "identity"``: each requested ``OUTPUT<i>`` is a copy of ``INPUT<i>``
(triton-inference-server/identity_backend ``src/identity.cc``).

- Load (``ModelState::ValidateModelConfig``, identity.cc 214-400): as many inputs
  as outputs, named ``INPUT<i>`` / ``OUTPUT<i>``, each pair of one datatype and one
  shape (``reshape`` when given, else ``dims``); ``parameters``
  ``execute_delay_ms`` with ``instance_wise_delay_multiplier`` and
  ``creation_delay_sec`` (``ModelState::CreationDelay``, 189-212: the load sleeps)
  are read. Inputs marked ``optional`` may be left out: their output is then zeros
  of the input's configured type and shape, ``-1`` dims as 1 (292-305, 1004-1060).
- Execute (``TRITONBACKEND_ModelInstanceExecute``, 711-1340): sleep
  ``execute_delay_ms`` times ``max(multiplier * instance index, 1)`` (785-795);
  for each output the request asked for, the matching input as it came (datatype
  and shape), its ``input_byte_size_counter`` custom metric raised by the input's
  bytes (95-187, 1168-1171), and one verbose line per input
  (``\\tinput INPUT0: datatype = FP32, shape = [1,5], byte_size = 20,
  buffer_count = 1``; qa/L0_backend_identity counts them); an output whose input
  is neither sent nor optional is UNSUPPORTED "failed to get input 'INPUT<i>'".
  Every response carries the parameters ``param0`` "an example string parameter",
  ``param1`` 42, ``param2`` false, ``param3`` 123.123 (1281-1297).

- ``enable_custom_tracing`` "true" (identity.cc 396-420, 875-935): for each
  traced request, before its outputs, the custom activities
  ``CUSTOM_ACTIVITY_START``, 100 ms later ``CUSTOM_ACTIVITY_END``, then
  ``CUSTOM_SINGLE_ACTIVITY``; with ``nested_span_count`` N, ``CUSTOM_ACTIVITY<i>_START``
  for i < N each 100 ms apart (and ``CUSTOM_SINGLE_ACTIVITY`` after those with i
  a multiple of ``single_activity_frequency``), then their ``_END`` from the
  innermost out (Triton's TRITONSERVER_InferenceTraceReportActivity: timestamps
  of the request's trace; spans in trace mode opentelemetry).

Not reproduced: outputs share the inputs' arrays instead of copies (no client can
tell: a response is encoded before its request is released).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from trionserve.backends.base import ExecuteResult, InstanceSpec, ModelContext
from trionserve.backends.reference.common import (
    ReferenceBackend,
    ReferenceInstance,
    ReferenceModel,
    byte_size,
    config_dims,
    error_for,
    int_parameter,
    log,
    parameter,
    refuse,
    requested_names,
    shape_string,
    vlog,
)
from trionserve.core import datatypes
from trionserve.core.errors import TritonError, Unimplemented
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.observability.custom_metrics import COUNTER
from trionserve.observability.trace.frontend import now_ns
from trionserve.observability.trace.trace_file import Trace

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

RESPONSE_PARAMETERS = {
    "param0": "an example string parameter",
    "param1": 42,
    "param2": False,
    "param3": 123.123,
}

METRIC_FAMILY = "input_byte_size_counter"
METRIC_DESCRIPTION = "Cumulative input byte size of all requests received by the model"


def _check(config: ModelConfig) -> dict[str, tuple[str, list[int]]]:
    """identity.cc ModelState::ValidateModelConfig; the optional inputs' zero
    outputs: index suffix -> (wire datatype, shape with -1 as 1)."""
    refuse(
        config,
        len(config.input) == len(config.output),
        "model configuration must have equal input/output pairs",
    )
    inputs: dict[str, tuple[str, list[int]]] = {}
    outputs: dict[str, tuple[str, list[int]]] = {}
    optional: dict[str, tuple[str, list[int]]] = {}
    for tensor_in, tensor_out in zip(config.input, config.output):
        refuse(
            config,
            tensor_in.name.startswith("INPUT"),
            f"expected input name to follow INPUT<index> pattern, got '{tensor_in.name}'",
        )
        refuse(
            config,
            tensor_out.name.startswith("OUTPUT"),
            f"expected output name to follow OUTPUT<index> pattern, got '{tensor_out.name}'",
        )
        in_type = config_type_name(tensor_in.data_type)
        out_type = config_type_name(tensor_out.data_type)
        in_shape, out_shape = config_dims(tensor_in), config_dims(tensor_out)
        inputs[tensor_in.name[5:]] = (in_type, in_shape)
        outputs[tensor_out.name[6:]] = (out_type, out_shape)
        if tensor_in.optional:
            optional[tensor_in.name[5:]] = (
                datatypes.BY_CONFIG[in_type].wire,
                [1 if d == -1 else d for d in in_shape],
            )
    for index, (out_type, out_shape) in sorted(outputs.items()):
        refuse(config, index in inputs, "expected input and output indices to match")
        in_type, in_shape = inputs[index]
        refuse(
            config,
            in_type == out_type,
            f"expected input and output datatype to match, got {in_type} and {out_type}",
        )
        refuse(
            config,
            in_shape == out_shape,
            "expected input and output shape to match, got "
            f"{shape_string(in_shape)} and {shape_string(out_shape)}",
        )
    return optional


def config_type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


class IdentityBackend(ReferenceBackend):
    name = "identity"

    def load(self, context: ModelContext) -> ReferenceModel:
        config = context.config
        optional = _check(config)
        delay_ms = int_parameter(config, "execute_delay_ms")
        tracing: tuple[int, int] | None = None  # (nested span count, single activity frequency)
        if parameter(config, "enable_custom_tracing") == "true":
            tracing = (
                int_parameter(config, "nested_span_count"),
                int_parameter(config, "single_activity_frequency") or 1,
            )
        multiplier = (
            int_parameter(config, "instance_wise_delay_multiplier")
            if parameter(config, "execute_delay_ms") is not None
            else 0
        )
        creation_delay = int_parameter(config, "creation_delay_sec")
        if parameter(config, "creation_delay_sec") is not None:
            log.info(f"Creation delay is set to: {creation_delay}")
            time.sleep(creation_delay)  # a worker thread: the load waits, as Triton's
        metrics = context.metrics  # the server's
        owner = metrics.new_owner()
        family = metrics.create_family(owner, METRIC_FAMILY, METRIC_DESCRIPTION, COUNTER)
        labels = metrics.create_metric(
            owner, family, {"model": context.name, "version": str(context.version)}, None
        )
        counter = (family, labels)
        created = [0]

        def make(spec: InstanceSpec) -> IdentityInstance:
            index = created[0]  # ModelState::instance_count_++
            created[0] += 1
            delay = delay_ms * max(multiplier * index if multiplier > 0 else 0, 1)
            return IdentityInstance(
                context, spec, delay if delay_ms > 0 else 0, optional, counter, tracing
            )

        def unload() -> None:
            metrics.delete_metric(owner, family, labels)
            metrics.delete_family(owner, family)

        return ReferenceModel(make, unload)


class IdentityInstance(ReferenceInstance):
    def __init__(
        self,
        context: ModelContext,
        spec: InstanceSpec,
        delay_ms: int,
        optional: dict[str, tuple[str, list[int]]],
        counter: tuple[int, tuple],
        tracing: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(context, spec)
        self._delay_ms = delay_ms
        self._tracing = tracing
        self._optional = optional
        self._counter = counter
        config = context.config
        self._outputs = [t.name for t in config.output]
        self._batching = config.max_batch_size > 0
        # index suffix -> (input dims, input reshape, output reshape, output dims)
        # for pairs with a reshape: Triton's core hands the backend the input in
        # its reshape shape and shows the output in its dims (core
        # infer_request.cc Normalize, infer_response.cc); here the backend does
        # both, as the other backends of this server do.
        outputs_by_suffix = {o.name[6:]: o for o in config.output}
        self._reshapes: dict[str, tuple] = {}
        for tensor_in in config.input:
            tensor_out = outputs_by_suffix.get(tensor_in.name[5:])
            if tensor_out is None:
                continue
            if tensor_in.HasField("reshape") or tensor_out.HasField("reshape"):
                self._reshapes[tensor_in.name[5:]] = (
                    list(tensor_in.dims),
                    config_dims(tensor_in),
                    config_dims(tensor_out),
                    list(tensor_out.dims),
                )

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult:
        vlog(
            f"model {self.context.name}, instance {self.spec.name}, executing "
            f"{len(requests)} requests"
        )
        if self._delay_ms > 0:
            await trio.sleep(self._delay_ms / 1000)
        if self._tracing is not None:
            for request in requests:
                if isinstance(request.trace, Trace):
                    await self._custom_activities(request.trace, *self._tracing)
        return self.execute(requests)

    @staticmethod
    async def _custom_activities(trace: Trace, nested: int, frequency: int) -> None:
        """identity.cc's example of a backend's custom trace activities (875-935)."""
        trace.timestamp("CUSTOM_ACTIVITY_START", now_ns())
        await trio.sleep(0.1)
        trace.timestamp("CUSTOM_ACTIVITY_END", now_ns())
        trace.timestamp("CUSTOM_SINGLE_ACTIVITY", now_ns())
        for count in range(nested):
            trace.timestamp(f"CUSTOM_ACTIVITY{count}_START", now_ns())
            await trio.sleep(0.1)
            if count % frequency == 0:
                trace.timestamp("CUSTOM_SINGLE_ACTIVITY", now_ns())
        for count in reversed(range(nested)):
            trace.timestamp(f"CUSTOM_ACTIVITY{count}_END", now_ns())

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        return [self._one(index, request) for index, request in enumerate(requests)]

    def _one(self, index: int, request: InferenceRequest) -> InferenceResponse | TritonError:
        asked = request.requested_outputs
        vlog(
            f'request {index}: id = "{request.id}", correlation_id = '
            f"{request.sequence_id or 0}, input_count = {len(request.inputs)}, "
            f"requested_output_count = {len(self._outputs if asked is None else asked)}"
        )
        batch_dim = 0
        if self._batching and request.inputs:
            first = next(iter(request.inputs.values()))
            batch_dim = first.shape[0] if first.data.ndim else 0
        outputs: list[Tensor] = []
        for output_name in requested_names(request, self._outputs):
            suffix = output_name[6:]
            input_name = "INPUT" + suffix
            tensor = request.inputs.get(input_name)
            if tensor is None:
                if suffix not in self._optional:
                    return error_for(request, Unimplemented(f"failed to get input '{input_name}'"))
                wire, shape = self._optional[suffix]
                full = ([batch_dim] if batch_dim else []) + shape
                zeros = datatypes.BY_WIRE[wire].numpy
                array = np.zeros(full, dtype=zeros) if wire != "BYTES" else _empty_bytes(full)
                outputs.append(Tensor(output_name, wire, array))
                continue
            size = byte_size(tensor)
            vlog(
                f"\tinput {input_name}: datatype = {tensor.datatype}, shape = "
                f"{shape_string(tensor.shape)}, byte_size = {size}, buffer_count = 1"
            )
            vlog(f"\trequested_output {output_name}")
            family, labels = self._counter
            self.context.metrics.update(family, labels, "increment", size)
            data = tensor.data
            shapes = self._reshapes.get(suffix)
            if shapes is not None:
                data = data.reshape(_through_reshapes(data.shape, self._batching, *shapes))
            outputs.append(Tensor(output_name, tensor.datatype, data))
        return self.response(request, outputs, dict(RESPONSE_PARAMETERS))


def _through_reshapes(
    shape: tuple[int, ...],
    batching: bool,
    in_dims: list[int],
    in_reshape: list[int],
    out_reshape: list[int],
    out_dims: list[int],
) -> tuple[int, ...]:
    """The shape an output shows for an input of ``shape``: the input as the
    backend sees it (its ``reshape``, variable dims filled from the input's in
    order, core infer_request.cc Normalize), then that shape as the output's dims
    (variable dims filled from the reshape's, infer_response.cc)."""
    batch = list(shape[:1]) if batching else []
    given = list(shape[1:] if batching else shape)
    variable = [v for d, v in zip(in_dims, given) if d == -1]
    backend = [variable.pop(0) if d == -1 and variable else d for d in in_reshape]
    values = [v for d, v in zip(out_reshape, backend) if d == -1]
    shown = [values.pop(0) if d == -1 and values else d for d in out_dims]
    return tuple(batch + shown)


def _empty_bytes(shape: list[int]) -> np.ndarray:
    array = np.empty(shape, dtype=object)
    array.fill(b"")
    return array
