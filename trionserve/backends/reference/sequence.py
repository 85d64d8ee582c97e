"""``backend: "sequence"``, ``"dyna_sequence"`` and ``"implicit_state"``: the stateful
test backends of Triton's sequence-batcher QA suites (server ``src/test/``).

sequence (``src/test/sequence/src/sequence.cc``): an INT32 accumulator per batch
slot (``max(1, max_batch_size)`` of them). Load (``ValidateModelConfig``, 113-233):
exactly the control inputs ``START`` and ``READY``, one INT32 vector input
``INPUT`` and one INT32 output ``OUTPUT`` of its shape. Execute (348-700): a batch
larger than the slots fails whole (UNSUPPORTED "unable to execute batch larger than
max-batch-size"); after ``execute_delay_ms``, for the request in slot ``r``: more
than one timestep is UNSUPPORTED; when READY, START sets the slot's accumulator to
the sum of INPUT's elements and otherwise adds that sum; OUTPUT (if asked for) is
INPUT's shape filled with the accumulator; a request that is not READY (the
batcher's filler) gets a response without outputs.

dyna_sequence (``src/test/dyna_sequence/src/dyna_sequence.cc``): one accumulator
per correlation ID. Load (116-290): the four controls ``START``, ``END``,
``READY``, ``CORRID``, CORRID of TYPE_UINT64 or TYPE_STRING, INPUT/OUTPUT as
sequence's. Execute (579-1160): as sequence, keyed by the CORRID tensor's value (a
string ID read as an integer, else INVALID_ARG "dyna sequence backend expects
correlation ID to be decodable into an integer"); at END the correlation ID is
added to the accumulator before it is sent, then the accumulator is dropped.

implicit_state (``src/test/implicit_state/src/implicit_state.cc``): exercises the
implicit-state API, chosen per request by input ``TEST_CASE`` (execute 403-1188):
0 creates a state named ``undefined_state`` (core ``TRITONBACKEND_StateNew``,
backend_model.cc 1424-1447, and ``SequenceStates::OutputState``,
sequence_state.cc 282-294: "unable to add state 'undefined_state'. State
configuration is missing for model '<m>'." without ``sequence_batching.state``,
"state 'undefined_state' is not a valid state name." with one); 1 answers
``OUTPUT = INPUT + INPUT_STATE`` and leaves the state as it was (the backend
fills a state buffer but never calls ``TRITONBACKEND_StateUpdate``); 2 creates
``OUTPUT_STATE`` and answers nothing; 3 (growable GPU memory) is refused with
the backend's "growable memory should always provide memory in GPU", which is
what a host without a GPU gets. State buffers have no memory kind here, so the
memory-kind checks of cases 1 and 2 pass as on a GPU host.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import trio

from trionserve.backends.base import ExecuteResult, InstanceSpec, ModelContext
from trionserve.backends.reference.common import (
    ReferenceBackend,
    ReferenceInstance,
    ReferenceModel,
    int_parameter,
    refuse,
    vlog,
)
from trionserve.backends.reference.identity import config_type_name
from trionserve.core.errors import InvalidArgument, TritonError, Unimplemented
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

_LEADING_INT = re.compile(r"\s*[+-]?\d+")


def _int32(value: int) -> int:
    """Wrap to int32, as the backends' int32_t accumulators do."""
    return (value + 2**31) % 2**32 - 2**31


def _flag(request: InferenceRequest, name: str) -> bool:
    """A control input's value is not zero (the backends read its first element's
    bytes; the false value is 0 in every control datatype)."""
    tensor = request.inputs.get(name)
    if tensor is None:
        raise InvalidArgument(f"input '{name}' is missing from the request")
    data = tensor.data.reshape(-1)
    return bool(data.size) and bool(data[0])


def _input(request: InferenceRequest, name: str) -> Tensor:
    tensor = request.inputs.get(name)
    if tensor is None:
        raise InvalidArgument(f"input '{name}' is missing from the request")
    return tensor


