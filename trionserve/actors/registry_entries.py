"""What the ModelRegistry keeps per model, and how a model's configuration is prepared.

The bookkeeping of Triton core's ``ModelLifeCycle``
(src/model_repository_manager/model_lifecycle.cc): each model's versions and their
states (:class:`ModelEntry`: one entry of Triton's ``ModelMap``, a ``VersionMap``
of ``ModelInfo``), the load or unload in progress (:class:`Operation`), the log
of state transitions, and the errors a load or an operation ends in, in Triton's
words.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import trio
from google.protobuf import text_format

from trionserve.actors.model import ModelVersion, resolve_instance_kinds
from trionserve.backends.cuda.devices import gpu_count
from trionserve.backends.manager import BackendManager, BackendNotFound, MissingBackend
from trionserve.core.errors import (
    InternalError,
    InvalidArgument,
    TritonError,
    Unavailable,
    as_triton_error,
)
from trionserve.observability.logging import verbose
from trionserve.repository.changes import LoadedSource
from trionserve.repository.config import (
    infer_platform,
    normalize_model_config,
    read_model_config,
)
from trionserve.repository.config_validation import validate_model_config
from trionserve.repository.repository import ModelId
from trionserve.repository.versions import list_versions, select_versions

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.backends.base import Backend

log = structlog.get_logger(__name__)


class PollFailed(InternalError):
    """A load that failed before any version could load: the model is in no
    repository, its file override or its configuration could not be read, or the
    configuration is invalid. Triton's core answers all of these INTERNAL with
    "failed to load '<name>', failed to poll from model repository" (core
    ``model_repository_manager.cc``: ``Poll`` counts a model whose
    ``InitializeModelInfo`` failed as not polled, and ``LoadUnloadModel`` answers
    that); here the reason Triton only logs follows the words."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"failed to load '{name}', failed to poll from model repository: {reason}")


class NotInRepository(PollFailed):
    """A poll that found the model in no repository."""


class BackendLoadError(InvalidArgument):
    """A load that failed in its backend (INVALID_ARG in Triton's core, ``load
    failed for model``): here, auto-completing the configuration from the model
    file, which Triton's backends do when they load the model."""


def poll_failure(name: str, exc: BaseException) -> TritonError:
    """``exc``, raised before the model's versions were loaded, as Triton answers
    it: PollFailed, except where the backend failed (BackendLoadError)."""
    error = as_triton_error(exc, f"failed to load '{name}'")
    if isinstance(error, (PollFailed, BackendLoadError)):
        return error
    reason = error.message
    for prefix in (f"failed to load '{name}': ", f"failed to load '{name}', "):
        reason = reason.removeprefix(prefix)
    return PollFailed(name, reason)


class RegistryStopped(Unavailable):
    """An operation cut short because the server is shutting down."""


def load_failure(name: str, error: TritonError) -> TritonError:
    """A failed load as Triton answers it: INVALID_ARGUMENT (core
    ``model_repository_manager.cc``, ``LoadUnloadModels``), with a message that
    starts ``failed to load '<name>'``; a model that could not be polled stays
    INTERNAL (``LoadUnloadModel``, PollFailed) and a load cut by shutdown
    UNAVAILABLE."""
    if isinstance(error, (RegistryStopped, PollFailed)):
        return error
    prefix = f"failed to load '{name}'"
    message = error.message if error.message.startswith(prefix) else f"{prefix}: {error.message}"
    return InvalidArgument(message)


@dataclass(frozen=True)
class PreparedModel:
    config: ModelConfig
    backend: Backend
    versions: list[int]


