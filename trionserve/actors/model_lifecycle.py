"""ModelLifeCycle: a model's versions loaded, switched to, retired and unloaded.

Triton core's ``ModelLifeCycle`` (src/model_repository_manager/model_lifecycle.cc:
``AsyncLoad``, ``CreateModel``, ``OnLoadComplete``, ``AsyncUnload``): the versions a
reload plan names are started beside the serving ones, the routing table is switched
to the new set once they are READY, and the retired versions drain and unload in
the background, each state change logged. Which models to load, when, and with
which configuration is the :class:`~trionserve.actors.registry.ModelRegistry`'s
(Triton's ``ModelRepositoryManager``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog
import trio

from trionserve.actors.model import ModelState, ModelVersion
from trionserve.actors.rate_limiter import RateLimiter
from trionserve.actors.registry_entries import (
    ModelEntry,
    PreparedModel,
    TransitionLog,
    composing_ids,
    load_error,
)
from trionserve.backends.base import InferenceService
from trionserve.core.errors import TritonError, Unavailable, as_status_string, as_triton_error
from trionserve.observability.custom_metrics import CustomMetrics
from trionserve.observability.metrics import uncustomizable_families
from trionserve.observability.quantiles import Target
from trionserve.repository.changes import LoadedSource, ReloadPlan, plan_reload
from trionserve.repository.overrides import remove_override
from trionserve.repository.repository import ModelId
from trionserve.repository.snapshot import file_changes, snapshot_model

log = structlog.get_logger(__name__)


class ModelLifeCycle:
    """The versions of every model, started as children of the registry's nursery,
    and the routing table: a name's READY versions, replaced whole on each switch.

    ``entries`` is the registry's map of models (shared, not copied): the routing
    table is rebuilt from a model's entry as it is at the switch.
    """

    def __init__(
        self,
        entries: dict[str, ModelEntry],
        *,
        load_concurrency: int = 4,
        drain_timeout: float = 30.0,
        rate_limiter: RateLimiter | None = None,
        summary_quantiles: Sequence[Target] | None = None,
        custom_metrics: CustomMetrics | None = None,
    ) -> None:
        self._entries = entries
        # The server's custom metrics, given to every model it loads (None: each
        # model gets a registry of its own).
        self._custom_metrics = custom_metrics
        # The server's rate limiter, given to every ModelVersion (None: unlimited).
        self.rate_limiter = rate_limiter
        # Quantiles of the latency summaries every version keeps; None: none kept
        # (--metrics-config summary_latencies, summary_quantiles).
        self._summary_quantiles = summary_quantiles
        self._load_limiter = trio.CapacityLimiter(max(1, load_concurrency))
        self._drain_timeout = drain_timeout
        # id -> (READY versions by number, default version)
        self.routes: dict[str, tuple[dict[int, ModelVersion], ModelVersion]] = {}
        # Counted up at each change of the routes or of what a name means: a version found by
        # route() is the one it would find again while this is the same (a frontend keeps what
        # it decided of a model's version until this changes).
        self.generation = 0
        self._transition = TransitionLog()
        # The registry's nursery, set while it runs: versions are its children.
        self.nursery: trio.Nursery | None = None
        # Every override directory written and not yet removed: removed at exit.
        self.override_dirs: set[Path] = set()
        # What models that call other models (BLS, ensembles) are given: the
        # DataPlane's model-facing view, set explicitly when the DataPlane is made.
        self.inference: InferenceService | None = None

    # -- override directories --------------------------------------------------------

    def remove_overrides(self) -> None:
        """Delete every override directory still on disk (at exit: the models
        loaded from them are unloaded, or the process is about to end)."""
        for model_dir in list(self.override_dirs):
            self.remove_override_now(model_dir)

    def remove_override_now(self, model_dir: Path) -> None:
        remove_override(model_dir)
        self.override_dirs.discard(model_dir)

    async def _remove_override(self, model_dir: Path) -> None:
        await trio.to_thread.run_sync(remove_override, model_dir)
        self.override_dirs.discard(model_dir)

    # -- load, switch, retire ------------------------------------------------------

    async def load(
        self,
        entry: ModelEntry,
        source: LoadedSource,
        prepared: PreparedModel,
        reason: str,
        stable_files: bool = False,
    ) -> None:
        """Load a model from ``source`` (its configuration read and its backend made):
        only what changed since the serving versions were loaded is redone (see
        :func:`plan_reload`), instance counts in place where they can change so."""
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
            entry.dependencies = composing_ids(prepared.config)
            if not plan.update_instances:
                log.info("model unchanged", model=entry.name, reason=reason)
            return
        await self._apply(entry, plan, prepared, source, f"{reason}: {plan.reason}", stable_files)

    async def _update_instances(
        self, entry: ModelEntry, plan: ReloadPlan, source: LoadedSource
    ) -> bool:
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
        self,
        entry: ModelEntry,
        plan: ReloadPlan,
        prepared: PreparedModel,
        source: LoadedSource,
        reason: str,
        stable_files: bool = False,
    ) -> None:
        """Load ``plan.load`` beside the serving versions, then switch and retire."""
        name = entry.name
        for family in uncustomizable_families(prepared.config):
            log.warning(
                f"Metric family '{family}' in 'metric_identifier' is not a customizable "
                "metric in Triton core.",
                model=name,
            )
        extra: dict = {"inference": self.inference} if self.inference is not None else {}
        if self.rate_limiter is not None:
            extra["rate_limiter"] = self.rate_limiter
        if self._summary_quantiles is not None:
            extra["summary_quantiles"] = self._summary_quantiles
        if self._custom_metrics is not None:
            extra["custom_metrics"] = self._custom_metrics
        new = {
            number: ModelVersion(
                name,
                number,
                prepared.config,
                source.model_dir,
                prepared.backend,
                self._load_limiter,
                self._drain_timeout,
                namespace=entry.model_id.namespace,
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
        # Triton's line once the load has ended (core model_lifecycle.cc:777 and
        # :839 OnLoadComplete): any version failing fails the whole load.
        outcome = "failed to load" if errors else "successfully loaded"
        log.info(f"{outcome} '{entry.model_id.display}'")
        if errors:
            error = load_error(name, errors)
            entry.reason = error.message
            if entry.serving:
                # A failed reload: the serving versions stay exactly as they were.
                for version in loaded.values():
                    self.retire(entry, version, "reload failed")
                if not loaded:
                    await self._remove_override(source.model_dir)
                log.error(
                    "model reload failed; the loaded versions keep serving",
                    model=name,
                    reason=error.message,
                )
                raise error
            entry.failed = True
            log.error("model load failed", model=name, reason=error.message)
            if not loaded:
                # Nothing was loaded from it: a failed file override leaves nothing.
                await self._remove_override(source.model_dir)
        retiring = [entry.serving[n] for n in plan.unload if n in entry.serving]
        entry.serving = {**{n: entry.serving[n] for n in plan.keep}, **loaded}
        self.switch(entry.model_id)
        for version in retiring:
            self.retire(entry, version, reason)
        for number in entry.serving:
            entry.unavailable.pop(number, None)
        entry.source = source
        entry.dependencies = composing_ids(prepared.config)
        if errors:
            raise load_error(name, errors)
        entry.reason = ""
        entry.failed = False

    async def _discard_if_changed(
        self, entry: ModelEntry, new: dict, errors: dict, source: LoadedSource
    ) -> None:
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
                self.retire(entry, version, "its files changed while it loaded")

    async def _start_version(
        self, entry: ModelEntry, version: ModelVersion, errors: dict, reason: str
    ) -> None:
        assert self.nursery is not None
        self._transition(version, "UNAVAILABLE", "LOADING", reason)
        # Triton's own line as each version begins to load (core
        # model_lifecycle.cc:472 CreateModel: "loading: <model>:<version>").
        log.info(f"loading: {entry.model_id.display}:{version.version}")
        try:
            await self.nursery.start(version.run)
        except Exception as exc:
            error = as_triton_error(exc, "failed to load")
            errors[version.version] = error
            # Triton's line (core model_lifecycle.cc:654, CreateModel).
            log.error(
                f"failed to load '{entry.model_id.display}' version {version.version}: "
                + as_status_string(error)
            )
            self._transition(version, "LOADING", "UNAVAILABLE", error.message)
            return
        self._transition(version, "LOADING", "READY", reason)
        self.nursery.start_soon(self._watch_version, entry, version)

    def retire(self, entry: ModelEntry, version: ModelVersion, reason: str) -> None:
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
            self.switch(entry.model_id)
            entry.failed = True
            entry.reason = reason
            self._transition(version, "READY", "UNAVAILABLE", reason)
        else:
            self._transition(version, "UNLOADING", "UNAVAILABLE", reason)
            # Triton's line once a version's model object is gone (core
            # model_lifecycle.cc:624, the ModelDeleter of CreateModel).
            log.info(f"successfully unloaded '{entry.model_id.display}' version {number}")
        if number not in entry.serving and number not in entry.loading:
            entry.unavailable[number] = reason
        await self.remove_override_if_unused(entry, version.model_dir)

    async def remove_override_if_unused(self, entry: ModelEntry, model_dir: Path) -> None:
        in_use = [
            v
            for v in (*entry.serving.values(), *entry.loading.values(), *entry.draining)
            if v.model_dir == model_dir
        ]
        current = entry.source is not None and entry.source.model_dir == model_dir
        if not in_use and not current:
            await self._remove_override(model_dir)

    def switch(self, model_id: ModelId) -> None:
        entry = self._entries.get(model_id)
        serving = entry.serving if entry is not None else {}
        if serving:
            self.routes[model_id] = (dict(serving), serving[max(serving)])
        else:
            self.routes.pop(model_id, None)
        self.generation += 1

    def unroute(self, model_id: ModelId) -> None:
        """Route no request to the model now (evicted: its versions are still serving)."""
        self.routes.pop(model_id, None)
        self.generation += 1
