"""The sans-I/O gRPC codec against the bytes the real tritonclient.grpc produces.

Requests are built with tritonclient's own request builder and serialized, as the
client does before sending; responses are parsed back with tritonclient's
``InferResult``, as the client does after receiving.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import _utils as triton_utils
from tritonclient.grpc import service_pb2 as triton_pb

from trionserve.core.errors import InvalidArgument, TritonError, Unimplemented
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.protocol.grpc import codec as grpc_codec
from trionserve.protocol.http import codec as http_codec


def client_request(
    model: str,
    inputs,
    *,
    version: str = "",
    request_id: str = "",
    outputs=None,
    sequence_id=0,
    sequence_start=False,
    sequence_end=False,
    priority=0,
    timeout=None,
    parameters=None,
) -> triton_pb.ModelInferRequest:
    """The ModelInferRequest tritonclient.grpc's infer() would send."""
    return triton_utils._get_inference_request(
        model_name=model,
        inputs=inputs,
        model_version=version,
        request_id=request_id,
        outputs=outputs,
        sequence_id=sequence_id,
        sequence_start=sequence_start,
        sequence_end=sequence_end,
        priority=priority,
        timeout=timeout,
        parameters=parameters,
    )


def infer_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def decode(message) -> InferenceRequest:
    return grpc_codec.decode_infer_request(message.SerializeToString())


def error_of(call) -> TritonError:
    with pytest.raises(TritonError) as info:
        call()
    return info.value


# ------------------------------------------------------------------------- requests


