"""The S3 client's first requests, against a small S3 stand-in on a loopback port.

Triton's S3 file system reaches the bucket with a HeadBucket request when it is
created (core src/filesystem/implementations/s3.h CheckClient) and lists with
ListObjectsV2 after; Triton's qa/L0_storage_S3_local checks both arrive over
HTTP/1.1, with no HTTP/2 upgrade offered. The stand-in answers HEAD 200 and
GET 404, as that suite's mock does, and records what it was sent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trionserve.core.errors import Unavailable
from trionserve.repository.object_store import ObjectStoreMirror

pytest.importorskip("boto3", reason="s3:// repositories need boto3 (the s3 extra)")


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, dict[str, str]]]
    head_status = 200

    def _record(self) -> None:
        self.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

    def do_HEAD(self) -> None:
        self._record()
        self.send_response(self.head_status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self._record()
        body = b"<Error><Code>NoSuchBucket</Code><Message>not here</Message></Error>"
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, type[_Recorder]]]:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    handler = type("Handler", (_Recorder,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_bucket_is_reached_with_head_before_listing_over_http1(stand_in, tmp_path):
    endpoint, handler = stand_in
    mirror = ObjectStoreMirror(f"s3://{endpoint}/dummy-bucket/models", tmp_path / "cache")
    with pytest.raises(Unavailable, match="dummy-bucket/models.*NoSuchBucket"):
        mirror.sync()
    methods = [method for method, _, _ in handler.seen]
    assert methods[0] == "HEAD" and handler.seen[0][1] == "/dummy-bucket"
    assert "GET" in methods
    for _, _, headers in handler.seen:
        assert "upgrade" not in headers and "http2-settings" not in headers
        assert "upgrade" not in headers.get("connection", "").lower()


def test_a_bucket_head_refused_names_the_credentials(stand_in, tmp_path):
    endpoint, handler = stand_in
    handler.head_status = 403
    mirror = ObjectStoreMirror(f"s3://{endpoint}/locked/models", tmp_path / "cache")
    # Triton's words exactly (its AWS C++ SDK names a body-less error '' / 'No
    # response body.'; qa/L0_storage_S3_local greps them), then the status.
    expected = (
        "'s3://127.0.0.1:[0-9]+/locked/models': Unable to create S3 filesystem client. "
        "Check account credentials. Exception: '' Message: 'No response body.' "
        r"\(HTTP 403: access denied"
    )
    with pytest.raises(Unavailable, match=expected):
        mirror.sync()
    assert [method for method, _, _ in handler.seen] == ["HEAD"]


def test_a_bucket_head_not_found_in_tritons_words_then_the_reason(stand_in, tmp_path):
    endpoint, handler = stand_in
    handler.head_status = 404
    mirror = ObjectStoreMirror(f"s3://{endpoint}/gone/models", tmp_path / "cache")
    with pytest.raises(Unavailable) as info:
        mirror.sync()
    assert info.value.message.endswith(
        "Unable to create S3 filesystem client. Check account credentials. Exception: '' "
        "Message: 'No response body.' (HTTP 404: NoSuchBucket, the bucket does not exist)"
    )
    assert [method for method, _, _ in handler.seen] == ["HEAD"]
