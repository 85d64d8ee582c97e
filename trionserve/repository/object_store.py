"""Object-storage model repositories: mirror an s3://, gs:// or as:// prefix locally.

Triton reads a repository in object storage by copying it to a local directory;
so does trionserve. An :class:`ObjectStoreMirror` keeps one local directory equal
to one remote prefix: each :meth:`~ObjectStoreMirror.sync` lists the prefix,
downloads the objects whose ETag or size differ from what it downloaded before,
deletes the local files whose objects are gone, and reports what changed. The rest
of the server sees only a local model repository, so config parsing, version
policies and POLL's snapshots work unchanged: a re-downloaded file has a new
modification time, which is what the next snapshot notices.

Locations, spelled as Triton spells them:

- ``s3://bucket/prefix``; an S3-compatible store at ``s3://host:port/bucket/prefix``
  (HTTP) or ``s3://https://host:port/bucket/prefix``. Credentials, region and
  endpoint also come from boto3's standard sources (``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``,
  ``AWS_PROFILE``, ``AWS_ENDPOINT_URL_S3``, instance and pod roles); with no
  credentials at all, requests go unsigned (public buckets).
- ``gs://bucket/prefix``: google-cloud-storage's default credentials
  (``GOOGLE_APPLICATION_CREDENTIALS``, workload identity), else anonymous.
- ``as://account/container/prefix``: ``AZURE_STORAGE_KEY`` for the account, or
  ``AZURE_STORAGE_CONNECTION_STRING`` for it (which also names the endpoint, as
  for Azurite), else anonymous.

Every method does blocking network and file I/O: run it in a worker thread.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Protocol

import structlog

from trionserve.core.errors import InvalidArgument, Unavailable

if TYPE_CHECKING:
    from azure.storage.blob import BlobProperties

log = structlog.get_logger(__name__)

SCHEMES = ("s3", "gs", "as")
_MANIFEST = ".trionserve-manifest.json"  # what was downloaded, with ETags and sizes
_PARTIAL = ".trionserve-partial"  # downloads in progress, renamed into place when done
_S3 = re.compile(r"s3://(?:(?P<scheme>https?)://)?(?:(?P<host>[^/:]+):(?P<port>\d+)/)?(?P<rest>.*)")


def is_remote(location: object) -> bool:
    """Whether a --model-repository value names object storage, not a directory."""
    return (
        isinstance(location, str) and location.split("://", 1)[0] in SCHEMES and ("://" in location)
    )


@dataclass(frozen=True)
class RemoteLocation:
    """A parsed object-storage repository location."""

    url: str  # as given
    scheme: str  # "s3", "gs" or "as"
    bucket: str  # the bucket (s3, gs) or container (as)
    prefix: str  # "" or a key prefix ending with "/"
    endpoint: str | None = None  # s3: a custom endpoint URL
    account: str | None = None  # as: the storage account

    def __str__(self) -> str:
        return self.url


def parse_location(url: str) -> RemoteLocation:
    """Parse ``s3://``, ``gs://`` and ``as://`` repository locations (Triton's forms)."""
    scheme = url.split("://", 1)[0]
    if scheme not in SCHEMES or "://" not in url:
        raise InvalidArgument(f"'{url}' is not an s3://, gs:// or as:// location")
    endpoint = account = None
    if scheme == "s3":
        match = _S3.fullmatch(url)
        assert match is not None  # the pattern accepts any s3:// text
        if match["host"]:
            endpoint = f"{match['scheme'] or 'http'}://{match['host']}:{match['port']}"
        rest = match["rest"]
    else:
        rest = url.split("://", 1)[1]
    if scheme == "as":
        account, _, rest = rest.partition("/")
        if not account:
            raise InvalidArgument(f"model repository '{url}': expected as://account/container/path")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise InvalidArgument(f"model repository '{url}' names no bucket")
    prefix = prefix.strip("/")
    return RemoteLocation(url, scheme, bucket, prefix + "/" if prefix else "", endpoint, account)


@dataclass(frozen=True)
class ObjectInfo:
    """One object under a repository prefix: key relative to the prefix, ETag, size."""

    key: str
    etag: str
    size: int