def test_simple_request_decodes_to_views_of_the_message():
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), -3, dtype=np.int32)
    message = client_request(
        "simple",
        [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", b, "INT32")],
        version="1",
        request_id="req-1",
    )
    request = decode(message)
    assert request.model_name == "simple"
    assert request.model_version == 1
    assert request.id == "req-1"
    assert request.requested_outputs is None
    assert list(request.inputs) == ["INPUT0", "INPUT1"]
    x = request.inputs["INPUT0"]
    assert x.datatype == "INT32"
    np.testing.assert_array_equal(x.data, a)
    np.testing.assert_array_equal(request.inputs["INPUT1"].data, b)
    # np.frombuffer over the message bytes: a read-only view, not a copy.
    assert not x.data.flags.owndata
    assert not x.data.flags.writeable


def test_latest_version_when_none_given():
    message = client_request("simple", [infer_input("X", np.zeros(2, np.float32), "FP32")])
    assert decode(message).model_version is None


@pytest.mark.parametrize(
    "datatype,array",
    [
        ("BOOL", np.array([[True, False, True]])),
        ("UINT8", np.array([[0, 255]], dtype=np.uint8)),
        ("INT8", np.array([[-128, 127]], dtype=np.int8)),
        ("UINT64", np.array([[2**64 - 1, 0]], dtype=np.uint64)),
        ("INT64", np.array([[-(2**63), 5]], dtype=np.int64)),
        ("FP16", np.array([[1.5, -2.25]], dtype=np.float16)),
        ("FP64", np.array([[1e300, -0.5]], dtype=np.float64)),
    ],
)
def test_raw_input_datatypes(datatype, array):
    request = decode(client_request("m", [infer_input("X", array, datatype)]))
    tensor = request.inputs["X"]
    assert tensor.datatype == datatype
    assert tensor.data.shape == array.shape
    np.testing.assert_array_equal(tensor.data, array)


def test_bytes_input_from_length_prefixed_raw_contents():
    data = np.array([[b"hello", b"", "wörld".encode()]], dtype=np.object_)
    request = decode(client_request("identity_bytes", [infer_input("INPUT0", data, "BYTES")]))
    tensor = request.inputs["INPUT0"]
    assert tensor.datatype == "BYTES"
    assert tensor.data.shape == (1, 3)
    assert tensor.data.reshape(-1).tolist() == [b"hello", b"", "wörld".encode()]


def test_request_parameters_and_requested_outputs():
    outputs = [
        grpcclient.InferRequestedOutput("OUTPUT1", class_count=3),
        grpcclient.InferRequestedOutput("OUTPUT0"),
    ]
    message = client_request(
        "simple",
        [infer_input("INPUT0", np.zeros((1, 16), np.int32), "INT32")],
        outputs=outputs,
        sequence_id=42,
        sequence_start=True,
        sequence_end=False,
        priority=2,
        timeout=1500,
        parameters={"tag": "blue", "count": 3, "flag": True, "scale": 0.5},
    )
    request = decode(message)
    assert request.sequence_id == 42
    assert request.sequence_start is True and request.sequence_end is False
    assert request.priority == 2
    assert request.timeout_us == 1500
    assert request.parameters == {"tag": "blue", "count": 3, "flag": True, "scale": 0.5}
    assert [o.name for o in request.requested_outputs] == ["OUTPUT1", "OUTPUT0"]
    assert request.requested_outputs[0].parameters == {"classification": 3}
    assert request.requested_outputs[1].parameters == {}


def test_string_sequence_id_and_uint64_priority():
    message = client_request(
        "m",
        [infer_input("X", np.zeros(1, np.float32), "FP32")],
        sequence_id="session-7",
    )
    message.parameters["priority"].uint64_param = 2**64 - 1
    request = decode(message)
    assert request.sequence_id == "session-7"
    assert request.priority == 2**64 - 1


def test_empty_final_response_flag_is_not_a_model_parameter():
    message = client_request("m", [infer_input("X", np.zeros(1, np.float32), "FP32")])
    assert not grpc_codec.empty_final_response_enabled(message)
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    ours = grpc_codec.parse_message(grpc_codec.pb.ModelInferRequest, message.SerializeToString())
    assert grpc_codec.empty_final_response_enabled(ours)
    assert grpc_codec.decode_infer_request(ours).parameters == {}


@pytest.mark.parametrize(
    "key,setter,fragment",
    [
        (
            "sequence_start",
            lambda p: setattr(p, "int64_param", 1),
            "invalid parameter 'sequence_start': expected a bool_param, got int64_param 1",
        ),
        (
            "priority",
            lambda p: setattr(p, "int64_param", -1),
            "invalid parameter 'priority': expected a non-negative int64_param",
        ),
        ("timeout", lambda p: setattr(p, "string_param", "soon"), "invalid parameter 'timeout'"),
        (
            "sequence_id",
            lambda p: setattr(p, "bool_param", True),
            "invalid parameter 'sequence_id'",
        ),
        (
            "triton_secret",
            lambda p: setattr(p, "bool_param", True),
            "parameter keys starting with 'triton_' are reserved",
        ),
        (
            "triton_enable_empty_final_response",
            lambda p: setattr(p, "int64_param", 1),
            "expected a bool_param",
        ),
    ],
)
def test_bad_request_parameters(key, setter, fragment):
    message = client_request("m", [infer_input("X", np.zeros(1, np.float32), "FP32")])
    setter(message.parameters[key])
    error = error_of(lambda: decode(message))
    assert isinstance(error, InvalidArgument)
    assert fragment in error.message


# ----------------------------------------------------------------- typed contents


def typed_request(datatype: str, shape, field: str, values) -> triton_pb.ModelInferRequest:
    message = triton_pb.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="X", datatype=datatype, shape=shape)
    getattr(tensor.contents, field).extend(values)
    return message


@pytest.mark.parametrize(
    "datatype,field,values,dtype",
    [
        ("INT32", "int_contents", [1, -2, 3, 4], np.int32),
        ("INT8", "int_contents", [-128, 0, 1, 127], np.int8),
        ("UINT16", "uint_contents", [0, 1, 2, 65535], np.uint16),
        ("INT64", "int64_contents", [2**40, -1, 0, 1], np.int64),
        ("UINT64", "uint64_contents", [2**64 - 1, 0, 1, 2], np.uint64),
        ("FP32", "fp32_contents", [0.5, -1.5, 2.0, 3.25], np.float32),
        ("FP64", "fp64_contents", [0.1, 0.2, 0.3, 0.4], np.float64),
        ("BOOL", "bool_contents", [True, False, False, True], np.bool_),
    ],
)
def test_typed_contents(datatype, field, values, dtype):
    request = decode(typed_request(datatype, [2, 2], field, values))
    tensor = request.inputs["X"]
    assert tensor.data.dtype == dtype
    np.testing.assert_array_equal(tensor.data, np.array(values, dtype=dtype).reshape(2, 2))


