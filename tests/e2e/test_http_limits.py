"""HTTP request shapes and limits against a real server on real sockets: raw binary
requests, inputs that name both data and shared memory, body limits, compression
caps, connection limits, malformed JSON and HTTP framing."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import time
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.helpers import tcp_sockets, wait_for
from tests.repository import python_model
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
    python_model(repository, "count_bytes", COUNT_BYTES_CONFIG, COUNT_BYTES_MODEL)
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
        headers = {name.lower(): value for name, value in response.getheaders()}
        return response.status, headers, response.read()
    finally:
        connection.close()


RAW = {"Inference-Header-Content-Length": "0"}


def test_raw_binary_request_is_the_only_input(server):
    """Inference-Header-Content-Length: 0: the whole body is the data of the
    model's one input, its shape deduced from the configuration (Triton core
    infer_request.cc, Normalize), and every output comes back in binary form with
    the header length in Inference-Header-Content-Length (the binary data
    extension's "Raw Binary Request")."""
    data = np.arange(6, dtype=np.float32)
    status, headers, body = post(server, "/v2/models/identity_fp32/infer", data.tobytes(), RAW)
    assert status == 200, body
    header_length = int(headers["inference-header-content-length"])
    (output,) = json.loads(body[:header_length])["outputs"]
    assert (output["name"], output["shape"]) == ("OUTPUT0", [1, 6])
    assert output["parameters"] == {"binary_data_size": data.nbytes}
    result = httpclient.InferenceServerClient.parse_response_body(body, header_length=header_length)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data.reshape(1, 6))


def test_raw_binary_request_of_tens_of_mib_in_chunks(server):
    payload = np.random.default_rng(7).integers(0, 256, 24 << 20, dtype=np.uint8)
    raw = payload.tobytes()
    pieces = (raw[i : i + (1 << 20)] for i in range(0, len(raw), 1 << 20))
    status, headers, body = post(server, "/v2/models/count_bytes/infer", pieces, RAW, chunked=True)
    assert status == 200, body
    result = httpclient.InferenceServerClient.parse_response_body(
        body, header_length=int(headers["inference-header-content-length"])
    )
    assert result.as_numpy("COUNTS").tolist() == [payload.size, int(payload.sum(dtype=np.int64))]


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


@pytest.mark.parametrize("chunks", [65536, 65537])
def test_chunked_body_in_at_most_65536_chunks(server, chunks):
    """qa/L0_http/http_request_many_chunks.py: a chunked body in 65,536 non-empty
    chunks is read (and here refused by the model for its inputs), one in 65,537
    is a 400 naming the limit, and its connection is closed (server
    src/http_server.cc kMaxChunkedChunks)."""
    head = (
        b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\n"
        b"Inference-Header-Content-Length: 0\r\nContent-Type: application/octet-stream\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    answer = exchange(server.http_port, head + b"1\r\nA\r\n" * chunks + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    if chunks == 65536:
        assert error == (
            "Raw request must only have 1 input (found 1) to be deduced but got 2 "
            "inputs in 'simple' model configuration"
        )
    else:
        assert error == (
            "Chunked request body exceeds maximum of 65536 non-empty chunks. "
            "Send fewer or larger HTTP chunks."
        )


LIMIT = 64 << 20
FLAG = "Use --http-max-input-size to increase the limit."


@pytest.mark.parametrize(
    "path, header, message",
    [
        (  # the body a raw input (src/http_server.cc EVBufferToRawInput)
            b"/v2/models/count_bytes/infer",
            b"Inference-Header-Content-Length: 0\r\n",
            f"Raw input has a byte_size ({LIMIT + 1} bytes) that exceeds the maximum "
            f"allowed value of {LIMIT} bytes. {FLAG}",
        ),
        (  # the body JSON (EVBufferToJson), on infer and on every other endpoint
            b"/v2/models/count_bytes/infer",
            b"",
            f"request JSON size of {LIMIT + 1} bytes exceeds the maximum allowed input "
            f"size of {LIMIT} bytes. {FLAG}",
        ),
        (
            b"/v2/repository/models/count_bytes/load",
            b"",
            f"request JSON size of {LIMIT + 1} bytes exceeds the maximum allowed input "
            f"size of {LIMIT} bytes. {FLAG}",
        ),
        (  # the JSON header alone over the limit
            b"/v2/models/count_bytes/versions/1/infer",
            b"Inference-Header-Content-Length: %d\r\n" % (LIMIT + 1),
            f"request JSON size of {LIMIT + 1} bytes exceeds the maximum allowed input "
            f"size of {LIMIT} bytes. {FLAG}",
        ),
    ],
)
def test_a_body_over_the_default_limit_is_refused_in_tritons_words(server, path, header, message):
    """Triton's default --http-max-input-size is 64 MiB (src/common.h,
    HTTP_DEFAULT_MAX_INPUT_SIZE = 1 << 26) and a body over it is a 400 worded by
    what the body is (src/http_server.cc); here it is refused from the head alone,
    before any of the body is read."""
    head = b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n" % (
        path,
        header,
        LIMIT + 1,
    )
    answer = exchange(server.http_port, head)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {"error": message}


def test_binary_tensors_past_the_limit_are_413(server):
    """Triton does not bound binary tensor data; this server bounds every body it
    buffers: a JSON header within the limit and binary data past it is a 413."""
    head = (
        b"POST /v2/models/count_bytes/infer HTTP/1.1\r\nHost: x\r\n"
        b"Inference-Header-Content-Length: 200\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1)
    )
    answer = exchange(server.http_port, head)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"for binary tensor data (--http-max-input-size)" in answer


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


