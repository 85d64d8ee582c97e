"""Fuzzing the HTTP infer path (issue 18): Hypothesis builds infer requests that are
almost right (every field of the KServe v2 JSON, wrong types, odd shapes, binary
tails of the wrong size, header lengths that do not fit) and bodies that are not
JSON at all. The decoder must answer each with a request or a TritonError, never
another exception; the real server must answer each with a 2xx or 4xx, never a 5xx,
and keep serving."""

from __future__ import annotations

import http.client
import json
import zlib

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trionserve.core.errors import TritonError
from trionserve.core.validation import ModelSignature, TensorSpec
from trionserve.protocol.http import codec
from trionserve.protocol.http.frontend import decompress

DATATYPES = [
    "BOOL",
    "UINT8",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
    "FLOAT",
    "",
    "int32",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# Edge values come up often: 0, the bounds of int32 / int64 indexing, -1.
dims = st.one_of(st.sampled_from([0, 1, 2, 4, 16, 2**31, 2**62, 2**63, -1]), st.integers(-2, 2**64))
shapes = st.one_of(st.lists(dims, max_size=4), json_values)
parameters = st.dictionaries(
    st.sampled_from(
        [
            "binary_data_size",
            "shared_memory_region",
            "shared_memory_byte_size",
            "shared_memory_offset",
            "binary_data",
            "classification",
            "x",
        ]
    ),
    json_values,
    max_size=3,
)
# Inputs right in every field but the shape and data: they reach the deepest checks.
plausible_inputs = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["INPUT0", "INPUT1"]),
        "datatype": st.sampled_from(["INT32", "FP32", "BYTES", "BOOL", "FP16"]),
        "shape": st.lists(dims, max_size=3),
    },
    optional={"data": st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=2)), max_size=4)},
)
wild_inputs = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["INPUT0", "INPUT1"]), json_values)},
    optional={
        "shape": shapes,
        "datatype": st.one_of(st.sampled_from(DATATYPES), json_values),
        "data": st.one_of(st.lists(scalars, max_size=20), json_values),
        "parameters": st.one_of(parameters, json_values),
    },
)
inputs = st.one_of(plausible_inputs, wild_inputs)
requests = st.fixed_dictionaries(
    {"inputs": st.one_of(st.lists(inputs, max_size=3), json_values)},
    optional={
        "id": st.one_of(st.text(max_size=4), json_values),
        "parameters": st.one_of(
            st.dictionaries(
                st.sampled_from(
                    [
                        "sequence_id",
                        "sequence_start",
                        "priority",
                        "timeout",
                        "binary_data_output",
                        "custom",
                    ]
                ),
                scalars,
                max_size=3,
            ),
            json_values,
        ),
        "outputs": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"name": json_values},
                    optional={"parameters": st.one_of(parameters, json_values)},
                ),
                max_size=2,
            ),
            json_values,
        ),
    },
)


@st.composite
def bodies(draw) -> tuple[bytes, int | None]:
    """(body, Inference-Header-Content-Length) of a fuzzed infer request."""
    if draw(st.booleans()):
        header = json.dumps(draw(requests)).encode()
    else:
        header = draw(st.binary(max_size=64))
    tail = draw(st.binary(max_size=64))
    length = draw(st.one_of(st.none(), st.just(len(header)), st.integers(-1, 200)))
    return (header + tail if length is not None else header), length


# Bodies that once got past the decoder as a 500, kept as regressions.
KNOWN = [
    (
        json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [0, 2**62], "datatype": "FP32", "data": []}]}
        ).encode(),
        None,
    ),
    (b'{"inputs":' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
@example(KNOWN[0])
@example(KNOWN[1])
def test_decoder_answers_every_body_with_a_request_or_a_triton_error(body_and_length):
    body, length = body_and_length
    try:
        codec.decode_infer_request(body, length, "simple", None, None)
    except TritonError:
        pass


SIGNATURE = ModelSignature("m", 8, {"RAW": TensorSpec("RAW", "FP32", (-1,))}, {})


@settings(max_examples=100, deadline=None)
@given(
    st.binary(max_size=64),
    st.sampled_from(["FP32", "BYTES", "INT8"]),
    st.lists(st.integers(-1, 4), max_size=3),
    st.integers(0, 4),
)
def test_raw_decoder_answers_with_a_request_or_a_triton_error(body, datatype, dims, batch):
    signature = ModelSignature("m", batch, {"RAW": TensorSpec("RAW", datatype, tuple(dims))}, {})
    try:
        codec.decode_raw_request(body, "m", None, signature)
    except TritonError:
        pass


@settings(max_examples=100, deadline=None)
@given(
    st.binary(max_size=256),
    st.sampled_from(["gzip", "deflate", "br"]),
    st.booleans(),
    st.integers(1, 300),
)
def test_decompress_answers_with_bytes_within_the_limit_or_a_triton_error(
    data, encoding, compress, limit
):
    if compress and encoding != "br":
        data = zlib.compress(data) if encoding == "deflate" else __import__("gzip").compress(data)
    try:
        assert len(decompress(data, encoding, limit)) <= limit
    except TritonError:
        pass


@pytest.fixture(scope="module")
def connection_to(server):
    connections: list[http.client.HTTPConnection] = []

    def post(path: str, body: bytes, headers: dict) -> tuple[int, bytes]:
        if not connections:
            connections.append(
                http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
            )
        connection = connections[0]
        try:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException):
            connections.clear()  # the server closed it (as it may after a 4xx)
            raise

    yield post
    for connection in connections:
        connection.close()


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(bodies(), st.sampled_from(["simple", "identity_fp32", "simple_ensemble"]))
@example(KNOWN[0], "identity_fp32")
def test_server_never_answers_a_fuzzed_infer_with_5xx(
    server, connection_to, body_and_length, model
):
    body, length = body_and_length
    headers = {} if length is None else {"Inference-Header-Content-Length": str(length)}
    try:
        status, answer = connection_to(f"/v2/models/{model}/infer", body, headers)
    except (OSError, http.client.HTTPException):
        status, answer = connection_to(f"/v2/models/{model}/infer", body, headers)
    assert status < 500, answer[:300]
    assert connection_to("/v2/repository/index", b"{}", {})[0] == 200
