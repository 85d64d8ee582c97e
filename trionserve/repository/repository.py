"""ModelRepository: where each model's directory is, across one or more repositories.

Layout: ``<repository>/<model>/config.pbtxt`` and ``<repository>/<model>/<version>/``.
A model is any non-hidden subdirectory of a repository (``__pycache__`` excepted);
files beside the models are ignored. A repository may also be an s3://, gs:// or
as:// location, served from a local copy (see object_store.py). All methods do
blocking file-system (and, for object storage, network) calls: run them in a
worker thread.

Models are identified by :class:`ModelId`. Without model namespacing the id is the
name, and a name found in several repositories is a duplicate that is not
loaded. With ``--model-namespacing=true`` each repository is a namespace (its
location as given), so the same name in two repositories is two models (core
``model_repository_manager.cc``, ``Poll``: ``ModelIdentifier(repository_path,
subdir)``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from trionserve.core.errors import (
    AlreadyExists,
    InternalError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from trionserve.repository.object_store import open_mirrors


def _is_model_name(name: str) -> bool:
    return bool(name) and not name.startswith(".") and name != "__pycache__"


class ModelId(str):
    """A model's identity: its name and its namespace (Triton's ``ModelIdentifier``).

    The namespace is empty unless model namespacing is on; then it is the
    repository the model came from (a model loaded from a file override has none,
    as in Triton). The id compares and hashes as a string: the name alone when the
    namespace is empty, so without namespacing a model's id *is* its name and a
    table keyed by ids is keyed by names; ``<namespace>/<name>`` otherwise, which
    no name can equal, since a model name never contains ``/``.
    """

    namespace: str
    name: str

    def __new__(cls, namespace: str, name: str) -> ModelId:
        model_id = super().__new__(cls, f"{namespace}/{name}" if namespace else name)
        model_id.namespace = namespace
        model_id.name = name
        return model_id

    def __reduce__(self) -> tuple[type[ModelId], tuple[str, str]]:
        return (ModelId, (self.namespace, self.name))

    @property
    def display(self) -> str:
        """How Triton writes the identifier in messages: ``<namespace>::<name>``."""
        return f"{self.namespace}::{self.name}" if self.namespace else self.name

    def order(self) -> tuple[str, str]:
        """Triton's order of identifiers: by namespace, then by name."""
        return (self.namespace, self.name)


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


