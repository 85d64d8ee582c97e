"""infercache (ModelInfer's common messages without protobuf objects) against the
protobuf codec, its reference: for the requests tritonclient.grpc builds and for
random and damaged messages, the request decoded is the codec's (or None, and the
codec decodes it), and the response bytes are the codec's."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import _utils as triton_utils

from trionserve._generated import grpc_service_pb2 as pb
from trionserve.core.bytes_tensor import serialize_bytes_tensor
from trionserve.core.errors import TritonError
from trionserve.core.inference import (
    InferenceRequest,
    InferenceResponse,
    RequestedOutput,
    Tensor,
)
from trionserve.protocol.grpc import codec, infercache


def reference(wire: bytes) -> InferenceRequest | TritonError:
    """The codec's request (protobuf), or its error."""
    try:
        return codec.decode_infer_request(wire)
    except TritonError as error:
        return error


def fields(request: InferenceRequest) -> dict:
    """Everything decoding sets on a request, comparable."""
    inputs = {}
    for name, tensor in request.inputs.items():
        data = tensor.data
        # Numbers by their bytes: a NaN (a FP16 byte flipped by the damage test)
        # is not equal to itself as a float.
        values = data.tolist() if data.dtype == object else data.tobytes()
        inputs[name] = (tensor.name, tensor.datatype, data.dtype.str, data.shape, values)
    outputs = (
        None
        if request.requested_outputs is None
        else [(o.name, o.parameters) for o in request.requested_outputs]
    )
    return {
        "model": (request.model_name, request.model_version, request.id),
        "inputs": list(inputs.items()),
        "outputs": outputs,
        "parameters": request.parameters,
        "priority": request.priority,
        "timeout_us": request.timeout_us,
        "sequence": (request.sequence_id, request.sequence_start, request.sequence_end),
    }


def check_same(wire: bytes) -> InferenceRequest | None:
    """infercache's request for ``wire`` is None or the codec's; returns it."""
    fast = infercache.decode_request(bytearray(wire))
    ref = reference(wire)
    if fast is not None:
        assert not isinstance(ref, TritonError), ref
        assert fields(fast) == fields(ref)
    return fast


def test_a_nan_input_compares_as_its_bytes() -> None:
    """fields() compares a NaN the two paths decode alike as equal (a damaged
    message can make one: an FP16 element's high byte flipped to 0x7E)."""
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="A", datatype="FP16", shape=[1])
    message.raw_input_contents.append(b"\x00\x7e")
    assert check_same(message.SerializeToString()) is not None


def client_wire(inputs, **kwargs) -> bytes:
    """The ModelInferRequest bytes tritonclient.grpc's infer() would send."""
    options = {
        "model_name": "simple",
        "inputs": inputs,
        "model_version": "",
        "request_id": "",
        "outputs": None,
        "sequence_id": 0,
        "sequence_start": False,
        "sequence_end": False,
        "priority": 0,
        "timeout": None,
        "parameters": None,
    }
    options.update(kwargs)
    return triton_utils._get_inference_request(**options).SerializeToString()


def client_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


INT32 = np.arange(16, dtype=np.int32).reshape(1, 16)


@pytest.mark.parametrize(
    "make",
    [
        lambda: client_wire([client_input("INPUT0", INT32, "INT32")]),
        lambda: client_wire(
            [client_input("INPUT0", INT32, "INT32"), client_input("INPUT1", INT32 * 2, "INT32")]
        ),
        lambda: client_wire(
            [client_input("TEXT", np.array([[b"a", b"", b"\xff" * 300]], dtype=object), "BYTES")]
        ),
        lambda: client_wire([client_input("E", np.zeros((0, 4), np.float32), "FP32")]),
        lambda: client_wire(
            [client_input("H", np.ones((2, 3), np.float16), "FP16")],
            model_version="3",
            request_id="r-1",
            outputs=[grpcclient.InferRequestedOutput("OUT", class_count=2)],
        ),
        lambda: client_wire(
            [client_input("INPUT0", INT32, "INT32")],
            sequence_id=42,
            sequence_start=True,
            priority=2,
            timeout=100,
            parameters={"custom": "x", "n": 3, "flag": True},
        ),
        lambda: client_wire(
            [client_input("BIG", np.arange(40_000, dtype=np.float32), "FP32")]
        ),  # a raw content longer than one varint byte, a message past 64 KiB
        lambda: client_wire([]),
    ],
)
def test_client_requests_take_the_common_path(make) -> None:
    wire = make()
    fast = check_same(wire)
    assert fast is not None
    # A second call takes the cached plan and gets a request of its own.
    again = infercache.decode_request(bytearray(wire))
    assert again is not None and again is not fast
    assert fields(again) == fields(fast)
    assert again.parameters is not fast.parameters or not fast.parameters


