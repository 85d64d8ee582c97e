"""Sans-I/O codec of Triton's gRPC inference messages.

Pure functions: a serialized ``ModelInferRequest`` becomes an
:class:`InferenceRequest`, and an :class:`InferenceResponse` becomes the serialized
bytes of a ``ModelInferResponse`` (or of a ``ModelStreamInferResponse``). No
sockets, no event loop.

Input tensors in ``raw_input_contents`` are ``np.frombuffer`` views of the message's
bytes (writable when the message is, as the transport hands it over): in a large
message the raw contents are cut out of the wire bytes before protobuf parses the
rest, since protobuf would copy each of them into a bytes object of its own; typed
``InferTensorContents`` are accepted too. Outputs always travel in
``raw_output_contents``, which is written as its own wire fields after the rest of
the message, so a large output array is handed to the transport as a memoryview
instead of being copied into a protobuf message first. Error messages match the
HTTP codec's wherever the two protocols share a concept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from trionserve._generated import grpc_service_pb2 as pb
from trionserve.core.bytes_tensor import deserialize_bytes_tensor
from trionserve.core.datatypes import BY_WIRE, WIRE_DTYPE, DataType
from trionserve.core.errors import InvalidArgument, Unimplemented
from trionserve.core.inference import (
    InferenceRequest,
    InferenceResponse,
    RequestedOutput,
    Tensor,
)
from trionserve.core.outputs import output_bytes, shared_memory_outputs
from trionserve.core.parameters import (
    EMPTY_FINAL_RESPONSE,
    FINAL_RESPONSE,
    check_reserved_key,
)
from trionserve.core.shared_memory import SharedMemory, shared_memory_window
from trionserve.core.validation import (
    byte_size_mismatch,
    check_shape_size,
    parse_model_version,
)

__all__ = [
    "parse_message",
    "parse_infer_request",
    "decode_infer_request",
    "empty_final_response_enabled",
    "encode_infer_response",
    "encode_empty_final_response",
    "encode_stream_response",
    "encode_stream_error",
]

Chunks = list[bytes | memoryview]

# A received message's bytes.
Wire = bytes | bytearray | memoryview
# ModelInferRequest.raw_input_contents (grpc_service.proto), length-delimited.
_RAW_INPUT_CONTENTS_TAG = 7 << 3 | 2
# Messages from this size on have their raw contents cut out before parsing (below
# it, protobuf's copies cost less than cutting them out in Python).
_CUT_RAW_FROM = 64 * 1024

_UINT64_MAX = 2**64 - 1
_INT64_MAX = 2**63 - 1

# The reserved keys a gRPC request may set (Triton's TRITON_RESERVED_REQUEST_PARAMS).
_RESERVED_TRITON_KEYS = (EMPTY_FINAL_RESPONSE,)

# Datatype -> the InferTensorContents field that carries it (FP16 and BF16 have none).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
# Types narrower than their contents field, whose values must be range-checked.
_NARROW = {w: np.iinfo(BY_WIRE[w].numpy) for w in ("INT8", "INT16", "UINT8", "UINT16")}

# Wire tags: ModelInferResponse.raw_output_contents (field 6) and
# ModelStreamInferResponse.infer_response (field 2), both length-delimited.
_RAW_OUTPUT_TAG = b"\x32"
_STREAM_RESPONSE_TAG = b"\x12"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fmt_shape(shape: Any) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


M = TypeVar("M", bound=Message)


def parse_message(message_type: type[M], data: Wire) -> M:
    """Parse one serialized message; a malformed one is the client's error."""
    try:
        # upb parses any buffer; the stubs say bytes.
        return message_type.FromString(data)  # type: ignore[arg-type]
    except DecodeError as exc:
        raise InvalidArgument(
            f"failed to parse the {message_type.DESCRIPTOR.name} message: {exc}"
        ) from None


# ------------------------------------------------------------------------- request


