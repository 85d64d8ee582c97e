"""Unit tests of the HTTP/REST codec against the bytes the real tritonclient makes.

Request bodies come from ``tritonclient.http.InferenceServerClient.generate_request_body``
and response bodies are read back with ``parse_response_body``, so these tests hold
the codec to the exact wire format of the official client.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient

from trionserve.core.errors import InvalidArgument, Status, TritonError
from trionserve.core.inference import (
    InferenceRequest,
    InferenceResponse,
    RequestedOutput,
    Tensor,
)
from trionserve.protocol.http.codec import (
    decode_infer_request,
    deserialize_bytes_tensor,
    encode_error,
    encode_infer_response,
    parse_model_version,
    serialize_bytes_tensor,
)

Client = httpclient.InferenceServerClient


def make_input(name, array, datatype, binary=True):
    inp = httpclient.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array, binary_data=binary)
    return inp


def client_body(inputs, **kwargs):
    body, header_length = Client.generate_request_body(inputs, **kwargs)
    return body, header_length


def decode(body, header_length=None, model="m", version=None):
    request, _ = decode_infer_request(body, header_length, model, version)
    return request


def json_body(doc) -> bytes:
    return json.dumps(doc).encode()


def join(chunks) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def parse(chunks, header_length):
    return Client.parse_response_body(
        join(chunks), verbose=False, header_length=header_length, content_encoding=None
    )


def expect_error(status, *fragments):
    """Expect a TritonError with ``status`` whose message holds every fragment."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(TritonError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            err = self.info.value
            assert err.status is status, err
            for fragment in fragments:
                assert fragment in err.message, (fragment, err.message)
            return handled

    return _Check()


INVALID = Status.INVALID_ARGUMENT

# ------------------------------------------------------------------ decode: happy


def test_int32_binary_is_a_view_of_the_body():
    array = np.arange(16, dtype=np.int32).reshape(1, 16)
    body, header_length = client_body([make_input("INPUT0", array, "INT32")])
    assert header_length is not None

    request, binary_output = decode_infer_request(body, header_length, "simple", 3)

    assert request.model_name == "simple" and request.model_version == 3
    tensor = request.inputs["INPUT0"]
    assert tensor.datatype == "INT32"
    assert tensor.data.dtype == np.int32 and tensor.shape == (1, 16)
    np.testing.assert_array_equal(tensor.data, array)
    # No copy: the array views the body's bytes.
    assert np.shares_memory(tensor.data, np.frombuffer(body, dtype=np.uint8))
    # The client asked for no outputs, so it asks for binary outputs; how the
    # response travels is not a parameter the model sees.
    assert request.requested_outputs is None
    assert binary_output is True
    assert request.parameters == {}


def test_fp32_json():
    array = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    body, header_length = client_body([make_input("X", array, "FP32", binary=False)])
    assert header_length is None

    tensor = decode(body).inputs["X"]

    assert tensor.data.dtype == np.float32 and tensor.shape == (2, 3)
    np.testing.assert_array_equal(tensor.data, array)


@pytest.mark.parametrize("binary", [True, False])
def test_bytes(binary):
    array = np.array(
        [[b"hello", b""], ["h\u00e9llo w\u00f6rld".encode(), b"x" * 300]],
        dtype=np.object_,
    )
    body, header_length = client_body([make_input("S", array, "BYTES", binary)])
    assert (header_length is not None) == binary

    tensor = decode(body, header_length).inputs["S"]

    assert tensor.datatype == "BYTES"
    assert tensor.data.dtype == np.object_ and tensor.shape == (2, 2)
    assert tensor.data.tolist() == array.tolist()
    assert all(type(x) is bytes for x in tensor.data.flat)


@pytest.mark.parametrize("binary", [True, False])
def test_bool(binary):
    array = np.array([[True, False, True]])
    body, header_length = client_body([make_input("B", array, "BOOL", binary)])
    tensor = decode(body, header_length).inputs["B"]
    assert tensor.data.dtype == np.bool_
    np.testing.assert_array_equal(tensor.data, array)


@pytest.mark.parametrize("binary", [True, False])
def test_fp16(binary):
    array = np.array([0.5, -2.25, 65504.0, 1e-3], dtype=np.float16)
    body, header_length = client_body([make_input("H", array, "FP16", binary)])
    tensor = decode(body, header_length).inputs["H"]
    assert tensor.data.dtype == np.float16
    np.testing.assert_array_equal(tensor.data, array)


