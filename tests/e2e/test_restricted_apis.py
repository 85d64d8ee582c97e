"""--http-restricted-api and --grpc-restricted-protocol against a real server.

Every one of Triton's API groups is restricted with a header of its own; each
group's calls are refused without the header, with another group's header and
with a wrong value, and served with the right one, over HTTP (403, "This API is
restricted, expecting header '<key>'") and gRPC (UNAVAILABLE, "This protocol is
restricted, expecting header 'triton-grpc-protocol-<key>'"), as Triton answers
(server src/http_server.cc RespondIfRestricted, src/grpc/grpc_server.cc).
"""

from __future__ import annotations

import http.client
import json
import queue
from functools import partial

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.helpers import cli_usage, expect_error, simple_inputs, wait_for
from tests.serverproc import EXAMPLES, ServerProcess
from trionserve.actors.registry import ModelRegistry
from trionserve.actors.watcher import ControlMode
from trionserve.dataplane import DataPlane
from trionserve.protocol.http.frontend import HttpFrontend
from trionserve.protocol.restricted import RestrictedCategory, parse_restricted_features
from trionserve.repository.repository import ModelRepository

GROUPS = [c.value for c in RestrictedCategory]
GRPC_PREFIX = "triton-grpc-protocol-"


def key(group: str) -> str:
    return f"{group}-key"


def value(group: str) -> str:
    return f"{group}-value"


@pytest.fixture(scope="module")
def server():
    args = []
    for group in GROUPS:
        args.append(f"--http-restricted-api={group}:{key(group)}={value(group)}")
        args.append(f"--grpc-restricted-protocol={group}:{key(group)}={value(group)}")
    proc = ServerProcess(EXAMPLES, args=args)
    try:
        # Health is restricted too: the server is up once it answers 403.
        wait_for(lambda: proc.process.poll() is not None or proc.status("/v2/health/live"), "HTTP")
        assert proc.process.poll() is None, proc.output()
        client = httpclient.InferenceServerClient(proc.http_url)
        health = {key("health"): value("health")}
        wait_for(lambda: client.is_server_ready(headers=health), "the models to load")
        client.close()
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


# group -> one call of the group's endpoints, given a client and its headers.
HTTP_CALLS = {
    "health": lambda c, h: c.is_model_ready("simple", headers=h) or _refused_http(),
    "metadata": lambda c, h: c.get_model_metadata("simple", headers=h),
    "inference": lambda c, h: c.infer("simple", simple_inputs(), headers=h),
    "shared-memory": lambda c, h: c.get_system_shared_memory_status(headers=h),
    "model-config": lambda c, h: c.get_model_config("simple", headers=h),
    "model-repository": lambda c, h: c.get_model_repository_index(headers=h),
    "statistics": lambda c, h: c.get_inference_statistics("simple", headers=h),
    "trace": lambda c, h: c.get_trace_settings(headers=h),
    "logging": lambda c, h: c.get_log_settings(headers=h),
}
GRPC_CALLS = {
    "health": lambda c, h: c.is_server_live(headers=h),
    "metadata": lambda c, h: c.get_server_metadata(headers=h),
    "inference": lambda c, h: c.infer(
        "simple", simple_inputs(module=grpcclient, binary=False), headers=h
    ),
    "shared-memory": lambda c, h: c.get_cuda_shared_memory_status(headers=h),
    "model-config": lambda c, h: c.get_model_config("simple", headers=h),
    "model-repository": lambda c, h: c.get_model_repository_index(headers=h),
    "statistics": lambda c, h: c.get_inference_statistics("simple", headers=h),
    "trace": lambda c, h: c.get_trace_settings(headers=h),
    "logging": lambda c, h: c.get_log_settings(headers=h),
}


def _refused_http():
    # tritonclient's is_*_ready answers False for any status but 200.
    raise InferenceServerException("This API is restricted (is_model_ready answered False)")


def _wrong_headers(group: str, prefix: str = "") -> list[dict | None]:
    other = GROUPS[(GROUPS.index(group) + 1) % len(GROUPS)]
    return [
        None,
        {prefix + key(other): value(other)},
        {prefix + key(group): value(group) + "x"},
    ]


@pytest.mark.parametrize("group", GROUPS)
def test_http_group_refused_without_its_header_and_served_with_it(server, group):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        call = HTTP_CALLS[group]
        for headers in _wrong_headers(group):
            expect_error(partial(call, client, headers), "This API is restricted")
        assert call(client, {key(group): value(group)}) is not None
    finally:
        client.close()