def test_typed_bytes_contents():
    request = decode(typed_request("BYTES", [2], "bytes_contents", [b"a", b"bc"]))
    assert request.inputs["X"].data.tolist() == [b"a", b"bc"]


@pytest.mark.parametrize(
    "message,fragment",
    [
        (
            typed_request("INT8", [2], "int_contents", [1, 200]),
            "value out of range for input 'X': element 1 is 200, expected INT8 in [-128, 127]",
        ),
        (
            typed_request("INT32", [3], "int_contents", [1, 2]),
            "unexpected number of elements for input 'X': expected 3 for shape [3], got 2",
        ),
        (
            typed_request("INT32", [2], "fp32_contents", [1.0, 2.0]),
            "got fp32_contents for datatype INT32, expected int_contents",
        ),
        (
            typed_request("FP16", [1], "fp32_contents", [1.0]),
            "input 'X' has datatype FP16, which has no typed contents field",
        ),
    ],
)
def test_bad_typed_contents(message, fragment):
    error = error_of(lambda: decode(message))
    assert isinstance(error, InvalidArgument)
    assert fragment in error.message


# ------------------------------------------------------------- malformed requests


def raw_message(*specs, raws=()) -> triton_pb.ModelInferRequest:
    message = triton_pb.ModelInferRequest(model_name="simple")
    for name, datatype, shape in specs:
        message.inputs.add(name=name, datatype=datatype, shape=shape)
    message.raw_input_contents.extend(raws)
    return message


@pytest.mark.parametrize(
    "message,fragment",
    [
        (raw_message(("X", "INT31", [1])), "invalid datatype for input 'X': expected one of"),
        (
            raw_message(("X", "INT32", [1, -1]), raws=[b""]),
            "invalid shape for input 'X': expected an array of non-negative integers, got [1, -1]",
        ),
        (
            raw_message(("X", "INT32", [1]), ("X", "INT32", [1]), raws=[b"\0" * 4] * 2),
            "input 'X' already exists in request",
        ),
        (
            raw_message(("X", "INT32", [1]), raws=[b"\0" * 4, b"\0" * 4]),
            "unexpected raw_input_contents for model 'simple': 2 entries for 1 inputs",
        ),
        (
            raw_message(("X", "INT32", [1]), ("Y", "INT32", [1]), raws=[b"\0" * 4]),
            "missing data for input 'Y' for model 'simple'",
        ),
        (
            raw_message(("X", "INT32", [1])),
            "missing data for input 'X' for model 'simple': expected raw_input_contents",
        ),
        (  # numpy: "array is too big", even with a 0 dimension; was INTERNAL
            raw_message(("X", "FP32", [0, 2**62]), raws=[b""]),
            "invalid shape for input 'X': [0,4611686018427387904] is too large",
        ),
        (
            raw_message(("X", "BYTES", [2]), raws=[b"\x01\0\0\0a"]),
            "unexpected number of BYTES elements for input 'X' with shape [2]: expected 2, got 1",
        ),
        (
            raw_message(("X", "BYTES", [1]), raws=[b"\x09\0\0\0a"]),
            "malformed BYTES data for input 'X' with shape [1]",
        ),
    ],
)
def test_malformed_requests(message, fragment):
    error = error_of(lambda: decode(message))
    assert isinstance(error, InvalidArgument)
    assert fragment in error.message, error.message


def test_contents_and_raw_together_rejected():
    message = raw_message(("X", "INT32", [1]), raws=[b"\0" * 4])
    message.inputs[0].contents.int_contents.append(1)
    error = error_of(lambda: decode(message))
    assert "contents field must not be specified when using raw_input_contents" in error.message


