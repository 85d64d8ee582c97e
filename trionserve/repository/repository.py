"""ModelRepository: where each model's directory is, across one or more repositories.

Layout: ``<repository>/<model>/config.pbtxt`` and ``<repository>/<model>/<version>/``.
A model is any non-hidden subdirectory of a repository (``__pycache__`` excepted);
files beside the models are ignored. A repository may also be an s3://, gs:// or
as:// location, served from a local copy (see object_store.py). All methods do
blocking file-system (and, for object storage, network) calls: run them in a
worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from trionserve.core.errors import InternalError, InvalidArgument, NotFound, Unavailable
from trionserve.repository.object_store import open_mirrors


def _is_model_name(name: str) -> bool:
    return bool(name) and not name.startswith(".") and name != "__pycache__"


def check_model_name(name: str) -> None:
    """Refuse a name that could not be a model directory, before it is looked up.

    Empty and path-traversing names in Triton's words (core
    ``model_repository_manager.cc``, ``ValidateModelName``); this also refuses
    ``.`` and NUL, which Triton lets through to the file system. A backslash is
    an ordinary character of a name, as in Triton (a Python model's stub then
    refuses it: python_backend stub_launcher.cc IsValidIdentifier).
    """
    stripped = name.strip()
    if not stripped:
        raise InvalidArgument("Model name cannot be empty. Please enter a valid name to deploy.")
    if stripped in (".", "..") or "/" in name:
        raise InvalidArgument(
            f"invalid model name '{name}', model name must not contain path traversal characters"
        )
    if "\0" in name:
        raise InvalidArgument(f"invalid model name '{name}', model name must not contain NUL")


class RepositoryScan(dict[str, Path]):
    """Model name -> model directory for every name found in exactly one repository.

    A name found in more than one repository is left out of the mapping (Triton
    refuses to load it) and listed in :attr:`duplicates` with every directory that
    carries it, so callers can report it as UNAVAILABLE with a reason.
    """

    def __init__(self, models: dict[str, Path], duplicates: dict[str, list[Path]]) -> None:
        super().__init__(models)
        self.duplicates: dict[str, list[Path]] = duplicates


def duplicate_reason(name: str, dirs: Iterable[Path]) -> str:
    """The error text for a model name present in several repositories."""
    where = ", ".join(f"'{d.parent}'" for d in dirs)
    return f"model '{name}' appears in multiple model repositories ({where}); it is not loaded"


class ModelRepository:
    """The ordered list of repository directories given at startup.

    Guarantees: every repository path existed and was a directory when the object
    was constructed (else InvalidArgument); :meth:`scan` and :meth:`find` never
    return a name that is hidden, ``__pycache__`` or contains a path separator.
    """

    def __init__(
        self,
        paths: Iterable[Path | str],
        *,
        cache_dir: Path | str | None = None,
        refresh_on_find: bool = False,
        config_name: str | None = None,
    ) -> None:
        # --model-config-name: models read configs/<name>.pbtxt where it exists.
        self.config_name = config_name
        # s3://, gs:// and as:// locations are mirrored into local directories
        # (object_store.py); everything else here sees only local paths.
        paths, self.mirrors = open_mirrors(paths, cache_dir)
        self.refresh_on_find = refresh_on_find
        self.paths: list[Path] = [Path(p) for p in paths]
        if not self.paths:
            raise InvalidArgument("at least one model repository path is required")
        for path in self.paths:
            if not path.exists():
                # INTERNAL, as Triton's IsDirectory on a missing path (core
                # src/filesystem/implementations/local.h "failed to stat file").
                raise InternalError(
                    f"failed to stat file {path}: model repository path '{path}' does not exist"
                )
            if not path.is_dir():
                raise InvalidArgument(f"model repository path '{path}' is not a directory")

    def refresh(self) -> None:
        """Bring the local copies of object-storage repositories up to date."""
        for mirror in self.mirrors:
            mirror.sync()

    def scan(self) -> RepositoryScan:
        """Every model in every repository; see :class:`RepositoryScan` for duplicates."""
        found: dict[str, list[Path]] = {}
        for repo in self.paths:
            try:
                with os.scandir(repo) as entries:
                    names = [e.name for e in entries if _is_model_name(e.name) and e.is_dir()]
            except OSError as exc:
                raise Unavailable(
                    f"failed to read model repository '{repo}': {exc.strerror or exc}"
                ) from None
            for name in names:
                found.setdefault(name, []).append(repo / name)
        models = {n: dirs[0] for n, dirs in sorted(found.items()) if len(dirs) == 1}
        duplicates = {n: dirs for n, dirs in sorted(found.items()) if len(dirs) > 1}
        return RepositoryScan(models, duplicates)

    def find(self, name: str) -> Path:
        """The directory of model ``name``.

        Raises NotFound when no repository has it (or the name could not be a model
        directory, e.g. ``../x``), InvalidArgument when several repositories do.
        """
        not_found = NotFound(f"model '{name}' is not found in the model repository")
        if not _is_model_name(name) or any(c in name for c in "/\\\0"):
            raise not_found
        if self.refresh_on_find:  # EXPLICIT mode: a load fetches the model's latest files
            for mirror in self.mirrors:
                mirror.sync(name)
        dirs = [repo / name for repo in self.paths if (repo / name).is_dir()]
        if not dirs:
            raise not_found
        if len(dirs) > 1:
            raise InvalidArgument(duplicate_reason(name, dirs))
        return dirs[0]
