"""as:// repositories against Azurite, Microsoft's Azure Storage emulator, on loopback.

Azurite is an npm package: the first run installs a pinned version with npm into
the user's cache directory (reused by later runs), and each test module starts
``azurite-blob`` on a free port with a fresh workspace. The mirror and trionserve
reach it the way they reach Azure when a connection string names a blob
endpoint: ``AZURE_STORAGE_CONNECTION_STRING`` with Azurite's well-known
``devstoreaccount1`` key. Without node and npm, or when the install fails, the
tests skip and say why.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from tests.e2e.test_object_store import infer_simple
from tests.helpers import emulator, wait_for
from tests.serverproc import EXAMPLES, ServerProcess, free_port
from trionserve.core.errors import InvalidArgument, Unavailable
from trionserve.repository.object_store import AzureStore, ObjectStoreMirror, parse_location

blob = pytest.importorskip("azure.storage.blob", reason="needs azure-storage-blob (azure extra)")

AZURITE_VERSION = "3.35.0"  # the newest that declares support for node < 21
ACCOUNT = "devstoreaccount1"
# Azurite's documented development key: public, valid only against the emulator.
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
SIMPLE = EXAMPLES / "simple"


def connection_string(endpoint: str, key: str = ACCOUNT_KEY) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
        f"BlobEndpoint={endpoint}/{ACCOUNT};"
    )


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trionserve-tests"


def install_azurite() -> Path:
    """The ``azurite-blob`` executable, installed with npm on first use; skips if it cannot be."""
    if shutil.which("node") is None:
        pytest.skip("the as:// tests run Azurite, which needs node: not found on PATH")
    prefix = cache_root() / f"azurite-{AZURITE_VERSION}"
    executable = prefix / "node_modules" / ".bin" / "azurite-blob"
    if executable.exists():
        return executable
    if shutil.which("npm") is None:
        pytest.skip("the as:// tests install Azurite with npm: not found on PATH")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # One install at a time (parallel test runs share the cache), each into its
    # own directory renamed into place when complete, so a half-done install
    # is never taken for a finished one.
    with open(prefix.parent / f"azurite-{AZURITE_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if executable.exists():
            return executable
        staging = Path(tempfile.mkdtemp(prefix=".azurite-install-", dir=prefix.parent))
        try:
            result = subprocess.run(
                [
                    "npm",
                    "install",
                    "--prefix",
                    str(staging),
                    "--no-audit",
                    "--no-fund",
                    "--loglevel=error",
                    f"azurite@{AZURITE_VERSION}",
                ],
                capture_output=True,
                text=True,
                timeout=240,
            )
            if result.returncode != 0:
                pytest.skip(
                    f"npm install azurite@{AZURITE_VERSION} failed "
                    f"({result.returncode}): {(result.stderr or result.stdout)[-800:]}"
                )
            os.rename(staging, prefix)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install azurite@{AZURITE_VERSION} took over 240 s")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return executable


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    """An Azurite blob service on loopback: its endpoint, ``http://127.0.0.1:PORT``."""
    executable = install_azurite()
    port = free_port()
    workspace = tmp_path_factory.mktemp("azurite")
    log = workspace / "azurite.log"
    command = [
        str(executable),
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(port),
        "--location",
        str(workspace / "data"),
        "--skipApiVersionCheck",
        "--loose",
    ]
    with emulator(command, log, "azurite-blob", lambda: "successfully listens" in log.read_text()):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def container(azurite, monkeypatch, request):
    """A fresh container (named after the test), with the connection string in the env."""
    connection = connection_string(azurite)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection)
    monkeypatch.delenv("AZURE_STORAGE_KEY", raising=False)
    service = blob.BlobServiceClient.from_connection_string(connection)
    name = request.node.name.replace("_", "-").lower()[:63].strip("-")
    return service.create_container(name)


def upload(container, key: str, data: bytes | Path, **options) -> None:
    body = data.read_bytes() if isinstance(data, Path) else data
    container.upload_blob(key, body, overwrite=True, **options)


def upload_model(container, prefix: str, name: str, versions=("1",)) -> None:
    upload(container, f"{prefix}/{name}/config.pbtxt", SIMPLE / "config.pbtxt")
    for version in versions:
        upload(container, f"{prefix}/{name}/{version}/model.onnx", SIMPLE / "1" / "model.onnx")


