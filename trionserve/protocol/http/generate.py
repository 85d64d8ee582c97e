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
from trionserve.core.types import InferenceRequest, InferenceResponse, Tensor
from trionserve.core.validation import ModelSignature
from trionserve.protocol.http.codec import _json_output, _json_to_array

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
        payload = json.loads(body) if body.strip() else {}
    except ValueError as exc:
        raise InvalidArgument(f"failed to parse the generate request JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument(
            "failed to parse the generate request JSON: nested too deeply"
        ) from None
    if not isinstance(payload, dict):
        raise InvalidArgument("the generate request body must be a JSON object")
    request_id = payload.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("Unable to parse 'id': the request id must be a string")
    inputs: dict[str, Tensor] = {}
    parameters: dict[str, Any] = {}
    for key, value in payload.items():
        if key == "id":
            continue
        if key == "parameters" and key not in signature.inputs:
            if not isinstance(value, dict):
                raise InvalidArgument("Expected JSON object for keyword: 'parameters'")
            for nested, nested_value in value.items():
                _map_field(nested, nested_value, signature, inputs, parameters)
            continue
        _map_field(key, value, signature, inputs, parameters)
    return InferenceRequest(
        model_name,
        model_version,
        id=request_id,
        inputs=inputs,
        parameters=parameters,
    )


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
            raise InvalidArgument(
                f"parameter '{key}' has invalid type. It should be either 'int', "
                "'bool', or 'string'."
            )
        parameters[key] = value
        return
    if key in inputs:
        raise InvalidArgument(f"input '{key}' is given more than once in the generate request")
    inputs[key] = input_tensor(key, spec.datatype, signature.full_shape(spec), value)


def input_tensor(name: str, datatype: str, full_shape: list[int], value: Any) -> Tensor:
    """One input from a JSON value (a scalar or a flat array) for a model input of
    ``datatype`` whose shape (batch dimension included) is ``full_shape``."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(item, (list, dict)) for item in items):
        raise InvalidArgument(
            f"input '{name}' in the generate request must be a value or a flat array"
        )
    shape = fit_shape(name, full_shape, len(items))
    dt = datatypes.from_wire(datatype)
    count = 1
    for dim in shape:
        count *= dim
    return Tensor(name, datatype, _json_to_array(name, dt, shape, count, items))


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
        values = _json_output(tensor.datatype, np.asarray(tensor.data))
        out[tensor.name] = values[0] if len(values) == 1 else values
    return out


def encode_json(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def encode_event(payload: dict) -> bytes:
    """One server-sent event carrying ``payload``."""
    return b"data: " + encode_json(payload) + b"\n\n"


def encode_error_event(message: str) -> bytes:
    return encode_event({"error": message})