class ObjectStore(Protocol):
    """The two calls a mirror needs from a storage service."""

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``location.prefix + prefix``."""

    def download(self, key: str, destination: Path) -> None:
        """Write the object at ``location.prefix + key`` to ``destination``."""


def _missing(package: str, extra: str, scheme: str) -> Unavailable:
    return Unavailable(
        f"{scheme}:// model repositories need the '{package}' package: "
        f"pip install 'trionserve[{extra}]'"
    )


class S3Store:
    """S3 and S3-compatible stores through boto3."""

    def __init__(self, location: RemoteLocation) -> None:
        try:
            import boto3
            import botocore.config
            from botocore import UNSIGNED
        except ImportError:
            raise _missing("boto3", "s3", "s3") from None
        self.location = location
        session = boto3.session.Session()
        options: dict = {"retries": {"max_attempts": 5, "mode": "standard"}}
        if location.endpoint:
            options["s3"] = {"addressing_style": "path"}  # host:port stores rarely do DNS
        if session.get_credentials() is None:
            options["signature_version"] = UNSIGNED
        self.client = session.client(
            "s3",
            endpoint_url=location.endpoint,
            config=botocore.config.Config(**options),
        )
        self._check_bucket()

    def _check_bucket(self) -> None:
        """Reach the bucket before anything is listed, as Triton's S3 file system
        does when it is created (core src/filesystem/implementations/s3.h:337-353,
        CheckClient: a HeadBucket request; when it fails, "Unable to create S3
        filesystem client. Check account credentials. Exception: '<name>'
        Message: '<message>'").

        A HEAD answer has no body, and the AWS C++ SDK Triton links names an
        error without a body ``''`` / ``No response body.`` whatever its status
        (aws-cpp-sdk-core AWSXmlClient::BuildAWSError), so a refused or missing
        bucket reads exactly as in Triton's log (qa/L0_storage_S3_local and
        L0_storage_S3 grep it); the status follows, as a reason to act on. A
        store that could not be reached at all gives the client's own reason.
        """
        try:
            self.client.head_bucket(Bucket=self.location.bucket)
        except Exception as exc:
            status = _http_status(exc)
            if status is None:
                code, _, message = _reason(exc).partition(": ")
                words = f"Exception: '{code}' Message: '{message}'"
            else:
                meaning = _HEAD_STATUS.get(status, "")
                words = f"Exception: '' Message: 'No response body.' (HTTP {status}{meaning})"
            raise Unavailable(
                f"failed to open model repository '{self.location.url}': Unable to create "
                f"S3 filesystem client. Check account credentials. {words}"
            ) from None

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self.location.prefix
        found = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=base + prefix
        )
        for page in pages:
            for item in page.get("Contents", []):
                found.append(ObjectInfo(item["Key"][len(base) :], item["ETag"], item["Size"]))
        return found

    def download(self, key: str, destination: Path) -> None:
        self.client.download_file(
            self.location.bucket, self.location.prefix + key, str(destination)
        )


class GCSStore:
    """Google Cloud Storage through google-cloud-storage."""

    def __init__(self, location: RemoteLocation) -> None:
        try:
            from google.auth.exceptions import DefaultCredentialsError
            from google.cloud import storage
        except ImportError:
            raise _missing("google-cloud-storage", "gcs", "gs") from None
        self.location = location
        try:
            client = storage.Client()
        except DefaultCredentialsError:
            client = storage.Client.create_anonymous_client()
        self.bucket = client.bucket(location.bucket)
        self.client = client

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self.location.prefix
        return [
            ObjectInfo(blob.name[len(base) :], blob.etag or blob.md5_hash or "", blob.size or 0)
            for blob in self.client.list_blobs(self.bucket, prefix=base + prefix)
        ]

    def download(self, key: str, destination: Path) -> None:
        self.bucket.blob(self.location.prefix + key).download_to_filename(str(destination))


class AzureStore:
    """Azure Blob Storage through azure-storage-blob."""

    def __init__(self, location: RemoteLocation) -> None:
        try:
            from azure.storage.blob import BlobServiceClient, ExponentialRetry
        except ImportError:
            raise _missing("azure-storage-blob", "azure", "as") from None
        self.location = location
        # The SDK's default backoff (15 s, then powers of 3) spends about 80 s
        # before reporting an unreachable endpoint, at start-up and at each poll;
        # this one still retries three times, within about 15 s.
        retry = ExponentialRetry(
            initial_backoff=0, increment_base=2, retry_total=3, random_jitter_range=1
        )
        connection = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        if connection:
            # The string also names the endpoint (Azurite, sovereign clouds, custom domains).
            service = BlobServiceClient.from_connection_string(connection, retry_policy=retry)
            account = getattr(service.credential, "account_name", None)
            if account and account != location.account:
                raise InvalidArgument(
                    f"model repository '{location.url}' names storage account "
                    f"'{location.account}', but AZURE_STORAGE_CONNECTION_STRING is for "
                    f"account '{account}'"
                )
        else:
            service = BlobServiceClient(
                f"https://{location.account}.blob.core.windows.net",
                credential=os.environ.get("AZURE_STORAGE_KEY") or None,
                retry_policy=retry,
            )
        self.container = service.get_container_client(location.bucket)

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self.location.prefix
        return [
            ObjectInfo(blob.name[len(base) :], blob.etag or "", blob.size or 0)
            for blob in self.container.list_blobs(
                name_starts_with=base + prefix, include=["metadata"]
            )
            if not _is_directory(blob)
        ]

    def download(self, key: str, destination: Path) -> None:
        with open(destination, "wb") as out:
            self.container.download_blob(self.location.prefix + key).readinto(out)


def _is_directory(blob: BlobProperties) -> bool:
    """Whether a listed blob is a directory of an account with a hierarchical namespace.

    Data Lake Gen2 accounts list each directory as an empty blob named like the
    directory (no trailing slash) with ``hdi_isfolder=true`` metadata; written as a
    file, it would stand where the directory's files must go.
    """
    return not blob.size and (blob.metadata or {}).get("hdi_isfolder", "").lower() == "true"


def open_store(location: RemoteLocation) -> ObjectStore:
    """The client for a location's storage service."""
    stores: dict[str, Callable[[RemoteLocation], ObjectStore]] = {
        "s3": S3Store,
        "gs": GCSStore,
        "as": AzureStore,
    }
    return stores[location.scheme](location)


