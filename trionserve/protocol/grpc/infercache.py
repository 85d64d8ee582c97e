"""ModelInfer's common messages without protobuf objects: what repeats is cached.

A client sends the same ``ModelInferRequest`` call after call but for its tensors'
bytes (tritonclient and perf_analyzer: the model's name, the inputs' names, types
and shapes, then the ``raw_input_contents``), and a model answers with the same
``ModelInferResponse`` but for its outputs' bytes. As the HTTP codec parses a
repeated JSON header once (``protocol/http/codec.py`` ``_parse_header``) and
keeps the JSON header of a response per outputs' description
(``_described_response_header``):

- :func:`decode_request`: the message's wire bytes before its
  ``raw_input_contents`` but for its ``id`` (its head) are parsed by protobuf and
  checked once per distinct head, into a plan; a call with a head seen before
  only cuts the id and the raw contents out of the bytes (views of them, no
  copy) and checks their count and sizes against the plan. The id is left out of
  the head because clients commonly give each call an id of its own: in the head
  it would make every call a new plan, and such a client would empty the cache
  for every other. A message of the last one's length whose bytes are the same
  but for its raw contents and its id's value is cut where the last one was
  (:class:`_Layout`), without walking its fields again.
- :func:`encode_response`: the serialized response without its ``id`` and
  ``raw_output_contents`` is made by protobuf once per model, version and
  outputs' names, types and shapes; a call puts its id in (protobuf writes
  fields in their numbers' order: the id, field 3, between the version and the
  outputs) and appends its outputs' bytes.

Only the common form is taken: for anything else (fields out of protobuf's order,
an unknown field, request parameters a plan cannot copy, an input's parameters
or typed contents, shared memory, a count or size that does not match, response
parameters) these functions return None and :mod:`codec` does the work with
protobuf messages, naming any fault. :mod:`codec` stays the reference:
tests/unit/test_grpc_infercache.py checks that both give the same request and
the same bytes, for random messages and every way of cutting and changing them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from trionserve._generated import grpc_service_pb2 as pb
from trionserve.core.bytes_tensor import deserialize_bytes_tensor
from trionserve.core.datatypes import BY_WIRE, WIRE_DTYPE, DataType
from trionserve.core.errors import TritonError
from trionserve.core.inference import (
    InferenceRequest,
    InferenceResponse,
    RequestedOutput,
    Tensor,
)
from trionserve.core.outputs import output_bytes
from trionserve.core.validation import check_shape_size, parse_model_version
from trionserve.protocol.grpc.codec import (
    Chunks,
    Wire,
    _apply_request_parameters,
    _decode_outputs,
    _fmt_shape,
    _read_varint,
    _varint,
)

__all__ = ["decode_request", "encode_response", "raw_at"]

# ModelInferRequest's fields 1-6 (model_name, model_version, id, parameters,
# inputs, outputs; grpc_service.proto), each length-delimited: their tags. Field
# 7, raw_input_contents, comes after them in protobuf's order (how every
# protobuf library serializes a message).
_HEAD_TAGS = frozenset(number << 3 | 2 for number in range(1, 7))
_ID_TAG = 3 << 3 | 2
_RAW_INPUT_TAG = 7 << 3 | 2
# Heads up to this size are planned, at most this many kept (least recently
# used dropped): a client cannot make the cache hold more than about 1 MiB.
_HEAD_LIMIT = 4096
_PLANS = 256
# The request attributes a request's parameters set (codec._apply_request_parameters).
_PARAMETER_ATTRIBUTES = ("priority", "timeout_us", "sequence_id", "sequence_start", "sequence_end")


def _split(
    data: memoryview,
) -> tuple[bytes, tuple[int, int] | None, list[tuple[int, int]]] | None:
    """The message's head (its fields before the raw_input_contents but for the
    id, as bytes), where the id's value lies and where the raw contents lie in
    ``data``, or None unless the message is fields 1-6 (the id at most once)
    then only field 7, every length within the message."""
    end = data.nbytes  # (a view of bytes: its length, without a call)
    offset = 0
    id_field: tuple[int, int, int] | None = None  # (tag's offset, value's, end)
    try:
        while offset < end:
            tag = data[offset]
            if tag not in _HEAD_TAGS:
                break
            start = offset
            length = data[offset + 1]
            offset += 2
            if length > 0x7F:
                length, offset = _read_varint(data, offset - 1)
            if tag == _ID_TAG:
                if id_field is not None:
                    return None  # the last would win: the codec's case
                id_field = (start, offset, offset + length)
            offset += length
        if offset > end or offset > _HEAD_LIMIT:
            return None
        head_end = offset
        raws: list[tuple[int, int]] = []
        while offset < end:
            if data[offset] != _RAW_INPUT_TAG:
                return None
            length = data[offset + 1]
            offset += 2
            if length > 0x7F:
                length, offset = _read_varint(data, offset - 1)
            stop = offset + length
            if stop > end:
                return None
            raws.append((offset, stop))
            offset = stop
    except (IndexError, ValueError):
        return None
    if id_field is None:
        return data[:head_end].tobytes(), None, raws
    start, value, stop = id_field
    head = data[:start].tobytes() + data[stop:head_end].tobytes()
    return head, (value, stop), raws


# An input as a plan takes it: name, datatype, numpy dtype on the wire, shape,
# element count, and byte size (None for BYTES, which its data sizes).
_Input = tuple[str, DataType, np.dtype, list[int], int, int | None]


class RequestPlan:
    """What a request head says, checked: the request each call builds from it."""

    __slots__ = (
        "model",
        "version",
        "inputs",
        "count",
        "outputs",
        "parameters",
        "attributes",
        "sized",
        "one",
    )

    def __init__(
        self,
        model: str,
        version: int | None,
        inputs: list[_Input],
        outputs: list[tuple[str, dict[str, Any]]] | None,
        template: InferenceRequest | None,
    ) -> None:
        self.model = model
        self.version = version
        self.inputs = inputs
        self.count = len(inputs)
        # Every input of a fixed size (no BYTES, whose contents are read as a request is made).
        self.sized = all(input_[5] is not None for input_ in inputs)
        # The common request's one input of a fixed size, not empty: its name, wire
        # datatype, dtype, shape and size, its tensor made without the loop over inputs.
        self.one: tuple[str, str, np.dtype, list[int], int] | None = None
        if len(inputs) == 1 and inputs[0][5] and inputs[0][4]:
            name, dt, dtype, shape, _, size = inputs[0]
            assert size is not None
            self.one = (name, dt.wire, dtype, shape, size)
        self.outputs = outputs
        # What the request's parameters set, copied into each call's request.
        self.parameters = template.parameters if template is not None else None
        self.attributes = (
            [(name, getattr(template, name)) for name in _PARAMETER_ATTRIBUTES]
            if template is not None
            else None
        )

    def request(self, request_id: str, raws: list[memoryview]) -> InferenceRequest | None:
        """The request with this id and raw contents, or None when they do not fit."""
        if len(raws) != self.count:
            return None
        one = self.one
        tensors: dict[str, Tensor] | None
        if one is not None:
            name, wire, dtype, shape, size = one
            raw = raws[0]
            if raw.nbytes != size:
                return None
            tensors = {name: Tensor(name, wire, np.ndarray(shape, dtype, raw))}
        else:
            tensors = self._tensors(raws)
            if tensors is None:
                return None
        request = InferenceRequest(self.model, self.version, id=request_id, inputs=tensors)
        request.shape_key = self  # (validated once per model: core/validation.py)
        if self.outputs is not None:
            request.requested_outputs = [
                RequestedOutput(name, dict(params)) for name, params in self.outputs
            ]
        if self.attributes is not None:
            assert self.parameters is not None
            request.parameters = dict(self.parameters)
            for name, value in self.attributes:
                setattr(request, name, value)
        return request

    def _tensors(self, raws: list[memoryview]) -> dict[str, Tensor] | None:
        """The inputs' tensors of these raw contents (one each, in order), or None when
        they do not fit."""
        tensors: dict[str, Tensor] = {}
        for (name, dt, dtype, shape, count, size), raw in zip(self.inputs, raws, strict=True):
            if size is None:  # BYTES
                try:
                    what = f"input '{name}' with shape {_fmt_shape(shape)}"
                    data = deserialize_bytes_tensor(raw, count, what).reshape(shape)
                except TritonError:
                    return None  # codec names the fault
            elif raw.nbytes != size:  # (a view of bytes: its length, without a call)
                return None
            elif count:  # (its view in one step, as frombuffer(...).reshape(shape) in two)
                data = np.ndarray(shape, dtype, raw)
            else:
                data = np.empty(shape, dtype=dt.numpy)
            tensors[name] = Tensor(name, dt.wire, data)
        return tensors


@functools.lru_cache(maxsize=_PLANS)
def _plan(head: bytes) -> RequestPlan | None:
    """The plan of a request head, or None when it is not in the common form (or
    not valid: the codec then says why)."""
    try:
        message = pb.ModelInferRequest.FromString(head)
    except DecodeError:
        return None
    try:
        version = parse_model_version(message.model_version)
        template = None
        if message.parameters:
            template = InferenceRequest(message.model_name, version)
            _apply_request_parameters(template, message.parameters)
        inputs: list[_Input] = []
        seen: set[str] = set()
        for spec in message.inputs[:]:
            name = spec.name
            dt = BY_WIRE.get(spec.datatype)
            if name in seen or dt is None or spec.parameters or spec.HasField("contents"):
                return None
            seen.add(name)
            shape = spec.shape[:]
            if shape and min(shape) < 0:
                return None
            check_shape_size(name, shape, dt.itemsize)
            count = math.prod(shape)
            size = None if dt.itemsize == 0 else count * dt.itemsize
            inputs.append((name, dt, WIRE_DTYPE.get(dt.wire, dt.numpy), shape, count, size))
        outputs = None
        if message.outputs:
            # Shared memory (no regions given here) raises: the codec's case.
            requested = _decode_outputs(message.outputs[:], None)
            outputs = [(o.name, o.parameters) for o in requested]
    except TritonError:
        return None
    return RequestPlan(message.model_name, version, inputs, outputs, template)


class _Layout:
    """Where the last message decoded put its bytes: a message of the same
    length whose bytes are the same but in its id's value (of the same length)
    and its raw contents is cut as that one was, without _split (a client
    repeats its call but for those)."""

    __slots__ = ("end", "fixed", "id_span", "spans", "one", "request_id", "plan")

    def __init__(
        self,
        view: memoryview,
        id_span: tuple[int, int] | None,
        spans: list[tuple[int, int]],
        request_id: str,
        plan: RequestPlan,
    ) -> None:
        self.end = end = view.nbytes
        # The bytes between the id's value and the raw contents, and around
        # them: (start, stop, bytes).
        self.fixed: list[tuple[int, int, bytes]] = []
        at = 0
        for start, stop in spans if id_span is None else [id_span, *spans]:
            if start > at:
                self.fixed.append((at, start, view[at:start].tobytes()))
            at = stop
        if at < end:  # (no raw contents: the head's end)
            self.fixed.append((at, end, view[at:end].tobytes()))
        self.id_span = id_span
        self.spans = spans
        self.one = spans[0] if len(spans) == 1 else None  # (one input's, the common case)
        self.request_id = request_id  # (the id's value decoded again when it has one)
        self.plan = plan


# The loop's last message's layout (decode_request runs on the loop only).
_last: _Layout | None = None


def raw_at(length: int) -> int:
    """Where a message of ``length`` bytes decoded as the last one was has its last raw
    contents (the bytes nothing on the loop reads: protocol/later.py), when they end it and
    every input has a fixed size (no BYTES); else 0."""
    layout = _last
    if layout is None or layout.end != length or not layout.spans:
        return 0
    start, stop = layout.spans[-1]
    return start if stop == length and layout.plan.sized else 0


def decode_request(data: Wire, at: int = 0) -> InferenceRequest | None:
    """The request of a serialized ModelInferRequest in the common form (its input
    tensors views of ``data``, writable when ``data`` is), or None: then decode it
    with :func:`codec.decode_infer_request`. Never raises.

    With ``at``: ``data``'s bytes from ``at`` on may be unread yet (its last raw
    contents, :func:`raw_at`'s, left in the socket: protocol/later.py); its request
    only when it is cut as the last message with its last raw contents there (none
    of those bytes read), else None without decoding it (read them, then decode it)."""
    global _last
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1 or not view.c_contiguous:  # (a message is)
        view = view.cast("B")
    layout = _last
    if (
        layout is not None
        and view.nbytes == layout.end
        and (
            not at or (layout.spans and layout.spans[-1] == (at, layout.end) and layout.plan.sized)
        )
    ):
        for start, stop, known in layout.fixed:
            if view[start:stop] != known:
                break
        else:  # cut as the last one
            request_id, id_span, one = layout.request_id, layout.id_span, layout.one
            if id_span is not None:
                try:
                    request_id = str(view[id_span[0] : id_span[1]], "utf-8")
                except UnicodeDecodeError:
                    return None  # protobuf refuses it: the codec names it
            if one is not None:  # (its view without a comprehension's frame)
                raws = [view[one[0] : one[1]]]
            else:
                raws = [view[start:stop] for start, stop in layout.spans]
            return layout.plan.request(request_id, raws)
    if at:
        return None  # (not cut so: nothing decoded before the rest is read)
    split = _split(view)
    if split is None:
        return None
    head, id_span, spans = split
    plan = _plan(head)
    if plan is None:
        return None
    request_id = ""
    if id_span is not None:
        try:
            request_id = str(view[id_span[0] : id_span[1]], "utf-8")
        except UnicodeDecodeError:
            return None  # protobuf refuses it: the codec names it
    request = plan.request(request_id, [view[start:stop] for start, stop in spans])
    if request is not None:
        _last = _Layout(view, id_span, spans, request_id, plan)
    return request


# ------------------------------------------------------------------------ response

# ModelInferResponse.id (field 3) and raw_output_contents (field 6), length-delimited.
_RESPONSE_ID_TAG = b"\x1a"
_RAW_OUTPUT_TAG = b"\x32"


@functools.lru_cache(maxsize=_PLANS)
def _response_head(
    model: str, version: str, outputs: tuple[tuple[str, str, Any], ...]
) -> tuple[bytes, bytes, bytes]:
    """The serialized ModelInferResponse without its id and raw_output_contents:
    the fields before the id (model_name, model_version), after it (outputs), and
    both together (a response without an id)."""
    before = pb.ModelInferResponse(model_name=model, model_version=version)
    after = pb.ModelInferResponse()
    add = after.outputs.add
    for name, datatype, shape in outputs:
        add(name=name, datatype=datatype, shape=shape)
    head, tail = before.SerializeToString(), after.SerializeToString()
    return head, tail, head + tail


@functools.lru_cache(maxsize=_PLANS)
def _raw_head(size: int) -> bytes:
    return _RAW_OUTPUT_TAG + _varint(size)


def encode_response(response: InferenceResponse, request: InferenceRequest) -> Chunks | None:
    """The serialized ModelInferResponse as chunks to write in order, as
    :func:`codec.encode_infer_response` writes it; None when the response has
    parameters or an output requested into shared memory (then encode it with
    :func:`codec.encode_infer_response`)."""
    if response.parameters:
        return None
    requested = request.requested_outputs
    if requested and any("shared_memory_region" in o.parameters for o in requested):
        return None
    outputs = response.outputs
    description = tuple([(t.name, t.datatype, t.data.shape) for t in outputs])
    head, tail, whole = _response_head(response.model_name, response.model_version, description)
    response_id = response.id or request.id
    if response_id:
        value = response_id.encode()
        whole = b"".join((head, _RESPONSE_ID_TAG, _varint(len(value)), value, tail))
    chunks: Chunks = [whole]
    for tensor in outputs:
        raw = output_bytes(tensor.datatype, tensor.data)
        chunks.append(_raw_head(len(raw)))
        if len(raw):
            chunks.append(raw)
    return chunks