def prepare_model(
    model_dir: Path,
    autocomplete: bool,
    override_json: str | None,
    config_name: str | None = None,
    backends: BackendManager | None = None,
    name: str | None = None,
) -> PreparedModel:
    """Read, complete and validate a model's config; blocking, run in a thread.

    ``config_name``: --model-config-name (read ``configs/<name>.pbtxt`` if present).
    ``backends``: the server's BackendManager, which makes the model's backend
    (None: one with no settings, for tools and tests). ``name``: the model's
    name; a model found in a directory of another name is a mapped one
    (ModelRepository.register), whose config takes that name (core
    model_repository_manager.cc:1693-1696).
    """
    config, max_batch_size_set = read_model_config(
        model_dir, override_json, config_name, check_name=False
    )
    if name is not None and name != model_dir.name:
        config.name = name
    infer_platform(config, model_dir)
    if verbose():
        # core model_config_utils.cc:756 GetNormalizedModelConfig, after the
        # server-side autofill of platform / backend, before the backend's own.
        log.debug("Server side auto-completed config: " + text_format.MessageToString(config))
    if config.name != (name or model_dir.name):
        # Triton polls a model by normalizing and validating its config, then
        # checks its name (core model_repository_manager.cc:1680-1711,
        # InitializeModelInfo): an invalid config's error comes first.
        normalize_model_config(config)
        validate_model_config(config, io=not autocomplete)
        raise InvalidArgument(
            f"unexpected directory name '{model_dir.name}' for model '{config.name}', "
            "directory name must equal model name"
        )
    try:
        backend: Backend = (backends or BackendManager()).backend_for(config)
    except BackendNotFound as missing:
        backend = MissingBackend(config.backend, missing)  # its versions fail to load
    try:
        versions = select_versions(config, list_versions(model_dir, warn=True))
    except InvalidArgument as no_versions:
        # Triton validates a config when it polls the model (core
        # model_repository_manager.cc: ValidateModelConfig, and ValidateModelIOConfig
        # without autofill) and finds no version to load only after, when it loads
        # (model_lifecycle.cc): the config's error is the one reported.
        normalize_model_config(config)
        validate_model_config(config, io=not autocomplete)
        raise no_versions from None
    if autocomplete:
        filename = config.default_model_filename or backend.default_model_filename()
        model_path = backend.auto_complete_source(model_dir / str(max(versions)), filename)
        if model_path.exists():
            try:
                backend.auto_complete_config(config, model_path, max_batch_size_set)
            except Exception as exc:
                reason = as_triton_error(exc).message
                raise BackendLoadError(f"failed to load '{model_dir.name}': {reason}") from exc
    normalize_model_config(config)
    resolve_instance_kinds(config, gpu_count() if backend.can_use_gpu() else 0)
    validate_model_config(config)
    return PreparedModel(config, backend, versions)


def composing_models(config: ModelConfig) -> list[str]:
    """The models an ensemble's steps call, in first-use order."""
    names: list[str] = []
    for step in config.ensemble_scheduling.step:
        if step.model_name not in names:
            names.append(step.model_name)
    return names


def missing_models(ensemble: ModelId, names: Iterable[str]) -> str:
    """Triton's words for steps naming models no repository has
    (model_repository_manager.cc:2153, ConnectDependencyGraph: its sorted set)."""
    return (
        f"ensemble {ensemble.display} contains models that are not available or ambiguous: "
        + ", ".join(sorted(set(names)))
    )


def cycle_error(start: str, current: str) -> InvalidArgument:
    """Triton's words for an ensemble that depends on itself
    (model_repository_manager.cc:2253, CircularDependencyCheck)."""
    return InvalidArgument(
        f"circular dependency between ensembles: {start} -> ... -> {current} -> {start}"
    )


async def check_cycle(
    start: str, steps: Sequence[str], steps_of: Callable[[str], Awaitable[Sequence[str]]]
) -> None:
    """Raise if ``start`` (an ensemble whose steps call ``steps``) is reached again
    through the steps of its composing ensembles; ``steps_of(name)`` gives the
    models a model's steps call (none for a model that is no ensemble).

    Triton walks the dependency graph towards the upstream models from each
    ensemble the graph update touched, before any of them loads
    (model_repository_manager.cc:2244, CircularDependencyCheck); each model is
    visited once here, so a cycle that does not pass ``start`` ends the walk
    (that cycle's own ensembles report it).
    """
    seen: set[str] = set()

    async def visit(current: str, upstreams: Sequence[str]) -> None:
        for upstream in upstreams:
            if upstream == start:
                raise cycle_error(start, current)
            if upstream not in seen:
                seen.add(upstream)
                await visit(upstream, await steps_of(upstream))

    await visit(start, steps)


def composing_ids(config: ModelConfig) -> frozenset[ModelId]:
    """The models an ensemble's steps are bound to: each step's name in the
    namespace the registry resolved it to (``model_namespace``, as Triton's
    ``ConnectDependencyGraph`` sets it; empty without namespacing)."""
    return frozenset(
        ModelId(step.model_namespace, step.model_name) for step in config.ensemble_scheduling.step
    )