def _read_varint(data: memoryview, offset: int) -> tuple[int, int]:
    """The varint at ``offset`` and the offset after it (IndexError past the end,
    ValueError past 10 bytes)."""
    value = shift = 0
    while True:
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, offset
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _cut_raw_contents(data: memoryview) -> tuple[bytes, list[memoryview]] | None:
    """The message's wire bytes without its raw_input_contents fields, and those
    fields' values as views of ``data``, in order; None when the top-level fields
    do not scan (protobuf then parses the whole message and names the fault)."""
    raws: list[memoryview] = []
    rest: list[memoryview] = []
    kept_from = offset = 0
    end = len(data)
    try:
        while offset < end:
            start = offset
            tag, offset = _read_varint(data, offset)
            wire_type = tag & 7
            if wire_type == 2:
                length, offset = _read_varint(data, offset)
                stop = offset + length
                if stop > end:
                    return None
                if tag == _RAW_INPUT_CONTENTS_TAG:
                    rest.append(data[kept_from:start])
                    raws.append(data[offset:stop])
                    kept_from = stop
                offset = stop
            elif wire_type == 0:
                offset = _read_varint(data, offset)[1]
            elif wire_type == 1:
                offset += 8
            elif wire_type == 5:
                offset += 4
            else:
                return None
    except (IndexError, ValueError):
        return None
    if offset != end:
        return None
    rest.append(data[kept_from:end])
    return b"".join(rest), raws


def parse_infer_request(data: Wire) -> tuple[pb.ModelInferRequest, Sequence[Wire]]:
    """A serialized ModelInferRequest and its raw_input_contents. In a large message
    the raw contents are views of ``data`` (no copy; writable when ``data`` is), the
    rest is parsed by protobuf; otherwise protobuf parses it all."""
    if len(data) >= _CUT_RAW_FROM:
        cut = _cut_raw_contents(memoryview(data).cast("B"))
        if cut is not None:
            rest, raws = cut
            return parse_message(pb.ModelInferRequest, rest), raws
    message = parse_message(pb.ModelInferRequest, data)
    return message, message.raw_input_contents


def decode_infer_request(
    message: pb.ModelInferRequest | Wire,
    shared_memory: SharedMemory | None = None,
    raws: Sequence[Wire] | None = None,
) -> InferenceRequest:
    """Decode a ModelInferRequest: its serialized bytes, or a message parsed by
    :func:`parse_infer_request` with the ``raws`` it returned (None: the message's
    own raw_input_contents).

    Inputs naming a ``shared_memory_region`` are views of that region of
    ``shared_memory``. Raises InvalidArgument for any malformed request,
    Unimplemented for shared memory when ``shared_memory`` is None.
    """
    if not isinstance(message, pb.ModelInferRequest):
        message, raws = parse_infer_request(message)
    elif raws is None:
        raws = message.raw_input_contents
    version = parse_model_version(message.model_version)
    request = InferenceRequest(message.model_name, version, id=message.id)
    if message.parameters:
        _apply_request_parameters(request, message.parameters)
    request.inputs = _decode_inputs(message, raws, shared_memory)
    if message.outputs:
        request.requested_outputs = _decode_outputs(message.outputs[:], shared_memory)
    return request


def empty_final_response_enabled(message: pb.ModelInferRequest) -> bool:
    """Whether the client asked for a final response flag on every stream response."""
    if EMPTY_FINAL_RESPONSE not in message.parameters:
        return False
    param = message.parameters[EMPTY_FINAL_RESPONSE]
    return param.WhichOneof("parameter_choice") == "bool_param" and param.bool_param


def _param_value(key: str, param: pb.InferParameter) -> tuple[str, Any]:
    kind = param.WhichOneof("parameter_choice")
    if kind is None:
        raise InvalidArgument(f"invalid parameter '{key}': no value is set")
    return kind, getattr(param, kind)