NUMERIC = [
    ("UINT8", np.uint8),
    ("UINT16", np.uint16),
    ("UINT32", np.uint32),
    ("UINT64", np.uint64),
    ("INT8", np.int8),
    ("INT16", np.int16),
    ("INT32", np.int32),
    ("INT64", np.int64),
    ("FP32", np.float32),
    ("FP64", np.float64),
]


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("datatype,np_type", NUMERIC)
def test_every_numeric_datatype_at_its_limits(datatype, np_type, binary):
    if np.dtype(np_type).kind == "f":
        info = np.finfo(np_type)
    else:
        info = np.iinfo(np_type)
    array = np.array([info.min, 0, 1, info.max], dtype=np_type).reshape(2, 2)
    body, header_length = client_body([make_input("T", array, datatype, binary)])
    tensor = decode(body, header_length).inputs["T"]
    assert tensor.data.dtype == np_type
    np.testing.assert_array_equal(tensor.data, array)


def test_bf16_binary_arrives_as_uint16_bits():
    array = np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16)
    body, header_length = client_body([make_input("BF", array, "BF16")])
    tensor = decode(body, header_length).inputs["BF"]
    assert tensor.datatype == "BF16" and tensor.data.dtype == np.uint16
    np.testing.assert_array_equal(tensor.data, array.view(np.uint16))


def test_multiple_inputs_mixed_binary_and_json_in_order():
    a = np.arange(4, dtype=np.int64)
    b = np.array([1.5, 2.5], dtype=np.float64)
    c = np.array([b"abc", b"de"], dtype=np.object_)
    d = np.array([7, 8, 9], dtype=np.uint8)
    body, header_length = client_body(
        [
            make_input("A", a, "INT64"),
            make_input("B", b, "FP64", binary=False),
            make_input("C", c, "BYTES"),
            make_input("D", d, "UINT8"),
        ]
    )
    inputs = decode(body, header_length).inputs
    assert list(inputs) == ["A", "B", "C", "D"]
    np.testing.assert_array_equal(inputs["A"].data, a)
    np.testing.assert_array_equal(inputs["B"].data, b)
    assert inputs["C"].data.tolist() == [b"abc", b"de"]
    np.testing.assert_array_equal(inputs["D"].data, d)


def test_requested_outputs_in_request_order():
    array = np.zeros(2, dtype=np.float32)
    outputs = [
        httpclient.InferRequestedOutput("OUT1", binary_data=False),
        httpclient.InferRequestedOutput("OUT0", binary_data=True, class_count=3),
    ]
    body, header_length = client_body(
        [make_input("X", array, "FP32")], outputs=outputs, request_id="req-7"
    )
    request = decode(body, header_length)
    assert request.id == "req-7"
    assert [o.name for o in request.requested_outputs] == ["OUT1", "OUT0"]
    assert request.requested_outputs[0].parameters == {"binary_data": False}
    assert request.requested_outputs[1].parameters == {
        "binary_data": True,
        "classification": 3,
    }
    assert "binary_data_output" not in request.parameters


def test_requested_output_without_parameters():
    doc = {
        "inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}],
        "outputs": [{"name": "Y"}],
    }
    request = decode(json_body(doc))
    assert request.requested_outputs == [RequestedOutput("Y", {})]


@pytest.mark.parametrize("sequence_id", [42, "corr-abc"])
def test_sequence_priority_timeout_and_custom_parameters(sequence_id):
    array = np.zeros(1, dtype=np.int32)
    body, header_length = client_body(
        [make_input("X", array, "INT32")],
        sequence_id=sequence_id,
        sequence_start=True,
        sequence_end=False,
        priority=2,
        timeout=1500,
        parameters={"my_str": "v", "my_int": 5, "my_bool": False, "my_float": 0.5},
    )
    request = decode(body, header_length)
    assert request.sequence_id == sequence_id
    assert request.sequence_start is True and request.sequence_end is False
    assert request.priority == 2
    assert request.timeout_us == 1500
    assert request.parameters == {
        "my_str": "v",
        "my_int": 5,
        "my_bool": False,
        "my_float": 0.5,
    }


def test_sequence_end_and_defaults():
    doc = {
        "parameters": {"sequence_id": 9, "sequence_end": True},
        "inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}],
    }
    request = decode(json_body(doc))
    assert request.sequence_id == 9 and request.sequence_end is True
    assert request.sequence_start is False
    assert request.priority == 0 and request.timeout_us == 0
    assert request.parameters == {}
    assert request.id == ""


def test_nested_json_data_is_flattened():
    doc = {
        "inputs": [
            {
                "name": "X",
                "shape": [2, 2, 2],
                "datatype": "INT16",
                "data": [[[1, 2], [3, 4]], [[5, 6], [7, 8]]],
            },
            {"name": "R", "shape": [3], "datatype": "FP32", "data": [[1, 2], [3.5]]},
            {"name": "S", "shape": [2, 1], "datatype": "BYTES", "data": [["a"], ["b"]]},
        ]
    }
    inputs = decode(json_body(doc)).inputs
    np.testing.assert_array_equal(
        inputs["X"].data, np.arange(1, 9, dtype=np.int16).reshape(2, 2, 2)
    )
    assert inputs["X"].data.dtype == np.int16
    np.testing.assert_array_equal(inputs["R"].data, np.array([1, 2, 3.5], np.float32))
    assert inputs["S"].data.tolist() == [[b"a"], [b"b"]]