@pytest.mark.parametrize("group", GROUPS)
def test_grpc_group_refused_without_its_header_and_served_with_it(server, group):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        call = GRPC_CALLS[group]
        expected = f"This protocol is restricted, expecting header '{GRPC_PREFIX}{key(group)}'"
        for headers in _wrong_headers(group, GRPC_PREFIX):
            expect_error(partial(call, client, headers), expected, "UNAVAILABLE")
        assert call(client, {GRPC_PREFIX + key(group): value(group)}) is not None
    finally:
        client.close()


def _raw_http(proc, method: str, path: str, headers: dict | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", proc.http_port, timeout=10)
    try:
        connection.request(
            method, path, body=b"{}" if method == "POST" else None, headers=headers or {}
        )
        response = connection.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else {}
    finally:
        connection.close()


@pytest.mark.parametrize(
    "method, path, group",
    [
        ("GET", "/v2/health/live", "health"),
        ("GET", "/v2", "metadata"),
        ("POST", "/v2/models/simple/generate", "inference"),
        ("POST", "/v2/repository/models/simple/unload", "model-repository"),
        ("GET", "/v2/models/stats", "statistics"),
        ("POST", "/v2/logging", "logging"),
    ],
)
def test_http_answer_is_triton_403_with_the_header_named(server, method, path, group):
    status, body = _raw_http(server, method, path)
    assert status == 403
    assert body == {"error": f"This API is restricted, expecting header '{key(group)}'"}
    # The header's name is matched case-insensitively, its value exactly.
    status, _ = _raw_http(server, method, path, {key(group).upper(): value(group).upper()})
    assert status == 403


def test_http_restriction_is_checked_before_the_method(server):
    # Triton checks the restriction first in each handler, the method after it.
    status, body = _raw_http(server, "POST", "/v2/health/live")
    assert status == 403 and "restricted" in body["error"]
    status, _ = _raw_http(server, "POST", "/v2/health/live", {key("health"): value("health")})
    assert status == 405
    status, _ = _raw_http(server, "GET", "/v2/nothing-here")
    assert status == 404


def test_grpc_stream_refused_without_its_header_and_served_with_it(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    inputs = simple_inputs(module=grpcclient, binary=False)
    try:
        client.start_stream(lambda result, error: results.put(error or result), headers={"x": "1"})
        error = results.get(timeout=10)
        assert isinstance(error, InferenceServerException)
        assert "This protocol is restricted" in error.message()
        client.stop_stream()
        headers = {GRPC_PREFIX + key("inference"): value("inference")}
        client.start_stream(lambda result, error: results.put(error or result), headers=headers)
        client.async_stream_infer("simple", inputs)
        result = results.get(timeout=10)
        assert not isinstance(result, InferenceServerException), result
        assert result.as_numpy("OUTPUT0").tolist() == [list(range(1, 17))]
        client.stop_stream()
    finally:
        client.close()


# -- groups left open, and the flags' errors ------------------------------------------


async def test_groups_not_named_stay_open(tmp_path):
    # Routing only: no handler runs; the data plane serves an empty repository.
    restricted = parse_restricted_features(
        ["inference,metadata:k=v"], "--http-restricted-api", "api"
    )
    dataplane = DataPlane(ModelRegistry(ModelRepository([tmp_path])), ControlMode.NONE)
    frontend = HttpFrontend(dataplane, restricted_apis=restricted)
    refused = frontend.route(b"POST", "/v2/models/simple/infer")
    status, _, body = await refused([(b"other", b"v")], b"")
    assert status == 403 and b"expecting header 'k'" in b"".join(body)
    open_route = frontend.route(b"POST", "/v2/models/stats")  # statistics: GET only
    status, _, _ = await open_route([], b"")
    assert status == 405


@pytest.mark.parametrize(
    "flag, kind", [("--http-restricted-api", "api"), ("--grpc-restricted-protocol", "protocol")]
)
def test_flag_errors_are_tritons(flag, kind):
    # qa/L0_http and qa/L0_grpc test.sh look for these messages in the log.
    twice = cli_usage(
        f"--model-repository={EXAMPLES}",
        f"{flag}=model-repository,health:k1=v1",
        f"{flag}=metadata,health:k2=v2",
    )
    assert twice.returncode != 0
    expected = f"restricted {kind} 'health' can not be specified in multiple config groups"
    assert twice.stderr.count(expected) == 1, twice.stderr
    unknown = cli_usage(f"--model-repository={EXAMPLES}", f"{flag}=model-reposit,health:k1=v1")
    assert unknown.returncode != 0
    assert f"unknown restricted {kind} 'model-reposit'" in unknown.stderr