def open_connections(server: ServerProcess) -> list[tuple[int, str]]:
    """The server's HTTP connections still open on its side (not its listener)."""
    return [
        (port, state)
        for port, state in tcp_sockets(server.process.pid)
        if port == server.http_port and state != "0A"
    ]


def answered(sock: socket.socket) -> bool:
    """Whether the server has written to or closed this connection (without waiting)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)
    return True


def test_connections_past_the_cap_are_refused_and_the_server_goes_on(guarded_server):
    """Past the cap with no connection idle (each in the middle of a request head),
    a new connection is answered 503 naming the flag; once they are gone, new
    connections are served again. (Idle keep-alive connections make room instead:
    tests/e2e/test_transport_hardening.py.)"""
    port = guarded_server.http_port
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    # A held connection may be answered instead of held: its head timed out
    # (--http-header-timeout=1, on a busy machine), or it was refused at the cap
    # because a connection closed by the client before was still open on the
    # server's side (counted, no longer idle): so each attempt starts once the
    # server holds no connection. Then the new connection is rightly served: try again.
    attempts = []
    for _ in range(10):
        wait_for(
            lambda: not open_connections(guarded_server),
            "the server to close the connections before",
            timeout=10,
        )
        started = time.monotonic()
        held = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(3)]
        try:
            for sock in held:
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
            answer = exchange(port, request)
            explained = [answered(sock) for sock in held]
        finally:
            for sock in held:
                sock.close()
        if not answer.startswith(b"HTTP/1.1 200 "):
            break
        # Served: only right if one of the three was not held (the server answers
        # or closes it before it accepts the next connection).
        elapsed = time.monotonic() - started
        assert any(explained) or elapsed >= 1.0, ("served past the cap", explained, elapsed)
        attempts.append((explained, round(elapsed, 3)))
    assert answer.startswith(b"HTTP/1.1 503 "), (answer[:200], attempts)
    assert b"--http-max-connections" in answer and b"3 open" in answer
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
    assert error.startswith("Decompressed data size exceeds the maximum allowed value")  # Triton


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_large_compressed_body_within_the_limit_is_served(server, encoding):
    payload = np.random.default_rng(3).integers(0, 4, 20 << 20, dtype=np.uint8)
    raw = payload.tobytes()
    packed = gzip.compress(raw, 1) if encoding == "gzip" else zlib.compress(raw, 1)
    status, headers, body = post(
        server, "/v2/models/count_bytes/infer", packed, {**RAW, "Content-Encoding": encoding}
    )
    assert status == 200, body
    result = httpclient.InferenceServerClient.parse_response_body(
        body, header_length=int(headers["inference-header-content-length"])
    )
    assert result.as_numpy("COUNTS").tolist() == [payload.size, int(payload.sum(dtype=np.int64))]


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


def test_unknown_http_version_is_refused_and_closed(server):
    """Refused with a JSON error, and the connection closed (``exchange`` reads
    until the server closes it)."""
    answer = exchange(
        server.http_port,
        b"GET /v2/health/live HTTP/9.9\r\nHost: x\r\n\r\n"
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 505"), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1
    assert b'{"error":' in answer


def test_content_length_beside_transfer_encoding_is_framed_by_chunks_and_closed(server):
    """A body chunked by hand under a Content-Length the client library added (as
    ``requests`` does, Triton's qa/L0_http test_content_encoding_chunked_manually)
    is framed by its chunks, as Triton's libevhtp does (RFC 9112 section 6.3); the
    connection is closed after the answer, since an intermediary may have framed it
    otherwise (section 6.1), so the request pipelined after it is not served."""
    data = np.arange(8, dtype=np.float32).tobytes()
    chunked = b"%X\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    answer = exchange(
        server.http_port,
        # A body of declared length first, large enough to be read past the parser:
        # the request after it is parsed by a fresh one.
        b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{}%s"
        % (2 + (1 << 20), b" " * (1 << 20))
        + b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\n"
        b"Inference-Header-Content-Length: 0\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%s"
        % (len(chunked), chunked)
        + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert answer.count(b"HTTP/1.1 200") == 2, answer  # the third is never read
    assert answer.count(b"HTTP/1.1 ") == 2
    assert answer.endswith(data)


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
    ],
    ids=["shm-key-nul", "huge-empty-shape"],
)
def test_client_mistakes_are_400_not_500(server, path, request_body, fragment):
    """Issue 18 item 7: what the client got wrong is a 400 naming it."""
    status, _, answer = post(server, path, json.dumps(request_body).encode())
    assert status == 400, answer[:300]
    assert fragment in json.loads(answer)["error"]


@pytest.mark.parametrize(
    "file_key, fragment",
    [
        ("file:1/a\0b", "NUL"),
        ("file:" + "a/" * 100 + "x", "levels"),
        ("file:" + "a" * 5000, "bytes"),
    ],
    ids=["file-nul", "file-deep", "file-long"],
)
def test_a_file_override_path_that_cannot_be_written_is_500_naming_it(server, file_key, fragment):
    """Triton answers a file override it cannot localize with 500 "failed to poll
    from model repository" (core model_repository_manager.cc: InitializeModelInfo
    fails, so LoadUnloadModel finds the model not polled; qa/L0_http http_test.py
    test_load_oversized_file_parameter); the reason follows, naming what was wrong."""
    request_body = {"parameters": {"config": IDENTITY_CONFIG, file_key: "AAAA"}}
    status, _, answer = post(
        server, "/v2/repository/models/identity_fp32/load", json.dumps(request_body).encode()
    )
    assert status == 500, answer[:300]
    error = json.loads(answer)["error"]
    assert error.startswith("failed to load 'identity_fp32', failed to poll from model repository")
    assert fragment in error
