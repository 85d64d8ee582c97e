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
from collections.abc import Iterable
from pathlib import Path

from trionserve.core.errors import InternalError, InvalidArgument, NotFound, Unavailable
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

    def refresh(self) -> None:
        """Bring the local copies of object-storage repositories up to date."""
        for mirror in self.mirrors:
            mirror.sync()

    def scan(self) -> RepositoryScan:
        """Every model in every repository; see :class:`RepositoryScan` for duplicates."""
        found: dict[ModelId, list[Path]] = {}
        for repo, namespace in zip(self.paths, self.namespaces):
            try:
                with os.scandir(repo) as entries:
                    names = [e.name for e in entries if _is_model_name(e.name) and e.is_dir()]
            except OSError as exc:
                raise Unavailable(
                    f"failed to read model repository '{repo}': {exc.strerror or exc}"
                ) from None
            for name in names:
                found.setdefault(ModelId(namespace, name), []).append(repo / name)
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
        found = [
            (ModelId(namespace, name), repo / name)
            for repo, namespace in zip(self.paths, self.namespaces)
            if (repo / name).is_dir()
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