def test_json_edge_values():
    doc = {
        "inputs": [
            {"name": "E", "shape": [0, 3], "datatype": "INT32", "data": []},
            {"name": "U", "shape": [2], "datatype": "UINT64", "data": [2**64 - 1, 0]},
            {"name": "M", "shape": [2], "datatype": "UINT64", "data": [2**63, 1]},
            {"name": "F", "shape": [2], "datatype": "FP32", "data": [1, 2.5]},
            {"name": "N", "shape": [], "datatype": "INT8", "data": [-128]},
        ]
    }
    inputs = decode(json_body(doc)).inputs
    assert inputs["E"].shape == (0, 3) and inputs["E"].data.dtype == np.int32
    assert inputs["U"].data.tolist() == [2**64 - 1, 0]
    assert inputs["M"].data.tolist() == [2**63, 1]
    assert inputs["F"].data.tolist() == [1.0, 2.5]
    assert inputs["N"].shape == () and inputs["N"].data.item() == -128


def test_zero_element_binary_input():
    array = np.zeros((0, 4), dtype=np.float32)
    body, header_length = client_body(
        [make_input("Z", array, "FP32"), make_input("X", np.ones(2, np.int32), "INT32")]
    )
    inputs = decode(body, header_length).inputs
    assert inputs["Z"].shape == (0, 4) and inputs["Z"].data.dtype == np.float32
    np.testing.assert_array_equal(inputs["X"].data, [1, 1])


def test_bytearray_and_memoryview_bodies():
    array = np.arange(3, dtype=np.int32)
    body, header_length = client_body([make_input("X", array, "INT32")])
    for variant in (bytearray(body), memoryview(body)):
        np.testing.assert_array_equal(decode(variant, header_length).inputs["X"].data, array)


# ----------------------------------------------------------------- decode: errors


def test_header_length_negative():
    with expect_error(INVALID, "Inference-Header-Content-Length", "-1"):
        decode(b"{}", -1)


def test_header_length_larger_than_body():
    with expect_error(INVALID, "Inference-Header-Content-Length", "10", "2 bytes"):
        decode(b"{}", 10)


def test_malformed_json():
    with expect_error(INVALID, "failed to parse the request JSON"):
        decode(b'{"inputs": [')


def test_json_not_an_object():
    with expect_error(INVALID, "failed to parse the request JSON", "an array"):
        decode(b"[1, 2]")


def test_invalid_utf8_json():
    with expect_error(INVALID, "failed to parse the request JSON"):
        decode(b'{"id": "\xff\xfe"}')


def test_missing_inputs():
    with expect_error(INVALID, "missing 'inputs'"):
        decode(json_body({"id": "x"}))


def test_inputs_not_a_list():
    with expect_error(INVALID, "'inputs'", "expected an array", "an object"):
        decode(json_body({"inputs": {}}))


def test_id_not_a_string():
    with expect_error(INVALID, "'id'", "expected a string", "an integer"):
        decode(json_body({"id": 5, "inputs": []}))


def _one_input(**fields):
    spec = {"name": "INPUT0", "shape": [2], "datatype": "INT32", "data": [1, 2]}
    spec.update(fields)
    return json_body({"inputs": [spec]})


def test_unknown_datatype():
    with expect_error(INVALID, "input 'INPUT0'", "FLOAT32", "INT32"):
        decode(_one_input(datatype="FLOAT32"))


def test_input_without_name():
    with expect_error(INVALID, "index 0", "'name'"):
        decode(json_body({"inputs": [{"shape": [1], "datatype": "INT32"}]}))


def test_duplicate_input_names():
    spec = {"name": "A", "shape": [1], "datatype": "INT32", "data": [1]}
    with expect_error(INVALID, "input 'A' already exists in request"):
        decode(json_body({"inputs": [spec, spec]}))


@pytest.mark.parametrize("shape", [[1, -2], [1.5], "2", [True], None])
def test_invalid_shape(shape):
    with expect_error(INVALID, "invalid shape for input 'INPUT0'", json.dumps(shape)):
        decode(_one_input(shape=shape))


def test_binary_byte_size_mismatch():
    header = json_body(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 16],
                    "datatype": "INT32",
                    "parameters": {"binary_data_size": 32},
                }
            ]
        }
    )
    body = header + bytes(32)
    with expect_error(
        INVALID,
        "input byte size mismatch for input 'INPUT0' for model 'm'. Expected 64, "
        "got 32 (shape [1,16] of INT32)",
    ):
        decode(body, len(header))


