"""The HTTP codec's decode plans: a request whose JSON header repeats an earlier
one's is decoded from that header's plan (its binary inputs' places), with the
same result as a full decode, and everything else as before."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient

from trionserve.core import validation
from trionserve.core.errors import InvalidArgument
from trionserve.core.validation import ModelSignature, TensorSpec, validate_request
from trionserve.protocol.http import codec
from trionserve.protocol.http.codec import decode_infer_request


@pytest.fixture(autouse=True)
def no_plans():
    codec._PLANS.clear()
    validation._PASSED.clear()
    yield
    codec._PLANS.clear()
    validation._PASSED.clear()


def body_of(a: np.ndarray, b: np.ndarray, **kwargs) -> tuple[bytearray, int]:
    inputs = []
    for name, array, datatype in (("A", a, "FP32"), ("B", b, "INT64")):
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput("OUT", binary_data=True)]
    body, header_length = httpclient.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, request_id="7", priority=3, parameters={"p": "v"}, **kwargs
    )
    return bytearray(body), header_length


def arrays(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((2, 3), dtype=np.float32), rng.integers(0, 99, (2, 2), dtype=np.int64)


def fields(request) -> tuple:
    return (
        request.model_name,
        request.model_version,
        request.id,
        request.priority,
        dict(request.parameters),
        [(o.name, dict(o.parameters)) for o in request.requested_outputs],
        [(t.name, t.datatype, t.data.dtype, t.data.shape) for t in request.inputs.values()],
    )


def test_a_repeated_header_is_decoded_from_its_plan(monkeypatch):
    first_body, header_length = body_of(*arrays(1))
    first, first_binary = decode_infer_request(first_body, header_length, "m", 2)
    assert bytes(first_body[:header_length]) in codec._PLANS

    # The same header with other tensor bytes: no input is checked again.
    def checked_again(*args):
        raise AssertionError("decoded in full, not from the plan")

    monkeypatch.setattr(codec, "_decode_inputs", checked_again)
    a, b = arrays(2)
    body, again = body_of(a, b)
    assert again == header_length and body[:header_length] == first_body[:header_length]
    second, binary = decode_infer_request(body, header_length, "m", 2)

    assert fields(second) == fields(first) and binary == first_binary
    assert second.id == "7" and second.priority == 3 and second.parameters["p"] == "v"
    np.testing.assert_array_equal(second.inputs["A"].data, a)
    np.testing.assert_array_equal(second.inputs["B"].data, b)
    # Views of this body, and nothing of the request shared with the first one.
    assert np.shares_memory(second.inputs["B"].data, np.frombuffer(body, np.uint8))
    assert second.parameters is not first.parameters
    assert second.requested_outputs[0].parameters is not first.requested_outputs[0].parameters


def test_a_planned_header_with_a_body_of_another_size_is_refused_as_before():
    body, header_length = body_of(*arrays(1))
    short = body[:-1]
    with pytest.raises(InvalidArgument) as unplanned:
        decode_infer_request(short, header_length, "m", None)
    decode_infer_request(body, header_length, "m", None)  # planned now
    with pytest.raises(InvalidArgument) as planned:
        decode_infer_request(short, header_length, "m", None)
    assert planned.value.message == unplanned.value.message
    assert "missing binary data for input 'B'" in planned.value.message


def test_headers_with_json_data_or_errors_are_not_planned():
    header = json.dumps(
        {"inputs": [{"name": "J", "datatype": "INT32", "shape": [2], "data": [1, 2]}]}
    ).encode()
    request, _ = decode_infer_request(header, len(header), "m", None)
    assert request.inputs["J"].data.tolist() == [1, 2]
    assert not codec._PLANS

    body, header_length = body_of(*arrays(1))
    with pytest.raises(InvalidArgument):
        decode_infer_request(body + b"x", header_length, "m", None)  # bytes left over
    assert not codec._PLANS


def signature(dims_a: tuple[int, ...]) -> ModelSignature:
    return ModelSignature(
        "m",
        8,
        {"A": TensorSpec("A", "FP32", dims_a), "B": TensorSpec("B", "INT64", (-1,))},
        {"OUT": TensorSpec("OUT", "FP32", (-1,))},
    )


def test_requests_of_one_plan_are_validated_once_per_signature(monkeypatch):
    body, header_length = body_of(*arrays(1))
    first, _ = decode_infer_request(body, header_length, "m", None)  # makes the plan
    assert first.shape_key is None
    model = signature((3,))
    planned = [decode_infer_request(body, header_length, "m", None)[0] for _ in range(3)]
    assert planned[0].shape_key is planned[1].shape_key is not None
    validate_request(planned[0], model)
    assert planned[0].batch_size == 2

    checks = []
    full = validation._validate
    monkeypatch.setattr(validation, "_validate", lambda *args: checks.append(args) or full(*args))
    validate_request(planned[1], model)  # passed before: not checked again
    assert planned[1].batch_size == 2 and not checks
    # Another model's signature is checked in full, with its own verdict.
    with pytest.raises(InvalidArgument, match="unexpected shape for input 'A'"):
        validate_request(planned[2], signature((4,)))
    with pytest.raises(InvalidArgument, match="unexpected shape for input 'A'"):
        validate_request(planned[2], signature((4,)))
    assert len(checks) == 2


def test_a_planned_header_sets_what_its_parameters_set_as_a_full_decode_does():
    a, b = arrays(3)
    params = {
        "sequence_id": "s-1",
        "sequence_start": True,
        "sequence_end": False,
        "priority": 2,
        "timeout": 500,
        "binary_data_output": True,
        "custom": 1.5,
    }
    header = json.dumps(
        {
            "id": "9",
            "parameters": params,
            "inputs": [
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": list(array.shape),
                    "parameters": {"binary_data_size": array.nbytes},
                }
                for name, array, datatype in (("A", a, "FP32"), ("B", b, "INT64"))
            ],
        }
    ).encode()

    def decoded(request, binary) -> tuple:
        return (
            request.sequence_id,
            request.sequence_start,
            request.sequence_end,
            request.priority,
            request.timeout_us,
            dict(request.parameters),
            binary,
        )

    body = bytearray(header + a.tobytes() + b.tobytes())
    full = decoded(*decode_infer_request(body, len(header), "m", None))
    assert bytes(header) in codec._PLANS
    planned, binary = decode_infer_request(body, len(header), "m", None)
    assert decoded(planned, binary) == full == ("s-1", True, False, 2, 500, {"custom": 1.5}, True)
    again, _ = decode_infer_request(body, len(header), "m", None)
    assert again.parameters is not planned.parameters
