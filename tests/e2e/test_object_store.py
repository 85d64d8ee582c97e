"""Object-storage model repositories against a real S3-compatible server.

The S3 server is moto's standalone server, started as a subprocess on a free
loopback port (never an in-process mock): the mirror and trionserve talk to it
over HTTP exactly as they would to S3 or MinIO, through Triton's
``s3://host:port/bucket/prefix`` form for custom endpoints.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.helpers import emulator, wait_for
from tests.serverproc import EXAMPLES, ServerProcess, free_port
from trionserve.core.errors import InvalidArgument, Unavailable
from trionserve.repository.object_store import (
    ObjectStoreMirror,
    is_remote,
    parse_location,
)

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (the test extra)")
boto3 = pytest.importorskip("boto3", reason="the S3 tests need boto3 (the s3 extra)")

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
SIMPLE = EXAMPLES / "simple"


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """A moto S3 server on loopback: its ``host:port``."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"

    def answers() -> bool:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/")
            connection.getresponse().read()
            connection.close()
        except OSError:
            return False
        return True

    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with emulator(command, log, "moto_server", answers):
        yield f"127.0.0.1:{port}"


@pytest.fixture
def aws_env(monkeypatch):
    """Credentials for moto in the environment (as a pod would get them)."""
    for name in (
        "AWS_PROFILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_SESSION_TOKEN",
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def bucket(s3_endpoint, aws_env, request):
    """A fresh bucket (named after the test) and a client to fill it."""
    client = boto3.client("s3", endpoint_url=f"http://{s3_endpoint}")
    name = request.node.name.replace("_", "-").lower()[:50]
    client.create_bucket(Bucket=name)
    return name, client


def upload_model(
    client, bucket: str, prefix: str, model_dir: Path, name: str, versions=("1",)
) -> None:
    client.upload_file(str(model_dir / "config.pbtxt"), bucket, f"{prefix}/{name}/config.pbtxt")
    for version in versions:
        client.upload_file(
            str(model_dir / "1" / "model.onnx"), bucket, f"{prefix}/{name}/{version}/model.onnx"
        )


def infer_simple(client, version: str = "") -> np.ndarray:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    result = client.infer("simple", inputs, model_version=version)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
    return result


# -- locations ------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, expected",
    [
        ("s3://bucket/path/to/repo", ("s3", "bucket", "path/to/repo/", None, None)),
        ("s3://bucket", ("s3", "bucket", "", None, None)),
        ("s3://bucket/repo/", ("s3", "bucket", "repo/", None, None)),
        (
            "s3://minio.local:9000/bucket/repo",
            ("s3", "bucket", "repo/", "http://minio.local:9000", None),
        ),
        (
            "s3://https://10.0.0.1:443/bucket/a/b",
            ("s3", "bucket", "a/b/", "https://10.0.0.1:443", None),
        ),
        ("gs://bucket/repo", ("gs", "bucket", "repo/", None, None)),
        ("as://account/container/repo", ("as", "container", "repo/", None, "account")),
    ],
)
def test_parse_location_follows_triton(url, expected):
    location = parse_location(url)
    assert (
        location.scheme,
        location.bucket,
        location.prefix,
        location.endpoint,
        location.account,
    ) == expected
    assert is_remote(url)


@pytest.mark.parametrize("url", ["s3://", "s3:///prefix", "as://account", "gs://"])
def test_parse_location_rejects_what_names_no_bucket(url):
    with pytest.raises(InvalidArgument, match="repository"):
        parse_location(url)


def test_local_paths_are_not_remote():
    assert not is_remote("/models")
    assert not is_remote("relative/s3://x")
    assert not is_remote(Path("/models"))


@pytest.mark.parametrize(
    "url, module, extra",
    [
        ("s3://127.0.0.1:9/bucket/models", "boto3", "s3"),
        ("gs://bucket/models", "google.cloud.storage", "gcs"),
        ("as://account/container/models", "azure.storage.blob", "azure"),
    ],
)
def test_a_missing_client_library_names_the_extra(url, module, extra, monkeypatch, tmp_path):
    # Should an import succeed after all, every endpoint is a closed loopback port.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        "DefaultEndpointsProtocol=http;AccountName=account;"
        "AccountKey=a2V5;BlobEndpoint=http://127.0.0.1:9/account",
    )
    # Make the import fail, also where the parent package already holds the module.
    monkeypatch.setitem(sys.modules, module, None)
    parent, _, child = module.rpartition(".")
    if parent in sys.modules:
        monkeypatch.delattr(sys.modules[parent], child, raising=False)
    with pytest.raises(Unavailable, match=rf"pip install 'trionserve\[{extra}\]'"):
        ObjectStoreMirror(url, tmp_path).sync()


# -- the mirror ------------------------------------------------------------------