def test_invalid_version_and_garbage_bytes():
    message = raw_message(("X", "INT32", [1]), raws=[b"\0" * 4])
    message.model_version = "v1"
    assert error_of(lambda: decode(message)).message == (
        "failed to get model version from specified version string 'v1' (details: stol), "
        "version should be an integral value > 0"
    )
    error = error_of(lambda: grpc_codec.decode_infer_request(b"\xff\xff\xff"))
    assert isinstance(error, InvalidArgument)
    assert "failed to parse the ModelInferRequest message" in error.message


def test_raw_byte_size_error_is_the_same_as_over_http():
    """The same mistake gets the same message on both protocols."""
    message = raw_message(("INPUT0", "INT32", [1, 16]), raws=[b"\0" * 60])
    grpc_error = error_of(lambda: decode(message))
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "INT32",
                    "shape": [1, 16],
                    "parameters": {"binary_data_size": 60},
                }
            ]
        }
    ).encode()
    http_error = error_of(
        lambda: http_codec.decode_infer_request(header + b"\0" * 60, len(header), "simple", None)
    )
    assert grpc_error.message == http_error.message
    assert grpc_error.message == (
        # core src/infer_request.cc ValidateRequestInputs' words (qa/L0_shared_memory)
        "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, "
        "got 60 (shape [1,16] of INT32)"
    )


def test_shared_memory_without_client_shm_is_unimplemented_as_over_http():
    client_input = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    client_input.set_shared_memory("region0", 64)
    message = client_request("simple", [client_input])
    error = error_of(lambda: decode(message))
    assert isinstance(error, Unimplemented)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "INT32",
                    "shape": [1, 16],
                    "parameters": {
                        "shared_memory_region": "region0",
                        "shared_memory_byte_size": 64,
                    },
                }
            ]
        }
    ).encode()
    http_error = error_of(lambda: http_codec.decode_infer_request(header, None, "simple", None))
    assert error.message == http_error.message


# ------------------------------------------------------------------------ responses


def response_of(*tensors: Tensor, **parameters) -> InferenceResponse:
    return InferenceResponse("simple", "1", outputs=list(tensors), parameters=parameters)


def client_result(chunks) -> grpcclient.InferResult:
    wire = b"".join(bytes(c) for c in chunks)
    return grpcclient.InferResult(triton_pb.ModelInferResponse.FromString(wire))


def test_response_as_tritonclient_reads_it():
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    names = np.array([[b"x", b"", "ü".encode()]], dtype=np.object_)
    request = InferenceRequest("simple", id="req-9")
    response = response_of(
        Tensor("OUTPUT0", "INT32", a),
        Tensor("NAMES", "BYTES", names),
        Tensor("EMPTY", "FP32", np.zeros((0, 4), np.float32)),
        note="hi",
        big=2**64 - 1,
        count=-5,
        ratio=0.25,
        ok=True,
    )
    result = client_result(grpc_codec.encode_infer_response(response, request))
    message = result.get_response()
    assert message.model_name == "simple" and message.model_version == "1"
    assert message.id == "req-9"  # echoed from the request
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a)
    assert result.as_numpy("NAMES").tolist() == [[b"x", b"", "ü".encode()]]
    assert result.as_numpy("EMPTY").shape == (0, 4)
    params = message.parameters
    assert params["note"].string_param == "hi"
    assert params["big"].uint64_param == 2**64 - 1
    assert params["count"].int64_param == -5
    assert params["ratio"].double_param == 0.25
    assert params["ok"].bool_param is True
    assert "triton_final_response" not in params


def test_large_output_is_not_copied_into_the_message():
    data = np.random.default_rng(0).random((1, 1_000_000), dtype=np.float32)
    chunks = grpc_codec.encode_infer_response(
        response_of(Tensor("OUTPUT0", "FP32", data)), InferenceRequest("identity_fp32")
    )
    assert isinstance(chunks[-1], memoryview) and chunks[-1].nbytes == 4_000_000
    assert np.shares_memory(np.frombuffer(chunks[-1], np.uint8), data)
    np.testing.assert_array_equal(client_result(chunks).as_numpy("OUTPUT0"), data)


def test_non_contiguous_and_non_native_outputs():
    data = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    chunks = grpc_codec.encode_infer_response(
        response_of(Tensor("T", "INT32", data)), InferenceRequest("m")
    )
    out = client_result(chunks).as_numpy("T")
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, data)