def test_inputs_are_writable_views_of_the_message() -> None:
    wire = bytearray(client_wire([client_input("INPUT0", INT32, "INT32")]))
    request = infercache.decode_request(wire)
    assert request is not None
    data = request.inputs["INPUT0"].data
    assert data.flags.writeable and data.base is not None
    wire[-4] = 0x7F  # the last element's low byte (little-endian)
    assert data[0, -1] == 0x7F


def test_each_request_gets_its_own_mutable_parts() -> None:
    wire = client_wire(
        [client_input("INPUT0", INT32, "INT32")],
        parameters={"custom": "x"},
        outputs=[grpcclient.InferRequestedOutput("OUT", class_count=2)],
    )
    first = infercache.decode_request(bytearray(wire))
    assert first is not None and first.requested_outputs is not None
    first.parameters["forwarded"] = "y"
    first.requested_outputs[0].parameters["extra"] = 1
    second = infercache.decode_request(bytearray(wire))
    assert second is not None and second.requested_outputs is not None
    assert second.parameters == {"custom": "x"}
    assert second.requested_outputs[0].parameters == {"classification": 2}


def _shared_input(m: pb.ModelInferRequest) -> None:
    m.inputs[0].parameters["shared_memory_region"].string_param = "r"


def _input_parameter(m: pb.ModelInferRequest) -> None:
    m.inputs[0].parameters["other"].int64_param = 1


def _shared_output(m: pb.ModelInferRequest) -> None:
    m.outputs.add(name="O").parameters["shared_memory_region"].string_param = "r"


def _bad_priority(m: pb.ModelInferRequest) -> None:
    m.parameters["priority"].string_param = "high"


@pytest.mark.parametrize(
    "change",
    [
        _shared_input,
        lambda m: m.inputs[0].contents.int_contents.extend(range(16)),
        _input_parameter,
        _shared_output,  # (no regions here: the codec's Unimplemented)
        lambda m: setattr(m, "model_version", "x"),
        lambda m: setattr(m.inputs[0], "datatype", "INT33"),
        lambda m: m.inputs[0].shape.append(-1),
        lambda m: m.inputs.add().CopyFrom(m.inputs[0]),
        _bad_priority,
        # Raw contents: one too many, one too few, a wrong size.
        lambda m: m.raw_input_contents.append(b"\0" * 64),
        lambda m: m.raw_input_contents.pop(),
        lambda m: m.raw_input_contents.__setitem__(0, b"\0" * 63),
    ],
)
def test_anything_else_is_left_to_the_codec(change) -> None:
    message = pb.ModelInferRequest.FromString(client_wire([client_input("INPUT0", INT32, "INT32")]))
    change(message)
    wire = message.SerializeToString()
    assert infercache.decode_request(bytearray(wire)) is None
    check_same(wire)


def test_fields_out_of_order_or_unknown_are_left_to_the_codec() -> None:
    wire = client_wire([client_input("INPUT0", INT32, "INT32")])
    raw_at = wire.index(b"\x3a\x40")
    # The raw contents before the inputs (valid protobuf, not the order we take).
    moved = wire[raw_at:] + wire[:raw_at]
    assert infercache.decode_request(bytearray(moved)) is None
    assert fields(codec.decode_infer_request(moved)) == fields(codec.decode_infer_request(wire))
    # An unknown field (number 9, length-delimited) after the raw contents.
    assert infercache.decode_request(bytearray(wire + b"\x4a\x01x")) is None
    # A field after the raw contents.
    assert infercache.decode_request(bytearray(wire + b"\x1a\x01x")) is None