@dataclass(frozen=True)
class MirrorChanges:
    """What one sync changed in the local copy, by key relative to the prefix."""

    added: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.updated or self.removed)

    @property
    def models(self) -> set[str]:
        """The names of the models whose files changed."""
        keys = self.added + self.updated + self.removed
        return {key.split("/", 1)[0] for key in keys}


def _local_path(key: str) -> PurePosixPath | None:
    """The relative path an object key is written to, or None for keys to skip.

    Skipped: keys that would leave the cache (``..``, absolute), empty path
    components, and names the mirror reserves for itself.
    """
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") for p in parts) or parts[0].startswith(".trionserve"):
        return None
    return PurePosixPath(*parts)


def cache_name(location: RemoteLocation) -> str:
    """A stable directory name for a location's copy inside the cache directory."""
    digest = hashlib.sha256(location.url.encode()).hexdigest()[:12]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{location.bucket}-{location.prefix}")
    return f"{location.scheme}-{readable.strip('-')[:60]}-{digest}"


class ObjectStoreMirror:
    """Owns one local directory, ``root``, and keeps it equal to one remote prefix.

    Guarantees: files appear in ``root`` whole (downloaded beside it, then renamed
    into place); an object is downloaded again only when its ETag or size changed;
    the record of what was downloaded survives restarts (kept in ``root``), so a
    persistent cache directory is not downloaded again; syncs are serialized.
    Failures to reach the store raise :class:`Unavailable` and leave ``root`` as
    the last successful sync made it.
    """

    def __init__(
        self, location: RemoteLocation | str, root: Path, store: ObjectStore | None = None
    ) -> None:
        self.location = (
            location if isinstance(location, RemoteLocation) else (parse_location(location))
        )
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._store = store
        self._lock = threading.Lock()
        self._manifest: dict[str, tuple[str, int]] = self._read_manifest()

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = open_store(self.location)
        return self._store

    def sync(self, model: str | None = None) -> MirrorChanges:
        """Bring the local copy (or only ``model``'s directory) up to date."""
        scope = f"{model}/" if model else ""
        with self._lock:
            try:
                listing = self.store.list(scope)
            except (Unavailable, InvalidArgument):
                raise
            except Exception as exc:
                raise Unavailable(
                    f"failed to list model repository '{self.location.url}': {_reason(exc)}"
                ) from None
            try:
                return self._apply(scope, listing)
            except OSError as exc:  # the cache's file system: full, read-only, ...
                raise Unavailable(
                    f"failed to update the local copy of '{self.location.url}' in "
                    f"'{self.root}': {exc}"
                ) from None
            finally:
                self._write_manifest()
                shutil.rmtree(self.root / _PARTIAL, ignore_errors=True)

    def _apply(self, scope: str, listing: list[ObjectInfo]) -> MirrorChanges:
        added: list[str] = []
        updated: list[str] = []
        removed: list[str] = []
        wanted: set[str] = set()
        for info in listing:
            if info.key.endswith("/") or not info.key:
                continue  # a "folder" marker: directories exist through their files
            relative = _local_path(info.key)
            if relative is None:
                log.warning(
                    "object skipped: its key cannot be a file name",
                    repository=self.location.url,
                    key=info.key,
                )
                continue
            target = self.root / relative
            key = str(relative)
            wanted.add(key)
            if self._manifest.get(key) == (info.etag, info.size) and _size(target) == info.size:
                continue
            self._download(key, target)
            (updated if key in self._manifest else added).append(key)
            self._manifest[key] = (info.etag, info.size)
        for key in sorted(self._local_files(scope) - wanted):
            self._remove(key)
            removed.append(key)
        changes = MirrorChanges(tuple(added), tuple(updated), tuple(removed))
        if changes:
            log.info(
                "model repository synced",
                repository=self.location.url,
                added=len(added),
                updated=len(updated),
                removed=len(removed),
                models=sorted(changes.models),
            )
        return changes

    def _download(self, key: str, target: Path) -> None:
        partial = self.root / _PARTIAL
        partial.mkdir(exist_ok=True)
        temporary = partial / hashlib.sha256(key.encode()).hexdigest()
        try:
            self.store.download(key, temporary)
        except Exception as exc:
            raise Unavailable(
                f"failed to download '{key}' from model repository "
                f"'{self.location.url}': {_reason(exc)}"
            ) from None
        if target.is_dir():  # the key was a folder before; the object wins
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(temporary, target)

    def _local_files(self, scope: str) -> set[str]:
        """Every file under ``root/scope`` and every manifest key, relative to root."""
        files = {key for key in self._manifest if key.startswith(scope)}
        base = self.root / scope if scope else self.root
        for directory, dirnames, filenames in os.walk(base):
            relative = Path(directory).relative_to(self.root)
            if relative == Path("."):
                dirnames[:] = [d for d in dirnames if not d.startswith(".trionserve")]
                filenames = [f for f in filenames if not f.startswith(".trionserve")]
            files.update(
                str(relative / name) if str(relative) != "." else name for name in filenames
            )
        return files

    def _remove(self, key: str) -> None:
        self._manifest.pop(key, None)
        path = self.root / key
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        # Remove directories the deletion emptied, up to (not including) root.
        parent = path.parent
        while parent != self.root and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

    def _read_manifest(self) -> dict[str, tuple[str, int]]:
        try:
            data = json.loads((self.root / _MANIFEST).read_text())
            if data.get("url") != self.location.url:
                return {}
            return {key: (etag, size) for key, (etag, size) in data["objects"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def _write_manifest(self) -> None:
        data = {
            "url": self.location.url,
            "objects": {k: list(v) for k, v in sorted(self._manifest.items())},
        }
        temporary = self.root / (_MANIFEST + ".tmp")
        temporary.write_text(json.dumps(data))
        os.replace(temporary, self.root / _MANIFEST)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


# What a HeadBucket status means, after Triton's words for it (see _check_bucket).
_HEAD_STATUS = {
    403: ": access denied, the credentials were refused or lack the right",
    404: ": NoSuchBucket, the bucket does not exist",
}


def _http_status(exc: Exception) -> int | None:
    """The HTTP status of a botocore ClientError, None for any other failure."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _reason(exc: Exception) -> str:
    """A short, readable reason from a storage client's exception."""
    response = getattr(exc, "response", None)  # botocore's ClientError
    if isinstance(response, dict) and "Error" in response:
        error = response["Error"]
        return f"{error.get('Code', '')}: {error.get('Message', '')}".strip(": ")
    code = getattr(exc, "error_code", None)  # azure-core's HttpResponseError
    if code is not None:
        # Its text goes on with a request id, a time and the XML body: keep the first line.
        message = (getattr(exc, "message", None) or str(exc)).split("\n", 1)[0]
        return f"{getattr(code, 'value', code)}: {message}"
    return str(exc) or type(exc).__name__


def open_mirrors(
    paths: Iterable[Path | str], cache_dir: Path | str | None = None
) -> tuple[list[Path | str], list[ObjectStoreMirror]]:
    """Replace each object-storage location in ``paths`` by a synced local copy.

    Returns the paths, in order, with each location replaced by its copy's
    directory, and the mirrors that keep the copies. Copies live in ``cache_dir``
    (one subdirectory per location, kept across restarts), or without one in a
    temporary directory removed when the process exits. Raises Unavailable when a
    location cannot be read, InvalidArgument when it cannot be parsed.
    """
    paths = list(paths)
    mirrors: list[ObjectStoreMirror] = []
    if not any(is_remote(p) for p in paths):
        return paths, mirrors
    if cache_dir is None:
        cache_dir = tempfile.mkdtemp(prefix="trionserve-model-cache-")
        atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    result: list[Path | str] = []
    for path in paths:
        if not is_remote(path):
            result.append(path)
            continue
        location = parse_location(str(path))
        mirror = ObjectStoreMirror(location, Path(cache_dir) / cache_name(location))
        mirror.sync()
        mirrors.append(mirror)
        result.append(mirror.root)
    return result, mirrors
