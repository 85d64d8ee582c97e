"""Model file overrides of the load API, written to a directory outside the repository.

Triton's load API may carry the whole model: a ``config`` parameter (the model
configuration as JSON) and ``file:<path>`` parameters (file contents, e.g.
``file:1/model.onnx``). Like Triton, the files are written to a fresh temporary
directory, never into a model repository, and the model is loaded from there; the
directory is removed once no loaded version uses it. Functions here are blocking:
run them in a worker thread.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from google.protobuf import text_format

from trionserve.core.errors import InvalidArgument
from trionserve.repository.config import CONFIG_FILENAME, read_model_config

FILE_PREFIX = "file:"
# Bounds on a file override's path inside the model directory (Linux allows 4096
# bytes in a path and 255 in a name; a model directory is rarely more than a few
# levels deep).
MAX_OVERRIDE_PATH_BYTES = 1024
MAX_OVERRIDE_PATH_LEVELS = 32
OVERRIDE_DIR_PREFIX = "trionserve-override-"
# Files one load request may write (Triton has no such bound: its request size is
# the only one). Their total size is bounded by the request's own limit
# (--http-max-input-size, --grpc-max-message-size).
MAX_OVERRIDE_FILES = 4096


def check_override_request(name: str, config_json: str | None, files: dict[str, bytes]) -> None:
    """Refuse, before anything is written, a load request whose text is no UTF-8
    (a JSON string can carry a lone surrogate such as ``"\\udcff"``) or that
    carries more files than :data:`MAX_OVERRIDE_FILES`."""
    for key, what in (
        *((key, f"load parameter {ascii(key)}") for key in files),
        *(((config_json, "load parameter 'config'"),) if config_json is not None else ()),
    ):
        try:
            key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgument(
                f"failed to load '{name}': {what} is not valid UTF-8: it holds "
                f"{ascii(exc.object[exc.start : exc.end])} at character {exc.start}"
            ) from None
    if len(files) > MAX_OVERRIDE_FILES:
        raise InvalidArgument(
            f"failed to load '{name}': {len(files)} file override parameters, more than "
            f"{MAX_OVERRIDE_FILES} in one load request"
        )


def override_digest(config_json: str | None, files: dict[str, bytes] | None) -> str:
    """A digest of a load request's overrides: equal digests, equal requests."""
    digest = hashlib.sha256()
    digest.update((config_json or "").encode())
    for key, data in sorted((files or {}).items()):
        digest.update(b"\0" + key.encode() + b"\0")
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def _relative_path(key: str, name: str) -> PurePosixPath:
    if not key.startswith(FILE_PREFIX):
        raise InvalidArgument(
            f"failed to load '{name}': file override parameter '{key}' must start "
            f"with '{FILE_PREFIX}'"
        )
    text = key[len(FILE_PREFIX) :]
    if "\0" in text:
        raise InvalidArgument(
            f"failed to load '{name}': invalid file override parameter {key!r}: the "
            "path contains a NUL byte"
        )
    if len(text.encode()) > MAX_OVERRIDE_PATH_BYTES:
        raise InvalidArgument(
            f"failed to load '{name}': invalid file override parameter: the path is "
            f"{len(text.encode())} bytes long, more than {MAX_OVERRIDE_PATH_BYTES} bytes"
        )
    # Triton joins the path to the model directory (core filesystem.cc JoinPath:
    # a leading '/' is dropped, so 'file:/1/model.py' is '1/model.py'), then
    # normalizes it and refuses what escapes the directory
    # (model_repository_manager.cc, IsChildPathEscapingParentPath).
    path = PurePosixPath(text.lstrip("/"))
    if len(path.parts) > MAX_OVERRIDE_PATH_LEVELS:
        raise InvalidArgument(
            f"failed to load '{name}': invalid file override parameter: the path has "
            f"{len(path.parts)} levels, more than {MAX_OVERRIDE_PATH_LEVELS} levels"
        )
    if any(len(part.encode()) > 255 for part in path.parts):
        raise InvalidArgument(
            f"failed to load '{name}': invalid file override parameter: a path part "
            "is longer than 255 bytes"
        )
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if not parts:
                parts = [".."]
                break
            parts.pop()
        elif part != ".":
            parts.append(part)
    if not parts or parts[0] == "..":
        raise InvalidArgument(
            f"failed to load '{name}': invalid file override parameter '{key}' with "
            f"normalized path '{'/'.join(parts)}' must stay within model directory"
        )
    path = PurePosixPath(*parts)
    if str(path) == CONFIG_FILENAME:
        raise InvalidArgument(
            f"failed to load '{name}': '{key}' cannot override the model "
            "configuration; pass it as the 'config' parameter"
        )
    return path


def write_override(name: str, config_json: str | None, files: dict[str, bytes]) -> Path:
    """Write an override model directory and return it (``<tmp>/<name>``).

    The configuration is required (Triton's rule: the files form a whole model
    directory and config.pbtxt cannot be one of them); it is validated as JSON
    here and written as config.pbtxt.
    """
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\0"):
        raise InvalidArgument(
            f"invalid model name '{name}': a model name must not be empty or contain "
            "path separators"
        )
    if config_json is None:
        raise InvalidArgument(
            f"failed to load '{name}': load parameter 'config' must be specified "
            "for a model file override"
        )
    paths = {key: _relative_path(key, name) for key in files}
    root = Path(tempfile.mkdtemp(prefix=OVERRIDE_DIR_PREFIX))
    model_dir = root / name
    try:
        model_dir.mkdir()
        config, _ = read_model_config(model_dir, config_json)
        (model_dir / CONFIG_FILENAME).write_text(text_format.MessageToString(config))
        for key, relative in paths.items():
            target = model_dir.joinpath(*relative.parts)
            if target.parent.exists() and not target.parent.is_dir():
                raise InvalidArgument(
                    f"failed to load '{name}': invalid file override parameter "
                    f"'{key}': '{relative.parent}' is already a file"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files[key])
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return model_dir


def is_override_dir(model_dir: Path) -> bool:
    return Path(model_dir).parent.name.startswith(OVERRIDE_DIR_PREFIX)


def remove_override(model_dir: Path) -> None:
    """Delete an override directory written by :func:`write_override`."""
    if is_override_dir(model_dir):
        shutil.rmtree(Path(model_dir).parent, ignore_errors=True)
