"""ModelVersion: the actor that owns one loaded version of one model.

Triton core's ``Model`` / ``TritonModel`` (src/model.cc, src/backend_model.cc): one
version's configuration, scheduler, instances and statistics.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import trio

from trionserve.actors.executor import InstanceExecutor
from trionserve.actors.rate_limiter import InstanceSlot, RateLimiter
from trionserve.actors.warmup import WarmupSample, check_results, warmup_samples
from trionserve.backends.base import (
    AsyncBackendInstance,
    Backend,
    BackendInstance,
    InferenceService,
    InstanceSpec,
    LoadedModel,
    ModelContext,
    ReadinessCheckedInstance,
)
from trionserve.backends.cuda.devices import gpu_count
from trionserve.backends.ensemble import EnsembleModel
from trionserve.core.errors import TritonError, Unavailable, as_triton_error
from trionserve.core.inference import InferenceRequest
from trionserve.core.memory import release_free_memory
from trionserve.core.validation import ModelSignature
from trionserve.observability.custom_metrics import CustomMetrics
from trionserve.observability.quantiles import Target
from trionserve.observability.statistics import ModelStatistics
from trionserve.schedulers.factory import create_scheduler
from trionserve.schedulers.scheduler import Scheduler
from trionserve.schedulers.sequence_batch import SequenceBatchScheduler
from trionserve.schedulers.sequence_state import SequenceStateManager, load_sequence_states

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import (
        ModelConfig,
        ModelInstanceGroup,
        ModelRateLimiter,
    )

# A backend instance, blocking or awaited.
Instance = BackendInstance | AsyncBackendInstance

log = structlog.get_logger(__name__)


class ModelState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


def resolve_instance_kinds(config: ModelConfig, gpus: int) -> None:
    """KIND_AUTO becomes KIND_GPU when a GPU exists, else KIND_CPU, as in Triton."""
    for group in config.instance_group:
        if group.kind == group.KIND_AUTO:
            group.kind = group.KIND_GPU if gpus > 0 else group.KIND_CPU


def instance_specs(config: ModelConfig, gpus: int) -> list[InstanceSpec]:
    """One spec per instance from instance_group, named like Triton's instances.

    Instance ``c`` of a group is ``<group name>_<c>``; a KIND_GPU group has that
    instance on each of its GPUs (all GPUs when it lists none), as in Triton.
    KIND_AUTO is KIND_GPU when a GPU exists, else KIND_CPU.
    """
    specs: list[InstanceSpec] = []
    for index, group in enumerate(config.instance_group):
        group_name = group.name or f"{config.name}_{index}"
        kind = type(group).Kind.Name(group.kind)
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if gpus > 0 else "KIND_CPU"
        devices = [0]
        if kind == "KIND_GPU":
            if gpus == 0:
                raise Unavailable(
                    f"instance group '{group_name}' of model '{config.name}' is "
                    "KIND_GPU but no GPU is available on this host"
                )
            devices = list(group.gpus) or list(range(gpus))
            bad = [d for d in devices if d >= gpus or d < 0]
            if bad:
                raise Unavailable(
                    f"instance group '{group_name}' of model '{config.name}' names "
                    f"GPU(s) {bad} but this host has {gpus}"
                )
        for c in range(group.count or 1):
            for device in devices:
                specs.append(InstanceSpec(f"{group_name}_{c}", group_name, kind, device))
    return specs


def group_rate_limiters(config: ModelConfig) -> dict[str, ModelRateLimiter | None]:
    """Each instance group's ``rate_limiter`` message (None where it has none), by
    the group name :func:`instance_specs` gives its instances."""
    return {
        group.name or f"{config.name}_{index}": (
            group.rate_limiter if group.HasField("rate_limiter") else None
        )
        for index, group in enumerate(config.instance_group)
    }


class ModelVersion:
    """One version of one model: loads it, serves it, drains and unloads it.

    Children (in its own nursery): the scheduler that
    :func:`~trionserve.schedulers.factory.create_scheduler` picks from the config
    (ensemble, sequence batcher, dynamic batcher or default) and one
    InstanceExecutor per instance. Guarantees: a request accepted by ``submit`` gets
    exactly one outcome;
    on unload, new requests are refused, in-flight ones are given ``drain_timeout``
    seconds to finish, and whatever remains is answered with an error before the
    backend is released. ``statistics`` counts what happened to its requests.
    """

    def __init__(
        self,
        name: str,
        version: int,
        config: ModelConfig,
        model_dir: Path,
        backend: Backend,
        load_limiter: trio.CapacityLimiter,
        drain_timeout: float = 30.0,
        inference: InferenceService | None = None,
        rate_limiter: RateLimiter | None = None,
        summary_quantiles: Sequence[Target] | None = None,
        namespace: str = "",
        custom_metrics: CustomMetrics | None = None,
    ) -> None:
        self.name = name
        # --model-namespacing: the repository the model came from ("" without).
        self.namespace = namespace
        self.version = version
        self.config = config
        self.model_dir = model_dir
        self.backend = backend
        self.signature = ModelSignature.from_config(config)
        self.state = ModelState.LOADING
        self.reason = ""
        self.stopped = trio.Event()
        self._load_limiter = load_limiter
        self._drain_timeout = drain_timeout
        # Given to the backend, for models that call other models (BLS).
        self.inference = inference
        # Given to the backend: where the model defines its metric families (the
        # server's; None: a registry of its own, which nothing exposes).
        self.custom_metrics = custom_metrics if custom_metrics is not None else CustomMetrics()
        self.statistics = ModelStatistics(name, version)
        if summary_quantiles is not None:  # --metrics-config summary_latencies=true
            self.statistics.enable_summaries(summary_quantiles, config.response_cache.enable)
        self._scheduler: Scheduler | None = None
        # Its scheduler's submit as a plain call, if it has one (the dynamic
        # batcher's): False, the request not queued, where it would wait (its
        # queue full). Set only while the version is READY, so that a caller
        # (the data plane's begin_now) needs no look at the state per request;
        # None otherwise (``infer`` then says why it is not ready).
        self.submit_now: Callable[[InferenceRequest], bool] | None = None
        self._sequence_states: list = []  # implicit states, read at load
        self._warmup: list[WarmupSample] = []  # model_warmup samples, read at load
        self._executors: list[InstanceExecutor] = []
        # Each instance's registration with the rate limiter (None: not limited).
        self._rate_limiter = rate_limiter
        self._rate_slots: dict[InstanceSpec, InstanceSlot | None] = {}
        self._loaded: LoadedModel | None = None
        self._instances: list[Instance] = []  # backend instances created and not yet closed
        self._nursery: trio.Nursery | None = None
        self._unload_requested = trio.Event()
        # Requests in flight here, counted by the data plane's Drain as it
        # counts them for the server (Drain.request_began, request_ended).
        self._inflight = 0
        # Made when asked for (``idle``): a request that comes and goes with
        # nobody waiting builds no event; set by the Drain as the count ends.
        self._idle: trio.Event | None = None
        # The reason the index shows once it has unloaded (an eviction names its own).
        self.unloaded_reason = "unloaded"

    def __repr__(self) -> str:
        return f"ModelVersion({self.name!r}, {self.version}, {self.state.value})"

    # -- the actor -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load, then serve until unload is requested or the parent is cancelled.

        A load failure is raised before ``started``, so ``nursery.start`` raises it
        to the caller; failures after that are contained here.
        """
        started_at = trio.current_time()
        self._log_state("loading")
        try:
            loaded, instances = await self._load()
        except BaseException as exc:
            self._unregister(self._rate_slots.pop(spec) for spec in list(self._rate_slots))
            self._set_unavailable(as_triton_error(exc, "failed to load").message)
            self.stopped.set()
            raise
        self._loaded = loaded
        self._instances = [instance for _, instance in instances]
        started = False
        try:
            # An ensemble's loaded form is its plan (it has no instances).
            plan = loaded.plan if isinstance(loaded, EnsembleModel) else None
            scheduler = create_scheduler(
                self.config,
                self.statistics,
                plan=plan,
                inference=self.inference,
                states=self._sequence_states,
            )
            self._scheduler = scheduler
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(scheduler.run)
                for spec, instance in instances:
                    await self._start_executor(spec, instance)
                await self._warm_up(instances)
                self.state = ModelState.READY
                self.submit_now = getattr(scheduler, "submit_now", None)
                self._log_state(
                    "ready",
                    instances=len(instances),
                    duration_s=round(trio.current_time() - started_at, 3),
                )
                task_status.started()
                started = True
                await self._unload_requested.wait()
                await self._drain()
                nursery.cancel_scope.cancel()
        except Exception as exc:
            if not started:
                # Warmup failed (or an instance died before READY): a load failure.
                reason = _failure_reason(exc)
                self._set_unavailable(reason)
                raise Unavailable(reason) from None
            # A bug in this model's actors, or an instance that gave up (a stub
            # process failing again and again): contained to this model.
            log.exception("model version failed", model=self.name, version=self.version)
            self._set_unavailable(_failure_reason(exc))
        finally:
            self._nursery = None
            if self._scheduler is not None:
                self._scheduler.abort(
                    Unavailable(f"model '{self.name}' version {self.version} was unloaded")
                )
            released, self._instances = self._instances, []
            with trio.CancelScope(shield=True):
                await self._release(loaded, released)
            self._unregister(self._rate_slots.pop(spec) for spec in list(self._rate_slots))
            if self.state is not ModelState.UNAVAILABLE:
                self._set_unavailable(self.unloaded_reason)
            self.stopped.set()

    async def _load(self) -> tuple[LoadedModel, list[tuple[InstanceSpec, Instance]]]:
        """Load the model and create its instances in worker threads."""
        context = ModelContext(
            self.name,
            self.version,
            self.config,
            self.model_dir,
            self.model_dir / str(self.version),
            inference=self.inference,
            metrics=self.custom_metrics,
        )
        specs = instance_specs(self.config, gpu_count())
        self._rate_slots = self._register(specs, self.config)
        async with self._load_limiter:
            self._warmup = await trio.to_thread.run_sync(
                warmup_samples, self.config, self.model_dir
            )
            if self.config.HasField("sequence_batching"):
                self._sequence_states = await trio.to_thread.run_sync(
                    load_sequence_states, self.config, self.model_dir
                )
            loaded = await trio.to_thread.run_sync(self.backend.load, context)
            instances: list[tuple[InstanceSpec, Instance]] = []
            try:
                for spec in specs:
                    async with self._rate_limited(spec):
                        instance = await trio.to_thread.run_sync(loaded.create_instance, spec)
                    instances.append((spec, instance))
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self._release(loaded, [i for _, i in instances])
                raise
        return loaded, instances

    async def _warm_up(
        self,
        instances: Iterable[tuple[InstanceSpec, Instance]],
        slots: dict[InstanceSpec, InstanceSlot | None] | None = None,
    ) -> None:
        """Every instance runs every warmup sample before READY (see warmup.py)."""
        for spec, instance in instances:
            async with self._rate_limited(spec, slots):
                await self._warm_up_instance(spec, instance)

    async def _warm_up_instance(self, spec: InstanceSpec, instance: Instance) -> None:
        for sample in self._warmup:
            label = (
                f"model '{self.name}' version {self.version}: warmup sample "
                f"'{sample.name}' on instance '{spec.name}'"
            )
            for _ in range(max(1, sample.count)):
                batch = sample.requests(self.name, self.version)
                try:
                    if isinstance(instance, AsyncBackendInstance):
                        results = await instance.execute_async(batch)
                    else:
                        results = await trio.to_thread.run_sync(instance.execute, batch)
                except TritonError:
                    raise
                except Exception as exc:
                    raise Unavailable(f"{label} failed: {type(exc).__name__}: {exc}") from exc
                check_results(label, results)
        if self._warmup:
            log.info(
                "model warmed up",
                model=self.name,
                version=self.version,
                instance=spec.name,
                samples=len(self._warmup),
            )

    async def _release(self, loaded: LoadedModel, instances: Iterable[Instance]) -> None:
        def release() -> None:
            for instance in instances:
                try:
                    instance.close()
                except Exception:
                    log.exception("instance close failed", model=self.name)
            try:
                loaded.unload()
            except Exception:
                log.exception("model unload failed", model=self.name)
            # glibc keeps what the model freed in its arenas until trimmed.
            release_free_memory()

        await trio.to_thread.run_sync(release)

    async def _drain(self) -> None:
        self.state = ModelState.UNLOADING
        self.submit_now = None
        self._log_state("unloading", inflight=self._inflight)
        assert self._scheduler is not None
        self._scheduler.close()
        with trio.move_on_after(self._drain_timeout) as scope:
            await self.idle.wait()
        if scope.cancelled_caught:
            log.warning(
                "unload deadline passed with requests in flight",
                model=self.name,
                version=self.version,
                inflight=self._inflight,
            )

    async def _start_executor(
        self, spec: InstanceSpec, instance: Instance, slot: InstanceSlot | None = None
    ) -> InstanceExecutor:
        assert self._scheduler is not None and self._nursery is not None
        executor = InstanceExecutor(
            spec,
            instance,
            self._scheduler.outlet(),
            self.statistics,
            rate_limiter=self._rate_limiter,
            rate_slot=slot if slot is not None else self._rate_slots.get(spec),
        )
        self._executors.append(executor)
        await self._nursery.start(executor.run)
        return executor

    def _register(
        self, specs: list[InstanceSpec], config: ModelConfig
    ) -> dict[InstanceSpec, InstanceSlot | None]:
        """Register instances with the rate limiter before they are created, as
        Triton does; a resource the server cannot provide fails the load (and
        registers none of them)."""
        limiter = self._rate_limiter
        slots: dict[InstanceSpec, InstanceSlot | None] = {}
        if limiter is None:
            return slots
        groups = group_rate_limiters(config)
        try:
            for spec in specs:
                slots[spec] = limiter.register(
                    self.name, spec.name, spec.device_id, groups.get(spec.group)
                )
        except BaseException:
            self._unregister(slots.values())
            raise
        return slots

    def _rate_limited(
        self, spec: InstanceSpec, slots: dict | None = None
    ) -> AbstractAsyncContextManager:
        """Hold ``spec``'s rate-limiter resources. Creating an instance and warming it
        up each take them once and count as an execution, as Triton's INIT and
        WARM_UP payloads do (backend_model_instance.cc InitAndWarmUpModelInstance)."""
        slot = (slots if slots is not None else self._rate_slots).get(spec)
        if self._rate_limiter is None or slot is None:
            return nullcontext()
        return self._rate_limiter.execution(slot)

    def _unregister(self, slots: Iterable[InstanceSlot | None]) -> None:
        if self._rate_limiter is not None:
            for slot in slots:
                self._rate_limiter.unregister(slot)

    def _set_unavailable(self, reason: str) -> None:
        self.state = ModelState.UNAVAILABLE
        self.submit_now = None
        self.reason = reason
        self._log_state("unavailable", reason=reason)

    def _log_state(self, event: str, **fields: object) -> None:
        """ "model ready" at info, once per version loaded; the other steps (and a
        failure, which the registry logs at error) at the verbose level."""
        level = log.info if event == "ready" else log.debug
        level(f"model {event}", model=self.name, version=self.version, **fields)

    # -- used by the registry and the data plane -----------------------------

    @property
    def instances(self) -> list[InstanceSpec]:
        """The instances serving now, in the order they were started."""
        return [executor.spec for executor in self._executors]

    @property
    def executors(self) -> list[InstanceExecutor]:
        """The executors of the instances serving now (read, not changed, by a frontend)."""
        return self._executors

    @property
    def sequences(self) -> SequenceStateManager | None:
        """The open sequences of a model with ``sequence_batching``; None otherwise."""
        scheduler = self._scheduler
        return scheduler.sequences if isinstance(scheduler, SequenceBatchScheduler) else None

    async def check_ready(self) -> None:
        """Raise why a READY version cannot serve now: the first instance whose
        backend says it is not ready (core backend_model.cc TritonModel::IsReady,
        asked by the model readiness API, server.cc ModelIsReady)."""
        if self.state is not ModelState.READY:
            # Failed or unloading, and not yet out of the registry's routes.
            raise Unavailable(f"model '{self.name}' version {self.version} is {self.state.value}")
        for instance in self._instances:
            if isinstance(instance, ReadinessCheckedInstance):
                await instance.check_ready()

    def request_unload(self) -> None:
        self._unload_requested.set()

    async def infer(self, request: InferenceRequest) -> None:
        """Queue a validated request; its outcome arrives on the request itself."""
        if self.state is not ModelState.READY or self._scheduler is None:
            raise self._not_ready()
        try:
            await self._scheduler.submit(request)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise self.unloading() from None

    def unloading(self) -> Unavailable:
        """The error for a request whose scheduler closed as it was queued."""
        return Unavailable(f"model '{self.name}' version {self.version} is unloading")

    def _not_ready(self) -> Unavailable:
        reason = f": {self.reason}" if self.reason else ""
        return Unavailable(
            f"model '{self.name}' version {self.version} is not ready ({self.state.value}{reason})"
        )

    @property
    def idle(self) -> trio.Event:
        """Set while no request is in flight (a new one is made by the next request)."""
        idle = self._idle
        if idle is None:
            idle = self._idle = trio.Event()
            if self._inflight == 0:
                idle.set()
        return idle

    @property
    def inflight(self) -> int:
        """Requests admitted to this version and not yet finished (queued included)."""
        return self._inflight

    async def set_instance_groups(self, config: ModelConfig) -> None:
        """Match the running instances to ``config``'s instance groups, without a reload.

        Only the instance groups may differ from the loaded configuration. New
        instances are created (in worker threads) and start taking batches before
        any instance goes away; a removed instance finishes the batch it holds,
        then is closed. Raises, changing nothing, if an instance cannot be created.
        """
        loaded = self._loaded
        if self.state is not ModelState.READY or self._nursery is None or loaded is None:
            raise Unavailable(
                f"model '{self.name}' version {self.version} is not ready "
                f"({self.state.value}); its instances cannot be changed"
            )
        wanted = instance_specs(config, gpu_count())
        # An instance whose group changed in more than its name and count (its
        # rate_limiter) is replaced, as Triton compares instance signatures.
        changed = _changed_groups(self.config, config)
        current = {executor.spec: executor for executor in self._executors}
        added = [spec for spec in wanted if spec not in current or spec.group in changed]
        removed = [
            e for spec, e in current.items() if spec not in set(wanted) or spec.group in changed
        ]
        created: list = []
        slots = self._register(added, config)
        async with self._load_limiter:
            try:
                for spec in added:
                    async with self._rate_limited(spec, slots):
                        created.append(await trio.to_thread.run_sync(loaded.create_instance, spec))
            except BaseException:
                self._unregister(slots.values())
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_close_all, created, self.name)
                raise
        pairs = list(zip(added, created))
        try:
            # New instances are warmed up before they take batches; a stub-backed
            # one needs its executor running first and serialises its executes.
            await self._warm_up(
                [p for p in pairs if not isinstance(p[1], AsyncBackendInstance)], slots
            )
        except BaseException:
            self._unregister(slots.values())
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_close_all, created, self.name)
            raise
        for spec, instance in pairs:
            self._instances.append(instance)
            await self._start_executor(spec, instance, slots.get(spec))
        old_slots = [self._rate_slots.get(e.spec) for e in removed]
        self._rate_slots.update(slots)
        try:
            await self._warm_up([p for p in pairs if isinstance(p[1], AsyncBackendInstance)], slots)
        except TritonError as exc:
            log.warning("warmup of a new instance failed", model=self.name, reason=exc.message)
        for executor in removed:
            self._executors.remove(executor)
            executor.stop()
        self.config = config
        self._log_state(
            "instances changed",
            added=[s.name for s in added],
            removed=[e.spec.name for e in removed],
            instances=len(self._executors),
        )
        for executor, old_slot in zip(removed, old_slots):
            await executor.finished.wait()
            self._unregister([old_slot])
            if executor.instance in self._instances:  # else the unload released it
                self._instances.remove(executor.instance)
                await trio.to_thread.run_sync(_close_all, [executor.instance], self.name)


def _changed_groups(old: ModelConfig, new: ModelConfig) -> set[str]:
    """Names of the instance groups in both configurations that differ in more than
    their count (core model_config_utils.cc EquivalentInInstanceConfig ignores the
    name and the count)."""
    before = {name: group for name, group in _groups(old)}
    changed = set()
    for name, group in _groups(new):
        if name in before:
            a, b = type(group)(), type(group)()
            a.CopyFrom(before[name])
            b.CopyFrom(group)
            a.count = b.count = 0
            a.name = b.name = ""
            if a != b:
                changed.add(name)
    return changed


def _groups(config: ModelConfig) -> Iterator[tuple[str, ModelInstanceGroup]]:
    for index, group in enumerate(config.instance_group):
        yield group.name or f"{config.name}_{index}", group


def _failure_reason(exc: BaseException) -> str:
    """Why a serving model version failed: a TritonError's own message (through the
    nurseries' exception groups), else an internal error."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, TritonError):
        return exc.message
    return f"internal error: {as_triton_error(exc).message}"


def _close_all(instances: list, model: str) -> None:
    for instance in instances:
        try:
            instance.close()
        except Exception:
            log.exception("instance close failed", model=model)
