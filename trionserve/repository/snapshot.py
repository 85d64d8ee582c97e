"""Snapshots of model directories: what POLL compares to see what changed.

A snapshot lists every file under a model directory by relative path with its size
and modification time, every directory by relative path, and a hash of
config.pbtxt and of the ``configs/*.pbtxt`` that ``--model-config-name`` picks
from (an edit that keeps the size within the file system's mtime granularity
would otherwise go unseen). Files that are not part of a model are left
out, so that they never cause a reload: hidden files, ``__pycache__`` (a Python
model's bytecode cache), and editor swap and backup files (``.config.pbtxt.swp``,
``config.pbtxt~``, ``#config.pbtxt#``, vim's ``4913`` probe). Directories carry no
mtime: a directory's mtime changes whenever an ignored file appears in it.

Every function here does blocking file-system calls: run it in a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trionserve.repository.config import CONFIG_FILENAME, CUSTOM_CONFIGS_DIR
from trionserve.repository.repository import ModelId, ModelRepository, duplicate_reason

_VERSION_NAME = re.compile(r"[1-9][0-9]*")
_EDITOR_SUFFIXES = (".swp", ".swo", ".swn", ".swx", ".bak", ".orig", ".tmp", "~")
DIRECTORY = -1  # the size recorded for a directory


def is_ignored(name: str, is_dir: bool = False) -> bool:
    """Whether a file or directory name is left out of snapshots."""
    return (
        name.startswith(".")
        or name == "__pycache__"
        or name.endswith(_EDITOR_SUFFIXES)
        or (name.startswith("#") and name.endswith("#"))
        or (name == "4913" and not is_dir)
    )


@dataclass(frozen=True)
class ModelSnapshot:
    """What a model directory held at one moment; equal snapshots mean no change.

    ``entries`` is sorted ``(relative path, size, mtime_ns)``, with size
    ``DIRECTORY`` and mtime 0 for directories.
    """

    entries: tuple[tuple[str, int, int], ...]
    config_hash: str | None

    def paths(self) -> dict[str, tuple[int, int]]:
        return {path: (size, mtime) for path, size, mtime in self.entries}


@dataclass(frozen=True)
class FileChanges:
    """Which parts of a model directory differ between two snapshots."""

    config: bool  # config.pbtxt, configs/
    shared: bool  # anything outside config.pbtxt and the version directories
    versions: frozenset[int]  # version directories with any difference

    @property
    def any(self) -> bool:
        return self.config or self.shared or bool(self.versions)


def snapshot_model(model_dir: Path) -> ModelSnapshot | None:
    """The snapshot of one model directory, or None when it is not a directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return None
    entries: list[tuple[str, int, int]] = []
    seen_dirs: set[tuple[int, int]] = set()

    def walk(directory: Path, prefix: str) -> None:
        try:
            stat = directory.stat()
            with os.scandir(directory) as scan:
                children = sorted(scan, key=lambda e: e.name)
        except OSError:
            return  # vanished mid-walk: the next poll sees the difference
        if (stat.st_dev, stat.st_ino) in seen_dirs:
            return  # a symlink loop
        seen_dirs.add((stat.st_dev, stat.st_ino))
        for child in children:
            try:
                is_dir = child.is_dir()
            except OSError:
                continue
            if is_ignored(child.name, is_dir):
                continue
            relative = f"{prefix}{child.name}"
            try:
                if is_dir:
                    entries.append((relative, DIRECTORY, 0))
                    walk(Path(child.path), relative + "/")
                else:
                    info = child.stat()
                    entries.append((relative, info.st_size, info.st_mtime_ns))
            except OSError:
                continue  # deleted between listing and stat

    walk(model_dir, "")
    return ModelSnapshot(tuple(sorted(entries)), _hash_configs(model_dir, entries))


def _hash_configs(model_dir: Path, entries: list[tuple[str, int, int]]) -> str | None:
    """One hash of config.pbtxt and configs/*.pbtxt; None when there is none."""
    names = [
        path
        for path, size, _mtime in entries
        if size != DIRECTORY
        and (
            path == CONFIG_FILENAME
            or (path.startswith(CUSTOM_CONFIGS_DIR + "/") and path.endswith(".pbtxt"))
        )
    ]
    digest = hashlib.sha256()
    for name in sorted(names):
        try:
            content = (model_dir / name).read_bytes()
        except OSError:
            continue  # deleted since the walk: the next poll sees it
        digest.update(b"%s\0%d\0" % (name.encode(), len(content)))
        digest.update(content)
    return digest.hexdigest() if names else None


def file_changes(old: ModelSnapshot | None, new: ModelSnapshot | None) -> FileChanges:
    """Classify every path that differs between two snapshots of one model."""
    before = old.paths() if old is not None else {}
    after = new.paths() if new is not None else {}
    config = (old.config_hash if old else None) != (new.config_hash if new else None)
    shared = False
    versions: set[int] = set()
    for path in set(before) | set(after):
        if before.get(path) == after.get(path):
            continue
        top = path.split("/", 1)[0]
        if top in (CONFIG_FILENAME, CUSTOM_CONFIGS_DIR):
            config = True
        elif _VERSION_NAME.fullmatch(top):
            versions.add(int(top))
        else:
            shared = True
    return FileChanges(config, shared, frozenset(versions))


class Duplicate(str):
    """Stands for a model name found in several repositories (its reason)."""


def snapshot_repository(
    repository: ModelRepository,
) -> dict[ModelId, ModelSnapshot | Duplicate]:
    """A snapshot of every model in every repository, by :class:`ModelId`.

    Without namespacing, a name found in several repositories maps to a
    :class:`Duplicate` holding the reason it cannot be loaded; equal reasons
    compare equal across polls.
    """
    scan = repository.scan()
    result: dict[ModelId, ModelSnapshot | Duplicate] = {}
    for model_id, model_dir in scan.items():
        snapshot = snapshot_model(model_dir)
        if snapshot is not None:
            result[model_id] = snapshot
    for name, dirs in scan.duplicates.items():
        result[ModelId("", name)] = Duplicate(duplicate_reason(name, dirs))
    return result