def test_a_large_head_is_not_cached() -> None:
    wire = client_wire([client_input("INPUT0", INT32, "INT32")], request_id="i" * 5000)
    assert infercache.decode_request(bytearray(wire)) is None
    assert not isinstance(reference(wire), TritonError)


def test_calls_that_differ_only_by_id_share_one_plan_and_one_response_head() -> None:
    """Clients commonly give each call an id of its own: the id is cut out of the
    cached head, so such calls make one plan (not one each, which would also empty
    the cache for every other client), and each request and response carries its
    own id, as the codec's."""
    infercache._plan.cache_clear()
    infercache._response_head.cache_clear()
    output = Tensor("OUT", "INT32", INT32)
    for n in range(20):
        request_id = f"call-{n}" + "ü" * (n % 2)
        wire = client_wire([client_input("INPUT0", INT32, "INT32")], request_id=request_id)
        fast = infercache.decode_request(bytearray(wire))
        assert fast is not None and fast.id == request_id
        assert fields(fast) == fields(reference(wire))  # type: ignore[arg-type]
        response = InferenceResponse("simple", "1", outputs=[output])
        encoded, ref = encode_both(response, fast)
        assert encoded is not None and b"".join(map(bytes, encoded)) == ref
    assert infercache._plan.cache_info().currsize == 1
    assert infercache._response_head.cache_info().currsize == 1


def test_an_id_protobuf_would_refuse_or_read_twice_is_left_to_the_codec() -> None:
    wire = client_wire([client_input("INPUT0", INT32, "INT32")], model_version="1")
    # Not UTF-8 (protobuf refuses a proto3 string that is not).
    bad = b"\x1a\x02\xff\xfe" + wire
    assert infercache.decode_request(bytearray(bad)) is None
    assert isinstance(reference(bad), TritonError)
    # Twice (protobuf keeps the last): not the common form.
    twice = b"\x1a\x01a\x1a\x01b" + wire
    assert infercache.decode_request(bytearray(twice)) is None
    assert reference(twice).id == "b"  # type: ignore[union-attr]


# ------------------------------------------------------------------ random messages

DATATYPES = ["INT32", "FP32", "UINT8", "INT64", "BOOL", "FP16", "BYTES", "BF16"] * 3 + ["INT33"]
SIZES = {"INT32": 4, "FP32": 4, "UINT8": 1, "INT64": 8, "BOOL": 1, "FP16": 2, "BF16": 2}


@st.composite
def messages(draw) -> bytes:
    message = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(["simple", "m", ""])),
        model_version=draw(st.sampled_from(["", "", "", "1", "7", "0", "-1", "x"])),
        id=draw(st.sampled_from(["", "id", "ü"])),
    )
    if draw(st.booleans()):
        for key in draw(st.lists(st.sampled_from(PARAMETER_KEYS), max_size=3, unique=True)):
            draw(parameter(message.parameters[key]))
    raws = []
    names = draw(st.lists(st.sampled_from(["A", "B", "C"]), max_size=3))
    for name in names:
        spec = message.inputs.add(
            name=name,
            datatype=draw(st.sampled_from(DATATYPES)),
            shape=draw(
                st.lists(st.integers(-1 if draw(st.integers(0, 9)) == 0 else 0, 3), max_size=3)
            ),
        )
        if draw(st.integers(0, 9)) == 0:
            spec.contents.int_contents.extend([1, 2])
        if draw(st.integers(0, 9)) == 0:
            spec.parameters["shared_memory_region"].string_param = "r"
        count = int(np.prod(spec.shape)) if min(spec.shape, default=0) >= 0 else 1
        if spec.datatype == "BYTES":
            elements = draw(st.lists(st.binary(max_size=5), min_size=count, max_size=count))
            raw = serialize_bytes_tensor(np.array(elements + [b""], dtype=object)[:count])
            if draw(st.integers(0, 9)) == 0:
                raw = raw[:-1]
        else:
            raw = bytes(i % 251 for i in range(count * SIZES.get(spec.datatype, 4)))
            raw += b"\0" * draw(st.sampled_from([0, 0, 0, 0, 0, 1]))
        raws.append(raw)
    if draw(st.integers(0, 5)) == 0:
        raws = raws[:-1] if raws and draw(st.booleans()) else [*raws, b"\0" * 4]
    message.raw_input_contents.extend(raws)
    for _ in range(draw(st.integers(0, 2))):
        out = message.outputs.add(name=draw(st.sampled_from(["X", "Y"])))
        for key in draw(
            st.lists(st.sampled_from(["classification", "binary_data", "z"]), max_size=2)
        ):
            draw(parameter(out.parameters[key]))
    return message.SerializeToString()


