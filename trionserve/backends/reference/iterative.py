"""``backend: "iterative_sequence"``: the test backend of Triton's request
rescheduling (server ``src/test/iterative_sequence/src/iterative_sequence.cc``,
used by ``qa/L0_iterative_sequence``).

Its model is decoupled and answers a request with a countdown, one response per
execution: ``INPUT`` = N starts a remainder of N for the request's correlation ID
(``GetOutput``, 148-160); each execution sends ``OUTPUT`` = the remainder less one
and, while that is above zero, releases the request with
``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`` so that its scheduler executes it again
(``TRITONBACKEND_ModelInstanceExecute``, 332-578). The backend waits 500 ms
between computing a response and releasing its request (519), which is what lets a
short ``max_sequence_idle_microseconds`` end the sequence under it.

Only a ``sequence_batching { iterative_sequence: true }`` scheduler takes a request
back; under any other the release fails with core's INVALID_ARG "Request is
released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is not
configured to handle such a flag." (``infer_request.cc`` 113-126), and the backend
sends that error as the request's final response (541-557).
"""

from __future__ import annotations

import numpy as np
import trio

from trionserve.backends.base import ExecuteResult, InstanceSpec, ModelContext
from trionserve.backends.reference.common import (
    ReferenceBackend,
    ReferenceInstance,
    ReferenceModel,
    error_for,
    log,
)
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, Tensor

# iterative_sequence.cc 519: std::this_thread::sleep_for(500 ms) before the release.
RELEASE_DELAY_S = 0.5

NOT_RESCHEDULABLE = (
    "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the "
    "model is not configured to handle such a flag."
)


class IterativeSequenceBackend(ReferenceBackend):
    name = "iterative_sequence"

    def load(self, context: ModelContext) -> ReferenceModel:
        # iterative_sequence.cc validates nothing of the config; its instances are
        # CPU ones only (ModelInstanceInitialize 302-305), as every reference
        # backend's here.
        return ReferenceModel(lambda spec: IterativeSequenceInstance(context, spec))


class IterativeSequenceInstance(ReferenceInstance):
    def __init__(self, context: ModelContext, spec: InstanceSpec) -> None:
        super().__init__(context, spec)
        config = context.config
        self._batching = config.max_batch_size > 0
        self._reschedulable = config.sequence_batching.iterative_sequence
        # ModelInstanceState::remainders_: correlation ID -> responses still to send.
        self._remainders: dict[int | str, int] = {}

    def _output(self, correlation_id: int | str, init_value: int) -> int:
        """ModelInstanceState::GetOutput: the remainder, one less each call; at zero
        or below the correlation ID is forgotten."""
        remainder = self._remainders.get(correlation_id, init_value) - 1
        if remainder <= 0:
            self._remainders.pop(correlation_id, None)
        else:
            self._remainders[correlation_id] = remainder
        return remainder

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult | None:
        log.info(
            f"model {self.context.name}, instance {self.spec.name}, "
            f"executing {len(requests)} requests"
        )
        for request in requests:
            await self._process(request)
        return None

    async def _process(self, request: InferenceRequest) -> None:
        tensor = request.inputs.get("INPUT")
        if tensor is None:
            request.fail(error_for(request, InvalidArgument("input 'INPUT' is missing")))
            return
        values = tensor.data.reshape(-1)
        if values.size == 0 or values.dtype.itemsize < 4:
            request.fail(error_for(request, InvalidArgument("input 'INPUT' holds no INT32 value")))
            return
        # The first 4 bytes as an int32_t, whatever the request's datatype.
        init_value = int(np.frombuffer(values.tobytes()[:4], dtype=np.int32)[0])
        value = self._output(request.sequence_id, init_value)
        shape = (1, 1) if self._batching else (1,)
        output = Tensor("OUTPUT", "INT32", np.full(shape, value, dtype=np.int32))
        response = self.response(request, [output])
        await trio.sleep(RELEASE_DELAY_S)
        if value <= 0:
            request.send(response, final=True)  # released with RELEASE_ALL
        elif not self._reschedulable:
            request.fail(error_for(request, InvalidArgument(NOT_RESCHEDULABLE)))
        else:
            request.send(response, final=False)
            request.rescheduled = True
