"""``backend: "bls"``: the BLS example backend of Triton's backend repository
(triton-inference-server/backend ``examples/backends/bls/``), which
``qa/L0_backend_bls`` builds and serves with ``examples/model_repos/bls_models``.

Load (``src/backend.cc`` ``ModelState::ValidateModelConfig``): ``max_batch_size``
0, exactly two inputs ``INPUT0``, ``INPUT1`` and two outputs ``OUTPUT0``,
``OUTPUT1``, in that order, each of one dimension and ``TYPE_FP32``; anything
else is refused with the example's words (INVALID_ARG).

Execute (``src/bls.cc`` ``BLSExecutor::Execute``): for each request, the models
``addsub_python`` and ``addsub_onnx`` must be ready and not decoupled (else the
request fails INTERNAL "Failed to send inference requests", the reason logged);
the request's inputs, requested outputs, id and correlation id go to both, in
parallel, on the server's own inference path, and the response is output 0 of
``addsub_python``'s response with output 1 of ``addsub_onnx``'s
(``ConstructFinalResponse``: ``TRITONSERVER_InferenceResponseOutput(..., icount,
...)``). Where an inner request fails, Triton's example logs the error and sends
what it has so far; here the request fails with that error, so the client is
told which model failed instead of getting a response with an output missing.
"""

from __future__ import annotations

import trio

from trionserve.backends.base import ExecuteResult, ModelContext
from trionserve.backends.reference.common import (
    ReferenceBackend,
    ReferenceInstance,
    ReferenceModel,
    log,
    refuse,
    shape_string,
)
from trionserve.backends.reference.identity import config_type_name
from trionserve.core.errors import InternalError, TritonError, as_triton_error
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor

# The models the example sends its requests to, in the order their outputs are
# taken (bls.cc Execute: model_names = {"addsub_python", "addsub_onnx"}).
MODELS = ("addsub_python", "addsub_onnx")


def _check_config(context: ModelContext) -> None:
    """ModelState::ValidateModelConfig (backend.cc), its checks in its order."""
    config = context.config
    refuse(
        config,
        config.max_batch_size == 0,
        "bls backend only supports models with max_batch_size == 0",
    )
    refuse(config, len(config.input) == 2, f"expected 2 inputs, got {len(config.input)}")
    refuse(config, len(config.output) == 2, f"expected 2 outputs, got {len(config.output)}")
    input0, input1 = config.input
    output0, output1 = config.output
    for tensor, ordinal, kind, name in (
        (input0, "first", "input", "INPUT0"),
        (input1, "second", "input", "INPUT1"),
        (output0, "first", "output", "OUTPUT0"),
        (output1, "second", "output", "OUTPUT1"),
    ):
        refuse(
            config,
            tensor.name == name,
            f"expected {ordinal} {kind} tensor name to be {name}, got {tensor.name}",
        )
    for tensor in (input0, input1, output0, output1):
        refuse(
            config,
            len(tensor.dims) == 1,
            f"expected {tensor.name} shape to have one dimension, got {shape_string(tensor.dims)}",
        )
    for tensor in (input0, input1, output0, output1):
        datatype = config_type_name(tensor.data_type)
        refuse(
            config,
            datatype == "TYPE_FP32",
            f"expected {tensor.name} datatype to be TYPE_FP32, got {datatype}",
        )


class _BLSInstance(ReferenceInstance):
    """BLSExecutor: each request sent on to both models, their outputs joined."""

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult:
        results: ExecuteResult = []
        for request in requests:
            try:
                results.append(await self._execute_one(request))
            except TritonError as error:
                results.append(error)
        return results

    def _check_models(self) -> None:
        """The readiness and transaction-policy checks of BLSExecutor::Execute."""
        # The server's inference path, as models see it, also answers whether a
        # model is ready and routes to its loaded version (its configuration).
        service = self.context.inference
        model_ready = getattr(service, "model_ready", None)
        route = getattr(service, "model", None)
        for name in MODELS:
            if model_ready is None or route is None or not model_ready(name, None):
                reason = f"Failed to execute the inference request. Model '{name}' is not ready."
            elif route(name, None).config.model_transaction_policy.decoupled:
                reason = (
                    f"Model '{name}' is using the decoupled. This BLS Backend doesn't "
                    "support models using the decoupled transaction policy."
                )
            else:
                continue
            log.error(reason)
            raise InternalError("Failed to send inference requests")

    async def _execute_one(self, request: InferenceRequest) -> InferenceResponse:
        self._check_models()
        service = self.context.inference
        assert service is not None  # _check_models refused a server without one
        answers: list[InferenceResponse | TritonError | None] = [None, None]

        async def send(index: int) -> None:
            inner = InferenceRequest(
                MODELS[index],
                None,
                id=request.id,
                inputs=dict(request.inputs),
                requested_outputs=request.requested_outputs,
                sequence_id=request.sequence_id,
                sequence_start=request.sequence_start,
                sequence_end=request.sequence_end,
            )
            try:
                answers[index] = await service.infer(inner)
            except Exception as exc:  # one outcome per request: the error is its answer
                answers[index] = as_triton_error(exc)

        async with trio.open_nursery() as nursery:
            for index in range(len(MODELS)):
                nursery.start_soon(send, index)

        outputs: list[Tensor] = []
        for index, answer in enumerate(answers):
            if isinstance(answer, TritonError) or answer is None:
                error = answer or InternalError(f"no response from model '{MODELS[index]}'")
                log.error(error.message)
                raise TritonError(
                    f"BLS request to model '{MODELS[index]}' failed: {error.message}",
                    error.status,
                )
            if len(answer.outputs) <= index:
                raise InternalError(
                    f"model '{MODELS[index]}' returned {len(answer.outputs)} outputs; "
                    f"the bls backend takes its output {index}"
                )
            outputs.append(answer.outputs[index])
        return self.response(request, outputs)


class BLSBackend(ReferenceBackend):
    name = "bls"

    def load(self, context: ModelContext) -> ReferenceModel:
        _check_config(context)
        return ReferenceModel(lambda spec: _BLSInstance(context, spec))