def test_binary_data_missing_from_body():
    array = np.arange(16, dtype=np.int32)
    body, header_length = client_body([make_input("INPUT0", array, "INT32")])
    with expect_error(INVALID, "missing binary data for input 'INPUT0'", "64", "60"):
        decode(body[:-4], header_length)


def test_binary_data_without_header_length():
    header = json_body(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1],
                    "datatype": "INT32",
                    "parameters": {"binary_data_size": 4},
                }
            ]
        }
    )
    with expect_error(INVALID, "input 'INPUT0'", "Inference-Header-Content-Length"):
        decode(header, None)


def test_leftover_binary_data():
    array = np.arange(4, dtype=np.int32)
    body, header_length = client_body([make_input("INPUT0", array, "INT32")])
    with expect_error(INVALID, "3 bytes after the last binary input"):
        decode(body + b"xyz", header_length)


def test_leftover_bytes_after_json_only_header():
    body = _one_input()
    with expect_error(INVALID, "5 bytes"):
        decode(body + b"extra", len(body))


def test_invalid_binary_data_size():
    body = _one_input(data=None, parameters={"binary_data_size": -4})
    body = body.replace(b'"data":null,', b"").replace(b'"data": null, ', b"")
    assert b'"data"' not in body
    with expect_error(INVALID, "'binary_data_size' for input 'INPUT0'", "-4"):
        decode(body)


def test_both_data_and_binary_data_size():
    header = _one_input(parameters={"binary_data_size": 8})
    with expect_error(
        INVALID, "Input 'INPUT0' must set only one of", "But set 'data' 'binary_data_size'"
    ):
        decode(header + bytes(8), len(header))


def _bytes_body(payload: bytes, shape=(2,)):
    header = json_body(
        {
            "inputs": [
                {
                    "name": "S",
                    "shape": list(shape),
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(payload)},
                }
            ]
        }
    )
    return header + payload, len(header)


def test_bytes_binary_truncated_length_prefix():
    body, hl = _bytes_body(b"\x01\x00\x00\x00a\x02\x00")
    with expect_error(INVALID, "input 'S'", "4-byte length prefix", "got 2 bytes"):
        decode(body, hl)


def test_bytes_binary_element_overruns():
    body, hl = _bytes_body(b"\x01\x00\x00\x00a\x09\x00\x00\x00abc")
    with expect_error(INVALID, "input 'S'", "element 1 has length 9", "3 bytes"):
        decode(body, hl)


def test_bytes_binary_element_count_mismatch():
    body, hl = _bytes_body(b"\x01\x00\x00\x00a", shape=(1, 2))
    with expect_error(
        INVALID, "BYTES elements for input 'S' with shape [1,2]", "expected 2", "got 1"
    ):
        decode(body, hl)


def test_json_element_count_mismatch():
    with expect_error(
        INVALID, "number of elements for input 'INPUT0'", "expected 2", "[2]", "got 3"
    ):
        decode(_one_input(data=[1, 2, 3]))


def test_bytes_json_element_count_mismatch():
    with expect_error(INVALID, "input 'INPUT0'", "expected 2", "got 1"):
        decode(_one_input(datatype="BYTES", data=["a"]))


@pytest.mark.parametrize(
    "datatype,value",
    [
        ("INT8", 128),
        ("INT8", -129),
        ("UINT8", -1),
        ("UINT8", 256),
        ("INT32", 2**31),
        ("UINT32", -1),
        ("INT64", 2**63),
        ("UINT64", 2**64),
        ("UINT64", -1),
    ],
)
def test_out_of_range_integers(datatype, value):
    with expect_error(INVALID, "out of range for input 'INPUT0'", str(value), datatype):
        decode(_one_input(datatype=datatype, data=[0, value]))


# A valid first element per datatype, so the bad one is element 1.
FIRST = {"BOOL": True, "BYTES": "a"}.get


@pytest.mark.parametrize(
    "datatype,value,expected",
    [
        ("INT32", 1.5, "integers"),
        ("INT32", "1", "integers"),
        ("INT32", True, "integers"),
        ("FP32", "1.0", "numbers"),
        ("FP32", None, "numbers"),
        ("FP16", False, "numbers"),
        ("BOOL", 1, "true or false"),
        ("BYTES", 3, "strings"),
        ("INT64", {"a": 1}, "integers"),
    ],
)
def test_wrong_json_element_type(datatype, value, expected):
    with expect_error(
        INVALID, "input 'INPUT0'", datatype, expected, json.dumps(value), "element 1"
    ):
        decode(_one_input(datatype=datatype, data=[FIRST(datatype, 0), value]))


def test_bf16_json_is_rejected():
    with expect_error(INVALID, "input 'INPUT0'", "BF16", "binary tensor extension"):
        decode(_one_input(datatype="BF16", data=[1.0, 2.0]))


def test_missing_data():
    spec = {"name": "INPUT0", "shape": [2], "datatype": "INT32"}
    with expect_error(INVALID, "missing data for input 'INPUT0'"):
        decode(json_body({"inputs": [spec]}))