def test_stream_response_and_final_flag():
    request = InferenceRequest("simple", 1, id="s1")
    response = response_of(Tensor("OUTPUT0", "INT32", np.ones((1, 2), np.int32)))
    inner = grpc_codec.encode_infer_response(response, request, final=True)
    wire = b"".join(bytes(c) for c in grpc_codec.encode_stream_response(inner))
    message = triton_pb.ModelStreamInferResponse.FromString(wire)
    assert message.error_message == ""
    assert message.infer_response.id == "s1"
    assert message.infer_response.parameters["triton_final_response"].bool_param is True
    result = grpcclient.InferResult(message.infer_response)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.ones((1, 2)))

    empty = grpc_codec.encode_empty_final_response(request)
    wire = b"".join(bytes(c) for c in grpc_codec.encode_stream_response(empty))
    message = triton_pb.ModelStreamInferResponse.FromString(wire)
    assert message.infer_response.id == "s1"
    assert message.infer_response.model_version == "1"
    assert message.infer_response.parameters["triton_final_response"].bool_param is True
    assert len(message.infer_response.outputs) == 0


def test_stream_error_names_the_request():
    request = InferenceRequest("simple", None, id="bad-1")
    message = triton_pb.ModelStreamInferResponse.FromString(
        grpc_codec.encode_stream_error("it broke", request)
    )
    assert message.error_message == "it broke"
    assert message.infer_response.id == "bad-1"
    assert message.infer_response.model_name == "simple"
    # The error ends the request (Triton's stream handler flags it too).
    assert message.infer_response.parameters["triton_final_response"].bool_param is True


def test_the_grpc_codec_does_not_import_the_http_codec():
    """What both protocols share (BYTES wire format, shared-memory parameters,
    model versions) lives in trionserve.core (issue 16 item 3)."""
    import subprocess
    import sys

    code = (
        "import sys, trionserve.protocol.grpc.codec\n"
        "print([m for m in sys.modules if m.startswith('trionserve.protocol.http')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_large_request_raw_contents_are_writable_views_of_the_message():
    """In a large message the raw contents are cut out of the wire bytes (no copy
    by protobuf): each input views the received buffer, writable as it is; the
    decoded request is the one protobuf's own parse gives, whatever the order of
    the fields on the wire."""
    a = np.random.default_rng(0).random((1, 150_528), dtype=np.float32)  # 602 KB
    b = np.arange(16, dtype=np.int32).reshape(1, 16)
    message = client_request(
        "m",
        [infer_input("A", a, "FP32"), infer_input("B", b, "INT32")],
        request_id="big",
        parameters={"key": "value"},
    )
    # Raw contents first, then the rest, as a hand-made client might order them.
    raws = triton_pb.ModelInferRequest()
    raws.raw_input_contents.extend(message.raw_input_contents)
    rest = triton_pb.ModelInferRequest()
    rest.CopyFrom(message)
    del rest.raw_input_contents[:]
    for wire in (message.SerializeToString(), raws.SerializeToString() + rest.SerializeToString()):
        received = np.frombuffer(wire, np.uint8).copy().data  # writable, as the transport's
        request = grpc_codec.decode_infer_request(received)
        expected = grpc_codec.decode_infer_request(bytes(wire))
        assert request.id == expected.id == "big"
        assert request.parameters == expected.parameters
        np.testing.assert_array_equal(request.inputs["A"].data, a)
        np.testing.assert_array_equal(request.inputs["B"].data, b)
        data = request.inputs["A"].data
        assert np.shares_memory(data, np.frombuffer(received, np.uint8))
        assert data.flags.writeable
    # Bytes stay read-only views; a truncated large message is the same error as ever.
    assert (
        not grpc_codec.decode_infer_request(message.SerializeToString())
        .inputs["A"]
        .data.flags.writeable
    )
    error = error_of(lambda: grpc_codec.decode_infer_request(message.SerializeToString()[:-3]))
    assert "failed to parse the ModelInferRequest message" in error.message