def url(container, prefix: str) -> str:
    return f"as://{ACCOUNT}/{container.container_name}/{prefix}"


# -- the mirror ------------------------------------------------------------------


def test_azure_repository_is_mirrored_and_follows_changes(container, tmp_path):
    upload_model(container, "repo", "simple")
    upload(container, "repo/simple/labels.txt", b"a\nb\n")
    upload(container, "repository/other/config.pbtxt", b"")  # shares "repo", not "repo/"
    mirror = ObjectStoreMirror(url(container, "repo"), tmp_path / "cache")
    root = mirror.root

    first = mirror.sync()
    assert sorted(first.added) == [
        "simple/1/model.onnx",
        "simple/config.pbtxt",
        "simple/labels.txt",
    ]
    assert (root / "simple" / "1" / "model.onnx").read_bytes() == (
        SIMPLE / "1" / "model.onnx"
    ).read_bytes()
    mtime = (root / "simple" / "1" / "model.onnx").stat().st_mtime_ns

    # Nothing changed: nothing is downloaded again.
    assert not mirror.sync()
    assert (root / "simple" / "1" / "model.onnx").stat().st_mtime_ns == mtime

    # Same size, new content: the ETag tells.
    upload(container, "repo/simple/labels.txt", b"c\nd\n")
    upload(container, "repo/simple/2/model.onnx", SIMPLE / "1" / "model.onnx")
    second = mirror.sync()
    assert (second.added, second.updated) == (("simple/2/model.onnx",), ("simple/labels.txt",))
    assert (root / "simple" / "labels.txt").read_text() == "c\nd\n"

    # A deleted blob is deleted locally, with the directory it emptied.
    container.delete_blob("repo/simple/2/model.onnx")
    assert mirror.sync().removed == ("simple/2/model.onnx",)
    assert not (root / "simple" / "2").exists()

    # The record of downloads survives a restart: a new mirror downloads nothing.
    assert not ObjectStoreMirror(url(container, "repo"), root).sync()
    assert (root / "simple" / "1" / "model.onnx").stat().st_mtime_ns == mtime


def test_azure_listing_follows_continuation_pages(container):
    for version in range(1, 6):
        upload(container, f"repo/simple/{version}/model.onnx", b"x" * version)
    store = AzureStore(parse_location(url(container, "repo")))
    whole = store.list("")
    # Azure pages at 5000 blobs; two per page makes the store follow four markers.
    store.container.list_blobs = functools.partial(store.container.list_blobs, results_per_page=2)
    paged = store.list("")
    assert [(o.key, o.size) for o in paged] == [(f"simple/{v}/model.onnx", v) for v in range(1, 6)]
    assert paged == whole
    assert all(o.etag for o in paged)


def test_azure_data_lake_directories_are_not_files(container, tmp_path):
    """Accounts with a hierarchical namespace (Data Lake Gen2) list directories as blobs.

    They come back as empty blobs with ``hdi_isfolder=true`` metadata, the same
    name as the directory and no trailing slash; written as files, they would
    stand where the model's directories must go.
    """
    for directory in ("repo", "repo/simple", "repo/simple/1"):
        upload(container, directory, b"", metadata={"hdi_isfolder": "true"})
    upload_model(container, "repo", "simple")
    upload(container, "repo/simple/empty.txt", b"")  # an empty file is still a file
    mirror = ObjectStoreMirror(url(container, "repo"), tmp_path / "cache")
    assert sorted(mirror.sync().added) == [
        "simple/1/model.onnx",
        "simple/config.pbtxt",
        "simple/empty.txt",
    ]
    assert (mirror.root / "simple" / "1" / "model.onnx").is_file()


def test_missing_container_is_unavailable_with_its_name(azurite, container, tmp_path):
    mirror = ObjectStoreMirror(f"as://{ACCOUNT}/no-such-container/repo", tmp_path / "c")
    with pytest.raises(Unavailable) as raised:
        mirror.sync()
    message = str(raised.value)
    assert f"as://{ACCOUNT}/no-such-container/repo" in message
    assert "ContainerNotFound" in message
    assert "\n" not in message  # not the service's multi-line XML body


