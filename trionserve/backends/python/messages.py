"""Requests and responses as stub messages, on the server's side.

Tensors go into shared memory and the messages name them (:mod:`.shm`); what the
stub wrote is copied out and its blocks released as soon as it is read, so no
server-side object ever points into a stub's memory. Error codes are Triton's
``TRITONSERVER_Error_Code`` numbers, as ``pb_utils.TritonError`` uses them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, cast

import numpy as np

from trionserve.backends.python.shm import INLINE, INLINE_MAX_BYTES, Block, TensorRef, block_of
from trionserve.backends.python.wire import Endpoint
from trionserve.core.datatypes import BY_WIRE
from trionserve.core.errors import Status, TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse, RequestedOutput, Tensor

if TYPE_CHECKING:
    from trionserve.observability.trace.trace_file import Trace

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
) -> tuple[tuple, list[Block]]:
    """An execute entry for one request; its inputs are written to shared memory.

    The entry is positional (the stub's ``StubRuntime._incoming`` reads it):
    ``(key, id, correlation_id, flags, parameters, inputs, outputs, cancelled,
    traced)``; ``traced``: the request has a trace, which the model's BLS
    requests given ``trace=request.trace()`` are traced as children of.
    """
    refs: list[TensorRef] = []
    blocks: list[Block] = []
    write = endpoint.arena.write
    for name, tensor in request.inputs.items():
        data, datatype = tensor.data, tensor.datatype
        if datatype != "BYTES" and 0 < data.nbytes <= INLINE_MAX_BYTES:
            # Arena.write's inline case written out: a small numeric tensor rides
            # in the message itself.
            refs.append((name, datatype, data.shape, INLINE, 0, data.tobytes()))
            continue
        ref, block = write(name, datatype, data)
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
    entry = (
        key,
        request.id,
        request.sequence_id,
        flags,
        _json(request.parameters),
        refs,
        outputs,
        request.cancelled,
        # Traced: its trace context ("" for none, mode triton); None: not traced.
        None if request.trace is None else (cast("Trace", request.trace).context or ""),
    )
    return entry, blocks


# A response as the stub and the server exchange it: (tensor references, error
# as (code, message) or None, parameters as JSON).
EncodedResponse = tuple[list, "tuple[int, str] | None", str]


def response_message(response: InferenceResponse, endpoint: Endpoint) -> EncodedResponse:
    """A BLS response for the stub; its outputs are written to shared memory."""
    refs = [endpoint.arena.write(t.name, t.datatype, t.data)[0] for t in response.outputs]
    return (refs, None, _json(response.parameters))


def error_message(error: TritonError) -> EncodedResponse:
    return ([], (code_of(error), error.message), "{}")


# -- stub -> server -----------------------------------------------------------------


def release_outputs(encoded: EncodedResponse | None, endpoint: Endpoint) -> None:
    """Give back the blocks of a response that will not be read (none for the
    tensors that came inline or empty: small responses skip the bookkeeping)."""
    if encoded is not None:
        for ref in encoded[0]:
            if ref[3] >= 0:
                endpoint.release([block_of(ref) for ref in encoded[0] if ref[3] >= 0])
                return


def read_response(
    encoded: EncodedResponse, endpoint: Endpoint, request: InferenceRequest, model_version: str
) -> InferenceResponse | TritonError:
    """A model's response to ``request``: the outputs it asked for, copied out."""
    refs_sent, error, parameters = encoded
    try:
        if error is not None:
            return error_from_code(error[0], error[1])
        requested = request.requested_outputs
        array = endpoint.view.array
        if requested is None and len(refs_sent) <= 1:
            refs = refs_sent  # no name to look up or to keep once
        else:
            by_name = {ref[0]: ref for ref in refs_sent}
            if requested is None:
                refs = list(by_name.values())
            else:
                refs = [by_name[o.name] for o in requested if o.name in by_name]
        outputs = []
        for ref in refs:
            name, datatype = ref[0], ref[1]
            if ref[3] == INLINE and datatype != "BYTES":
                # ArenaView.array's inline case written out: the array made on a
                # writable copy of the bytes.
                data = np.ndarray(ref[2], BY_WIRE[datatype].numpy, bytearray(ref[5]))
            else:
                data = array(ref, copy=True)
            outputs.append(Tensor(name, datatype, data))
        return InferenceResponse(
            request.model_name,
            model_version,
            request.id,
            outputs,
            _parameters(parameters) if parameters != "{}" else {},
        )
    finally:
        for ref in refs_sent:
            if ref[3] >= 0:  # a block to give back (none for inline or empty tensors)
                endpoint.release([block_of(ref) for ref in refs_sent if ref[3] >= 0])
                break


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