PARAMETER_KEYS = [
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "priority",
    "timeout",
    "binary_data_output",
    "triton_enable_empty_final_response",
    "triton_other",
    "custom",
]


@st.composite
def parameter(draw, param: pb.InferParameter) -> None:
    kind = draw(st.sampled_from(["bool", "int64", "uint64", "string", "double", "none"]))
    if kind == "bool":
        param.bool_param = draw(st.booleans())
    elif kind == "int64":
        param.int64_param = draw(st.integers(-3, 3))
    elif kind == "uint64":
        param.uint64_param = draw(st.integers(0, 2**64 - 1))
    elif kind == "string":
        param.string_param = draw(st.sampled_from(["", "s", "7"]))
    elif kind == "double":
        param.double_param = draw(st.floats(allow_nan=False))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_random_messages_decode_as_the_codec_decodes_them(wire: bytes) -> None:
    check_same(wire)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), st.data())
def test_damaged_messages_decode_as_the_codec_decodes_them(wire: bytes, data) -> None:
    damage = data.draw(st.sampled_from(["cut", "flip", "insert"]))
    at = data.draw(st.integers(0, len(wire)))
    if damage == "cut":
        wire = wire[:at]
    elif damage == "flip" and at < len(wire):
        wire = wire[:at] + bytes([wire[at] ^ data.draw(st.integers(1, 255))]) + wire[at + 1 :]
    else:
        wire = wire[:at] + data.draw(st.binary(min_size=1, max_size=4)) + wire[at:]
    check_same(wire)


def test_the_random_messages_take_the_common_path_too() -> None:
    """The strategy reaches the plan's success path (else the tests above prove
    only that None is returned)."""
    taken = 0

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(messages())
    def count(wire: bytes) -> None:
        nonlocal taken
        taken += check_same(wire) is not None

    count()
    assert taken >= 10


# ------------------------------------------------------------------------ responses


def encode_both(response: InferenceResponse, request: InferenceRequest):
    fast = infercache.encode_response(response, request)
    ref = b"".join(map(bytes, codec.encode_infer_response(response, request)))
    return fast, ref


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["", "1"]),
    st.sampled_from(["", "id"]),
    st.sampled_from(["", "rid"]),
    st.lists(
        st.tuples(
            st.sampled_from(["OUT0", "OUT1"]),
            st.sampled_from(["INT32", "FP32", "BYTES", "UINT8"]),
            st.lists(st.integers(0, 40), max_size=3),
        ),
        max_size=3,
    ),
)
def test_responses_encode_as_the_codec_encodes_them(version, response_id, request_id, outputs):
    tensors = []
    for name, datatype, shape in outputs:
        count = int(np.prod(shape))
        if datatype == "BYTES":
            data = np.array([b"x" * (i % 3) for i in range(count)], dtype=object).reshape(shape)
        else:
            data = (
                np.arange(count)
                .astype({"INT32": np.int32, "FP32": np.float32}.get(datatype, np.uint8))
                .reshape(shape)
            )
        tensors.append(Tensor(name, datatype, data))
    response = InferenceResponse("simple", version, response_id, tensors)
    request = InferenceRequest("simple", None, id=request_id)
    for _ in range(2):  # made, then from the cache
        fast, ref = encode_both(response, request)
        assert fast is not None
        assert b"".join(map(bytes, fast)) == ref