class RepositoryScan(dict[ModelId, Path]):
    """Model id -> model directory for every model the repositories hold.

    Without namespacing, a name found in more than one repository is left out of
    the mapping (Triton refuses to load it) and listed in :attr:`duplicates` with
    every directory that carries it, so callers can report it as UNAVAILABLE with
    a reason. With namespacing there are no duplicates: each is its own model.
    """

    def __init__(self, models: dict[ModelId, Path], duplicates: dict[str, list[Path]]) -> None:
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
        namespacing: bool = False,
    ) -> None:
        paths = list(paths)
        # --model-namespacing: each repository's namespace is its location as given.
        self.namespacing = namespacing
        self.namespaces = [str(p) if namespacing else "" for p in paths]
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
        # Run-time registrations (the Trio thread) against lookups (worker
        # threads): paths, namespaces and mappings change under this lock and
        # are read as one snapshot (_state).
        self._lock = threading.Lock()
        # Mapped model name -> (registered repository, its subdirectory).
        self._mappings: dict[str, tuple[Path, str]] = {}

    def _state(self) -> tuple[list[tuple[Path, str]], dict[str, tuple[Path, str]]]:
        with self._lock:
            return list(zip(self.paths, self.namespaces)), dict(self._mappings)

    def register(self, path: Path, mapping: Mapping[str, str]) -> None:
        """Add the local directory ``path`` as a model repository at run time,
        each ``mapping`` item (model name -> subdirectory) naming one of its
        models; its other subdirectories are models of their own names.

        Triton's ``RegisterModelRepository`` (core
        ``model_repository_manager.cc:1716-1768``) in its words: InvalidArgument
        when ``path`` is no directory, AlreadyExists when it is a repository
        already or a name is mapped already. The caller decides which paths may
        be registered (nothing here confines them).
        """
        if not path.is_dir():
            raise InvalidArgument(f"failed to register '{path}', repository not found")
        with self._lock:
            if path in self.paths:
                raise AlreadyExists(f"model repository '{path}' has already been registered")
            for name in mapping:
                if name in self._mappings:
                    raise AlreadyExists(
                        f"failed to register '{name}', there is a conflicting mapping for '{name}'"
                    )
            self.paths = [*self.paths, path]
            self.namespaces = [*self.namespaces, str(path) if self.namespacing else ""]
            for name, subdir in mapping.items():
                self._mappings[name] = (path, subdir)

    def unregister(self, path: Path) -> None:
        """Remove a repository :meth:`register` added, and its mappings
        (``UnregisterModelRepository``, core ``model_repository_manager.cc:1770-1800``).
        Models loaded from it stay loaded."""
        with self._lock:
            if path not in self.paths:
                raise InvalidArgument(f"failed to unregister '{path}', repository not found")
            index = self.paths.index(path)
            self.paths = self.paths[:index] + self.paths[index + 1 :]
            self.namespaces = self.namespaces[:index] + self.namespaces[index + 1 :]
            for name in [n for n, (repo, _) in self._mappings.items() if repo == path]:
                del self._mappings[name]

    def refresh(self) -> None:
        """Bring the local copies of object-storage repositories up to date."""
        for mirror in self.mirrors:
            mirror.sync()

    def scan(self) -> RepositoryScan:
        """Every model in every repository; see :class:`RepositoryScan` for duplicates."""
        found: dict[ModelId, list[Path]] = {}
        roots, mappings = self._state()
        for repo, namespace in roots:
            # Mapped subdirectories are listed by their mapped names (core
            # model_repository_manager.cc:1209-1225, RepositoryIndex).
            renamed = {subdir: name for name, (where, subdir) in mappings.items() if where == repo}
            try:
                with os.scandir(repo) as entries:
                    names = [e.name for e in entries if _is_model_name(e.name) and e.is_dir()]
            except OSError as exc:
                raise Unavailable(
                    f"failed to read model repository '{repo}': {exc.strerror or exc}"
                ) from None
            for name in names:
                model_id = ModelId(namespace, renamed.get(name, name))
                found.setdefault(model_id, []).append(repo / name)
        ordered = sorted(found.items(), key=lambda item: item[0].order())
        models = {m: dirs[0] for m, dirs in ordered if len(dirs) == 1}
        duplicates = {m.name: dirs for m, dirs in ordered if len(dirs) > 1}
        return RepositoryScan(models, duplicates)

    def find_all(self, name: str) -> dict[ModelId, Path]:
        """Every model called ``name``, by id: the one model of that name, or with
        namespacing one per repository that has it (a load by name loads them all,
        as Triton's ``Poll`` of a named model does).

        Raises NotFound when no repository has it (or the name could not be a model
        directory, e.g. ``../x``), InvalidArgument when several repositories do and
        namespacing is off.
        """
        not_found = NotFound(f"model '{name}' is not found in the model repository")
        if not _is_model_name(name) or any(c in name for c in "/\\\0"):
            raise not_found
        if self.refresh_on_find:  # EXPLICIT mode: a load fetches the model's latest files
            for mirror in self.mirrors:
                mirror.sync(name)
        roots, mappings = self._state()
        namespaces = dict(roots)
        if name in mappings:
            # A mapped name is its mapped directory, and only that (core
            # model_repository_manager.cc:1386-1411, Poll).
            repo, subdir = mappings[name]
            if not (repo / subdir).is_dir():
                raise NotFound(f"mapped path '{repo / subdir}' does not exist for model '{name}'")
            return {ModelId(namespaces.get(repo, ""), name): repo / subdir}
        mapped = {repo / subdir for repo, subdir in mappings.values()}
        found = [
            (ModelId(namespace, name), repo / name)
            for repo, namespace in roots
            if (repo / name).is_dir() and repo / name not in mapped  # (:1429-1440)
        ]
        if not found:
            raise not_found
        if len(found) > 1 and not self.namespacing:
            raise InvalidArgument(duplicate_reason(name, [path for _, path in found]))
        return dict(found)

    def find(self, model_id: str) -> Path:
        """The directory of one model, by :class:`ModelId` (or, without
        namespacing, by name); raises as :meth:`find_all`, and NotFound when the
        model's own repository no longer has it."""
        if not isinstance(model_id, ModelId):
            model_id = ModelId("", model_id)
        path = self.find_all(model_id.name).get(model_id)
        if path is None:
            raise NotFound(
                f"model '{model_id.name}' is not found in model repository '{model_id.namespace}'"
            )
        return path
