"""Requests and responses as stub messages, on the server's side.

Tensors go into shared memory and the messages name them (:mod:`.shm`); what the
stub wrote is copied out and its blocks released as soon as it is read, so no
server-side object ever points into a stub's memory. Error codes are Triton's
``TRITONSERVER_Error_Code`` numbers, as ``pb_utils.TritonError`` uses them.
"""

from __future__ import annotations

import json

from trionserve.backends.python.shm import Block, TensorRef, block_of
from trionserve.backends.python.wire import Endpoint
from trionserve.core.errors import Status, TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse, RequestedOutput, Tensor

_STATUS_BY_CODE = {
    0: Status.UNKNOWN,
    1: Status.INTERNAL,
    2: Status.NOT_FOUND,
    3: Status.INVALID_ARGUMENT,
    4: Status.UNAVAILABLE,
    5: Status.UNIMPLEMENTED,  # UNSUPPORTED
    6: Status.ALREADY_EXISTS,
    7: Status.CANCELLED,
}
_CODE_BY_STATUS = {
    Status.UNKNOWN: 0,
    Status.INTERNAL: 1,
    Status.NOT_FOUND: 2,
    Status.INVALID_ARGUMENT: 3,
    Status.UNAVAILABLE: 4,
    Status.UNIMPLEMENTED: 5,
    Status.ALREADY_EXISTS: 6,
    Status.CANCELLED: 7,
    Status.DEADLINE_EXCEEDED: 4,
}
FLAG_SEQUENCE_START = 1
FLAG_SEQUENCE_END = 2


def code_of(error: TritonError) -> int:
    """The ``pb_utils.TritonError`` code of a server error."""
    return _CODE_BY_STATUS.get(error.status, 1)


def error_from_code(code: int, message: str) -> TritonError:
    return TritonError(message, _STATUS_BY_CODE.get(code, Status.INTERNAL))


def _json(parameters: dict) -> str:
    return json.dumps(parameters, default=str) if parameters else "{}"


def _parameters(text: str) -> dict:
    return json.loads(text) if text != "{}" else {}


# -- server -> stub -----------------------------------------------------------------


def request_message(
    key: int, request: InferenceRequest, endpoint: Endpoint, output_names: list[str]
) -> tuple[dict, list[Block]]:
    """An execute entry for one request; its inputs are written to shared memory."""
    refs: list[TensorRef] = []
    blocks: list[Block] = []
    for name, tensor in request.inputs.items():
        ref, block = endpoint.arena.write(name, tensor.datatype, tensor.data)
        refs.append(ref)
        if block is not None:
            blocks.append(block)
    flags = (FLAG_SEQUENCE_START if request.sequence_start else 0) | (
        FLAG_SEQUENCE_END if request.sequence_end else 0
    )
    if request.requested_outputs is None:
        outputs = output_names
    else:
        outputs = [o.name for o in request.requested_outputs]
    message = {
        "key": key,
        "id": request.id,
        "correlation_id": request.sequence_id,
        "flags": flags,
        "parameters": _json(request.parameters),
        "inputs": refs,
        "outputs": outputs,
        "cancelled": request.cancelled,
    }
    return message, blocks


def response_message(response: InferenceResponse, endpoint: Endpoint) -> dict:
    """A BLS response for the stub; its outputs are written to shared memory."""
    refs = [endpoint.arena.write(t.name, t.datatype, t.data)[0] for t in response.outputs]
    return {"outputs": refs, "error": None, "parameters": _json(response.parameters)}


def error_message(error: TritonError) -> dict:
    return {
        "outputs": [],
        "error": (code_of(error), error.message),
        "parameters": "{}",
    }


# -- stub -> server -----------------------------------------------------------------


def release_outputs(encoded: dict | None, endpoint: Endpoint) -> None:
    """Give back the blocks of a response that will not be read."""
    if encoded is not None:
        endpoint.release(block_of(ref) for ref in encoded["outputs"])


def read_response(
    encoded: dict, endpoint: Endpoint, request: InferenceRequest, model_version: str
) -> InferenceResponse | TritonError:
    """A model's response to ``request``: the outputs it asked for, copied out."""
    try:
        if encoded["error"] is not None:
            code, message = encoded["error"]
            return error_from_code(code, message)
        by_name = {ref[0]: ref for ref in encoded["outputs"]}
        if request.requested_outputs is None:
            refs = list(by_name.values())
        else:
            refs = [by_name[o.name] for o in request.requested_outputs if o.name in by_name]
        outputs = [Tensor(ref[0], ref[1], endpoint.view.array(ref, copy=True)) for ref in refs]
        parameters = _parameters(encoded["parameters"])
        return InferenceResponse(request.model_name, model_version, request.id, outputs, parameters)
    finally:
        release_outputs(encoded, endpoint)


def bls_request(message: dict, endpoint: Endpoint) -> InferenceRequest:
    """The request a model built with ``pb_utils.InferenceRequest``, copied out."""
    try:
        inputs = {
            ref[0]: Tensor(ref[0], ref[1], endpoint.view.array(ref, copy=True))
            for ref in message["inputs"]
        }
    finally:
        endpoint.release(block_of(ref) for ref in message["inputs"])
    return called_request(
        message["model_name"],
        message["model_version"],
        message["id"],
        message["correlation_id"],
        message["flags"],
        message["timeout"],
        message["parameters"],
        inputs,
        message["outputs"],
    )


def called_request(
    model_name: str,
    model_version: int,
    request_id: str,
    correlation_id: int | str,
    flags: int,
    timeout_us: int,
    parameters: str,
    inputs: dict[str, Tensor],
    output_names: list[str],
) -> InferenceRequest:
    """The server's request for a ``pb_utils.InferenceRequest`` a model executes:
    version -1 is the model's latest, no output names ask for every output."""
    return InferenceRequest(
        model_name,
        model_version if model_version > 0 else None,
        id=request_id,
        inputs=inputs,
        requested_outputs=[RequestedOutput(n) for n in output_names] if output_names else None,
        parameters=_parameters(parameters),
        timeout_us=timeout_us,
        sequence_id=correlation_id,
        sequence_start=bool(flags & FLAG_SEQUENCE_START),
        sequence_end=bool(flags & FLAG_SEQUENCE_END),
    )