def test_responses_it_leaves_to_the_codec() -> None:
    output = Tensor("OUT", "INT32", INT32)
    request = InferenceRequest("simple", None)
    assert (
        infercache.encode_response(
            InferenceResponse("simple", "1", outputs=[output], parameters={"p": 1}), request
        )
        is None
    )
    request.requested_outputs = [RequestedOutput("OUT", {"shared_memory_region": "r"})]
    assert (
        infercache.encode_response(InferenceResponse("simple", "1", outputs=[output]), request)
        is None
    )
    # A long id is no longer the codec's (the id is not part of what is cached):
    # it encodes as the codec encodes it.
    long_id = InferenceRequest("simple", None, id="i" * 200)
    fast, ref = encode_both(InferenceResponse("simple", "1", outputs=[output]), long_id)
    assert fast is not None and b"".join(map(bytes, fast)) == ref


def test_requests_of_one_plan_are_validated_once_per_signature(monkeypatch) -> None:
    """Calls of one head share its plan as their shape key, so a model validates
    them once (core/validation.py), as HTTP's planned requests; a request the
    plan does not fit (left to the codec) has none and is validated in full."""
    from trionserve.core import validation
    from trionserve.core.validation import ModelSignature, TensorSpec

    infercache._plan.cache_clear()
    wire = client_wire([client_input("INPUT0", INT32, "INT32")])
    first, second = (infercache.decode_request(bytearray(wire)) for _ in range(2))
    assert first is not None and second is not None
    assert first.shape_key is second.shape_key is not None
    checks: list = []
    full = validation._validate
    monkeypatch.setattr(validation, "_validate", lambda *args: checks.append(args) or full(*args))
    spec = TensorSpec("INPUT0", "INT32", (-1,))
    signature = ModelSignature("simple", 8, {"INPUT0": spec}, {})
    validation.validate_request(first, signature)
    validation.validate_request(second, signature)  # passed before: not checked again
    assert len(checks) == 1 and first.batch_size == second.batch_size == INT32.shape[0]
    other = ModelSignature("simple", 8, {"INPUT1": spec}, {})  # another signature: in full
    with pytest.raises(TritonError, match="unexpected inference input 'INPUT0'"):
        validation.validate_request(second, other)
    assert len(checks) == 2


def test_a_repeated_call_is_cut_as_the_last_without_split(monkeypatch) -> None:
    """A message of the last one's length whose bytes are the same but in its
    raw contents and its id's value (of the same length) is cut as that one was
    (infercache._Layout), with its own tensors and id, as the codec decodes it;
    any other byte changed is split again; the layout keeps no view of the
    message (its buffer stays free to be reused)."""
    two = [client_input("INPUT0", INT32, "INT32"), client_input("INPUT1", INT32 * 2, "INT32")]
    first = client_wire(two, request_id="id-1")
    assert check_same(first) is not None
    split = infercache._split
    splits: list[int] = []

    def counted(data):
        splits.append(1)
        return split(data)

    monkeypatch.setattr(infercache, "_split", counted)
    other = [client_input("INPUT0", INT32 + 5, "INT32"), client_input("INPUT1", INT32 * 3, "INT32")]
    again = client_wire(other, request_id="id-2")
    assert len(again) == len(first)
    request = check_same(again)
    assert request is not None and request.id == "id-2" and splits == []
    assert request.inputs["INPUT1"].data.tolist() == (INT32 * 3).tolist()
    # A head byte changed (another model of a name as long): split, its own plan.
    renamed = client_wire(other, request_id="id-2", model_name="simplf")
    assert len(renamed) == len(first)
    renamed_request = check_same(renamed)
    assert renamed_request is not None and renamed_request.model_name == "simplf"
    assert splits == [1]
    # An id's value protobuf refuses: left to the codec, as when split.
    bad = bytearray(renamed)
    bad[bad.index(b"id-2") + 3] = 0xFF
    assert infercache.decode_request(bad) is None and splits == [1]
    # No view of the message is kept once its request is gone: its buffer can
    # be resized (a bytearray refuses while a view of it exists).
    buffer = bytearray(renamed)
    assert infercache.decode_request(buffer) is not None
    buffer.append(0)