def _apply_request_parameters(
    request: InferenceRequest, params: Mapping[str, pb.InferParameter]
) -> None:
    custom = request.parameters
    for key, param in params.items():
        kind, value = _param_value(key, param)
        if key == "sequence_id":
            if kind == "string_param" or (kind in ("int64_param", "uint64_param") and value >= 0):
                request.sequence_id = value
            else:
                raise InvalidArgument(
                    "invalid parameter 'sequence_id': expected a non-negative "
                    f"int64_param, a uint64_param or a string_param, got {kind} "
                    f"{value!r}"
                )
        elif key == "sequence_start" or key == "sequence_end":
            setattr(request, key, _bool_parameter(key, kind, value))
        elif key == "priority":
            request.priority = _unsigned_parameter(key, kind, value)
        elif key == "timeout":
            request.timeout_us = _unsigned_parameter(key, kind, value)
        elif key == "binary_data_output":
            pass  # an HTTP notion: gRPC outputs are always binary
        elif check_reserved_key(key, _RESERVED_TRITON_KEYS):
            _bool_parameter(key, kind, value)
        else:
            custom[key] = value


def _bool_parameter(key: str, kind: str, value: Any) -> bool:
    if kind != "bool_param":
        raise InvalidArgument(
            f"invalid parameter '{key}': expected a bool_param, got {kind} {value!r}"
        )
    return value


def _unsigned_parameter(key: str, kind: str, value: Any) -> int:
    if kind not in ("int64_param", "uint64_param") or value < 0:
        raise InvalidArgument(
            f"invalid parameter '{key}': expected a non-negative int64_param or a "
            f"uint64_param, got {kind} {value!r}"
        )
    return value


