"""ModelRegistry: which models are loaded, and the loads and unloads asked of them.

Triton core's ``ModelRepositoryManager``
(src/model_repository_manager/model_repository_manager.cc): load and unload
requests queued per model, each model's configuration read (its poll), an
ensemble's composing models loaded first and its steps bound, and a request's
model name resolved to a loaded version. Starting, switching and retiring a
model's versions is the :class:`~trionserve.actors.model_lifecycle.ModelLifeCycle`'s
(Triton's ``ModelLifeCycle``), the models known by each name the
:class:`~trionserve.actors.global_map.GlobalMap`'s; finding the models on disk is
:mod:`trionserve.repository`, polling it the
:class:`~trionserve.actors.watcher.RepositoryWatcher`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import trio

from trionserve.actors.global_map import GlobalMap
from trionserve.actors.model import ModelVersion
from trionserve.actors.model_lifecycle import ModelLifeCycle
from trionserve.actors.rate_limiter import RateLimiter
from trionserve.actors.registry_entries import (
    ModelEntry,
    NotInRepository,
    Operation,
    PollFailed,
    RegistryStopped,
    check_cycle,
    composing_models,
    cycle_error,
    load_failure,
    missing_models,
    poll_failure,
    prepare_model,
)
from trionserve.backends.manager import BackendManager
from trionserve.core.errors import (
    InvalidArgument,
    NotFound,
    TritonError,
    Unavailable,
    as_triton_error,
)
from trionserve.observability.custom_metrics import CustomMetrics
from trionserve.observability.quantiles import Target
from trionserve.repository.changes import LoadedSource
from trionserve.repository.config import read_model_config
from trionserve.repository.overrides import check_override_request, override_digest, write_override
from trionserve.repository.repository import ModelId, ModelRepository, check_model_name
from trionserve.repository.snapshot import snapshot_model

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.actors.residency import ResidencyManager

log = structlog.get_logger(__name__)

# One operation on a model, run under its entry's lock.
Work = Callable[[ModelEntry], Awaitable[None]]


class ModelRegistry:
    """Owns every model: its :class:`ModelLifeCycle` runs every ModelVersion (as
    children of the registry's nursery) and keeps the routing table.

    Models are kept by :class:`ModelId`: the name, or with model namespacing
    (``repository.namespacing``) the name in the namespace of its repository.
    Requests name a model; with namespacing the name is resolved among the models
    the registry knows (Triton's global map): one model of that name is used, two
    or more is an ambiguity error. An ensemble's steps are resolved at load, in
    the ensemble's own namespace first, else to the one model of that name
    (Triton's ``ConnectDependencyGraph``), and the step's ``model_namespace``
    records the choice; when models of a step's name appear or go away, the
    ensembles whose choice changes are loaded again (rebound).

    Inbox: ``load`` and ``unload`` queue an operation per model; operations on
    one model run one at a time in arrival order, each in a task of the registry's
    nursery (a caller that goes away stops waiting, the operation still finishes),
    and overlapping identical requests share one operation, so a model is never
    loaded twice for two concurrent identical requests. At most ``load_concurrency``
    versions load at once. The routing table maps a name to its READY versions and
    is replaced whole when an operation completes: requests see the old or the new
    version set, never a mix, and never none during a reload. Retired versions
    drain their in-flight requests (bounded by ``drain_timeout``) and unload in the
    background. On cancellation every ModelVersion is cancelled and releases its
    backend.
    """

    def __init__(
        self,
        repository: ModelRepository,
        *,
        autocomplete: bool = True,
        load_concurrency: int = 4,
        drain_timeout: float = 30.0,
        rate_limiter: RateLimiter | None = None,
        summary_quantiles: Sequence[Target] | None = None,
        backends: BackendManager | None = None,
    ) -> None:
        self.repository = repository
        # The server's BackendManager: every model's backend is made through it
        # (None: one with no settings).
        self.backends = backends if backends is not None else BackendManager()
        self.autocomplete = autocomplete
        self._namespacing = repository.namespacing
        # Keyed by ModelId, which is the name itself without namespacing.
        self._entries: dict[str, ModelEntry] = {}
        # The models' versions and the routing table (Triton's ModelLifeCycle).
        self.lifecycle = ModelLifeCycle(
            self._entries,
            load_concurrency=load_concurrency,
            drain_timeout=drain_timeout,
            rate_limiter=rate_limiter,
            summary_quantiles=summary_quantiles,
            custom_metrics=self.backends.custom_metrics,
        )
        # Triton's global map: name -> the ids of the models known by that name.
        self.global_map = GlobalMap(repository.namespacing)
        # Bumped when the models known by a name change: rebinds queued for one
        # change share one operation per ensemble.
        self._generation = 0
        self._stopping = False
        self._nursery: trio.Nursery | None = None
        # The residency policy (models on demand, memory budget), when one is on:
        # it charges every load (see ``_load``).
        self.residency: ResidencyManager | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = self.lifecycle.nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.lifecycle.remove_overrides()

    # -- queries (synchronous, on the Trio thread) ---------------------------

    @property
    def custom_metrics(self) -> CustomMetrics:
        """The metric families its models define (its BackendManager's)."""
        return self.backends.custom_metrics

    def identify(self, name: str) -> ModelId:
        """The one model a request's name means (Triton's ``FindModelIdentifier``):
        with namespacing, an unknown name and an ambiguous one are errors."""
        return self.global_map.identify(name)

    def route(self, name: str, version: int | None, namespace: str | None = None) -> ModelVersion:
        """The READY ModelVersion for a request, or the error to answer it with.

        ``namespace`` (an ensemble step's ``model_namespace``) names the model
        exactly; without it, the name is resolved as :meth:`identify` says.
        """
        if namespace:
            key: str = ModelId(namespace, name)
        elif namespace is None and self._namespacing:
            key = self.identify(name)
        else:
            key = name  # equal to ModelId("", name)
        route = self.lifecycle.routes.get(key)
        if route is not None:
            if version is None:
                return route[1]
            found = route[0].get(version)
            if found is not None:
                return found
            raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")
        if key in self._entries and not self._entries[key].is_empty():
            raise Unavailable(f"Request for unknown model: '{name}' has no available versions")
        raise NotFound(f"Request for unknown model: '{name}' is not found")

    def entries(self) -> dict[str, ModelEntry]:
        """Every model the registry knows, by id (by name without namespacing)."""
        return self._entries

    def entry(self, name: str, namespace: str | None = None) -> ModelEntry | None:
        """The entry of the model a request names (None when unknown)."""
        try:
            key = ModelId(namespace, name) if namespace is not None else self.identify(name)
        except TritonError:
            return None
        return self._entries.get(key)

    def serving(self) -> list[ModelVersion]:
        """Every version requests are routed to now."""
        return [
            version
            for versions, _ in self.lifecycle.routes.values()
            for version in versions.values()
        ]

    def all_ready(self) -> bool:
        """True when every model has every version its policy wants serving."""
        return not any(e.failed for e in self._entries.values())

    def index(self) -> list[dict]:
        """Every known model and version with state and reason, in Triton's order
        (by namespace, then name)."""
        return [
            row
            for entry in sorted(self._entries.values(), key=lambda e: e.model_id.order())
            for row in entry.index_rows()
        ]

    # -- operations --------------------------------------------------------------

    async def load(
        self,
        name: str,
        override_json: str | None = None,
        *,
        files: dict[str, bytes] | None = None,
        explicit: bool = True,
        reason: str = "load requested",
        stable_files: bool = False,
        _chain: tuple[str, ...] = (),
    ) -> None:
        """Load or reload a model; raises the reason if it could not be loaded.

        ``name`` is a name, or a :class:`ModelId` for one model exactly. With
        namespacing a name loads every repository's model of that name (Triton's
        ``Poll`` of a named model); a file override has no namespace, as in
        Triton. ``override_json`` replaces config.pbtxt; ``files``
        (``file:<path>`` -> contents, with ``override_json`` required) replace the
        model directory. Only what changed since the serving versions were loaded
        is redone (see :func:`plan_reload`); a reload loads beside the serving
        versions and switches only if every new version loaded, else they keep
        serving. With ``stable_files`` (POLL), versions whose files changed while
        they loaded are discarded instead of served: they may mix old and new files.
        """
        plain = name.name if isinstance(name, ModelId) else name
        try:
            check_model_name(plain)  # a name that is no directory never enters the index
            check_override_request(plain, override_json, files or {})
            digest = override_digest(override_json, files) if (override_json or files) else ""
            if isinstance(name, ModelId) or files or not self._namespacing:
                ids = [name if isinstance(name, ModelId) else ModelId("", name)]
            else:
                ids = sorted(await self._find_all(plain), key=ModelId.order)
            work = partial(
                self._load,
                override_json=override_json,
                files=files,
                digest=digest,
                reason=reason,
                chain=_chain,
                stable_files=stable_files,
            )
            errors = await self._each(ids, ("load", digest), explicit, work)
        except TritonError as error:
            raise load_failure(plain, error) from None
        if errors:
            # Several namespaces' models of this name: each failure named, as
            # Triton's LoadUnloadModels lists them.
            detail = "; ".join(
                f"load failed for model '{model_id.display}': {errors[model_id].message}"
                for model_id in ids
                if model_id in errors
            )
            raise load_failure(plain, InvalidArgument(detail))

    async def unload(
        self,
        name: str,
        *,
        wait: bool = True,
        unload_dependents: bool = False,
        reason: str = "unload requested",
    ) -> None:
        """Stop routing to a model, drain its in-flight requests and unload it.

        ``name`` is a name (with namespacing: every model known by it, as Triton
        unloads every identifier of the name) or a :class:`ModelId`. Unloading a
        model that is not loaded succeeds and does nothing, as in Triton. With
        ``unload_dependents`` the models loaded only as this ensemble's composing
        models, and used by no other loaded model, are unloaded too. A name that
        could not be a model directory is refused.
        """
        plain = name.name if isinstance(name, ModelId) else name
        try:
            check_model_name(plain)
        except TritonError as error:
            raise InvalidArgument(f"failed to unload '{plain}': {error.message}") from None
        if isinstance(name, ModelId) or not self._namespacing:
            ids = [name if isinstance(name, ModelId) else ModelId("", name)]
        else:
            ids = sorted(self.global_map.ids(name), key=ModelId.order)
        errors = await self._each(
            ids,
            ("unload", unload_dependents, wait),
            False,
            partial(self._unload, wait=wait, unload_dependents=unload_dependents, reason=reason),
        )
        if errors:
            raise next(iter(errors.values()))

    async def unload_all(self) -> None:
        """Unload every model, each draining its in-flight requests.

        Models unload concurrently in waves: an ensemble goes before the models its
        steps call, so its in-flight requests can still run their later steps.
        """
        self._stopping = True  # no ensemble is rebound while everything unloads
        remaining = {entry.model_id for entry in self._entries.values()}
        while remaining:
            needed = {
                dependency
                for model_id in remaining
                if model_id in self._entries
                for dependency in self._entries[model_id].dependencies
                if dependency != model_id
            }
            wave = (remaining - needed) or remaining  # a cycle cannot block shutdown
            async with trio.open_nursery() as nursery:
                for model_id in sorted(wave):
                    nursery.start_soon(partial(self.unload, model_id, reason="server shutdown"))
            remaining -= wave

    async def _each(
        self, ids: list[ModelId], key: tuple, explicit: bool, work: Work
    ) -> dict[ModelId, TritonError]:
        """Run one operation on each model, concurrently; their errors by model."""
        if len(ids) == 1:
            await self._submit(ids[0], key, explicit, work)
            return {}
        errors: dict[ModelId, TritonError] = {}

        async def one(model_id: ModelId) -> None:
            try:
                await self._submit(model_id, key, explicit, work)
            except TritonError as error:
                errors[model_id] = error

        async with trio.open_nursery() as nursery:
            for model_id in ids:
                nursery.start_soon(one, model_id)
        return errors

    async def _submit(self, model_id: ModelId, key: tuple, explicit: bool, work: Work) -> None:
        assert self._nursery is not None, "registry is not running"
        # Cancelled (the server's nursery is being torn down), the registry's own
        # nursery may be closed already: end here rather than start work there.
        await trio.lowlevel.checkpoint_if_cancelled()
        entry = self._entries.get(model_id)
        if entry is None:
            entry = self._entries[model_id] = ModelEntry(model_id)
        operation = next(
            (op for op in entry.operations if op.key == key and not op.done.is_set()), None
        )
        if operation is None:
            operation = Operation(key)
            entry.operations.append(operation)
            self._nursery.start_soon(self._run_operation, entry, operation, work)
        elif key[0] == "load":
            log.debug("joining a load of the same model already in progress", model=model_id)
        operation.explicit |= explicit
        await operation.done.wait()
        if operation.error is not None:
            raise operation.error

    async def _run_operation(self, entry: ModelEntry, operation: Operation, work: Work) -> None:
        try:
            async with entry.lock:
                await work(entry)
                if operation.explicit:
                    entry.explicit = True
        except TritonError as error:
            operation.error = error
        except Exception as exc:
            log.exception("model operation failed", model=entry.model_id)
            operation.error = as_triton_error(exc, f"model '{entry.name}'")
        except BaseException:
            operation.error = RegistryStopped("the server is shutting down")
            raise
        finally:
            entry.operations.remove(operation)
            operation.done.set()
            if entry.is_empty() and self._entries.get(entry.model_id) is entry:
                del self._entries[entry.model_id]
                self._set_known(entry, False)

    # -- namespacing: Triton's global map and ensemble step binding -------------------

    def _set_known(self, entry: ModelEntry, known: bool) -> None:
        """Add a model to Triton's global map or take it out, and rebind the
        ensembles that changes. A model is known from the moment a load has read
        its configuration (Triton's ``Poll`` of it succeeded; a failed load of it
        later leaves it known) until it is unloaded or removed from the
        repository (``RemoveNode``)."""
        if entry.known == known:
            return
        entry.known = known
        if known:
            self.global_map.add(entry.model_id)
        else:
            self.global_map.discard(entry.model_id)
        self.lifecycle.generation += 1  # (what a name means may change with namespacing)
        if self._namespacing and not self._stopping:
            self._rebind_affected(entry.name)

    def _rebind_affected(self, name: str) -> None:
        """Load again each serving ensemble whose step ``name`` resolves elsewhere now,
        and each that failed to load because that step resolved to nothing and now
        resolves.

        Triton re-evaluates the downstreams of a node added or removed
        (``DependencyGraph::AddNodes`` via ``missing_nodes_``, ``RemoveNode``) and
        reloads them; the reload here is the registry's own, so the ensemble keeps
        serving its current versions until the rebound ones are READY.
        """
        if self._nursery is None:
            return
        self._generation += 1
        for entry in list(self._entries.values()):
            if entry.source is not None and entry.source.override_digest:
                continue  # an ensemble from a file override is not read again
            if name in entry.unresolved and entry.known and not entry.serving:
                if self.global_map.resolve(entry.model_id.namespace, name) is not None:
                    self._nursery.start_soon(self._rebind, entry.model_id, name, self._generation)
                continue
            if not entry.serving or entry.source is None:
                continue
            for bound in entry.dependencies:
                if (
                    bound.name == name
                    and self.global_map.resolve(entry.model_id.namespace, name) != bound
                ):
                    self._nursery.start_soon(self._rebind, entry.model_id, name, self._generation)
                    break

    async def _rebind(self, model_id: ModelId, name: str, generation: int) -> None:
        reason = f"the models named '{name}' changed; its ensemble steps are resolved again"
        try:
            await self._submit(
                model_id,
                ("rebind", generation),
                False,
                partial(
                    self._load,
                    override_json=None,
                    files=None,
                    digest="",
                    reason=reason,
                    chain=(),
                    rebind=True,
                ),
            )
        except TritonError as exc:
            log.warning("ensemble not rebound", model=model_id, reason=exc.message)

    async def _settled(self, name: str) -> None:
        """Wait until no operation is queued or running on a model known by ``name``
        (a rebind takes the composing models as they are, without loading them)."""
        for model_id in self.global_map.ids(name):
            entry = self._entries.get(model_id)
            for operation in list(entry.operations) if entry is not None else ():
                await operation.done.wait()

    # -- load: a model's poll, its composing models ------------------------------------

    async def _load(
        self,
        entry: ModelEntry,
        *,
        override_json: str | None,
        files: dict[str, bytes] | None,
        digest: str,
        reason: str,
        chain: tuple[str, ...],
        stable_files: bool = False,
        rebind: bool = False,
    ) -> None:
        name = entry.name
        if files and entry.source is not None and entry.source.override_digest == digest:
            if entry.serving and not entry.failed:
                log.info("model unchanged: same file override", model=name)
                return
        model_dir: Path | None = None
        polled = False
        try:
            if files:
                model_dir = await trio.to_thread.run_sync(
                    write_override, name, override_json, files
                )
                self.lifecycle.override_dirs.add(model_dir)
                config_json = None
            else:
                model_dir = await self._find(entry.model_id)
                config_json = override_json
            snapshot = await trio.to_thread.run_sync(snapshot_model, model_dir)
            prepared = await trio.to_thread.run_sync(
                partial(prepare_model, name=name),  # mapped: ModelRepository.register
                model_dir,
                self.autocomplete,
                config_json,
                self.repository.config_name,
                self.backends,
            )
            polled = True
            self._set_known(entry, True)
            await self._load_composing_models(entry, prepared.config, chain, rebind)
        except BaseException as exc:
            if files and model_dir is not None:
                # Not awaited: a cancelled load (shutdown) removes it too.
                self.lifecycle.remove_override_now(model_dir)
            if not isinstance(exc, Exception):
                raise
            if polled:
                error = as_triton_error(exc, f"failed to load '{name}'")
            else:
                error = poll_failure(name, exc)
            # Remember the failure of a model the repository has, or that has
            # versions; a name found nowhere (a typo, a failed file override of
            # a new name) is not listed, as in Triton, so such names cannot grow
            # the index.
            if entry.has_state() or (model_dir is not None and not files):
                entry.reason = error.message
                entry.failed = entry.failed or not entry.serving
            log.error("model load failed", model=name, reason=error.message)
            raise error from None

        source = LoadedSource(model_dir, snapshot, prepared.config, digest if files else "")
        if self.residency is None:
            await self.lifecycle.load(entry, source, prepared, reason, stable_files)
            return
        loading = False
        try:
            async with self.residency.charging(entry, prepared.config, model_dir):
                loading = True
                await self.lifecycle.load(entry, source, prepared, reason, stable_files)
                loading = False
        except TritonError as exc:
            if loading:
                raise  # the lifecycle's own failure, recorded and logged there
            if isinstance(exc, Unavailable):  # abandoned while waiting for room
                log.info("model load abandoned", model=name, reason=exc.message)
                raise
            # No room under the memory budget.
            entry.reason = exc.message
            entry.failed = entry.failed or not entry.serving
            log.error("model load failed", model=name, reason=exc.message)
            raise

    async def _find(self, model_id: ModelId) -> Path:
        """The model's directory; not found in Triton's words (core
        ``model_repository_manager.cc``, ``LoadUnloadModel``)."""
        try:
            return await trio.to_thread.run_sync(self.repository.find, model_id)
        except NotFound as exc:
            raise NotInRepository(model_id.name, exc.message) from None

    async def _find_all(self, name: str) -> dict[ModelId, Path]:
        """Every repository's model called ``name`` (namespacing)."""
        try:
            return await trio.to_thread.run_sync(self.repository.find_all, name)
        except NotFound as exc:
            raise NotInRepository(name, exc.message) from None

    async def _steps_on_disk(self, namespace: str, name: str) -> Sequence[str]:
        """The models the steps of model ``name`` call, as its repository's config
        says (none when it is no ensemble, or is not there to read)."""
        model_id = (
            self.global_map.resolve(namespace, name) if self._namespacing else ModelId("", name)
        )
        try:
            model_dir = await trio.to_thread.run_sync(self.repository.find, model_id or name)
            config, _ = await trio.to_thread.run_sync(
                read_model_config, model_dir, None, self.repository.config_name
            )
        except TritonError:
            return ()
        return composing_models(config)

    async def _load_composing_models(
        self, entry: ModelEntry, config: ModelConfig, chain: tuple[str, ...], rebind: bool = False
    ) -> None:
        """Load an ensemble's composing models first, as Triton does, and bind each
        step to the model it calls (its ``model_namespace``). A rebind only waits
        for the loads and unloads in progress and takes the models as they are."""
        name = entry.name
        steps = composing_models(config)
        for step in steps:
            if step == name or step in chain:
                raise cycle_error(step, name)
        # Before any step loads: two ensembles that load each other would each
        # wait for the other's load.
        await check_cycle(name, steps, partial(self._steps_on_disk, entry.model_id.namespace))
        errors: dict[str, str] = {}
        not_polled: set[str] = set()
        missing: set[str] = set()

        async def load_one(step: str) -> None:
            if rebind:
                await self._settled(step)
                return
            try:
                await self.load(
                    step,
                    explicit=False,
                    reason=f"composing model of '{name}'",
                    _chain=(*chain, name),
                )
            except TritonError as exc:
                errors[step] = exc.message
                if isinstance(exc, PollFailed):
                    not_polled.add(step)
                if isinstance(exc, NotInRepository):
                    missing.add(step)

        async with trio.open_nursery() as nursery:
            for step in steps:
                nursery.start_soon(load_one, step)
        if self._namespacing:
            self.global_map.bind_steps(entry, config, errors, self._entries)
        elif missing:
            raise PollFailed(name, missing_models(entry.model_id, missing))
        if errors:
            detail = "; ".join(f"'{s}': {m}" for s, m in sorted(errors.items()))
            if not_polled & set(errors):
                # Triton polls an ensemble's steps with it (core
                # model_repository_manager.cc PollModels), so a step that cannot
                # be polled fails the ensemble's poll: INTERNAL.
                raise PollFailed(name, f"composing model(s) failed: {detail}")
            raise InvalidArgument(f"failed to load '{name}': composing model(s) failed: {detail}")

    # -- unload ----------------------------------------------------------------------

    async def _unload(
        self, entry: ModelEntry, *, wait: bool, unload_dependents: bool, reason: str
    ) -> None:
        versions = list(entry.serving.values())
        entry.serving = {}
        self.lifecycle.switch(entry.model_id)
        self._set_known(entry, False)
        for version in versions:
            self.lifecycle.retire(entry, version, reason)
        entry.failed = False
        entry.reason = ""
        entry.explicit = False
        entry.unresolved = frozenset()
        source, entry.source = entry.source, None
        dependencies, entry.dependencies = entry.dependencies, frozenset()
        if versions:
            log.info(
                "model unloading",
                model=entry.name,
                reason=reason,
                versions=[v.version for v in versions],
            )
        if wait:
            for version in list(entry.draining):
                await version.stopped.wait()
        if source is not None and not versions:
            await self.lifecycle.remove_override_if_unused(entry, source.model_dir)
        if unload_dependents:
            for model_id in sorted(dependencies, key=ModelId.order):
                if not self._still_needed(model_id):
                    await self.unload(
                        model_id,
                        wait=wait,
                        unload_dependents=True,
                        reason=f"composing model of unloaded '{entry.name}'",
                    )

    def _still_needed(self, model_id: ModelId) -> bool:
        """Whether a composing model was loaded by name or serves another model."""
        dependency = self._entries.get(model_id)
        if dependency is None or dependency.explicit:
            return True
        return any(
            model_id in other.dependencies
            for other in self._entries.values()
            if other.serving and other.model_id != model_id
        )