def test_unreachable_endpoint_is_reported_within_seconds(monkeypatch, tmp_path):
    """Retried three times, but not for a minute and a half (the SDK's default):
    the backoffs the retry policy asks its transport to sleep are recorded, not
    slept, so the bound holds on them whatever the host's load."""
    from azure.core.pipeline.transport import HttpTransport

    backoffs: list[float] = []
    monkeypatch.setattr(HttpTransport, "sleep", lambda self, seconds: backoffs.append(seconds))
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING", connection_string(f"http://127.0.0.1:{free_port()}")
    )  # nothing listens there
    mirror = ObjectStoreMirror(f"as://{ACCOUNT}/models/repo", tmp_path / "c")
    started = time.monotonic()
    with pytest.raises(Unavailable, match=f"'as://{ACCOUNT}/models/repo'.*refused"):
        mirror.sync()
    assert len(backoffs) == 3, backoffs
    assert sum(backoffs) + (time.monotonic() - started) < 40, backoffs


def test_a_connection_string_for_another_account_is_refused(container, tmp_path):
    mirror = ObjectStoreMirror(f"as://otheraccount/{container.container_name}/repo", tmp_path / "c")
    with pytest.raises(
        InvalidArgument,
        match=(
            f"'as://otheraccount/{container.container_name}/repo' names storage account "
            f"'otheraccount', but AZURE_STORAGE_CONNECTION_STRING is for account '{ACCOUNT}'"
        ),
    ):
        mirror.sync()


# -- the server ------------------------------------------------------------------


def test_server_serves_and_polls_a_container(container, tmp_path):
    """Load from Azure, serve with tritonclient; POLL follows versions, configs, deletions."""
    upload_model(container, "models", "simple")
    cache = tmp_path / "cache"
    server = ServerProcess(
        url(container, "models"),
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

        # A new version appears in the container; the default policy (latest 1)
        # serves it in place of version 1.
        upload(container, "models/simple/2/model.onnx", SIMPLE / "1" / "model.onnx")
        wait_for(lambda: http.is_model_ready("simple", "2"), "version 2 to load", 30)
        infer_simple(http, "2")
        wait_for(lambda: not http.is_model_ready("simple", "1"), "version 1 to unload", 30)

        # A changed config is reloaded: pinning version 1 brings it back.
        config = (SIMPLE / "config.pbtxt").read_text()
        upload(
            container,
            "models/simple/config.pbtxt",
            (config + "version_policy: { specific: { versions: [1] } }\n").encode(),
        )
        wait_for(lambda: http.is_model_ready("simple", "1"), "version 1 to load again", 30)
        wait_for(lambda: not http.is_model_ready("simple", "2"), "version 2 to unload", 30)
        infer_simple(http, "1")
        policy = http.get_model_config("simple")["version_policy"]
        assert [int(v) for v in policy["specific"]["versions"]] == [1]

        # A model removed from the container is unloaded.
        for key in ("config.pbtxt", "1/model.onnx", "2/model.onnx"):
            container.delete_blob(f"models/simple/{key}")
        wait_for(lambda: not http.is_model_ready("simple"), "the model to unload", 30)
        http.close()
        assert server.stop() == 0
    finally:
        server.close()
    assert not any(p.name != ".trionserve-manifest.json" for p in cache.rglob("*") if p.is_file())


def start_and_fail(location: str, connection: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, AZURE_STORAGE_CONNECTION_STRING=connection)
    env.pop("AZURE_STORAGE_KEY", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trionserve",
            f"--model-repository={location}",
            "--allow-http=false",
            "--allow-grpc=false",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_missing_container_stops_startup_with_a_clear_error(azurite):
    location = f"as://{ACCOUNT}/no-such-container/models"
    result = start_and_fail(location, connection_string(azurite))
    assert result.returncode == 1
    assert location in result.stderr and "ContainerNotFound" in result.stderr


def test_wrong_key_stops_startup_with_a_clear_error(azurite, container):
    upload_model(container, "models", "simple")
    location = url(container, "models")
    wrong = "d3Jvbmcga2V5IGZvciBkZXZzdG9yZWFjY291bnQx"  # base64, but not the account's key
    result = start_and_fail(location, connection_string(azurite, key=wrong))
    assert result.returncode == 1
    # Azure answers AuthenticationFailed, Azurite AuthorizationFailure; both say this.
    assert location in result.stderr and "failed to authenticate" in result.stderr
    assert "<?xml" not in result.stderr
