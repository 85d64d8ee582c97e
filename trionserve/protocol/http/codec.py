"""Sans-I/O codec of the KServe v2 / Triton HTTP/REST inference protocol.

Pure functions over bytes: an infer request body (JSON, optionally followed by the
binary tensor extension's raw tensor bytes) becomes an :class:`InferenceRequest`, and
an :class:`InferenceResponse` becomes a list of body chunks. No sockets, no event loop.

Binary input tensors are ``np.frombuffer`` views of the request body (writable when
the body is, as the HTTP transport hands it over; read-only when it is ``bytes``);
binary output tensors are memoryviews of the output arrays, so tensor data is never
copied on either path except for BYTES tensors, which have no fixed-size layout.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import numpy as np

from trionserve.core.bytes_tensor import (
    deserialize_bytes_tensor,
    serialize_bytes_tensor,
)
from trionserve.core.datatypes import BY_WIRE
from trionserve.core.errors import InvalidArgument, Unimplemented
from trionserve.core.inference import (
    InferenceRequest,
    InferenceResponse,
    RequestedOutput,
    Tensor,
)
from trionserve.core.outputs import output_bytes, shared_memory_outputs
from trionserve.core.parameters import check_reserved_key
from trionserve.core.shared_memory import SharedMemory, shared_memory_window
from trionserve.core.validation import ModelSignature, check_shape_size, parse_model_version
from trionserve.protocol.http.tensor_data import (
    binary_to_array,
    json_kind,
    json_output,
    json_to_array,
)

__all__ = [
    "decode_infer_request",
    "encode_infer_response",
    "encode_error",
    "parse_model_version",
    "serialize_bytes_tensor",
    "deserialize_bytes_tensor",
]

_UINT64_MAX = 2**64 - 1

_JSON_SEPARATORS = (",", ":")


# ensure_ascii (the default) keeps len(str) == len(bytes) for the header length.
_ENCODER = json.JSONEncoder(separators=_JSON_SEPARATORS)
# JSON headers up to this size are parsed once per distinct header (clients send
# the same header with every request of a shape: see _parse_header).
_CACHED_HEADER_BYTES = 4096


def _dumps(obj: Any) -> bytes:
    return _ENCODER.encode(obj).encode()


@functools.lru_cache(maxsize=64)
def _parse_header(header: bytes) -> Any:
    """A request's JSON header, parsed once per distinct header (a client repeats
    it with every request of the same shape). What it returns is shared: decoding
    only reads it."""
    return json.loads(header)


# An input of a plan: name, wire datatype, numpy dtype, shape, bytes.
PlannedInput = tuple[str, str, np.dtype, tuple[int, ...], int]


class Plan:
    """A request header decoded once (a client repeats it with every request of the
    same shape): its id, its parameters as parsed, its requested outputs, and where
    each of its inputs, all binary, lies after the header. A request with the same
    header and a body of ``binary_size`` bytes after it is decoded from its plan
    without checking the header again: only its binary tensors' views are made, the
    fields its parameters set (checked once) set again and its outputs made anew
    (each request has its own); outputs into shared memory are decoded again
    (their regions are checked each time)."""

    __slots__ = (
        "binary_output",
        "binary_size",
        "custom",
        "fields",
        "inputs",
        "outputs",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        params: Any,
        inputs: tuple[PlannedInput, ...],
        outputs: tuple[tuple[str, dict], ...] | list | None,
    ) -> None:
        self.request_id = request_id
        # What its parameters (which decoded without error) set: binary_data_output,
        # the request's own fields by name, the custom parameters (None: none).
        params = params or {}
        self.binary_output: bool = params.get("binary_data_output", False)
        self.fields = tuple((_FIELDS[k], v) for k, v in params.items() if k in _FIELDS)
        custom = {k: v for k, v in params.items() if k not in _FIELDS and k != "binary_data_output"}
        self.custom = custom or None
        self.inputs = inputs
        # (name, parameters) of each requested output, or the outputs as parsed
        # where one is in shared memory, or None.
        self.outputs = outputs
        self.binary_size = sum(planned[4] for planned in inputs)


# The request parameters that set the request's own fields, and those fields.
_FIELDS = {
    "sequence_id": "sequence_id",
    "sequence_start": "sequence_start",
    "sequence_end": "sequence_end",
    "priority": "priority",
    "timeout": "timeout_us",
}

# Plans by header (bounded: emptied when full, as the HTTP head cache).
_PLANS: dict[bytes, Plan] = {}
_PLANS_SIZE = 64


def _plan(key: bytes, doc: dict, request: InferenceRequest) -> None:
    """Keep the plan of a header that decoded without error, when every input of
    it is binary data after the header (none in JSON or shared memory, none empty
    or of BYTES)."""
    planned: list[PlannedInput] = []
    for spec in doc["inputs"]:
        params = spec.get("parameters")
        if "data" in spec or not params or "shared_memory_region" in params:
            return
        nbytes = params.get("binary_data_size")
        tensor = request.inputs[spec["name"]]
        data = tensor.data
        if nbytes is None or not data.size or tensor.datatype == "BYTES":
            return
        planned.append((tensor.name, tensor.datatype, data.dtype, data.shape, nbytes))
    requested = request.requested_outputs
    outputs: tuple[tuple[str, dict], ...] | list | None = None
    if requested is not None and any("shared_memory_region" in o.parameters for o in requested):
        outputs = doc["outputs"]
    elif requested is not None:  # (copied: the request's own may change)
        outputs = tuple((o.name, dict(o.parameters)) for o in requested)
    if len(_PLANS) >= _PLANS_SIZE:
        _PLANS.clear()
    _PLANS[key] = Plan(request.id, doc.get("parameters"), tuple(planned), outputs)


def planned(header: bytes, size: int) -> Plan | None:
    """The plan of a JSON header for a body of ``size`` bytes (the header's own included),
    if one was kept for it and the body is what it plans: every input binary, no output in
    shared memory (what :func:`decode_planned` decodes without a region); else None."""
    plan = _PLANS.get(header)
    if plan is None or len(header) + plan.binary_size != size or type(plan.outputs) is list:
        return None
    return plan


def decode_planned(
    plan: Plan,
    body: bytes | bytearray | memoryview,
    offset: int,
    model_name: str,
    model_version: int | None,
    shared_memory: SharedMemory | None,
) -> tuple[InferenceRequest, bool]:
    """A request decoded from its header's plan (its body's size checked by the caller), its
    header ``offset`` bytes long."""
    request = InferenceRequest(model_name, model_version, id=plan.request_id)
    request.shape_key = plan  # (validated once per model: core/validation.py)
    for field, value in plan.fields:
        setattr(request, field, value)
    if plan.custom is not None:
        request.parameters.update(plan.custom)
    inputs = request.inputs
    for name, wire, dtype, shape, nbytes in plan.inputs:
        # (np.ndarray over the buffer: one call, where frombuffer and reshape are two)
        inputs[name] = Tensor(name, wire, np.ndarray(shape, dtype, body, offset))
        offset += nbytes
    outputs = plan.outputs
    if type(outputs) is tuple:
        request.requested_outputs = [RequestedOutput(n, dict(p)) for n, p in outputs]
    elif outputs is not None:
        request.requested_outputs = _decode_outputs(outputs, shared_memory)
    return request, plan.binary_output


# ------------------------------------------------------------------------- request


def decode_infer_request(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    model_name: str,
    model_version: int | None,
    shared_memory: SharedMemory | None = None,
) -> tuple[InferenceRequest, bool]:
    """Decode an infer request body into the request and whether its outputs default
    to binary (its ``binary_data_output`` parameter).

    ``header_length`` is the ``Inference-Header-Content-Length`` header's value (None
    when absent: the whole body is JSON). Inputs naming a ``shared_memory_region`` are
    views of that region of ``shared_memory``. ``binary_data_output`` says how the
    response travels, so it is not one of the request's parameters (Triton keeps it
    in the HTTP server's allocator payload, ``src/http_server.cc``
    ParseJsonTritonParams, and its model never sees it). Raises InvalidArgument for
    any malformed request, Unimplemented for shared memory when ``shared_memory`` is
    None.
    """
    size = len(body)
    if header_length is None:
        header = body
        header_end = size
    else:
        if type(header_length) is not int or header_length < 0:
            raise InvalidArgument(
                "invalid Inference-Header-Content-Length: expected a non-negative "
                f"integer, got {header_length!r}"
            )
        if header_length > size:
            raise InvalidArgument(
                f"invalid Inference-Header-Content-Length: {header_length} is larger "
                f"than the request body ({size} bytes)"
            )
        header = body if header_length == size else body[:header_length]
        header_end = header_length

    key: bytes | None = None
    if len(header) <= _CACHED_HEADER_BYTES:
        key = bytes(header)  # a key: bytes, never a buffer
        plan = _PLANS.get(key) if header_length is not None else None
        if plan is not None and header_end + plan.binary_size == size:
            return decode_planned(plan, body, header_end, model_name, model_version, shared_memory)
    try:
        if key is not None:
            doc = _parse_header(key)
        else:
            doc = json.loads(header if isinstance(header, (bytes, bytearray)) else bytes(header))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"failed to parse the request JSON: {exc}") from None
    except RecursionError:  # Python's parser recurses per level; Triton's iterates
        raise InvalidArgument("failed to parse the request JSON: nested too deeply") from None
    if type(doc) is not dict:
        raise InvalidArgument(
            f"failed to parse the request JSON: expected an object, got {json_kind(doc)}"
        )

    request_id = doc.get("id")
    if request_id is None:
        request_id = ""
    elif type(request_id) is not str:
        raise InvalidArgument(
            f"invalid request 'id': expected a string, got {json_kind(request_id)}"
        )

    request = InferenceRequest(model_name, model_version, id=request_id)
    params = doc.get("parameters")
    binary_output = False
    if params is not None:
        binary_output = _apply_request_parameters(request, params)

    request.inputs = _decode_inputs(
        model_name,
        doc.get("inputs"),
        body,
        header_end,
        size,
        header_length is not None,
        shared_memory,
    )

    outputs = doc.get("outputs")
    if outputs is not None:
        request.requested_outputs = _decode_outputs(outputs, shared_memory)
    if key is not None and header_length is not None and request.inputs:
        _plan(key, doc, request)
    return request, binary_output


def decode_raw_request(
    body: bytes | bytearray | memoryview,
    model_name: str,
    model_version: int | None,
    signature: ModelSignature,
) -> InferenceRequest:
    """Triton's raw binary request (``Inference-Header-Content-Length: 0``): the whole
    body is the data of the model's only input. As Triton's core (infer_request.cc,
    ``Normalize``): the model must have exactly one input; its shape is the
    configured dims, after a batch dimension of 1 when the model batches, with the
    one variable dimension (at most one) deduced from the body's size; a BYTES input
    must have shape [1] and gets the whole body as its one element. Raises
    InvalidArgument otherwise, naming the model and the input."""
    if len(signature.inputs) != 1:
        raise InvalidArgument(
            "Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(signature.inputs)} inputs in '{model_name}' model configuration"
        )
    (spec,) = signature.inputs.values()
    dt = BY_WIRE[spec.datatype]
    shape = [1] if signature.max_batch_size > 0 else []
    dynamic_axis = None
    count = 1
    for dim in spec.dims:
        if dim == -1:
            if dynamic_axis is not None:
                raise InvalidArgument(
                    f"The shape of the raw input '{spec.name}' can not be deduced because "
                    "there are more than one variable-sized dimension"
                )
            dynamic_axis = len(shape)
        else:
            count *= dim
        shape.append(dim)
    size = len(body)
    if dt.itemsize == 0:  # BYTES
        if dynamic_axis is not None or count != 1:
            raise InvalidArgument(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
            )
        data = np.empty(1, dtype=object)
        data[0] = bytes(body)
        array = data.reshape(shape)
    else:
        if dynamic_axis is not None:
            shape[dynamic_axis] = size // dt.itemsize // count if count else 0
        total = math.prod(shape)
        array = binary_to_array(spec.name, model_name, dt, shape, total, body, 0, size)
    request = InferenceRequest(model_name, model_version)
    request.inputs = {spec.name: Tensor(spec.name, dt.wire, array)}
    return request


def _apply_request_parameters(request: InferenceRequest, params: Any) -> bool:
    """Set the request's fields and parameters from ``params``; return its
    ``binary_data_output`` (False when absent)."""
    if type(params) is not dict:
        raise InvalidArgument(
            f"invalid request 'parameters': expected an object, got {json_kind(params)}"
        )
    custom = request.parameters
    binary_output = False
    for key, value in params.items():
        if key == "sequence_id":
            if type(value) is str:
                request.sequence_id = value
            elif type(value) is int and 0 <= value <= _UINT64_MAX:
                request.sequence_id = value
            else:
                raise InvalidArgument(
                    "invalid parameter 'sequence_id': expected an unsigned integer "
                    f"or a string, got {json.dumps(value)}"
                )
        elif key == "sequence_start" or key == "sequence_end":
            if type(value) is not bool:
                raise InvalidArgument(
                    f"invalid parameter '{key}': expected a boolean, got {json.dumps(value)}"
                )
            setattr(request, key, value)
        elif key == "priority":
            request.priority = _unsigned_parameter(key, value)
        elif key == "timeout":
            request.timeout_us = _unsigned_parameter(key, value)
        elif key == "binary_data_output":
            if type(value) is not bool:
                raise InvalidArgument(
                    "invalid parameter 'binary_data_output': expected a boolean, "
                    f"got {json.dumps(value)}"
                )
            binary_output = value
        else:
            check_reserved_key(key)
            # Same value types as gRPC's InferParameter, so both frontends agree.
            if type(value) not in (str, int, float, bool):
                raise InvalidArgument(
                    f"invalid parameter '{key}': expected a string, integer, number "
                    f"or boolean, got {json_kind(value)}"
                )
            custom[key] = value
    return binary_output


def _unsigned_parameter(key: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value <= _UINT64_MAX:
        raise InvalidArgument(
            f"invalid parameter '{key}': expected a non-negative integer, got {json.dumps(value)}"
        )
    return value


def _decode_inputs(
    model: str,
    inputs: Any,
    body: bytes | bytearray | memoryview,
    offset: int,
    size: int,
    has_header: bool,
    shared_memory: SharedMemory | None,
) -> dict[str, Tensor]:
    if type(inputs) is not list:
        if inputs is None:
            raise InvalidArgument("invalid request: missing 'inputs'")
        raise InvalidArgument(
            f"invalid request 'inputs': expected an array, got {json_kind(inputs)}"
        )
    tensors: dict[str, Tensor] = {}
    for index, spec in enumerate(inputs):
        if type(spec) is not dict:
            raise InvalidArgument(
                f"invalid input at index {index}: expected an object, got {json_kind(spec)}"
            )
        name = spec.get("name")
        if type(name) is not str:
            raise InvalidArgument(
                f"invalid input at index {index}: 'name' must be a string, got {json_kind(name)}"
            )
        if name in tensors:
            raise InvalidArgument(f"input '{name}' already exists in request")

        datatype = spec.get("datatype")
        dt = BY_WIRE.get(datatype) if type(datatype) is str else None
        if dt is None:
            raise InvalidArgument(
                f"invalid datatype for input '{name}': expected one of "
                f"{', '.join(BY_WIRE)}, got {json.dumps(datatype)}"
            )

        shape = spec.get("shape")
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise InvalidArgument(
                f"invalid shape for input '{name}': expected an array of "
                f"non-negative integers, got {json.dumps(shape)}"
            )
        count = math.prod(shape)
        check_shape_size(name, shape, dt.itemsize)

        params = spec.get("parameters")
        binary_size = None
        if params is not None:
            if type(params) is not dict:
                raise InvalidArgument(
                    f"invalid parameters for input '{name}': expected an object, "
                    f"got {json_kind(params)}"
                )
            _check_one_content(name, spec, params)
            if "shared_memory_region" in params:
                if shared_memory is None:
                    raise Unimplemented(
                        f"shared memory is not enabled (input '{name}' uses region "
                        f"{json.dumps(params['shared_memory_region'])})"
                    )
                what = f"input '{name}'"
                region, at, nbytes = shared_memory_window(params, what)
                view = shared_memory.view(region, at, nbytes, what)
                data = binary_to_array(name, model, dt, shape, count, view, 0, nbytes)
                tensors[name] = Tensor(name, dt.wire, data)
                continue
            binary_size = params.get("binary_data_size")

        if binary_size is not None:
            if type(binary_size) is not int or binary_size < 0:
                raise InvalidArgument(
                    f"invalid 'binary_data_size' for input '{name}': expected a "
                    f"non-negative integer, got {json.dumps(binary_size)}"
                )
            end = offset + binary_size
            if end > size:
                hint = (
                    ""
                    if has_header
                    else " (binary data needs the Inference-Header-Content-Length header)"
                )
                raise InvalidArgument(
                    f"missing binary data for input '{name}': expected "
                    f"{binary_size} bytes, got {size - offset}{hint}"
                )
            data = binary_to_array(name, model, dt, shape, count, body, offset, binary_size)
            offset = end
        else:
            data = json_to_array(name, dt, shape, count, spec.get("data"))
        tensors[name] = Tensor(name, dt.wire, data)

    if offset != size:
        raise InvalidArgument(
            f"unexpected binary data in the request: {size - offset} bytes after the "
            "last binary input are not claimed by any input's 'binary_data_size'"
        )
    return tensors


def _check_one_content(name: str, spec: dict, params: dict) -> None:
    """An input names at most one place its data is: 'data', 'binary_data_size' or
    'shared_memory_region' (Triton's http_server.cc ValidateInputContentType, with
    its wording; none at all is reported where the data is looked for)."""
    fields = [
        field
        for field, present in (
            ("data", "data" in spec),
            ("binary_data_size", "binary_data_size" in params),
            ("shared_memory_region", "shared_memory_region" in params),
        )
        if present
    ]
    if len(fields) > 1:
        raise InvalidArgument(
            f"Input '{name}' must set only one of the following fields: 'data', "
            "'binary_data_size' in 'parameters', 'shared_memory_region' in "
            "'parameters'. But set " + " ".join(f"'{field}'" for field in fields)
        )


def _decode_outputs(outputs: Any, shared_memory: SharedMemory | None) -> list[RequestedOutput]:
    if type(outputs) is not list:
        raise InvalidArgument(
            f"invalid request 'outputs': expected an array, got {json_kind(outputs)}"
        )
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for index, spec in enumerate(outputs):
        if type(spec) is not dict:
            raise InvalidArgument(
                f"invalid output at index {index}: expected an object, got {json_kind(spec)}"
            )
        name = spec.get("name")
        if type(name) is not str:
            raise InvalidArgument(
                f"invalid output at index {index}: 'name' must be a string, got {json_kind(name)}"
            )
        if name in seen:
            raise InvalidArgument(f"output '{name}' already exists in request")
        seen.add(name)
        params = spec.get("parameters")
        if params is None:
            params = {}
        elif type(params) is not dict:
            raise InvalidArgument(
                f"invalid parameters for output '{name}': expected an object, "
                f"got {json_kind(params)}"
            )
        else:
            if "shared_memory_region" in params:
                if shared_memory is None:
                    raise Unimplemented(
                        f"shared memory is not enabled (output '{name}' uses region "
                        f"{json.dumps(params['shared_memory_region'])})"
                    )
                what = f"output '{name}'"
                region, at, nbytes = shared_memory_window(params, what)
                shared_memory.check(region, at, nbytes, what)
            binary = params.get("binary_data")
            if binary is not None and type(binary) is not bool:
                raise InvalidArgument(
                    f"invalid 'binary_data' for output '{name}': expected a boolean, "
                    f"got {json.dumps(binary)}"
                )
            classes = params.get("classification")
            if classes is not None and (type(classes) is not int or classes < 0):
                raise InvalidArgument(
                    f"invalid 'classification' for output '{name}': expected a "
                    f"non-negative integer, got {json.dumps(classes)}"
                )
            params = dict(params)
        requested.append(RequestedOutput(name, params))
    return requested


# ------------------------------------------------------------------------ response


def encode_infer_response(
    response: InferenceResponse,
    request: InferenceRequest,
    shared_memory: SharedMemory | None = None,
    *,
    binary_output: bool = False,
) -> tuple[list[bytes | memoryview], int | None]:
    """Encode a response body as chunks to write in order, plus the JSON header length
    when any output is binary (for ``Inference-Header-Content-Length``), else None.

    ``binary_output`` is the request's default for outputs that do not set
    ``binary_data`` themselves: its ``binary_data_output`` parameter, or True for a
    raw binary request (Triton's ``src/http_server.cc`` EVBufferToRawInput sets the
    default output kind to BINARY). Outputs requested into a shared memory region
    are written there and described by name, datatype and shape only, as Triton
    does."""
    default_binary = binary_output
    per_output: dict[str, bool] = {}
    for out in request.requested_outputs or ():
        flag = out.parameters.get("binary_data")
        if flag is not None:
            per_output[out.name] = flag is True
    in_shm = shared_memory_outputs(request)

    chunks: list[bytes | memoryview] = [b""]
    any_binary = False
    in_json = False
    outputs: list[_Output] = []
    for tensor in response.outputs:
        wire = tensor.datatype
        binary = per_output.get(tensor.name, default_binary)
        shape = tensor.data.shape
        shm_params = in_shm.get(tensor.name)
        if shm_params is not None and shared_memory is not None:
            what = f"output '{tensor.name}'"
            region, at, nbytes = shared_memory_window(shm_params, what)
            shared_memory.write(region, at, nbytes, output_bytes(wire, tensor.data), what)
            # As Triton: name, datatype and shape only. Clients read an output's
            # "parameters" as the binary tensor extension's (tritonclient's C++
            # client, hence perf_analyzer, requires binary_data_size there).
            outputs.append((tensor.name, wire, shape, None, None))
        elif binary:
            any_binary = True
            chunk = output_bytes(wire, tensor.data)
            outputs.append((tensor.name, wire, shape, len(chunk), None))
            if len(chunk):
                chunks.append(chunk)
        else:
            in_json = True
            outputs.append(
                (tensor.name, wire, shape, None, json_output(wire, tensor.data, tensor.name))
            )

    args = (response.model_name, response.model_version, response.id or request.id)
    if in_json or response.parameters:
        header = _response_header(*args, response.parameters, outputs)
    else:  # nothing but names, shapes and sizes: the same header for the same shapes
        header = _described_response_header(*args, tuple(outputs))
    chunks[0] = header
    return chunks, (len(header) if any_binary else None)


# An output as the response's JSON header describes it: name, datatype, shape, and
# its binary_data_size (binary) or its data (JSON), neither when it is in shared memory.
_Output = tuple[str, str, tuple[int, ...], int | None, list | None]


def _response_header(
    model_name: str,
    model_version: str,
    response_id: str,
    parameters: dict[str, Any] | None,
    outputs: list[_Output] | tuple[_Output, ...],
) -> bytes:
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if response_id:
        doc["id"] = response_id
    if parameters:
        doc["parameters"] = parameters
    entries = []
    for name, wire, shape, size, data in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": wire, "shape": list(shape)}
        if size is not None:
            entry["parameters"] = {"binary_data_size": size}
        elif data is not None:
            entry["data"] = data
        entries.append(entry)
    doc["outputs"] = entries
    return _dumps(doc)


@functools.lru_cache(maxsize=256)
def _described_response_header(
    model_name: str, model_version: str, response_id: str, outputs: tuple[_Output, ...]
) -> bytes:
    """The JSON header of a response without parameters whose outputs are all
    binary (or in shared memory), made once per distinct description: a model
    answering requests of the same shapes answers with the same header."""
    return _response_header(model_name, model_version, response_id, None, outputs)


# -------------------------------------------------------------------------- errors


def encode_error(message: str) -> bytes:
    """The body of an error response: ``{"error": "<message>"}``."""
    return _dumps({"error": message})
