"""File overrides of the load API against a real server: nothing they write is left
behind (a failed load, a reload, shutdown), their number is bounded, and text that
is no UTF-8 is the client's fault (400 / INVALID_ARGUMENT), never a 500."""

from __future__ import annotations

import base64
import http.client
import json

import grpc
import pytest

from tests.serverproc import EXAMPLES, ServerProcess
from trionserve._generated import grpc_service_pb2 as pb
from trionserve.repository.overrides import MAX_OVERRIDE_FILES, OVERRIDE_DIR_PREFIX

SIMPLE_CONFIG = json.dumps(
    {
        "name": "over",
        "platform": "onnxruntime_onnx",
        "max_batch_size": 8,
        "input": [
            {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ],
        "output": [
            {"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ],
    }
)


@pytest.fixture
def tmpdir_server(tmp_path):
    """An explicit-mode server whose temporary files go to a directory of the test."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = ServerProcess(
        EXAMPLES, args=["--model-control-mode=explicit"], env={"TMPDIR": str(scratch)}
    )
    try:
        proc.wait_ready()
        yield proc, scratch
    finally:
        proc.close()


def post(proc: ServerProcess, path: str, body: bytes) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", proc.http_port, timeout=60)
    try:
        connection.request("POST", path, body=body)
        response = connection.getresponse()
        data = response.read()
        return response.status, (json.loads(data) if data else {})
    finally:
        connection.close()


def load(proc: ServerProcess, name: str, files: dict[str, bytes], config=SIMPLE_CONFIG):
    parameters = {key: base64.b64encode(data).decode() for key, data in files.items()}
    parameters["config"] = config
    body = json.dumps({"parameters": parameters}).encode()
    return post(proc, f"/v2/repository/models/{name}/load", body)


def left_behind(scratch) -> tuple[int, int]:
    """Override directories under ``scratch``, and the bytes of their files."""
    dirs = [p for p in scratch.iterdir() if p.name.startswith(OVERRIDE_DIR_PREFIX)]
    size = sum(f.stat().st_size for d in dirs for f in d.rglob("*") if f.is_file())
    return len(dirs), size


def test_failed_override_loads_and_shutdown_leave_no_files(tmpdir_server):
    proc, scratch = tmpdir_server
    model = (EXAMPLES / "simple" / "1" / "model.onnx").read_bytes()
    # The model file is missing: written, polled, then refused by the backend.
    for _ in range(3):
        status, reply = load(proc, "over", {"file:1/weights.bin": b"\0" * (1 << 20)})
        assert status >= 400, reply
    assert left_behind(scratch) == (0, 0)
    # Loaded, then a failed reload beside it: only the serving one's directory stays.
    assert load(proc, "over", {"file:1/model.onnx": model})[0] == 200
    assert load(proc, "over", {"file:1/weights.bin": b"\0" * 1024})[0] >= 400
    assert left_behind(scratch)[0] == 1
    assert proc.stop() == 0, proc.output()  # SIGTERM
    assert left_behind(scratch) == (0, 0)


def test_override_file_count_is_bounded(tmpdir_server):
    proc, scratch = tmpdir_server
    files = {f"file:1/f{i}": b"" for i in range(MAX_OVERRIDE_FILES + 1)}
    status, reply = load(proc, "over", files)
    assert status == 400, reply
    assert f"more than {MAX_OVERRIDE_FILES}" in reply["error"]
    assert left_behind(scratch) == (0, 0)


def test_a_lone_surrogate_in_a_file_key_is_400_naming_it(tmpdir_server):
    proc, scratch = tmpdir_server
    body = b'{"parameters": {"config": "{}", "file:1/\\udcff": ""}}'
    status, reply = post(proc, "/v2/repository/models/over/load", body)
    assert status == 400, reply
    assert "'file:1/\\udcff'" in reply["error"] and "UTF-8" in reply["error"]
    body = b'{"parameters": {"config": "{\\"name\\": \\"\\ud800\\"}", "file:1/a": ""}}'
    status, reply = post(proc, "/v2/repository/models/over/load", body)
    assert status == 400 and "'config'" in reply["error"], reply
    assert left_behind(scratch) == (0, 0)
    assert proc.status("/v2/health/live") == 200


def test_a_file_key_that_is_no_utf8_is_invalid_argument_over_grpc(tmpdir_server):
    proc, _ = tmpdir_server
    request = pb.RepositoryModelLoadRequest(model_name="over")
    request.parameters["config"].string_param = "{}"
    request.parameters["file:1/xyz"].bytes_param = b""
    # The UTF-8 form of a lone surrogate, which no conforming client can send.
    wire = request.SerializeToString().replace(b"file:1/xyz", b"file:1/\xed\xb3\xbf")
    with grpc.insecure_channel(f"127.0.0.1:{proc.grpc_port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/RepositoryModelLoad")
        with pytest.raises(grpc.RpcError) as caught:
            call(wire, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert proc.status("/v2/health/live") == 200