def _parameter_dict(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {key: _param_value(key, param)[1] for key, param in params.items()}


def _shared_memory_params(
    params: Mapping[str, pb.InferParameter], what: str, shared_memory: SharedMemory | None
) -> tuple[SharedMemory, str, int, int] | None:
    """The regions to use and the (region, offset, byte_size) a tensor names, or None
    if it names none."""
    if "shared_memory_region" not in params:
        return None
    values = _parameter_dict(params)
    if shared_memory is None:
        raise Unimplemented(
            f"shared memory is not enabled ({what} uses region "
            f"{json.dumps(values['shared_memory_region'])})"
        )
    return (shared_memory, *shared_memory_window(values, what))


def _decode_inputs(
    message: pb.ModelInferRequest, raws: Sequence[Wire], shared_memory: SharedMemory | None
) -> dict[str, Tensor]:
    model = message.model_name
    tensors: dict[str, Tensor] = {}
    used = 0  # raw_input_contents are taken in order by inputs not in shared memory
    for spec in message.inputs[:]:  # a list: iterated, upb's field ends in an IndexError
        name = spec.name
        if name in tensors:
            raise InvalidArgument(f"input '{name}' already exists in request")
        dt = BY_WIRE.get(spec.datatype)
        if dt is None:
            raise InvalidArgument(
                f"invalid datatype for input '{name}': expected one of "
                f"{', '.join(BY_WIRE)}, got {json.dumps(spec.datatype)}"
            )
        shape = spec.shape[:]  # (list() iterates to an IndexError)
        if shape and min(shape) < 0:
            raise InvalidArgument(
                f"invalid shape for input '{name}': expected an array of "
                f"non-negative integers, got {json.dumps(shape)}"
            )
        check_shape_size(name, shape, dt.itemsize)
        has_contents = spec.HasField("contents")
        what = f"input '{name}'"
        if has_contents and "shared_memory_region" in spec.parameters:
            # Checked first: the request is wrong whatever the region (Triton's
            # src/grpc/infer_handler.cc, same wording).
            raise InvalidArgument(
                "unexpected 'content' provided when using shared memory for "
                f"input tensor '{name}' for model '{model}'"
            )
        window = (
            _shared_memory_params(spec.parameters, what, shared_memory) if spec.parameters else None
        )
        if window is not None:
            regions, region, offset, byte_size = window
            view = regions.view(region, offset, byte_size, what)
            data = _raw_to_array(name, model, dt, shape, view)
        elif raws:
            if has_contents:
                raise InvalidArgument(
                    "contents field must not be specified when using "
                    f"raw_input_contents for '{name}' for model '{model}'"
                )
            if used == len(raws):
                raise InvalidArgument(
                    f"missing data for input '{name}' for model '{model}': expected "
                    f"one raw_input_contents entry per input, got {len(raws)}"
                )
            data = _raw_to_array(name, model, dt, shape, raws[used])
            used += 1
        elif has_contents:
            data = _contents_to_array(name, model, dt, shape, spec.contents)
        else:
            raise InvalidArgument(
                f"missing data for input '{name}' for model '{model}': expected "
                "raw_input_contents or typed contents"
            )
        tensors[name] = Tensor(name, dt.wire, data)
    if used != len(raws):
        raise InvalidArgument(
            f"unexpected raw_input_contents for model '{model}': {len(raws)} entries "
            f"for {used} inputs that take raw data"
        )
    return tensors


def _raw_to_array(name: str, model: str, dt: DataType, shape: list[int], raw: Wire) -> np.ndarray:
    count = math.prod(shape)
    if dt.itemsize == 0:  # BYTES
        what = f"input '{name}' with shape {_fmt_shape(shape)}"
        return deserialize_bytes_tensor(raw, count, what).reshape(shape)
    expected = count * dt.itemsize
    if len(raw) != expected:
        raise InvalidArgument(byte_size_mismatch(name, model, expected, len(raw), shape, dt.wire))
    if count == 0:
        return np.empty(shape, dtype=dt.numpy)
    return np.frombuffer(raw, dtype=WIRE_DTYPE[dt.wire], count=count).reshape(shape)


def _contents_to_array(
    name: str, model: str, dt: DataType, shape: list[int], contents: pb.InferTensorContents
) -> np.ndarray:
    wire = dt.wire
    field = _CONTENTS_FIELD.get(wire)
    if field is None:
        raise InvalidArgument(
            f"input '{name}' has datatype {wire}, which has no typed contents field; "
            "send its data in raw_input_contents"
        )
    for descriptor, _ in contents.ListFields():
        if descriptor.name != field:
            raise InvalidArgument(
                f"unexpected explicit tensor data for input '{name}' for model "
                f"'{model}': got {descriptor.name} for datatype {wire}, expected "
                f"{field}"
            )
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidArgument(
            f"unexpected number of elements for input '{name}': expected {count} "
            f"for shape {_fmt_shape(shape)}, got {len(values)}"
        )
    if wire == "BYTES":
        out = np.empty(count, dtype=np.object_)
        out[:] = list(values)
        return out.reshape(shape)
    info = _NARROW.get(wire)
    if info is not None and count:
        wide = np.asarray(values, dtype=np.int64)
        bad = np.flatnonzero((wide < info.min) | (wide > info.max))
        if bad.size:
            i = int(bad[0])
            raise InvalidArgument(
                f"value out of range for input '{name}': element {i} is "
                f"{int(wide[i])}, expected {wire} in [{int(info.min)}, {int(info.max)}]"
            )
        return wide.astype(dt.numpy).reshape(shape)
    return np.asarray(values, dtype=dt.numpy).reshape(shape)


def _decode_outputs(
    outputs: Iterable[pb.ModelInferRequest.InferRequestedOutputTensor],
    shared_memory: SharedMemory | None,
) -> list[RequestedOutput]:
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for spec in outputs:
        name = spec.name
        if name in seen:
            raise InvalidArgument(f"output '{name}' already exists in request")
        seen.add(name)
        params: dict[str, Any] = {}
        if spec.parameters:
            what = f"output '{name}'"
            window = _shared_memory_params(spec.parameters, what, shared_memory)
            if window is not None:
                regions, region, offset, byte_size = window
                regions.check(region, offset, byte_size, what)
            for key, param in spec.parameters.items():
                kind, value = _param_value(key, param)
                if key == "binary_data":
                    continue  # gRPC outputs are always binary
                if key == "classification" and (
                    kind not in ("int64_param", "uint64_param") or value < 0
                ):
                    raise InvalidArgument(
                        f"invalid 'classification' for output '{name}': expected a "
                        f"non-negative int64_param, got {kind} {value!r}"
                    )
                params[key] = value
        requested.append(RequestedOutput(name, params))
    return requested


# ------------------------------------------------------------------------ response


def _set_parameter(param: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if value > _INT64_MAX:
            param.uint64_param = value
        else:
            param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


def encode_infer_response(
    response: InferenceResponse,
    request: InferenceRequest,
    final: bool | None = None,
    shared_memory: SharedMemory | None = None,
) -> Chunks:
    """The serialized ModelInferResponse, as chunks to write in order.

    ``final`` adds the ``triton_final_response`` parameter (every response on a
    stream carries it). Outputs requested into a shared memory region
    are written there, described by their region parameters, and keep an empty
    ``raw_output_contents`` entry so that entries stay aligned with outputs.
    """
    message = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id or request.id,
    )
    for key, value in response.parameters.items():
        _set_parameter(message.parameters[key], value)
    if final is not None:
        message.parameters[FINAL_RESPONSE].bool_param = final
    in_shm = shared_memory_outputs(request) if shared_memory is not None else {}
    raws = []
    outputs = message.outputs
    for tensor in response.outputs:
        output = outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.data.shape)
        raw = output_bytes(tensor.datatype, tensor.data)
        params = in_shm.get(tensor.name)
        if params is not None and shared_memory is not None:  # (in_shm is {} if None)
            what = f"output '{tensor.name}'"
            region, offset, byte_size = shared_memory_window(params, what)
            written = shared_memory.write(region, offset, byte_size, raw, what)
            output.parameters["shared_memory_region"].string_param = region
            output.parameters["shared_memory_byte_size"].int64_param = written
            if offset:
                output.parameters["shared_memory_offset"].int64_param = offset
            raw = b""
        raws.append(raw)
    chunks: Chunks = [message.SerializeToString()]
    for raw in raws:
        chunks.append(_RAW_OUTPUT_TAG + _varint(len(raw)))
        if len(raw):
            chunks.append(raw)
    return chunks