def test_mirror_follows_the_bucket_by_etag_and_size(bucket, s3_endpoint, tmp_path):
    name, client = bucket
    upload_model(client, name, "repo", SIMPLE, "simple")
    client.put_object(Bucket=name, Key="repo/simple/labels.txt", Body=b"a\nb\n")
    client.put_object(Bucket=name, Key="repo/../escape.txt", Body=b"x")  # never written
    client.put_object(Bucket=name, Key="other/ignored.txt", Body=b"x")  # outside prefix
    client.put_object(Bucket=name, Key="repo/simple/3/", Body=b"")  # a console "folder"
    url = f"s3://{s3_endpoint}/{name}/repo"
    mirror = ObjectStoreMirror(url, tmp_path / "cache")
    root = mirror.root

    first = mirror.sync()
    assert sorted(first.added) == [
        "simple/1/model.onnx",
        "simple/config.pbtxt",
        "simple/labels.txt",
    ]
    assert first.models == {"simple"}
    assert (root / "simple" / "1" / "model.onnx").read_bytes() == (
        SIMPLE / "1" / "model.onnx"
    ).read_bytes()
    assert not (tmp_path / "escape.txt").exists() and not (root.parent / "escape.txt").exists()
    assert not (root / "simple" / "3").exists()  # an empty version would fail to load
    mtime = (root / "simple" / "1" / "model.onnx").stat().st_mtime_ns

    # Nothing changed: nothing is downloaded again.
    assert not mirror.sync()
    assert (root / "simple" / "1" / "model.onnx").stat().st_mtime_ns == mtime

    # Same size, new content: the ETag tells.
    client.put_object(Bucket=name, Key="repo/simple/labels.txt", Body=b"c\nd\n")
    client.put_object(
        Bucket=name, Key="repo/simple/2/model.onnx", Body=(SIMPLE / "1" / "model.onnx").read_bytes()
    )
    second = mirror.sync()
    assert second.updated == ("simple/labels.txt",)
    assert second.added == ("simple/2/model.onnx",)
    assert (root / "simple" / "labels.txt").read_text() == "c\nd\n"

    # A deleted object is deleted locally, with the directory it emptied.
    client.delete_object(Bucket=name, Key="repo/simple/2/model.onnx")
    assert mirror.sync().removed == ("simple/2/model.onnx",)
    assert not (root / "simple" / "2").exists()

    # The record of downloads survives a restart: a new mirror downloads nothing.
    again = ObjectStoreMirror(url, root)
    assert not again.sync()
    assert (root / "simple" / "1" / "model.onnx").stat().st_mtime_ns == mtime


def test_mirror_sync_of_one_model(bucket, s3_endpoint, tmp_path):
    name, client = bucket
    upload_model(client, name, "repo", SIMPLE, "a")
    upload_model(client, name, "repo", SIMPLE, "b")
    mirror = ObjectStoreMirror(f"s3://{s3_endpoint}/{name}/repo", tmp_path / "cache")
    assert mirror.sync("a").models == {"a"}
    assert sorted(p.name for p in mirror.root.iterdir() if not p.name.startswith(".")) == ["a"]


def test_unreachable_bucket_is_unavailable_with_its_name(bucket, s3_endpoint, tmp_path):
    mirror = ObjectStoreMirror(f"s3://{s3_endpoint}/no-such-bucket/repo", tmp_path / "c")
    with pytest.raises(Unavailable, match="s3://.*no-such-bucket/repo.*NoSuchBucket"):
        mirror.sync()


# -- the server ------------------------------------------------------------------


def test_server_serves_and_polls_a_bucket(bucket, s3_endpoint, tmp_path):
    """Load from S3, serve with tritonclient; POLL picks up a version added later."""
    name, client = bucket
    upload_model(client, name, "models", SIMPLE, "simple")
    cache = tmp_path / "cache"
    server = ServerProcess(
        f"s3://{s3_endpoint}/{name}/models",
        args=[
            "--model-control-mode=poll",
            "--repository-poll-secs=0.3",
            f"--model-cache-dir={cache}",
            "--allow-grpc=false",
        ],
    )
    try:
        server.wait_ready(path="/v2/health/ready")
        http = httpclient.InferenceServerClient(server.http_url)
        infer_simple(http)
        assert http.is_model_ready("simple", "1")

        # A new version appears in the bucket; the default policy (latest 1)
        # serves it in place of version 1.
        client.upload_file(str(SIMPLE / "1" / "model.onnx"), name, "models/simple/2/model.onnx")
        wait_for(lambda: http.is_model_ready("simple", "2"), "version 2 to load", 30)
        infer_simple(http, "2")
        wait_for(lambda: not http.is_model_ready("simple", "1"), "version 1 to unload", 30)

        # A model removed from the bucket is unloaded.
        for key in ("config.pbtxt", "1/model.onnx", "2/model.onnx"):
            client.delete_object(Bucket=name, Key=f"models/simple/{key}")
        wait_for(lambda: not http.is_model_ready("simple"), "the model to unload", 30)
        http.close()
        assert server.stop() == 0
    finally:
        server.close()
    assert not any(p.name != ".trionserve-manifest.json" for p in cache.rglob("*") if p.is_file())


def test_explicit_load_fetches_the_model_from_the_bucket(bucket, s3_endpoint):
    name, client = bucket
    server = ServerProcess(
        f"s3://{s3_endpoint}/{name}/models",
        args=["--model-control-mode=explicit", "--allow-grpc=false"],
    )
    try:
        server.wait_ready()
        http = httpclient.InferenceServerClient(server.http_url)
        upload_model(client, name, "models", SIMPLE, "simple")  # after the server started
        http.load_model("simple")
        infer_simple(http)
        http.close()
        assert server.stop() == 0
    finally:
        server.close()


def test_missing_bucket_stops_startup_with_a_clear_error(s3_endpoint, aws_env):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trionserve",
            f"--model-repository=s3://{s3_endpoint}/no-such-bucket/models",
            "--allow-http=false",
            "--allow-grpc=false",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert result.returncode == 1
    assert "no-such-bucket" in result.stderr and "NoSuchBucket" in result.stderr