def test_data_not_a_list():
    with expect_error(INVALID, "'data' for input 'INPUT0'", "expected an array"):
        decode(_one_input(data=5))


@pytest.mark.parametrize(
    "key,value",
    [
        ("sequence_id", -1),
        ("sequence_id", 1.5),
        ("sequence_id", True),
        ("sequence_id", 2**64),
        ("sequence_start", 1),
        ("sequence_end", "true"),
        ("priority", -1),
        ("priority", "high"),
        ("timeout", 1.5),
        ("timeout", -5),
        ("binary_data_output", 1),
    ],
)
def test_reserved_parameter_with_wrong_type(key, value):
    doc = {"parameters": {key: value}, "inputs": []}
    with expect_error(INVALID, f"parameter '{key}'", json.dumps(value)):
        decode(json_body(doc))


@pytest.mark.parametrize("key", ["triton_x", "triton_enable_empty_final_response"])
def test_triton_parameter_keys_are_reserved(key):
    doc = {"parameters": {key: True}, "inputs": []}
    with expect_error(INVALID, "parameter keys starting with 'triton_' are reserved"):
        decode(json_body(doc))


@pytest.mark.parametrize("value", [{"a": 1}, [1, 2], None])
def test_custom_parameter_with_unsupported_type(value):
    doc = {"parameters": {"mine": value}, "inputs": []}
    with expect_error(INVALID, "parameter 'mine'"):
        decode(json_body(doc))


def test_parameters_not_an_object():
    with expect_error(INVALID, "'parameters'", "expected an object"):
        decode(json_body({"parameters": [1], "inputs": []}))


def test_shared_memory_without_manager_is_unimplemented():
    inp = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    inp.set_shared_memory("region0", 64)
    body, header_length = client_body([inp])
    with expect_error(Status.UNIMPLEMENTED, "shared memory is not enabled", "INPUT0"):
        decode(body, header_length)
    out = httpclient.InferRequestedOutput("OUT0")
    out.set_shared_memory("region1", 64)
    body, header_length = client_body(
        [make_input("X", np.zeros(1, np.int32), "INT32")], outputs=[out]
    )
    with expect_error(Status.UNIMPLEMENTED, "shared memory is not enabled", "OUT0"):
        decode(body, header_length)


@pytest.fixture
def shm_region():
    """A real POSIX shared memory region made with tritonclient's own utilities."""
    import tritonclient.utils.shared_memory as shm

    key = f"/trionserve_codec_{os.getpid()}"
    handle = shm.create_shared_memory_region("codec", key, 256)
    try:
        yield shm, handle, key
    finally:
        shm.destroy_shared_memory_region(handle)


def test_shared_memory_input_and_output(shm_region):
    from trionserve.core.shared_memory import SystemSharedMemory

    shm, handle, key = shm_region
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    shm.set_shared_memory_region(handle, [data])
    manager = SystemSharedMemory()
    manager.register("region", key, 0, 256)

    inp = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    inp.set_shared_memory("region", 64)
    out = httpclient.InferRequestedOutput("OUT0")
    out.set_shared_memory("region", 64, offset=128)
    body, header_length = client_body([inp], outputs=[out])
    request, _ = decode_infer_request(body, header_length, "m", None, manager)
    np.testing.assert_array_equal(request.inputs["INPUT0"].data, data)

    response = InferenceResponse("m", "1", outputs=[Tensor("OUT0", "INT32", data * 3)])
    chunks, json_length = encode_infer_response(response, request, manager)
    assert json_length is None  # no binary chunks: the output went to shared memory
    doc = json.loads(b"".join(chunks))
    # As Triton: no data and no parameters (clients would read binary_data_size).
    assert doc["outputs"][0] == {"name": "OUT0", "datatype": "INT32", "shape": [1, 16]}
    written = shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128)
    np.testing.assert_array_equal(written, data * 3)


def test_shared_memory_bounds_are_checked(shm_region):
    from trionserve.core.shared_memory import SystemSharedMemory

    _, _, key = shm_region
    manager = SystemSharedMemory()
    manager.register("small", key, 0, 32)
    inp = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    inp.set_shared_memory("small", 64)
    body, header_length = client_body([inp])
    with expect_error(INVALID, "out of bounds", "'small'", "INPUT0"):
        decode_infer_request(body, header_length, "m", None, manager)
    inp = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    inp.set_shared_memory("nope", 64)
    body, header_length = client_body([inp])
    with expect_error(INVALID, "'nope' is not registered"):
        decode_infer_request(body, header_length, "m", None, manager)


def test_duplicate_output_names():
    doc = {"inputs": [], "outputs": [{"name": "Y"}, {"name": "Y"}]}
    with expect_error(INVALID, "output 'Y' already exists in request"):
        decode(json_body(doc))


