"""The generate extension's JSON <-> InferenceRequest / InferenceResponse mapping.

Sans-I/O: bytes and plain data in, an :class:`InferenceRequest` or bytes out.
Follows Triton's ``/generate`` and ``/generate_stream`` endpoints:

- a top-level field named like a model input becomes that input: a string is one
  BYTES element, a number or boolean one element of the input's datatype, a flat
  array one element per item; the shape is the input's shape (with the batch
  dimension) with the fixed dimensions filled first, the innermost variable
  dimension taking the remaining elements and any other variable dimension 1;
- ``id`` is the request id; every other field becomes a request parameter
  (string, integer, float or boolean); the fields of the ``parameters`` object
  are treated the same way (an input there is an input, anything else a
  parameter);
- a response becomes ``{"id"?, "model_name", "model_version", <parameters>,
  <outputs>}`` where an output of one element is that element and any other a
  flat array, BYTES as strings;
- ``generate_stream`` sends each response as a server-sent event
  ``data: {...}\\n\\n``, and an error after the stream started as
  ``data: {"error": "..."}\\n\\n``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from trionserve.core import datatypes
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.core.validation import ModelSignature
from trionserve.protocol.http.tensor_data import flatten, json_output, json_to_array

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
NOT_ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for "
    "model that generates various number of responses"
)


def decode_generate_request(
    body: bytes | bytearray | memoryview,
    model_name: str,
    model_version: int | None,
    signature: ModelSignature,
) -> InferenceRequest:
    """A generate request body as an InferenceRequest for the model ``signature``."""
    if isinstance(body, memoryview):
        body = bytes(body)
    try:
        # Objects keep their members in order, duplicates included, so that a key
        # given twice is refused as Triton's core refuses a second input.
        payload = json.loads(body, object_pairs_hook=_Members) if body.strip() else _Members()
    except ValueError as exc:
        raise InvalidArgument(f"failed to parse the generate request JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument(
            "failed to parse the generate request JSON: nested too deeply"
        ) from None
    if not isinstance(payload, _Members):
        raise InvalidArgument("the generate request body must be a JSON object")
    request_id = payload.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("Unable to parse 'id': the request id must be a string")
    inputs: dict[str, Tensor] = {}
    parameters: dict[str, Any] = {}
    for key, value in payload.members:
        if key == "id":
            continue
        if key == "parameters" and key not in signature.inputs:
            # Triton's mapping schema (src/http_server.cc ConvertGenerateRequest).
            if not isinstance(value, _Members):
                raise InvalidArgument(
                    "Expected JSON object for keyword: 'parameters': attempt to access "
                    "JSON non-object as object"
                )
            try:
                for nested, nested_value in value.members:
                    _map_field(nested, nested_value, signature, inputs, parameters)
            except InvalidArgument as exc:
                raise InvalidArgument(f"Converting keyword: 'parameters': {exc.message}") from None
            continue
        _map_field(key, value, signature, inputs, parameters)
    return InferenceRequest(
        model_name,
        model_version,
        id=request_id,
        inputs=inputs,
        parameters=parameters,
    )


class _Members(dict):
    """A JSON object: a dict, with its members in order, duplicates included."""

    def __init__(self, members: list[tuple[str, Any]] | None = None) -> None:
        self.members = members or []
        super().__init__(self.members)


# TritonJson's words for a value of the wrong JSON type (Triton's common
# triton_json.h AsString / AsBool / AsInt / AsUInt / AsDouble), by input datatype.
_STRING = "attempt to access JSON non-string as string"
_TYPE_ERRORS = {
    "BOOL": ("attempt to access JSON non-boolean as boolean", (bool,)),
    "FP16": ("attempt to access JSON non-number as double", (int, float)),
    "FP32": ("attempt to access JSON non-number as double", (int, float)),
    "FP64": ("attempt to access JSON non-number as double", (int, float)),
}
for _wire in ("INT8", "INT16", "INT32", "INT64"):
    _TYPE_ERRORS[_wire] = ("attempt to access JSON non-signed-integer as signed-integer", (int,))
for _wire in ("UINT8", "UINT16", "UINT32", "UINT64"):
    _TYPE_ERRORS[_wire] = (
        "attempt to access JSON non-unsigned-integer as unsigned-integer",
        (int,),
    )


def _check_types(name: str, datatype: str, items: list) -> None:
    """Refuse an element of the wrong JSON type with TritonJson's words, as Triton
    reads a generate input (src/http_server.cc ExactMappingInput:
    JsonBytesArrayByteSize for BYTES, ReadDataFromJson for the others)."""
    if datatype == "BYTES":
        if any(type(item) is not str for item in items):
            raise InvalidArgument(f"Unable to parse JSON bytes array for input '{name}': {_STRING}")
        return
    rule = _TYPE_ERRORS.get(datatype)
    if rule is None:
        return
    message, allowed = rule
    for item in items:
        if type(item) not in allowed or (datatype.startswith("UINT") and item < 0):
            raise InvalidArgument(f"invalid data for input '{name}': {message}")


def _map_field(
    key: str,
    value: Any,
    signature: ModelSignature,
    inputs: dict[str, Tensor],
    parameters: dict[str, Any],
) -> None:
    spec = signature.inputs.get(key)
    if spec is None:
        if value is None or isinstance(value, (list, dict)):
            # src/http_server.cc SetTritonParameterFromJsonParameter
            raise InvalidArgument(
                f"parameter '{key}' has invalid type. It should be either 'int', "
                "'bool', or 'string'."
            )
        parameters[key] = value
        return
    if key in inputs:  # core infer_request.cc AddOriginalInput
        raise InvalidArgument(f"input '{key}' already exists in request")
    inputs[key] = input_tensor(key, spec.datatype, signature.full_shape(spec), value)


def input_tensor(name: str, datatype: str, full_shape: list[int], value: Any) -> Tensor:
    """One input from a JSON value (a scalar or a flat array) for a model input of
    ``datatype`` whose shape (batch dimension included) is ``full_shape``."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(item, list) for item in items):
        if datatype == "BYTES":
            flatten(items)  # Triton's cap on the nesting depth
        raise InvalidArgument(
            f"input '{name}' in the generate request must be a value or a flat array"
        )
    _check_types(name, datatype, items)
    shape = fit_shape(name, full_shape, len(items))
    dt = datatypes.from_wire(datatype)
    count = 1
    for dim in shape:
        count *= dim
    return Tensor(name, datatype, json_to_array(name, dt, shape, count, items))


