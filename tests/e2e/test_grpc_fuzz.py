"""Fuzzing the gRPC infer path (issue 18), as tests/e2e/test_http_fuzz.py does for
HTTP: Hypothesis builds ModelInferRequest messages that are almost right (model
names, versions, parameters of every kind, datatypes, shapes with the bounds of
int64, typed contents of the wrong kind or count, raw_input_contents of the wrong
size or number) and bytes that are barely a message at all. The decoder must answer
each with a request or a TritonError, never another exception; the real server
must end each ModelInfer call with OK or a client-fault status, never INTERNAL or
UNKNOWN, answer each ModelStreamInfer request in the stream, and keep serving."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trionserve._generated import grpc_service_pb2 as pb
from trionserve.core.errors import TritonError
from trionserve.protocol.grpc import codec

MODELS = ["simple", "identity_fp32", "identity_bytes", "simple_ensemble", "nonexistent", ""]
DATATYPES = ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16"]
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
# What a server may answer a client's malformed request with; never INTERNAL/UNKNOWN.
CLIENT_FAULTS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}

int64s = st.one_of(
    st.sampled_from([0, 1, 2, 4, 16, -1, 2**31, 2**62, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)
# One InferParameter of each kind the oneof allows (or none set at all).
parameter_values = st.one_of(
    st.none(),
    st.booleans().map(lambda v: ("bool_param", v)),
    int64s.map(lambda v: ("int64_param", v)),
    st.text(max_size=8).map(lambda v: ("string_param", v)),
    st.floats(allow_nan=True).map(lambda v: ("double_param", v)),
    st.integers(0, 2**64 - 1).map(lambda v: ("uint64_param", v)),
)
parameter_names = st.one_of(
    st.sampled_from(
        [
            "sequence_id",
            "sequence_start",
            "sequence_end",
            "priority",
            "timeout",
            "binary_data_output",
            "shared_memory_region",
            "shared_memory_byte_size",
            "shared_memory_offset",
            "classification",
            "triton_enable_empty_final_response",
            "triton_x",
            "custom",
        ]
    ),
    st.text(max_size=6),
)
parameters = st.dictionaries(parameter_names, parameter_values, max_size=3)
contents = st.fixed_dictionaries(
    {},
    optional={
        "bool_contents": st.lists(st.booleans(), max_size=20),
        "int_contents": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
        "int64_contents": st.lists(int64s, max_size=20),
        "uint_contents": st.lists(st.integers(0, 2**32 - 1), max_size=4),
        "uint64_contents": st.lists(st.integers(0, 2**64 - 1), max_size=4),
        "fp32_contents": st.lists(st.floats(width=32, allow_nan=True), max_size=20),
        "fp64_contents": st.lists(st.floats(allow_nan=True), max_size=4),
        "bytes_contents": st.lists(st.binary(max_size=8), max_size=4),
    },
)
inputs = st.fixed_dictionaries(
    {
        "name": st.one_of(st.sampled_from(["INPUT0", "INPUT1"]), st.text(max_size=4)),
        "datatype": st.one_of(st.sampled_from(DATATYPES), st.text(max_size=5)),
        "shape": st.lists(st.one_of(st.sampled_from([1, 16, 4]), int64s), max_size=4),
    },
    optional={"parameters": parameters, "contents": contents},
)
outputs = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["OUTPUT0", "OUTPUT1"]), st.text(max_size=4))},
    optional={"parameters": parameters},
)
# Raw contents: often exactly what a right-shaped INT32 / FP32 input needs (64 bytes).
raw_contents = st.lists(
    st.one_of(st.binary(min_size=64, max_size=64), st.binary(max_size=80)), max_size=3
)


def _set_parameters(target, values: dict) -> None:
    for key, value in values.items():
        param = target[key]
        if value is not None:
            setattr(param, *value)


@st.composite
def infer_requests(draw) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(
        model_name=draw(st.one_of(st.sampled_from(MODELS), st.text(max_size=6))),
        model_version=draw(st.sampled_from(["", "1", "2", "0", "-1", "x", "99999999999999999"])),
        id=draw(st.text(max_size=4)),
    )
    _set_parameters(message.parameters, draw(parameters))
    for fields in draw(st.lists(inputs, max_size=3)):
        tensor = message.inputs.add(
            name=fields["name"], datatype=fields["datatype"], shape=fields["shape"]
        )
        _set_parameters(tensor.parameters, fields.get("parameters", {}))
        for kind, values in fields.get("contents", {}).items():
            getattr(tensor.contents, kind).extend(values)
    for fields in draw(st.lists(outputs, max_size=2)):
        tensor = message.outputs.add(name=fields["name"])
        _set_parameters(tensor.parameters, fields.get("parameters", {}))
    message.raw_input_contents.extend(draw(raw_contents))
    return message


@st.composite
def wire_messages(draw) -> bytes:
    """A serialized ModelInferRequest, one cut or with bytes flipped, or noise."""
    data = draw(infer_requests()).SerializeToString()
    how = draw(st.sampled_from(["whole", "whole", "cut", "flip", "noise"]))
    if how == "cut" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    if how == "noise":
        return draw(st.binary(max_size=64))
    return data


def right_simple() -> pb.ModelInferRequest:
    """A well-formed request for ``simple`` (two INT32 [1, 16] inputs, raw contents)."""
    message = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        message.raw_input_contents.append(bytes(64))
    return message


def huge_shape() -> pb.ModelInferRequest:
    """Once a candidate for 'array is too big': a zero dimension beside a huge one."""
    message = pb.ModelInferRequest(model_name="identity_fp32")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[0, 2**62])
    message.raw_input_contents.append(b"")
    return message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wire_messages())
@example(right_simple().SerializeToString())
@example(huge_shape().SerializeToString())
def test_decoder_answers_every_message_with_a_request_or_a_triton_error(data):
    try:
        codec.decode_infer_request(data, None)
    except TritonError:
        pass


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as opened:
        yield opened


def is_serving(channel) -> None:
    """The server still answers a well-formed request, with the right sum."""
    call = channel.unary_unary(INFER)
    answer = pb.ModelInferResponse.FromString(call(right_simple().SerializeToString(), timeout=30))
    assert answer.model_name == "simple"
    assert len(answer.raw_output_contents) == 2


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(wire_messages())
@example(huge_shape().SerializeToString())
def test_server_never_ends_a_fuzzed_model_infer_internal_or_unknown(server, channel, data):
    call = channel.unary_unary(INFER)
    try:
        call(data, timeout=30)
    except grpc.RpcError as error:
        assert error.code() in CLIENT_FAULTS, (error.code(), error.details())
        assert error.details(), error.code()  # a message the client can act on


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(wire_messages(), min_size=1, max_size=4))
def test_server_answers_each_fuzzed_stream_request_and_ends_the_stream_ok(
    server, channel, messages
):
    """A stream's bad request is answered with its error_message; the stream goes on
    (as Triton's stream handler), so every request gets one answer and the call ends
    OK. A message that is not a ModelInferRequest at all has no id to answer with:
    the server may then end the stream INVALID_ARGUMENT."""
    call = channel.stream_stream(STREAM_INFER)
    answers = 0
    try:
        for data in call(iter(messages), timeout=30):
            pb.ModelStreamInferResponse.FromString(data)
            answers += 1
    except grpc.RpcError as error:
        assert error.code() in CLIENT_FAULTS, (error.code(), error.details())
        return
    assert answers == len(messages)
    is_serving(channel)


def test_server_still_serves_after_the_fuzzing(server, channel):
    is_serving(channel)
