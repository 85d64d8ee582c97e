"""gs:// repositories against a real GCS-compatible server on loopback.

The server is gcp-storage-emulator, started as a subprocess; google-cloud-storage
finds it through ``STORAGE_EMULATOR_HOST``, the variable Google's clients honour.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers import emulator
from tests.serverproc import EXAMPLES, free_port
from trionserve.repository.object_store import ObjectStoreMirror
from trionserve.repository.repository import ModelRepository

pytest.importorskip("gcp_storage_emulator", reason="needs gcp-storage-emulator (test extra)")
storage = pytest.importorskip(
    "google.cloud.storage", reason="needs google-cloud-storage (gcs extra)"
)
from google.auth.credentials import AnonymousCredentials  # noqa: E402

SIMPLE = EXAMPLES / "simple"


@pytest.fixture(scope="module")
def gcs_endpoint(tmp_path_factory):
    """A gcp-storage-emulator on loopback: its ``http://127.0.0.1:PORT``."""
    port = free_port()
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    command = [
        sys.executable,
        "-m",
        "gcp_storage_emulator",
        "start",
        "--host=127.0.0.1",
        f"--port={port}",
        "--in-memory",
    ]
    with emulator(
        command, log, "gcp-storage-emulator", lambda: "All services started" in log.read_text()
    ):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def bucket(gcs_endpoint, monkeypatch, request):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    client = storage.Client(project="test", credentials=AnonymousCredentials())
    return client.create_bucket(request.node.name.replace("_", "-").lower()[:50])


def test_gcs_repository_is_mirrored_and_follows_changes(bucket, tmp_path):
    bucket.blob("repo/simple/config.pbtxt").upload_from_filename(str(SIMPLE / "config.pbtxt"))
    bucket.blob("repo/simple/1/model.onnx").upload_from_filename(str(SIMPLE / "1" / "model.onnx"))
    repository = ModelRepository([f"gs://{bucket.name}/repo"], cache_dir=tmp_path)
    (mirror,) = repository.mirrors
    assert repository.find("simple") == mirror.root / "simple"
    assert (mirror.root / "simple" / "config.pbtxt").read_bytes() == (
        SIMPLE / "config.pbtxt"
    ).read_bytes()

    assert not mirror.sync()
    bucket.blob("repo/simple/2/model.onnx").upload_from_filename(str(SIMPLE / "1" / "model.onnx"))
    bucket.blob("repo/simple/1/model.onnx").delete()
    changes = mirror.sync()
    assert (changes.added, changes.removed) == (("simple/2/model.onnx",), ("simple/1/model.onnx",))
    assert sorted(p.name for p in (mirror.root / "simple").iterdir()) == ["2", "config.pbtxt"]


def test_gcs_empty_prefix_mirrors_to_an_empty_directory(bucket, tmp_path):
    mirror = ObjectStoreMirror(f"gs://{bucket.name}/empty", tmp_path / "c")
    assert not mirror.sync()
    assert [p.name for p in mirror.root.iterdir()] == [".trionserve-manifest.json"]