class Operation:
    """One queued or running load or unload of one model; callers await ``done``."""

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.explicit = False
        self.done = trio.Event()
        self.error: TritonError | None = None


@dataclass(eq=False)
class ModelEntry:
    """What the registry knows of one model (one name, or with namespacing one name
    in one namespace); changed only under ``lock``.

    A version number is in at most one of ``serving`` and ``loading`` at a time
    (a reload's new version is in ``loading`` while the old one serves); retired
    versions stay in ``draining`` until they have unloaded.
    """

    model_id: ModelId
    serving: dict[int, ModelVersion] = field(default_factory=dict)  # READY, routed
    loading: dict[int, ModelVersion] = field(default_factory=dict)
    draining: set[ModelVersion] = field(default_factory=set)  # UNLOADING
    unavailable: dict[int, str] = field(default_factory=dict)  # version -> reason
    # The latest error of a load of this model; shown until a load succeeds.
    reason: str = ""
    # True while a version the policy wants is not serving (Triton's readiness).
    failed: bool = False
    explicit: bool = False  # loaded by name, not only as an ensemble's composing model
    known: bool = False  # in the registry's map of names (Triton's global map)
    # Ensemble steps that resolved to no model at its last load (namespacing).
    unresolved: frozenset[str] = frozenset()
    dependencies: frozenset[ModelId] = frozenset()  # the models its ensemble steps call
    source: LoadedSource | None = None
    lock: trio.Lock = field(default_factory=trio.Lock)
    operations: list[Operation] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.model_id.name

    @property
    def versions(self) -> dict[int, ModelVersion]:
        """The versions serving requests, by number."""
        return self.serving

    def has_state(self) -> bool:
        """True when the index has something to say about this model."""
        return bool(
            self.serving or self.loading or self.draining or self.unavailable or self.reason
        )

    def is_empty(self) -> bool:
        return not (self.has_state() or self.operations)

    def index_rows(self) -> list[dict]:
        """The repository index rows of this model: one per version it knows."""
        draining = {v.version for v in self.draining}
        numbers = set(self.serving) | set(self.loading) | draining | set(self.unavailable)
        if not numbers:
            return [_row(self.name, "", "UNAVAILABLE", self.reason)] if self.reason else []
        rows = []
        for number in sorted(numbers):
            if number in self.serving:
                # A failed reload's reason shows beside the version still serving.
                rows.append(_row(self.name, number, "READY", self.reason))
            elif number in self.loading:
                rows.append(_row(self.name, number, "LOADING", ""))
            elif number in draining:
                rows.append(_row(self.name, number, "UNLOADING", ""))
            else:
                rows.append(_row(self.name, number, "UNAVAILABLE", self.unavailable[number]))
        return rows


def _row(name: str, version: int | str, state: str, reason: str) -> dict[str, str]:
    """One index row; ``reason`` only when there is one, as Triton's index leaves
    an empty reason out (core src/tritonserver.cc:3176-3179, ServerModelIndex):
    an HTTP client reads ``{"name":..,"version":"4","state":"READY"}``."""
    row = {"name": name, "version": str(version), "state": state}
    if reason:
        row["reason"] = reason
    return row


def load_error(name: str, errors: dict[int, TritonError]) -> TritonError:
    detail = "; ".join(f"version {n}: {e.message}" for n, e in sorted(errors.items()))
    return InvalidArgument(f"failed to load '{name}': {detail}")


class TransitionLog:
    """One structured log line per state transition of a model version, at the
    verbose level (the model's own "model ready" and the registry's failures and
    unloads are the info and error lines).

    Each line has model, version, from, to, reason and duration_s: how long the
    version spent in the state it leaves.
    """

    def __init__(self) -> None:
        self._entered: dict[ModelVersion, float] = {}

    def __call__(self, version: ModelVersion, before: str, after: str, reason: str) -> None:
        now = trio.current_time()
        entered = self._entered.pop(version, None)
        if after != "UNAVAILABLE":
            self._entered[version] = now
        log.debug(
            "model state",
            model=version.name,
            version=version.version,
            reason=reason,
            duration_s=0.0 if entered is None else round(now - entered, 3),
            **{"from": before, "to": after},
        )