def fit_shape(name: str, full_shape: list[int], count: int) -> list[int]:
    """Triton's shape for ``count`` elements of an input whose shape is ``full_shape``:
    fixed dimensions first, the innermost variable dimension takes what remains,
    the other variable dimensions are 1."""
    remaining = count
    shape = list(full_shape)
    for dim in shape:
        if dim != -1:
            if dim == 0 or remaining % dim:
                raise _no_shape(name, full_shape, count)
            remaining //= dim
    for index in range(len(shape) - 1, -1, -1):
        if shape[index] == -1:
            shape[index] = remaining
            remaining = 1
    if remaining != 1 and count != 0:
        raise _no_shape(name, full_shape, count)
    return shape


def _no_shape(name: str, full_shape: list[int], count: int) -> InvalidArgument:
    dims = "[" + ",".join(str(d) for d in full_shape) + "]"
    return InvalidArgument(
        f"The schema can not convert input '{name}' to tensor with proper shape: "
        f"{count} element(s) do not fit shape {dims}"
    )


def encode_generate_response(response: InferenceResponse, request_id: str = "") -> dict:
    """One response as a generate response object."""
    out: dict[str, Any] = {}
    response_id = response.id or request_id
    if response_id:
        out["id"] = response_id
    out["model_name"] = response.model_name
    out["model_version"] = str(response.model_version)
    for key, value in response.parameters.items():
        if isinstance(value, (bool, int, float, str)):
            out[key] = value
    for tensor in response.outputs:
        values = json_output(tensor.datatype, np.asarray(tensor.data))
        out[tensor.name] = values[0] if len(values) == 1 else values
    return out


def encode_json(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def encode_event(payload: dict) -> bytes:
    """One server-sent event carrying ``payload``."""
    return b"data: " + encode_json(payload) + b"\n\n"


def encode_error_event(message: str) -> bytes:
    return encode_event({"error": message})