def _check_vector_io(config: ModelConfig) -> None:
    """sequence.cc / dyna_sequence.cc: one INT32 vector INPUT, one OUTPUT of its shape."""
    refuse(
        config,
        len(config.input) == 1,
        "model must have input 'INPUT' with vector shape, any length",
    )
    tensor_in = config.input[0]
    refuse(
        config,
        len(tensor_in.dims) == 1,
        "model must have one input 'INPUT' with vector shape, any length",
    )
    refuse(
        config,
        config_type_name(tensor_in.data_type) == "TYPE_INT32",
        "model input must have TYPE_INT32 data-type",
    )
    refuse(config, tensor_in.name == "INPUT", "model input must be named 'INPUT'")
    refuse(
        config,
        len(config.output) == 1,
        "model must have one output 'OUTPUT' with vector shape, any length",
    )
    tensor_out = config.output[0]
    refuse(
        config,
        len(tensor_out.dims) == 1 and tensor_out.dims[0] == tensor_in.dims[0],
        "model must have output 'OUTPUT' with shape matching 'INPUT'",
    )
    refuse(
        config,
        config_type_name(tensor_out.data_type) == "TYPE_INT32",
        "model output must have TYPE_INT32 data-type",
    )
    refuse(config, tensor_out.name == "OUTPUT", "model output must be named 'OUTPUT'")


def _control_names(config: ModelConfig) -> list[str]:
    return [c.name for c in config.sequence_batching.control_input]


class _Accumulating(ReferenceInstance):
    """What sequence and dyna_sequence share: the delay, the batch bound, the
    one-timestep rule, the accumulator's output."""

    def __init__(self, context: ModelContext, spec: InstanceSpec, delay_ms: int) -> None:
        super().__init__(context, spec)
        self._delay_ms = delay_ms
        self._slots = max(1, context.config.max_batch_size)
        self._batching = context.config.max_batch_size > 0

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult:
        vlog(
            f"model {self.context.name}, instance {self.spec.name}, executing "
            f"{len(requests)} requests"
        )
        if len(requests) > self._slots:
            error = Unimplemented("unable to execute batch larger than max-batch-size")
            return [error] * len(requests)
        if self._delay_ms > 0:
            await trio.sleep(self._delay_ms / 1000)
        results: ExecuteResult = []
        for slot, request in enumerate(requests):
            try:
                results.append(self._one(slot, request))
            except TritonError as exc:
                results.append(exc)
        return results

    def _timestep(self, request: InferenceRequest) -> np.ndarray:
        tensor = _input(request, "INPUT")
        if self._batching and tensor.data.ndim and tensor.shape[0] != 1:
            raise Unimplemented("unable to execute more than one timestep at a time")
        return tensor.data

    def _answer(
        self, request: InferenceRequest, values: np.ndarray, total: int
    ) -> InferenceResponse:
        outputs = []
        if request.requested_outputs is None or request.requested_outputs:
            outputs.append(Tensor("OUTPUT", "INT32", np.full(values.shape, total, np.int32)))
        return self.response(request, outputs)

    def _one(self, slot: int, request: InferenceRequest) -> InferenceResponse | TritonError:
        raise NotImplementedError


class SequenceBackend(ReferenceBackend):
    name = "sequence"

    def load(self, context: ModelContext) -> ReferenceModel:
        config = context.config
        delay = int_parameter(config, "execute_delay_ms")
        names = _control_names(config)
        message = "'START' and 'READY' must be configured as the control inputs"
        refuse(config, len(names) == 2, message)
        refuse(config, sorted(names) == ["READY", "START"], message)
        _check_vector_io(config)
        return ReferenceModel(lambda spec: SequenceInstance(context, spec, delay))


class SequenceInstance(_Accumulating):
    def __init__(self, context: ModelContext, spec: InstanceSpec, delay_ms: int) -> None:
        super().__init__(context, spec, delay_ms)
        self._accumulators = [0] * self._slots

    def _one(self, slot: int, request: InferenceRequest) -> InferenceResponse | TritonError:
        values = self._timestep(request)
        start, ready = _flag(request, "START"), _flag(request, "READY")
        if not ready:
            return self.response(request, [])
        total = int(values.astype(np.int64).sum())
        if start:
            self._accumulators[slot] = _int32(total)
        else:
            self._accumulators[slot] = _int32(self._accumulators[slot] + total)
        return self._answer(request, values, self._accumulators[slot])


