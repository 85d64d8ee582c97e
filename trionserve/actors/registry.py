"""ModelRegistry: the routing table and the lifecycle of every model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import structlog
import trio

from trionserve.actors.model import ModelState, ModelVersion, resolve_instance_kinds
from trionserve.backends.gpu import gpu_count
from trionserve.backends.registry import backend_for
from trionserve.core.errors import NotFound, TritonError, Unavailable, as_triton_error
from trionserve.repository.config import (
    infer_platform,
    normalize_model_config,
    read_model_config,
    validate_model_config,
)
from trionserve.repository.repository import ModelRepository
from trionserve.repository.versions import list_versions, select_versions

log = structlog.get_logger(__name__)


@dataclass
class ModelEntry:
    """What the registry knows of one model name."""

    name: str
    # The versions of the latest load attempt plus any still serving, by version.
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    # Why the model as a whole could not be loaded (bad config, no versions).
    reason: str = ""
    # True when the latest load of this model failed.
    failed: bool = False
    lock: trio.Lock = field(default_factory=trio.Lock)


@dataclass(frozen=True)
class PreparedModel:
    config: object
    backend: object
    versions: list[int]


def prepare_model(model_dir: Path, autocomplete: bool, override_json: str | None):
    """Read, complete and validate a model's config; blocking, run in a thread."""
    config, max_batch_size_set = read_model_config(model_dir, override_json)
    infer_platform(config, model_dir)
    backend = backend_for(config)
    versions = select_versions(config, list_versions(model_dir))
    if autocomplete:
        filename = config.default_model_filename or backend.default_model_filename()
        model_path = model_dir / str(max(versions)) / filename
        if model_path.exists():
            backend.auto_complete_config(config, model_path, max_batch_size_set)
    normalize_model_config(config)
    resolve_instance_kinds(config, gpu_count())
    validate_model_config(config)
    return PreparedModel(config, backend, versions)


