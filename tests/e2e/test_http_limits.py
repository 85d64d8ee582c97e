"""HTTP request shapes and limits against a real server on real sockets: raw binary
requests, inputs that name both data and shared memory, body limits, compression
caps, connection limits, malformed JSON and HTTP framing."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import textwrap
import time
import zlib

import numpy as np
import pytest

from tests.serverproc import EXAMPLES, ServerProcess

# Sums and counts the bytes of its one UINT8 input (any length): a large input
# answered with a small output.
COUNT_BYTES_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            counts = np.array([data.size, int(data.sum(dtype=np.int64))], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("COUNTS", counts)]))
        return responses
"""

COUNT_BYTES_CONFIG = """
name: "count_bytes"
backend: "python"
max_batch_size: 0
input [ { name: "RAW", data_type: TYPE_UINT8, dims: [ -1 ] } ]
output [ { name: "COUNTS", data_type: TYPE_INT64, dims: [ 2 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    model = repository / "count_bytes"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(COUNT_BYTES_CONFIG)
    (model / "1" / "model.py").write_text(textwrap.dedent(COUNT_BYTES_MODEL))
    proc = ServerProcess(
        EXAMPLES,
        repository,
        args=["--allow-client-shm=true", "--model-control-mode=explicit", "--load-model=*"],
    )
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def post(server, path: str, body, headers: dict | None = None, chunked: bool = False):
    """(status, headers, body) of one POST on a fresh connection."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers=headers or {}, encode_chunked=chunked)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


RAW = {"Inference-Header-Content-Length": "0"}


def test_raw_binary_request_is_the_only_input(server):
    """Inference-Header-Content-Length: 0: the whole body is the data of the
    model's one input, its shape deduced from the configuration (Triton core
    infer_request.cc, Normalize)."""
    data = np.arange(6, dtype=np.float32)
    status, _, body = post(server, "/v2/models/identity_fp32/infer", data.tobytes(), RAW)
    assert status == 200, body
    (output,) = json.loads(body)["outputs"]
    assert (output["name"], output["shape"]) == ("OUTPUT0", [1, 6])
    assert output["data"] == data.tolist()


def test_raw_binary_request_of_tens_of_mib_in_chunks(server):
    payload = np.random.default_rng(7).integers(0, 256, 24 << 20, dtype=np.uint8)
    raw = payload.tobytes()
    pieces = (raw[i : i + (1 << 20)] for i in range(0, len(raw), 1 << 20))
    status, _, body = post(server, "/v2/models/count_bytes/infer", pieces, RAW, chunked=True)
    assert status == 200, body
    (output,) = json.loads(body)["outputs"]
    assert output["data"] == [payload.size, int(payload.sum(dtype=np.int64))]


def test_raw_binary_request_to_a_model_with_two_inputs_is_400(server):
    status, _, body = post(server, "/v2/models/simple/infer", b"\0" * 128, RAW)
    assert status == 400
    assert "Raw request must only have 1 input" in json.loads(body)["error"]
    assert "got 2 inputs in 'simple' model configuration" in json.loads(body)["error"]


def test_raw_binary_request_of_the_wrong_size_is_400(server):
    status, _, body = post(server, "/v2/models/identity_fp32/infer", b"\0" * 7, RAW)
    assert status == 400
    assert "input 'INPUT0'" in json.loads(body)["error"]


def exchange(port: int, data: bytes, timeout: float = 20.0) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_default_body_limit_is_64_mib(server):
    """Triton's default --http-max-input-size is 64 MiB (src/common.h,
    HTTP_DEFAULT_MAX_INPUT_SIZE = 1 << 26); a larger body is refused before it is
    read, naming the flag."""
    head = (
        b"POST /v2/models/count_bytes/infer HTTP/1.1\r\nHost: x\r\n"
        b"Inference-Header-Content-Length: 0\r\nContent-Length: %d\r\n\r\n" % ((64 << 20) + 1)
    )
    answer = exchange(server.http_port, head)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"67108864 bytes (--http-max-input-size)" in answer