class DynaSequenceBackend(ReferenceBackend):
    name = "dyna_sequence"

    def load(self, context: ModelContext) -> ReferenceModel:
        config = context.config
        delay = int_parameter(config, "execute_delay_ms")
        controls = config.sequence_batching.control_input
        message = "'START', 'END, 'READY' and 'CORRID' must be configured as the control inputs"
        refuse(config, len(controls) == 4, message)
        corrid = next((c for c in controls if c.name == "CORRID"), None)
        refuse(config, corrid is not None and len(corrid.control) > 0, message)
        assert corrid is not None
        corrid_type = config_type_name(corrid.control[0].data_type)
        refuse(
            config,
            corrid_type in ("TYPE_UINT64", "TYPE_STRING"),
            "model CORRID control input must have TYPE_UINT64 or TYPE_STRING data-type",
        )
        _check_vector_io(config)
        strings = corrid_type == "TYPE_STRING"
        return ReferenceModel(lambda spec: DynaSequenceInstance(context, spec, delay, strings))


def _decode_id(value: object) -> int:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    match = _LEADING_INT.match(text)
    if match is None:
        raise InvalidArgument(
            "dyna sequence backend expects correlation ID to be decodable into an integer"
        )
    return int(match.group())


class DynaSequenceInstance(_Accumulating):
    def __init__(
        self, context: ModelContext, spec: InstanceSpec, delay_ms: int, strings: bool
    ) -> None:
        super().__init__(context, spec, delay_ms)
        self._strings = strings
        self._accumulators: dict[int, int] = {}

    def _one(self, slot: int, request: InferenceRequest) -> InferenceResponse | TritonError:
        if self._strings and request.collect_stats:
            _decode_id(request.sequence_id)
        values = self._timestep(request)
        start, end = _flag(request, "START"), _flag(request, "END")
        ready = _flag(request, "READY")
        raw = _input(request, "CORRID").data.reshape(-1)
        corrid = _decode_id(raw[0]) if self._strings else int(raw[0])
        if not ready:
            return self.response(request, [])
        total = int(values.astype(np.int64).sum())
        accumulators = self._accumulators
        if start:
            accumulators[corrid] = _int32(total)
        else:
            accumulators[corrid] = _int32(accumulators.get(corrid, 0) + total)
        if end:
            accumulators[corrid] = _int32(accumulators[corrid] + _int32(corrid))
            value = accumulators.pop(corrid)
        else:
            value = accumulators[corrid]
        return self._answer(request, values, value)


class ImplicitStateBackend(ReferenceBackend):
    name = "implicit_state"

    def load(self, context: ModelContext) -> ReferenceModel:
        config = context.config
        names = _control_names(config)
        message = "'START', 'END, and 'READY' must be configured as the control inputs"
        refuse(config, len(names) == 3, message)
        refuse(config, bool({"START", "END", "READY"} & set(names)), message)
        return ReferenceModel(lambda spec: ImplicitStateInstance(context, spec))


class ImplicitStateInstance(ReferenceInstance):
    def __init__(self, context: ModelContext, spec: InstanceSpec) -> None:
        super().__init__(context, spec)
        batching = context.config.sequence_batching
        self._has_states = len(batching.state) > 0
        self._state_outputs = {s.output_name for s in batching.state}
        self._request_index = 0

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        results: ExecuteResult = []
        for request in requests:
            try:
                results.append(self._one(request))
            except TritonError as exc:
                results.append(exc)
        return results

    def _state_new(self, name: str) -> None:
        """core TRITONBACKEND_StateNew's refusals (backend_model.cc 1424-1447)."""
        if not self._has_states:
            raise InvalidArgument(
                f"unable to add state '{name}'. State configuration is missing for model "
                f"'{self.context.name}'."
            )
        if name not in self._state_outputs:
            raise InvalidArgument(f"state '{name}' is not a valid state name.")

    def _one(self, request: InferenceRequest) -> InferenceResponse | TritonError:
        if _flag(request, "START"):
            self._request_index = 0
        end = _flag(request, "END")
        value = int(_input(request, "INPUT").data.reshape(-1)[0])
        test_case = int(_input(request, "TEST_CASE").data.reshape(-1)[0])
        try:
            state = 0
            if test_case != 0:
                state_input = _input(request, "INPUT_STATE").data.reshape(-1)
                if test_case == 3:
                    raise Unimplemented("growable memory should always provide memory in GPU")
                state = int(state_input[0]) if state_input.size else 0
            outputs: list[Tensor] = []
            if test_case == 0:
                self._state_new("undefined_state")
            elif test_case == 1:
                self._state_new("OUTPUT_STATE")
                total = np.array([_int32(value + state)], dtype=np.int32)
                outputs.append(Tensor("OUTPUT", "INT32", total))
            elif test_case == 2:
                self._state_new("OUTPUT_STATE")
            return self.response(request, outputs)
        finally:
            self._request_index = 0 if end else self._request_index + 1