def encode_empty_final_response(request: InferenceRequest) -> Chunks:
    """A response with no outputs that only says "this request is complete"; it
    names the request's model, version (as requested) and id, as Triton's does."""
    message = pb.ModelInferResponse(
        model_name=request.model_name,
        model_version=_version_text(request),
        id=request.id,
    )
    message.parameters[FINAL_RESPONSE].bool_param = True
    return [message.SerializeToString()]


def encode_stream_response(inner: Chunks) -> Chunks:
    """Wrap a serialized ModelInferResponse as a ModelStreamInferResponse."""
    size = sum(map(len, inner))
    return [_STREAM_RESPONSE_TAG + _varint(size), *inner]


def encode_stream_error(
    message: str, request: InferenceRequest | pb.ModelInferRequest | None = None
) -> bytes:
    """A ModelStreamInferResponse carrying an error, which ends its request; it
    names the request when known, with ``triton_final_response`` true."""
    out = pb.ModelStreamInferResponse(error_message=message)
    if request is not None:
        response = out.infer_response
        response.model_name = request.model_name
        response.id = request.id
        response.parameters[FINAL_RESPONSE].bool_param = True
        if isinstance(request, InferenceRequest):
            response.model_version = _version_text(request)
        else:
            response.model_version = request.model_version
    return out.SerializeToString()


def _version_text(request: InferenceRequest) -> str:
    return "" if request.model_version is None else str(request.model_version)