def test_output_binary_data_not_bool():
    doc = {"inputs": [], "outputs": [{"name": "Y", "parameters": {"binary_data": 1}}]}
    with expect_error(INVALID, "'binary_data' for output 'Y'", "boolean"):
        decode(json_body(doc))


def test_output_classification_not_int():
    doc = {
        "inputs": [],
        "outputs": [{"name": "Y", "parameters": {"classification": "3"}}],
    }
    with expect_error(INVALID, "'classification' for output 'Y'"):
        decode(json_body(doc))


# ----------------------------------------------------------------------- encoding


def as_bytes(array):
    """tritonclient returns JSON BYTES outputs as str and binary ones as bytes."""
    return [x.encode() if isinstance(x, str) else x for x in array.reshape(-1).tolist()]


def _request(outputs=None, id=""):
    return InferenceRequest("m", None, id=id, requested_outputs=outputs)


def _response(*tensors, id="", parameters=None):
    return InferenceResponse("m", "1", id=id, outputs=list(tensors), parameters=parameters or {})


SAMPLE = {
    "F": Tensor("F", "FP32", np.arange(6, dtype=np.float32).reshape(2, 3) / 3),
    "I": Tensor("I", "INT64", np.array([[-(2**62), 2**62]], dtype=np.int64)),
    "B": Tensor("B", "BOOL", np.array([True, False, True])),
    "H": Tensor("H", "FP16", np.array([0.5, -1.25], dtype=np.float16)),
    "S": Tensor("S", "BYTES", np.array([b"abc", "z\u00fcrich".encode(), b""], dtype=np.object_)),
    "U": Tensor("U", "UINT8", np.array([[0, 255]], dtype=np.uint8)),
}


@pytest.mark.parametrize("binary", [False, True])
def test_response_roundtrip_through_tritonclient(binary):
    chunks, header_length = encode_infer_response(
        _response(*SAMPLE.values()), _request(), binary_output=binary
    )
    if binary:
        assert header_length == len(chunks[0])
    else:
        assert header_length is None and len(chunks) == 1
    result = parse(chunks, header_length)
    for name, tensor in SAMPLE.items():
        got = result.as_numpy(name)
        assert got.shape == tensor.data.shape, name
        if tensor.datatype == "BYTES":
            assert as_bytes(got) == tensor.data.tolist()
        else:
            assert got.dtype == tensor.data.dtype, name
            np.testing.assert_array_equal(got, tensor.data)
    response = result.get_response()
    assert response["model_name"] == "m" and response["model_version"] == "1"
    assert "id" not in response and "parameters" not in response


def test_binary_chunks_are_views_of_output_arrays():
    data = np.arange(8, dtype=np.float32)
    chunks, header_length = encode_infer_response(
        _response(Tensor("F", "FP32", data)), _request(), binary_output=True
    )
    assert len(chunks) == 2 and isinstance(chunks[1], memoryview)
    assert np.shares_memory(np.frombuffer(chunks[1], dtype=np.uint8), data)
    header = json.loads(chunks[0])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 32}
    assert "data" not in header["outputs"][0]


def test_per_output_binary_data_overrides_request_default():
    outputs = [
        RequestedOutput("F", {"binary_data": False}),
        RequestedOutput("I", {"binary_data": True}),
        RequestedOutput("S", {}),
    ]
    tensors = [SAMPLE["F"], SAMPLE["I"], SAMPLE["S"]]
    for default in (None, True):
        chunks, header_length = encode_infer_response(
            _response(*tensors), _request(outputs=outputs), binary_output=bool(default)
        )
        header = json.loads(chunks[0])["outputs"]
        assert "data" in header[0]
        assert header[1]["parameters"]["binary_data_size"] == 16
        assert ("data" in header[2]) == (default is None)
        assert header_length == len(chunks[0])
        result = parse(chunks, header_length)
        np.testing.assert_array_equal(result.as_numpy("F"), SAMPLE["F"].data)
        np.testing.assert_array_equal(result.as_numpy("I"), SAMPLE["I"].data)
        assert as_bytes(result.as_numpy("S")) == SAMPLE["S"].data.tolist()


def test_binary_data_false_everywhere_gives_json_body():
    outputs = [RequestedOutput("F", {"binary_data": False})]
    chunks, header_length = encode_infer_response(
        _response(SAMPLE["F"]), _request(outputs=outputs), binary_output=True
    )
    assert header_length is None
    assert json.loads(join(chunks))["outputs"][0]["data"] == pytest.approx(
        SAMPLE["F"].data.reshape(-1).tolist()
    )


