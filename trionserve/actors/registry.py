"""ModelRegistry: the routing table and the lifecycle of every model."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import structlog
import trio

from trionserve.actors.lifecycle import (
    ModelEntry,
    Operation,
    PollFailed,
    TransitionLog,
    composing_models,
    load_error,
    poll_failure,
    prepare_model,
)
from trionserve.actors.model import ModelState, ModelVersion
from trionserve.actors.rate_limiter import RateLimiter
from trionserve.backends.base import InferenceService
from trionserve.core.errors import (
    InvalidArgument,
    NotFound,
    TritonError,
    Unavailable,
    as_triton_error,
)
from trionserve.observability.quantiles import Target
from trionserve.repository.changes import LoadedSource, ReloadPlan, plan_reload
from trionserve.repository.overrides import override_digest, remove_override, write_override
from trionserve.repository.repository import ModelRepository, check_model_name
from trionserve.repository.snapshot import file_changes, snapshot_model

log = structlog.get_logger(__name__)


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


class ModelRegistry:
    """Owns every ModelVersion (as children of its nursery) and the routing table.

    Inbox: ``load`` and ``unload`` queue an operation per model name; operations on
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
    ) -> None:
        self.repository = repository
        # The server's rate limiter, given to every ModelVersion (None: unlimited).
        self.rate_limiter = rate_limiter
        # Quantiles of the latency summaries every version keeps; None: none kept
        # (--metrics-config summary_latencies, summary_quantiles).
        self._summary_quantiles = summary_quantiles
        self.autocomplete = autocomplete
        self._load_limiter = trio.CapacityLimiter(max(1, load_concurrency))
        self._drain_timeout = drain_timeout
        self._entries: dict[str, ModelEntry] = {}
        # name -> (READY versions by number, default version)
        self._routes: dict[str, tuple[dict[int, ModelVersion], ModelVersion]] = {}
        self._transition = TransitionLog()
        self._nursery: trio.Nursery | None = None
        # What models that call other models (BLS, ensembles) are given: the
        # DataPlane's model-facing view, set explicitly when the DataPlane is made.
        self.inference: InferenceService | None = None

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
            raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")
        if name in self._entries and not self._entries[name].is_empty():
            raise Unavailable(f"Request for unknown model: '{name}' has no available versions")
        raise NotFound(f"Request for unknown model: '{name}' is not found")

    def entries(self) -> dict[str, ModelEntry]:
        return self._entries

    def all_ready(self) -> bool:
        """True when every model has every version its policy wants serving."""
        return not any(e.failed for e in self._entries.values())

    def index(self) -> list[dict]:
        """Every known model and version with state and reason, sorted by name."""
        return [row for name in sorted(self._entries) for row in self._entries[name].index_rows()]

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

        ``override_json`` replaces config.pbtxt; ``files`` (``file:<path>`` ->
        contents, with ``override_json`` required) replace the model directory.
        Only what changed since the serving versions were loaded is redone (see
        :func:`plan_reload`); a reload loads beside the serving versions and
        switches only if every new version loaded, else they keep serving.
        With ``stable_files`` (POLL), versions whose files changed while they
        loaded are discarded instead of served: they may mix old and new files.
        """
        try:
            check_model_name(name)  # a name that is no directory never enters the index
            digest = override_digest(override_json, files) if (override_json or files) else ""
            await self._submit(
                name,
                ("load", digest),
                explicit,
                partial(
                    self._load,
                    override_json=override_json,
                    files=files,
                    digest=digest,
                    reason=reason,
                    chain=_chain,
                    stable_files=stable_files,
                ),
            )
        except TritonError as error:
            raise load_failure(name, error) from None

    async def unload(
        self,
        name: str,
        *,
        wait: bool = True,
        unload_dependents: bool = False,
        reason: str = "unload requested",
    ) -> None:
        """Stop routing to a model, drain its in-flight requests and unload it.

        Unloading a model that is not loaded succeeds and does nothing, as in
        Triton. With ``unload_dependents`` the models loaded only as this
        ensemble's composing models, and used by no other loaded model, are
        unloaded too. A name that could not be a model directory is refused.
        """
        try:
            check_model_name(name)
        except TritonError as error:
            raise InvalidArgument(f"failed to unload '{name}': {error.message}") from None
        await self._submit(
            name,
            ("unload", unload_dependents, wait),
            False,
            partial(self._unload, wait=wait, unload_dependents=unload_dependents, reason=reason),
        )

    async def unload_all(self) -> None:
        """Unload every model, each draining its in-flight requests.

        Models unload concurrently in waves: an ensemble goes before the models its
        steps call, so its in-flight requests can still run their later steps.
        """
        remaining = set(self._entries)
        while remaining:
            needed = {
                dependency
                for name in remaining
                for dependency in self._entries[name].dependencies
                if dependency != name
            }
            wave = (remaining - needed) or remaining  # a cycle cannot block shutdown
            async with trio.open_nursery() as nursery:
                for name in sorted(wave):
                    nursery.start_soon(partial(self.unload, name, reason="server shutdown"))
            remaining -= wave

    async def _submit(self, name: str, key: tuple, explicit: bool, work) -> None:
        assert self._nursery is not None, "registry is not running"
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = ModelEntry(name)
        operation = next(
            (op for op in entry.operations if op.key == key and not op.done.is_set()), None
        )
        if operation is None:
            operation = Operation(key)
            entry.operations.append(operation)
            self._nursery.start_soon(self._run_operation, entry, operation, work)
        elif key[0] == "load":
            log.info("joining a load of the same model already in progress", model=name)
        operation.explicit |= explicit
        await operation.done.wait()
        if operation.error is not None:
            raise operation.error

    async def _run_operation(self, entry: ModelEntry, operation: Operation, work) -> None:
        try:
            async with entry.lock:
                await work(entry)
                if operation.explicit:
                    entry.explicit = True
        except TritonError as error:
            operation.error = error
        except Exception as exc:
            log.exception("model operation failed", model=entry.name)
            operation.error = as_triton_error(exc, f"model '{entry.name}'")
        except BaseException:
            operation.error = RegistryStopped("the server is shutting down")
            raise
        finally:
            entry.operations.remove(operation)
            operation.done.set()
            if entry.is_empty() and self._entries.get(entry.name) is entry:
                del self._entries[entry.name]

    # -- load ----------------------------------------------------------------------

    async def _load(
        self, entry, *, override_json, files, digest, reason, chain, stable_files=False
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
                config_json = None
            else:
                model_dir = await self._find(name)
                config_json = override_json
            snapshot = await trio.to_thread.run_sync(snapshot_model, model_dir)
            prepared = await trio.to_thread.run_sync(
                prepare_model,
                model_dir,
                self.autocomplete,
                config_json,
                self.repository.config_name,
            )
            polled = True
            await self._load_composing_models(name, prepared.config, chain)
        except Exception as exc:
            if files and model_dir is not None:
                await trio.to_thread.run_sync(remove_override, model_dir)
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
        plan = plan_reload(entry.source, set(entry.serving), source, prepared.versions)
        if plan.update_instances and not await self._update_instances(entry, plan, source):
            plan = ReloadPlan(
                (),
                tuple(prepared.versions),
                tuple(sorted(entry.serving)),
                False,
                "instance count changed; the instances could not change in place",
            )
        if not (plan.load or plan.unload):
            entry.source = source
            entry.reason = ""
            entry.failed = False
            entry.dependencies = frozenset(composing_models(prepared.config))
            if not plan.update_instances:
                log.info("model unchanged", model=name, reason=reason)
            return
        await self._apply(entry, plan, prepared, source, f"{reason}: {plan.reason}", stable_files)

    async def _find(self, name: str) -> Path:
        """The model's directory; not found in Triton's words (core
        ``model_repository_manager.cc``, ``LoadUnloadModel``)."""
        try:
            return await trio.to_thread.run_sync(self.repository.find, name)
        except NotFound as exc:
            raise PollFailed(name, exc.message) from None

    async def _load_composing_models(self, name: str, config, chain: tuple[str, ...]) -> None:
        """Load an ensemble's composing models first, as Triton does."""
        steps = composing_models(config)
        for step in steps:
            if step == name or step in chain:
                raise InvalidArgument(
                    f"failed to load '{name}': ensemble step model '{step}' makes a "
                    f"cycle ({' -> '.join((*chain, name, step))})"
                )
        errors: dict[str, str] = {}

        async def load_one(step: str) -> None:
            try:
                await self.load(
                    step,
                    explicit=False,
                    reason=f"composing model of '{name}'",
                    _chain=(*chain, name),
                )
            except TritonError as exc:
                errors[step] = exc.message

        async with trio.open_nursery() as nursery:
            for step in steps:
                nursery.start_soon(load_one, step)
        if errors:
            detail = "; ".join(f"'{s}': {m}" for s, m in sorted(errors.items()))
            raise InvalidArgument(f"failed to load '{name}': composing model(s) failed: {detail}")

    async def _update_instances(self, entry: ModelEntry, plan: ReloadPlan, source) -> bool:
        """Give the kept versions the new instance counts without a reload."""
        for number in plan.keep:
            version = entry.serving[number]
            before = [g.count for g in version.config.instance_group]
            started = trio.current_time()
            try:
                await version.set_instance_groups(source.config)
            except Exception as exc:
                log.warning(
                    "changing instances in place failed; reloading instead",
                    model=entry.name,
                    version=number,
                    reason=as_triton_error(exc).message,
                )
                return False
            log.info(
                "model instances changed",
                model=entry.name,
                version=number,
                reason="instance_group count changed",
                duration_s=round(trio.current_time() - started, 3),
                **{"from": before, "to": [g.count for g in source.config.instance_group]},
            )
        return True

    async def _apply(
        self, entry, plan: ReloadPlan, prepared, source, reason: str, stable_files: bool = False
    ) -> None:
        """Load ``plan.load`` beside the serving versions, then switch and retire."""
        name = entry.name
        extra: dict = {"inference": self.inference} if self.inference is not None else {}
        if self.rate_limiter is not None:
            extra["rate_limiter"] = self.rate_limiter
        if self._summary_quantiles is not None:
            extra["summary_quantiles"] = self._summary_quantiles
        new = {
            number: ModelVersion(
                name,
                number,
                prepared.config,
                source.model_dir,
                prepared.backend,
                self._load_limiter,
                self._drain_timeout,
                **extra,
            )
            for number in plan.load
        }
        entry.loading.update(new)
        errors: dict[int, TritonError] = {}
        try:
            async with trio.open_nursery() as loaders:
                for version in new.values():
                    loaders.start_soon(self._start_version, entry, version, errors, reason)
        finally:
            for number, version in new.items():
                if entry.loading.get(number) is version:
                    del entry.loading[number]
        if stable_files and len(errors) < len(new):
            await self._discard_if_changed(entry, new, errors, source)
        loaded = {n: v for n, v in new.items() if n not in errors}
        for number, error in errors.items():
            entry.unavailable[number] = error.message
        if errors:
            error = load_error(name, errors)
            entry.reason = error.message
            if entry.serving:
                # A failed reload: the serving versions stay exactly as they were.
                for version in loaded.values():
                    self._retire(entry, version, "reload failed")
                if not loaded:
                    await trio.to_thread.run_sync(remove_override, source.model_dir)
                log.error(
                    "model reload failed; the loaded versions keep serving",
                    model=name,
                    reason=error.message,
                )
                raise error
            entry.failed = True
        retiring = [entry.serving[n] for n in plan.unload if n in entry.serving]
        entry.serving = {**{n: entry.serving[n] for n in plan.keep}, **loaded}
        self._switch(name)
        for version in retiring:
            self._retire(entry, version, reason)
        for number in entry.serving:
            entry.unavailable.pop(number, None)
        entry.source = source
        entry.dependencies = frozenset(composing_models(prepared.config))
        if errors:
            raise load_error(name, errors)
        entry.reason = ""
        entry.failed = False

    async def _discard_if_changed(self, entry, new: dict, errors: dict, source) -> None:
        """Retire the new versions if the files they were loaded from changed meanwhile.

        The config was read when the load began and each version's files when its
        backend loaded it, possibly seconds apart: a copy that began in between
        would be served torn (found by the simulations' poll_changes scenario).
        """
        now = await trio.to_thread.run_sync(snapshot_model, source.model_dir)
        changes = file_changes(source.snapshot, now)
        for number, version in new.items():
            if number in errors:
                continue
            if changes.config or changes.shared or number in changes.versions:
                errors[number] = Unavailable(
                    "its files changed while it loaded, so it may mix old and new files; "
                    "it is loaded again once they stop changing"
                )
                self._retire(entry, version, "its files changed while it loaded")

    async def _start_version(self, entry, version: ModelVersion, errors: dict, reason) -> None:
        assert self._nursery is not None
        self._transition(version, "UNAVAILABLE", "LOADING", reason)
        try:
            await self._nursery.start(version.run)
        except Exception as exc:
            error = as_triton_error(exc, "failed to load")
            errors[version.version] = error
            self._transition(version, "LOADING", "UNAVAILABLE", error.message)
            return
        self._transition(version, "LOADING", "READY", reason)
        self._nursery.start_soon(self._watch_version, entry, version)

    def _retire(self, entry: ModelEntry, version: ModelVersion, reason: str) -> None:
        """Unload a version the routing table no longer names, once it has drained."""
        entry.draining.add(version)
        if version.state is ModelState.READY:
            self._transition(version, "READY", "UNLOADING", reason)
        version.request_unload()

    async def _watch_version(self, entry: ModelEntry, version: ModelVersion) -> None:
        """Account for a version once it has stopped: retired, or failed while serving."""
        await version.stopped.wait()
        number = version.version
        entry.draining.discard(version)
        reason = version.reason or "unloaded"
        if entry.serving.get(number) is version:
            # A failure inside the model's actors while serving: contained here.
            del entry.serving[number]
            self._switch(entry.name)
            entry.failed = True
            entry.reason = reason
            self._transition(version, "READY", "UNAVAILABLE", reason)
        else:
            self._transition(version, "UNLOADING", "UNAVAILABLE", reason)
        if number not in entry.serving and number not in entry.loading:
            entry.unavailable[number] = reason
        await self._remove_override_if_unused(entry, version.model_dir)

    async def _remove_override_if_unused(self, entry: ModelEntry, model_dir: Path) -> None:
        in_use = [
            v
            for v in (*entry.serving.values(), *entry.loading.values(), *entry.draining)
            if v.model_dir == model_dir
        ]
        current = entry.source is not None and entry.source.model_dir == model_dir
        if not in_use and not current:
            await trio.to_thread.run_sync(remove_override, model_dir)

    def _switch(self, name: str) -> None:
        entry = self._entries.get(name)
        serving = entry.serving if entry is not None else {}
        if serving:
            self._routes[name] = (dict(serving), serving[max(serving)])
        else:
            self._routes.pop(name, None)

    # -- unload ----------------------------------------------------------------------

    async def _unload(
        self, entry: ModelEntry, *, wait: bool, unload_dependents: bool, reason: str
    ) -> None:
        versions = list(entry.serving.values())
        entry.serving = {}
        self._switch(entry.name)
        for version in versions:
            self._retire(entry, version, reason)
        entry.failed = False
        entry.reason = ""
        entry.explicit = False
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
            await self._remove_override_if_unused(entry, source.model_dir)
        if unload_dependents:
            for name in sorted(dependencies):
                if not self._still_needed(name):
                    await self.unload(
                        name,
                        wait=wait,
                        unload_dependents=True,
                        reason=f"composing model of unloaded '{entry.name}'",
                    )

    def _still_needed(self, name: str) -> bool:
        """Whether a composing model was loaded by name or serves another model."""
        dependency = self._entries.get(name)
        if dependency is None or dependency.explicit:
            return True
        return any(
            name in other.dependencies
            for other in self._entries.values()
            if other.serving and other.name != name
        )