class ModelRegistry:
    """Owns every ModelVersion (as children of its nursery) and the routing table.

    Loads and unloads are serialised per model name and bounded overall by
    ``load_limiter``. The routing table maps a name to its READY versions and is
    replaced whole for a model when a load completes, so requests always see
    either the old or the new version set, never a mix. On cancellation every
    ModelVersion is cancelled and releases its backend.
    """

    def __init__(
        self,
        repository: ModelRepository,
        *,
        autocomplete: bool = True,
        load_concurrency: int = 4,
        drain_timeout: float = 30.0,
    ) -> None:
        self.repository = repository
        self.autocomplete = autocomplete
        self._load_limiter = trio.CapacityLimiter(max(1, load_concurrency))
        self._drain_timeout = drain_timeout
        self._entries: dict[str, ModelEntry] = {}
        # name -> (READY versions by number, default version)
        self._routes: dict[str, tuple[dict[int, ModelVersion], ModelVersion]] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- queries (synchronous, on the Trio thread) ---------------------------

    def route(self, name: str, version: int | None) -> ModelVersion:
        """The READY ModelVersion for a request, or the error to answer it with."""
        route = self._routes.get(name)
        if route is not None:
            if version is None:
                return route[1]
            found = route[0].get(version)
            if found is not None:
                return found
            raise NotFound(
                f"Request for unknown model: '{name}' version {version} is not found"
            )
        if name in self._entries:
            raise Unavailable(
                f"Request for unknown model: '{name}' has no available versions"
            )
        raise NotFound(f"Request for unknown model: '{name}' is not found")

    def entries(self) -> dict[str, ModelEntry]:
        return self._entries

    def all_ready(self) -> bool:
        """True when no model's latest load failed (Triton's strict readiness)."""
        return not any(e.failed for e in self._entries.values())

    def index(self) -> list[dict]:
        """Every known model and version with state and reason, sorted by name."""
        rows: list[dict] = []
        for name in sorted(self._entries):
            entry = self._entries[name]
            if not entry.versions:
                rows.append(
                    {"name": name, "version": "", "state": "UNAVAILABLE", "reason": entry.reason}
                )
                continue
            for number in sorted(entry.versions):
                v = entry.versions[number]
                rows.append(
                    {"name": name, "version": str(number), "state": v.state.value, "reason": v.reason}
                )
        return rows

    # -- lifecycle -------------------------------------------------------------

    async def load(self, name: str, override_json: str | None = None) -> None:
        """Load or reload a model; raises the reason if it could not be loaded.

        A reload loads the new version set beside the old one and switches the
        routing table only if every new version loaded; otherwise the old set keeps
        serving and the error is raised.
        """
        assert self._nursery is not None, "registry is not running"
        entry = self._entries.setdefault(name, ModelEntry(name))
        async with entry.lock:
            try:
                model_dir = self.repository.find(name)
                prepared = await trio.to_thread.run_sync(
                    prepare_model, model_dir, self.autocomplete, override_json
                )
            except Exception as exc:
                error = as_triton_error(exc, f"failed to load '{name}'")
                if isinstance(error, NotFound) and not entry.versions:
                    del self._entries[name]
                    raise error from None
                entry.failed = True
                if name not in self._routes:
                    entry.reason = error.message
                log.error("model load failed", model=name, reason=error.message)
                raise error from None

            new = {
                number: ModelVersion(
                    name,
                    number,
                    prepared.config,
                    model_dir,
                    prepared.backend,
                    self._load_limiter,
                    self._drain_timeout,
                )
                for number in prepared.versions
            }
            errors: dict[int, TritonError] = {}
            async with trio.open_nursery() as loaders:
                for version in new.values():
                    loaders.start_soon(self._start_version, version, errors)

            old = self._routes.get(name)
            if errors and old is not None:
                # A failed reload: keep the old versions serving, drop the new ones.
                for version in new.values():
                    version.request_unload()
                error = self._load_error(name, errors)
                self._record(entry, {**{n: new[n] for n in errors}, **old[0]})
                entry.failed = True
                entry.reason = error.message
                raise error

            loaded = {n: v for n, v in new.items() if n not in errors}
            self._switch(name, loaded)
            self._record(entry, new)
            entry.reason = ""
            entry.failed = bool(errors)
            if old is not None:
                for version in old[0].values():
                    version.request_unload()
            if errors:
                raise self._load_error(name, errors)

    async def _start_version(self, version: ModelVersion, errors: dict) -> None:
        assert self._nursery is not None
        try:
            await self._nursery.start(version.run)
        except Exception as exc:
            errors[version.version] = as_triton_error(exc, "failed to load")

    @staticmethod
    def _load_error(name: str, errors: dict[int, TritonError]) -> TritonError:
        detail = "; ".join(f"version {n}: {e.message}" for n, e in sorted(errors.items()))
        return Unavailable(f"failed to load '{name}': {detail}")

    def _switch(self, name: str, versions: dict[int, ModelVersion]) -> None:
        if versions:
            self._routes[name] = (versions, versions[max(versions)])
        else:
            self._routes.pop(name, None)

    @staticmethod
    def _record(entry: ModelEntry, versions: dict[int, ModelVersion]) -> None:
        entry.versions = dict(versions)

    async def unload(self, name: str, *, wait: bool = True) -> None:
        """Stop routing to a model, drain its in-flight requests and unload it."""
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"failed to unload '{name}': model is not found")
        async with entry.lock:
            self._routes.pop(name, None)
            entry.failed = False
            versions = [v for v in entry.versions.values() if v.state is not ModelState.UNAVAILABLE]
            for version in versions:
                version.request_unload()
            if wait:
                for version in versions:
                    await version.stopped.wait()
            log.info("model unloaded", model=name)

    async def unload_all(self) -> None:
        """Unload every model concurrently, each draining its in-flight requests."""
        async with trio.open_nursery() as nursery:
            for name in list(self._entries):
                nursery.start_soon(self.unload, name)