@pytest.mark.parametrize("binary", [False, True])
def test_non_contiguous_and_empty_outputs(binary):
    transposed = np.arange(12, dtype=np.int32).reshape(3, 4).T
    empty = np.zeros((0, 5), dtype=np.float64)
    chunks, header_length = encode_infer_response(
        _response(Tensor("T", "INT32", transposed), Tensor("E", "FP64", empty)),
        _request(),
        binary_output=binary,
    )
    result = parse(chunks, header_length)
    np.testing.assert_array_equal(result.as_numpy("T"), transposed)
    assert result.as_numpy("E").shape == (0, 5)


@pytest.mark.parametrize("binary", [False, True])
def test_bf16_output(binary):
    values = np.array([1.0, -2.5, 0.15625], dtype=ml_dtypes.bfloat16)
    chunks, header_length = encode_infer_response(
        _response(Tensor("BF", "BF16", values.view(np.uint16))),
        _request(),
        binary_output=binary,
    )
    got = parse(chunks, header_length).as_numpy("BF")
    np.testing.assert_array_equal(got.astype(np.float32), values.astype(np.float32))


def test_bytes_json_output_accepts_str_and_refuses_bytes_that_are_not_utf8():
    data = np.array(["pl\u00e4in".encode(), "str"], dtype=np.object_)
    chunks, header_length = encode_infer_response(_response(Tensor("S", "BYTES", data)), _request())
    assert header_length is None
    assert json.loads(join(chunks))["outputs"][0]["data"] == ["pl\u00e4in", "str"]
    # qa/L0_string_io string_client_test.py: non-UTF-8 bytes asked for as JSON are
    # an error the client sees, never text with replacement characters.
    data = np.array([b"ok", b"\xffok"], dtype=np.object_)
    with pytest.raises(InvalidArgument, match="output 'S' holds BYTES that are not UTF-8"):
        encode_infer_response(_response(Tensor("S", "BYTES", data)), _request())
    chunks, header_length = encode_infer_response(
        _response(Tensor("S", "BYTES", data)), _request(), binary_output=True
    )
    assert parse(chunks, header_length).as_numpy("S").tolist() == [b"ok", b"\xffok"]


def test_response_id_and_parameters():
    chunks, _ = encode_infer_response(
        _response(SAMPLE["U"], id="abc", parameters={"sequence_id": 3}),
        _request(),
    )
    doc = json.loads(join(chunks))
    assert doc["id"] == "abc" and doc["parameters"] == {"sequence_id": 3}
    # The request id is echoed when the response carries none.
    chunks, _ = encode_infer_response(_response(SAMPLE["U"]), _request(id="req-1"))
    assert json.loads(join(chunks))["id"] == "req-1"
    assert b" " not in chunks[0]  # compact separators


def test_full_roundtrip_request_to_response():
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    s = np.array([[b"x", b"yy"]], dtype=np.object_)
    body, header_length = client_body(
        [make_input("A", a, "INT32"), make_input("S", s, "BYTES", binary=False)],
        outputs=[
            httpclient.InferRequestedOutput("A", binary_data=True),
            httpclient.InferRequestedOutput("S", binary_data=False),
        ],
        request_id="7",
    )
    request = decode(body, header_length)
    response = InferenceResponse("m", "1", outputs=list(request.inputs.values()))  # echo model
    chunks, out_length = encode_infer_response(response, request)
    result = parse(chunks, out_length)
    np.testing.assert_array_equal(result.as_numpy("A"), a)
    assert result.as_numpy("S").tolist() == [["x", "yy"]]  # JSON BYTES come as str
    assert result.get_response()["id"] == "7"


# ------------------------------------------------------------------- small parts


def test_encode_error():
    body = encode_error('model "x" not found')
    assert json.loads(body) == {"error": 'model "x" not found'}
    assert isinstance(body, bytes)


@pytest.mark.parametrize("text,expected", [("", None), ("1", 1), ("42", 42), ("+7", 7)])
def test_parse_model_version(text, expected):
    assert parse_model_version(text) == expected


# Triton's words: server src/common.cc, GetModelVersionFromString.
@pytest.mark.parametrize("text", ["abc", "1.0", " 1", "1_0", "\u0661", "9" * 19, "1" * 5000])
def test_parse_model_version_rejects_what_is_not_an_integer(text):
    with expect_error(
        INVALID,
        f"failed to get model version from specified version string '{text}' (details: stol), "
        "version should be an integral value > 0",
    ):
        parse_model_version(text)


@pytest.mark.parametrize("text", ["0", "-1", "-0"])
def test_parse_model_version_rejects_what_is_not_positive(text):
    with expect_error(
        INVALID,
        f"invalid model version specified '{text}' , version should be an integral value > 0",
    ):
        parse_model_version(text)