@pytest.fixture(scope="module")
def guarded_server():
    """A server with small connection and header-time limits."""
    proc = ServerProcess(
        args=[
            "--http-max-connections=3",
            "--http-header-timeout=1",
            "--allow-grpc=false",
            "--allow-metrics=false",
        ]
    )
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def live(port: int) -> http.client.HTTPConnection:
    """A keep-alive connection that has been served one request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    connection.request("GET", "/v2/health/live")
    response = connection.getresponse()
    response.read()
    assert response.status == 200
    return connection


def test_connections_past_the_cap_are_refused_and_the_server_goes_on(guarded_server):
    port = guarded_server.http_port
    held = [live(port) for _ in range(3)]
    try:
        for _ in range(5):
            answer = exchange(port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
            assert b"--http-max-connections" in answer and b"3 open" in answer
        # The connections being served are untouched.
        for connection in held:
            connection.request("GET", "/v2/health/live")
            assert connection.getresponse().read() == b""
    finally:
        for connection in held:
            connection.close()
    # Once they are gone, new connections are served again.
    deadline = time.monotonic() + 20
    while True:
        answer = exchange(
            port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        if answer.startswith(b"HTTP/1.1 200 ") or time.monotonic() > deadline:
            break
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert "refusing HTTP connections" in guarded_server.output()


def test_a_request_head_that_never_ends_is_timed_out(guarded_server):
    """Slowloris: a connection that does not complete its request head within
    --http-header-timeout gets 408 and is closed; others are served meanwhile."""
    port = guarded_server.http_port
    with socket.create_connection(("127.0.0.1", port), timeout=20) as slow:
        slow.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        live(port).close()
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"--http-header-timeout" in answer
    # A connection that sends nothing at all is closed too.
    with socket.create_connection(("127.0.0.1", port), timeout=20) as silent:
        assert silent.recv(65536).startswith(b"HTTP/1.1 408 ")


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_body_is_capped_after_decompression(server, encoding):
    """A small compressed body that inflates past --http-max-input-size (a
    decompression bomb) is a 400 naming the limit; it is never inflated whole."""
    bomb = bytes(65 << 20)
    packed = gzip.compress(bomb, 9) if encoding == "gzip" else zlib.compress(bomb, 9)
    assert len(packed) < 1 << 20
    status, _, body = post(
        server, "/v2/models/count_bytes/infer", packed, {**RAW, "Content-Encoding": encoding}
    )
    assert status == 400, body
    error = json.loads(body)["error"]
    assert "67108864 bytes" in error and "--http-max-input-size" in error


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_large_compressed_body_within_the_limit_is_served(server, encoding):
    payload = np.random.default_rng(3).integers(0, 4, 20 << 20, dtype=np.uint8)
    raw = payload.tobytes()
    packed = gzip.compress(raw, 1) if encoding == "gzip" else zlib.compress(raw, 1)
    status, _, body = post(
        server, "/v2/models/count_bytes/infer", packed, {**RAW, "Content-Encoding": encoding}
    )
    assert status == 200, body
    (output,) = json.loads(body)["outputs"]
    assert output["data"] == [payload.size, int(payload.sum(dtype=np.int64))]


def test_truncated_gzip_body_is_400(server):
    packed = gzip.compress(b"\1" * 1000)[:-12]
    status, _, body = post(
        server, "/v2/models/count_bytes/infer", packed, {**RAW, "Content-Encoding": "gzip"}
    )
    assert status == 400
    assert "gzip" in json.loads(body)["error"]


DEEP = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v2/models/simple/infer", b'{"inputs":' + DEEP + b"}"),
        ("/v2/models/simple/infer", DEEP),
        ("/v2/repository/index", b'{"ready":' + DEEP + b"}"),
        ("/v2/logging", DEEP),
        ("/v2/models/simple/generate", b'{"INPUT0":' + DEEP + b"}"),
    ],
)
def test_deeply_nested_json_is_400(server, path, body):
    status, _, answer = post(server, path, body)
    assert status == 400, answer[:300]
    assert "nested too deeply" in json.loads(answer)["error"]


def test_non_finite_floats_in_json_outputs_are_written_as_triton_does(server):
    """Triton's JSON writer (common triton_json.h: rapidjson::kWriteNanAndInfFlag)
    writes NaN, Infinity and -Infinity; tritonclient reads them back."""
    import tritonclient.http as httpclient

    values = np.array([[np.nan, np.inf, -np.inf, 1.5]], dtype=np.float32)
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(values)
        output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
        result = client.infer("identity_fp32", [tensor], outputs=[output])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)
    finally:
        client.close()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                }
            ]
        }
    ).encode()
    status, _, body = post(
        server,
        "/v2/models/identity_fp32/infer",
        header + values.tobytes(),
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200
    assert b'"data":[NaN,Infinity,-Infinity,1.5]' in body


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /v2/health/live HTTP/9.9\r\nHost: x\r\n\r\n", b"505"),
        (
            b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            b"400",
        ),
    ],
    ids=["http-9.9", "content-length-and-transfer-encoding"],
)
def test_ambiguous_or_unknown_http_is_refused_and_closed(server, request_bytes, status):
    """Refused with a JSON error, and the connection closed (``exchange`` reads
    until the server closes it): a request that could be framed two ways is how
    requests are smuggled past a proxy."""
    answer = exchange(
        server.http_port, request_bytes + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1
    assert b'{"error":' in answer


IDENTITY_CONFIG = json.dumps(
    {
        "name": "identity_fp32",
        "platform": "onnxruntime_onnx",
        "max_batch_size": 8,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    }
)


@pytest.mark.parametrize(
    "path, request_body, fragment",
    [
        (
            "/v2/systemsharedmemory/region/r/register",
            {"key": "/trionserve\0x", "offset": 0, "byte_size": 16},
            "NUL",
        ),
        (
            "/v2/models/identity_fp32/infer",
            {"inputs": [{"name": "INPUT0", "shape": [0, 2**62], "datatype": "FP32", "data": []}]},
            "too large",
        ),
        (
            "/v2/repository/models/identity_fp32/load",
            {"parameters": {"config": IDENTITY_CONFIG, "file:1/a\0b": "AAAA"}},
            "NUL",
        ),
        (
            "/v2/repository/models/identity_fp32/load",
            {"parameters": {"config": IDENTITY_CONFIG, "file:" + "a/" * 100 + "x": "AAAA"}},
            "levels",
        ),
        (
            "/v2/repository/models/identity_fp32/load",
            {"parameters": {"config": IDENTITY_CONFIG, "file:" + "a" * 5000: "AAAA"}},
            "bytes",
        ),
    ],
    ids=["shm-key-nul", "huge-empty-shape", "file-nul", "file-deep", "file-long"],
)
def test_client_mistakes_are_400_not_500(server, path, request_body, fragment):
    """Issue 18 item 7: what the client got wrong is a 400 naming it."""
    status, _, answer = post(server, path, json.dumps(request_body).encode())
    assert status == 400, answer[:300]
    assert fragment in json.loads(answer)["error"]
