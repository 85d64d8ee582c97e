"""Server-wide behaviours that Triton clients check (issue 17, items 8, 10, 11, 12, 15, 16).

Real servers on free loopback ports, real ``tritonclient`` (HTTP and gRPC): the
server's name and extensions, model-load errors (status and wording), model names
that are not a model directory, BYTES tensors through the ONNX Runtime and Python
backends, and the types of the Prometheus counters.
"""

from __future__ import annotations

import shutil

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.serverproc import EXAMPLES, ServerProcess, serving
from trionserve.core.cuda_shared_memory import cuda_unavailable_reason


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("server-parity")
    for name in ("simple", "identity_bytes"):
        shutil.copytree(EXAMPLES / name, repo / name)
    process = ServerProcess(
        repo,
        args=[
            "--model-control-mode=explicit",
            "--load-model=simple",
            "--load-model=identity_bytes",
            "--allow-client-shm=true",
        ],
    )
    try:
        process.wait_ready()
        process.repository = repo
        yield process
    finally:
        process.close()


@pytest.fixture
def http(server):
    client = httpclient.InferenceServerClient(server.http_url)
    yield client
    client.close()


@pytest.fixture
def grpc(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


# -- server metadata: name (item 16) and extensions (item 10) -------------------------

# Triton's list, in its order: core src/server.cc, InferenceServer::InferenceServer.
TRITON_EXTENSIONS = [
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "cuda_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
]


def test_server_metadata_names_the_server_triton_and_lists_tritons_extensions(http, grpc):
    cuda = cuda_unavailable_reason() is None
    expected = [e for e in TRITON_EXTENSIONS if cuda or e != "cuda_shared_memory"]
    expected.append("generate")  # ours, beside Triton's
    metadata = http.get_server_metadata()
    assert metadata["name"] == "triton"
    assert metadata["extensions"] == expected
    reply = grpc.get_server_metadata()
    assert reply.name == "triton"
    assert list(reply.extensions) == expected


def test_id_names_the_server_and_shared_memory_is_listed_only_when_usable(tmp_path):
    shutil.copytree(EXAMPLES / "simple", tmp_path / "simple")
    with serving(tmp_path, args=["--id=edge-7"]) as process:
        client = httpclient.InferenceServerClient(process.http_url)
        try:
            metadata = client.get_server_metadata()
        finally:
            client.close()
    assert metadata["name"] == "edge-7"
    assert "sequence" in metadata["extensions"]
    # Without --allow-client-shm a client cannot register regions: not listed.
    assert "system_shared_memory" not in metadata["extensions"]
    assert "cuda_shared_memory" not in metadata["extensions"]
