"""``backend: "repeat"`` and ``backend: "square"``: decoupled models that answer one
request with a stream of responses.

repeat (triton-inference-server/repeat_backend ``src/repeat.cc``):

- Load (``ValidateModelConfig``, 178-330): ``max_batch_size`` 0 ("repeat backend
  only supports models with max_batch_size == 0"); inputs ``IN`` (INT32, one
  dimension), ``DELAY`` (UINT32, IN's shape) and ``WAIT`` (UINT32 [1]), outputs
  ``OUT`` (INT32 [1]) and ``IDX`` (UINT32 [1]), in that order, each refused with
  repeat.cc's words.
- Execute (``ProcessRequest`` 395-490, ``ResponseThread`` 492-620,
  ``TRITONBACKEND_ModelInstanceExecute`` 743-830): IN and DELAY must have one
  shape; then, apart from the instance, for each element ``e`` of IN: wait
  ``DELAY[e]`` ms and send ``OUT = IN[e]``, ``IDX = e``; then the final flag alone
  (no responses at all for an empty IN). The instance itself waits ``WAIT`` ms
  before it takes its next request, whatever the responses still to come.

square (triton-inference-server/square_backend ``src/square.cc``):

- Load (``ValidateModelConfig``, 294-362): one input ``IN`` and one output ``OUT``,
  both INT32 [1]. ``parameters`` ``CUSTOM_INFER_DELAY_NS``,
  ``CUSTOM_OUTPUT_DELAY_NS``, ``CUSTOM_CANCEL_DELAY_NS``, ``CUSTOM_FAIL_COUNT`` and
  ``CUSTOM_EMPTY_COUNT`` (``ModelParameters``, 100-222; a value that is not a
  number is ignored, as there).
- Execute (``ProcessRequest`` 461-517, ``RequestThread`` 519-669): ``IN`` = N; N
  responses ``OUT = N`` (shape of ones, IN's rank), each after the infer delay
  and followed by the output delay, then the final flag alone. Of the N, the last
  ``CUSTOM_EMPTY_COUNT`` send nothing and the ``CUSTOM_FAIL_COUNT`` before them
  fail ("simulated failure", UNKNOWN). A request cancelled by its client stops at
  the next response after the cancel delay, with CANCELLED "cancelled".

Here a Triton error response that is not final (square's simulated failure) ends
the request with that error, since an InferenceRequest has no non-final errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import trio

from trionserve.backends.base import ExecuteResult, InstanceSpec, ModelContext
from trionserve.backends.reference.common import (
    ReferenceBackend,
    ReferenceInstance,
    ReferenceModel,
    log,
    parameter,
    refuse,
    shape_string,
)
from trionserve.backends.reference.identity import config_type_name
from trionserve.core.errors import Cancelled, InvalidArgument, Status, TritonError
from trionserve.core.inference import InferenceRequest, Tensor

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelInput, ModelOutput


def _named(
    config: ModelConfig,
    tensors: Sequence[ModelInput] | Sequence[ModelOutput],
    index: int,
    expected: str,
    which: str,
    kind: str,
) -> None:
    name = tensors[index].name
    refuse(
        config,
        name == expected,
        f"expected {which} {kind} tensor name to be {expected}, got {name}",
    )


def _dtype(config: ModelConfig, tensor: ModelInput | ModelOutput, expected: str) -> None:
    got = config_type_name(tensor.data_type)
    refuse(
        config,
        got == "TYPE_" + expected,
        f"expected {tensor.name} datatype to be {expected}, got {got}",
    )


class RepeatBackend(ReferenceBackend):
    name = "repeat"

    def load(self, context: ModelContext) -> ReferenceModel:
        config = context.config
        refuse(
            config,
            config.max_batch_size == 0,
            "repeat backend only supports models with max_batch_size == 0",
        )
        refuse(config, len(config.input) == 3, f"expected 3 inputs, got {len(config.input)}")
        refuse(config, len(config.output) == 2, f"expected 2 outputs, got {len(config.output)}")
        ins, outs = config.input, config.output
        _named(config, ins, 0, "IN", "first", "input")
        _named(config, ins, 1, "DELAY", "second", "input")
        _named(config, ins, 2, "WAIT", "third", "input")
        _named(config, outs, 0, "OUT", "first", "output")
        _named(config, outs, 1, "IDX", "second", "output")
        in_shape, delay_shape = list(ins[0].dims), list(ins[1].dims)
        refuse(
            config,
            len(in_shape) == 1,
            f"expected IN shape to have one dimension, got {shape_string(in_shape)}",
        )
        refuse(
            config,
            in_shape == delay_shape,
            "expected IN and DELAY shape to match, got "
            f"{shape_string(in_shape)} and {shape_string(delay_shape)}",
        )
        for dims, what in ((ins[2].dims, "WAIT"), (outs[0].dims, "OUT"), (outs[1].dims, "IDX")):
            refuse(
                config,
                list(dims) == [1],
                f"expected {what} shape to be [1], got {shape_string(dims)}",
            )
        checked: tuple[ModelInput | ModelOutput, ...] = (ins[0], ins[1], ins[2], outs[0], outs[1])
        for tensor, expected in zip(
            checked,
            ("INT32", "UINT32", "UINT32", "INT32", "UINT32"),
        ):
            _dtype(config, tensor, expected)
        return ReferenceModel(lambda spec: RepeatInstance(context, spec))


class RepeatInstance(ReferenceInstance):
    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult | None:
        log.info(f"model instance {self.spec.name}, executing {len(requests)} requests")
        wait_ms = 0
        for request in requests:
            wait_ms = self._process(request)
        log.info(f"waiting {wait_ms} ms before releasing requests")
        if wait_ms:
            await trio.sleep(wait_ms / 1000)
        return None

    def _process(self, request: InferenceRequest) -> int:
        """repeat.cc ProcessRequest: the WAIT to hold the instance for; the
        responses go on from a task of their own."""
        try:
            wait = _read(request, "WAIT")
            if wait.size != 1:
                raise InvalidArgument("unexpected size for WAIT input")
            values, delays = _read(request, "IN"), _read(request, "DELAY")
            if values.shape != delays.shape:
                raise InvalidArgument(
                    "expected IN and DELAY shape to match, got "
                    f"{shape_string(values.shape)} and {shape_string(delays.shape)}"
                )
        except TritonError as exc:
            request.fail(exc)
            return 0
        values = values.reshape(-1).astype(np.int32, copy=True)
        delays = delays.reshape(-1).astype(np.uint32, copy=True)

        async def responses() -> None:
            count = len(values)
            for index in range(count):
                log.info(
                    f"waiting {int(delays[index])} ms, then sending response {index + 1} of {count}"
                )
                await trio.sleep(int(delays[index]) / 1000)
                if request.cancelled:
                    break
                request.send(
                    self.response(
                        request,
                        [
                            Tensor("OUT", "INT32", values[index : index + 1]),
                            Tensor("IDX", "UINT32", np.array([index], dtype=np.uint32)),
                        ],
                    ),
                    final=not self.decoupled,
                )
                log.info(f"sent response {index + 1} of {count}")
            if count == 0:
                log.info("IN size is zero, no responses sent")
            request.send(None, final=True)

        self.respond_later(request, responses)
        return int(wait.reshape(-1)[0])


def _read(request: InferenceRequest, name: str) -> np.ndarray:
    tensor = request.inputs.get(name)
    if tensor is None:
        raise InvalidArgument(f"input '{name}' is missing from the request")
    return tensor.data


class SquareBackend(ReferenceBackend):
    name = "square"

    def load(self, context: ModelContext) -> ReferenceModel:
        config = context.config
        refuse(config, len(config.input) == 1, f"expected 1 input, got {len(config.input)}")
        refuse(config, len(config.output) == 1, f"expected 1 output, got {len(config.output)}")
        _named(config, config.input, 0, "IN", "first", "input")
        _named(config, config.output, 0, "OUT", "first", "output")
        for tensor in (config.input[0], config.output[0]):
            refuse(
                config,
                list(tensor.dims) == [1],
                f"expected {tensor.name} shape to be [1], got {shape_string(tensor.dims)}",
            )
        for tensor in (config.input[0], config.output[0]):
            _dtype(config, tensor, "INT32")
        settings = SquareParameters(config)
        return ReferenceModel(lambda spec: SquareInstance(context, spec, settings))


class SquareParameters:
    """square.cc ModelParameters: delays in nanoseconds and the failing and empty
    responses' counts, each 0 unless its parameter is a number."""

    def __init__(self, config: ModelConfig) -> None:
        self.infer_delay_ns = self._read(config, "CUSTOM_INFER_DELAY_NS")
        self.output_delay_ns = self._read(config, "CUSTOM_OUTPUT_DELAY_NS")
        self.cancel_delay_ns = self._read(config, "CUSTOM_CANCEL_DELAY_NS")
        self.fail_count = self._read(config, "CUSTOM_FAIL_COUNT")
        self.empty_count = self._read(config, "CUSTOM_EMPTY_COUNT")

    @staticmethod
    def _read(config: ModelConfig, key: str) -> int:
        value = parameter(config, key)
        if value is None:
            return 0
        if not value.isdigit():
            log.info(f"{value} string_value from {key} parameter is not a number")
            return 0
        return int(value)

    def result(self, index: int, count: int) -> str:
        """InferResult: success, then fail, then empty (square.cc 154-172)."""
        if index + self.fail_count + self.empty_count < count:
            return "success"
        if index + self.empty_count < count:
            return "fail"
        return "empty"