def test_bytes_tensor_helpers_match_tritonclient():
    from tritonclient.utils import serialize_byte_tensor

    array = np.array([[b"a", "b\u00e9"], [b"", b"\x00\x01"]], dtype=np.object_)
    ours = serialize_bytes_tensor(array)
    assert ours == serialize_byte_tensor(array).item()
    back = deserialize_bytes_tensor(ours, 4, "output 'S'")
    assert back.tolist() == [b"a", "b\u00e9".encode(), b"", b"\x00\x01"]
    assert deserialize_bytes_tensor(memoryview(ours), None, "x").shape == (4,)
    assert serialize_bytes_tensor(np.array([], dtype=np.object_)) == b""
    with expect_error(INVALID, "output 'S'", "expected 5", "got 4"):
        deserialize_bytes_tensor(ours, 5, "output 'S'")


def test_huge_integer_for_a_float_input():
    with expect_error(INVALID, "out of range for input 'INPUT0'", "FP32", "element 0"):
        decode(_one_input(datatype="FP32", data=[2**1100, 1]))


@pytest.mark.parametrize("depth, ok", [(99, True), (100, False), (120, False)])
def test_json_data_nested_as_deep_as_tritons_cap_is_refused(depth, ok):
    """Triton refuses an input's JSON data nested 100 arrays deep or more
    (server src/common.h HTTP_MAX_JSON_NESTING_DEPTH, ReadDataFromJsonHelper;
    qa/L0_http http_test.py test_json_recursion_depth_limit)."""
    data: object = 7
    for _ in range(depth):
        data = [data]
    doc = {"inputs": [{"name": "X", "shape": [1], "datatype": "INT64", "data": data}]}
    if ok:
        assert decode(json_body(doc)).inputs["X"].data.tolist() == [7]
    else:
        with expect_error(INVALID, "JSON nesting depth exceeds maximum allowed limit (100)"):
            decode(json_body(doc))


@pytest.mark.parametrize(
    "shape, fragment",
    [
        (
            [2**4, 2**60 + 2],
            "shape [16,1152921504606846978] causes total element count to exceed maximum "
            "size of 9223372036854775807",
        ),
        (
            [2**2, 2**60 + 2],
            "byte size overflow for input 'INPUT0': element count (4611686018427387912) * "
            "data type size (4) exceeds maximum allowed size (9223372036854775807)",
        ),
    ],
)
def test_shapes_that_overflow_are_refused_in_tritons_words(shape, fragment):
    # server src/http_server.cc ParseJsonTritonIO; qa/L0_http http_test.py
    # test_buffer_size_overflow.
    doc = {"inputs": [{"name": "INPUT0", "shape": shape, "datatype": "FP32", "data": [1.0]}]}
    with expect_error(INVALID, fragment):
        decode(json_body(doc))


# ------------------------------------------------------------- repeated headers


def test_a_repeated_header_decodes_to_requests_of_their_own():
    """The parsed header is shared between requests that repeat it: what one
    request's decoding makes of it (parameters, requested outputs) is its own."""
    array = np.arange(16, dtype=np.int32).reshape(1, 16)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    body, header_length = client_body(
        [make_input("INPUT0", array, "INT32")], outputs=[out], parameters={"p": "v"}
    )
    first, _ = decode_infer_request(bytearray(body), header_length, "simple", None)
    first.parameters["p"] = "changed"
    first.requested_outputs[0].parameters["binary_data"] = False
    second, _ = decode_infer_request(memoryview(bytearray(body)), header_length, "simple", None)
    assert second.parameters == {"p": "v"}
    assert second.requested_outputs[0].parameters == {"binary_data": True}
    np.testing.assert_array_equal(second.inputs["INPUT0"].data, array)


def _binary_response(shape, model_version="1", response_id=""):
    outputs = [
        Tensor(name, "INT32", np.zeros(shape, dtype=np.int32)) for name in ("OUTPUT0", "OUTPUT1")
    ]
    return InferenceResponse("simple", model_version, id=response_id, outputs=outputs)


@pytest.mark.parametrize("response_id", ["", "r-1"])
def test_an_all_binary_response_header_says_what_each_response_holds(response_id):
    """All-binary headers come from a cache keyed by what they say: responses of
    other shapes, versions or ids get their own header, the same as one built
    from scratch."""
    request = InferenceRequest("simple", None)
    for shape, version in [((1, 16), "1"), ((2, 3), "1"), ((1, 16), "2"), ((1, 16), "1")]:
        response = _binary_response(shape, version, response_id)
        chunks, header_length = encode_infer_response(response, request, binary_output=True)
        doc = json.loads(bytes(chunks[0]))
        expected = {"model_name": "simple", "model_version": version}
        if response_id:
            expected["id"] = response_id
        size = 4 * int(np.prod(shape))
        expected["outputs"] = [
            {
                "name": name,
                "datatype": "INT32",
                "shape": list(shape),
                "parameters": {"binary_data_size": size},
            }
            for name in ("OUTPUT0", "OUTPUT1")
        ]
        assert doc == expected
        assert header_length == len(chunks[0])
        result = parse(chunks, header_length)
        assert result.as_numpy("OUTPUT1").shape == shape