async def _sleep_ns(delay_ns: int) -> None:
    if delay_ns > 0:
        log.info(f"add delay {delay_ns} ns")
        await trio.sleep(delay_ns / 1e9)


class SquareInstance(ReferenceInstance):
    def __init__(self, context: ModelContext, spec: InstanceSpec, settings: SquareParameters):
        super().__init__(context, spec)
        self._settings = settings

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult | None:
        log.info(f"model instance {self.spec.name}, executing {len(requests)} requests")
        for request in requests:
            self._process(request)
        return None

    def _process(self, request: InferenceRequest) -> None:
        try:
            values = _read(request, "IN")
            if values.ndim == 2 and values.shape[0] != 1:
                raise InvalidArgument("unexpected shape for IN input")
        except TritonError as exc:
            request.fail(exc)
            return
        count = int(values.reshape(-1)[0]) if values.size else 0
        rank = values.ndim
        settings = self._settings

        async def responses() -> None:
            for index in range(count):
                cancelled = request.cancelled
                await _sleep_ns(settings.cancel_delay_ns if cancelled else settings.infer_delay_ns)
                if cancelled:
                    log.info(f"cancelled at response {index + 1} of {count}")
                    request.fail(Cancelled("cancelled"))
                    return
                result = settings.result(index, count)
                if result == "empty":
                    continue
                output = np.full((1,) * rank, count, dtype=np.int32)
                response = self.response(request, [Tensor("OUT", "INT32", output)])
                await _sleep_ns(settings.output_delay_ns)
                if result == "fail":
                    request.fail(TritonError("simulated failure", Status.UNKNOWN))
                    return
                request.send(response, final=not self.decoupled)
                log.info(f"sent response {index + 1} of {count}")
            if count == 0:
                log.info("IN value is zero, no responses sent")
            request.send(None, final=True)

        self.respond_later(request, responses)
