"""ResidencyManager: models loaded on first request, under a memory budget, evicted when idle.

Triton has no such policy (users script load, infer, unload from their clients, and
race: server#3583, #7279); here it lives beside the
:class:`~trionserve.actors.registry.ModelRegistry`, which owns every load, unload
and request routing, so that a model is never unloaded under a request:

- **Load on first request** (``--model-load-on-demand``): a request for a model that
  is in a repository and not loaded starts its load; every request for it waits on
  that one load (within its own timeout) and is then served. A failed load answers
  every waiting request with its error, once, and the model is not tried again
  before a backoff has passed (2 s, doubling to 60 s); requests meanwhile get the
  same error at once.
- **Budget** (``--model-memory-limit``): each loaded model is charged what its load
  took (the process tree's resident memory and each GPU's used memory before and
  after; the configuration's ``model_memory`` parameter wins when present). A load
  that does not fit first evicts idle models, least recently used first; one that
  cannot fit even then fails with the budget, what is resident and what it needs.
  With a budget, loads are measured one at a time so that each delta is its own.
- **Idle unload** (``--model-idle-unload-secs``): models unused that long unload.

Never evicted: a model with a request in flight or queued, an open sequence,
requests waiting to be admitted to it, a loaded ensemble that calls it, a load or
unload in progress; nor a model loaded at start-up or pinned (``model_pinned``).
An eviction stops routing to the model in the same step as it is decided, so a
request either reached the model before (and is served while it drains) or finds
it gone (and loads it again).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import trio

from trionserve.actors.memory_usage import (
    GpuMemory,
    delta,
    files_size,
    host_total,
    settled_usage,
    usage,
)
from trionserve.actors.residency_budget import (
    HOST,
    Charge,
    MemoryLimit,
    budget_error,
    charge_text,
    declared_charge,
    is_pinned,
    over,
    total,
)
from trionserve.core.errors import NotFound, TritonError, Unavailable
from trionserve.observability.residency_metrics import ResidencyMetrics
from trionserve.repository.repository import ModelId

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.actors.model import ModelVersion
    from trionserve.actors.registry import ModelRegistry
    from trionserve.actors.registry_entries import ModelEntry
    from trionserve.core.inference import InferenceRequest

log = structlog.get_logger(__name__)

RETRY_FIRST_SECS = 2.0
RETRY_MAX_SECS = 60.0
# How often an on-demand load waiting for room looks again without being woken.
ROOM_RECHECK_SECS = 0.05
# How long a load waits for another's measurement before it takes itself for part
# of it (a model whose initialize loads another).
NESTED_WAIT_SECS = 10.0
# Why a model cannot be evicted now, but may soon.
_TRANSIENT = (
    "requests in flight",
    "requests waiting for it",
    "loading or unloading",
    "open sequences",
    "being evicted",
)


@dataclass
class ResidencyOptions:
    """``--model-load-on-demand``, ``--model-memory-limit`` (repeatable) and
    ``--model-idle-unload-secs`` (0: never)."""

    load_on_demand: bool = False
    memory_limits: list[MemoryLimit] = field(default_factory=list)
    idle_unload_secs: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.load_on_demand or bool(self.memory_limits) or self.idle_unload_secs > 0


@dataclass(eq=False)
class Resident:
    """One loaded model as the policy sees it."""

    model_id: ModelId
    charge: Charge
    last_used: float
    pinned: bool = False
    startup: bool = False
    evicting: bool = False
    measured: bool = False  # the charge was measured (not declared by its config)


@dataclass(eq=False)
class _Load:
    """One on-demand load, shared by every request that waits for it."""

    done: trio.Event = field(default_factory=trio.Event)
    error: TritonError | None = None


@dataclass(eq=False)
class _MeasuredLoad:
    """A load being measured, seen by every task it starts (a context variable
    copied into them): active until the measurement ends."""

    active: bool = True


# The load whose measurement the current task is part of, if any.
_MEASURED_LOAD: contextvars.ContextVar[_MeasuredLoad] = contextvars.ContextVar(
    "trionserve_measured_load"
)


class _Abandoned(Unavailable):
    """An on-demand load given up while it waited for room: no request waits for it
    (not a failure of the model: no backoff follows)."""


@dataclass
class _Failure:
    error: TritonError
    retry_at: float
    backoff: float


class ResidencyManager:
    """Which models stay loaded: on-demand loads, charges, evictions, idle unloads.

    Owns its nursery (the on-demand loads, each in its own task so that a request
    that gives up does not cut the load others wait for, and the idle reaper) and
    the residents' charges. The registry calls :meth:`charging` around every load;
    the DataPlane calls :meth:`wait_routable` before routing a request and
    :meth:`touch` when it admits one.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        options: ResidencyOptions,
        gpus: GpuMemory | None = None,
        *,
        may_unload: bool = True,
    ) -> None:
        self.registry = registry
        # False outside EXPLICIT mode: nothing would load an unloaded model again
        # (NONE loads once, POLL only on a change), so every model stays, and a
        # budget only refuses the loads that do not fit.
        self._may_unload = may_unload
        self.options = options
        self._gpus = gpus
        self.budgets = self._resolve(options.memory_limits)
        self.residents: dict[ModelId, Resident] = {}
        self._loads: dict[ModelId, _Load] = {}
        self._failures: dict[ModelId, _Failure] = {}
        self._waiting: dict[ModelId, int] = {}
        # Loads are measured one at a time, evictions made under it too.
        self._measuring = trio.Lock()
        self._reserved: tuple[ModelId, Charge] | None = None
        # Measured charges of models since unloaded: the estimate of their next load.
        self._measured: dict[ModelId, Charge] = {}
        # What evicted models were charged and did not give back (a framework's
        # one-time libraries and thread pools, charged to the first model that
        # loaded them): it stays charged, so the budget bounds what the server takes.
        self.retained: Charge = {}
        self._started = False  # loads before are start-up loads
        # Models whose load a request started (they may wait for room).
        self._on_demand: set[ModelId] = set()
        self._abandoned: set[ModelId] = set()  # ... and given up for want of waiters
        # Set when a waiter goes or a model is evicted: room may have changed.
        self._changed = trio.Event()
        # With a budget, one on-demand load runs at a time, reading its
        # configuration (an ONNX model's auto-complete builds a session) included:
        # sixteen cold models read at once took 500 MiB past the budget.
        self._load_slots = trio.CapacityLimiter(1 if self.budgets else 1_000_000)
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self.metrics = ResidencyMetrics()
        registry.residency = self

    def _resolve(self, limits: list[MemoryLimit]) -> Charge:
        budgets: Charge = {}
        for limit in limits:
            if limit.device == HOST:
                budgets[HOST] = limit.resolve(host_total())
                continue
            index = int(limit.device.split(":")[1])
            gpus = self._gpus
            if gpus is None or not gpus.available or index >= gpus.count():
                raise ValueError(
                    f"--model-memory-limit={limit.text()}: there is no {limit.device} "
                    f"here ({gpus.count() if gpus is not None else 0} GPUs visible through NVML)"
                )
            budgets[limit.device] = limit.resolve(gpus.total(index))
        return budgets

    # -- the actor -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.options.idle_unload_secs > 0:
                    nursery.start_soon(self._reap_idle)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            if self._gpus is not None:
                self._gpus.close()

    def serving(self) -> None:
        """The start-up loads are over: models loaded from now on may be evicted."""
        self._started = True

    # -- queries ---------------------------------------------------------------------

    def used(self) -> Charge:
        """What the resident models are charged, by device (a load being measured
        counts with its estimate)."""
        self._prune()
        charges = [r.charge for r in self.residents.values()] + [self.retained]
        if self._reserved is not None:
            charges.append(self._reserved[1])
        return total(charges)

    def busy(self, resident: Resident) -> str | None:
        """Why a resident cannot be evicted now (None: it can)."""
        if resident.pinned:
            return "pinned"
        if resident.startup:
            return "loaded at start-up" if self._may_unload else "kept outside explicit mode"
        if resident.evicting:
            return "being evicted"
        model_id = resident.model_id
        if self._waiting.get(model_id):
            return "requests waiting for it"
        entry = self.registry.entries().get(model_id)
        if entry is None:
            return None
        if entry.operations or entry.lock.locked():
            return "loading or unloading"
        for version in entry.serving.values():
            if version.inflight:
                return "requests in flight"
            sequences = version.sequences
            if sequences is not None and sequences.open:
                return "open sequences"
        for other in self.registry.entries().values():
            if other.serving and other is not entry and model_id in other.dependencies:
                return f"used by ensemble '{other.name}'"
        return None

    def _prune(self) -> None:
        """Forget residents whose model no longer serves (unloaded, or failed)."""
        entries = self.registry.entries()
        for model_id, resident in list(self.residents.items()):
            entry = entries.get(model_id)
            if resident.evicting:
                continue
            if entry is None or not (entry.serving or entry.draining or entry.loading):
                self._forget(model_id)

    def _forget(self, model_id: ModelId) -> None:
        resident = self.residents.pop(model_id, None)
        if resident is not None and resident.charge:
            self._measured[model_id] = resident.charge

    # -- the request path --------------------------------------------------------------

    def touch(self, model: ModelVersion) -> None:
        """A request was admitted to ``model``: it is the most recently used."""
        resident = self.residents.get(ModelId(model.namespace, model.name))
        if resident is not None:
            resident.last_used = trio.current_time()

    async def wait_routable(self, request: InferenceRequest) -> None:
        """Return once the request's model routes, loading it if it is in a
        repository and not loaded (within the request's own timeout); else raise
        what routing it raises, or the load's error. Returns without a checkpoint
        when the model routes already, so routing and admission that follow see
        the same table."""
        await self.wait_model(
            request.model_name, request.model_version, request.model_namespace, request.timeout_us
        )

    async def wait_model(
        self, name: str, version: int | None, namespace: str | None = None, timeout_us: int = 0
    ) -> None:
        """:meth:`wait_routable` for a model named by a request that is no inference
        (its metadata or configuration)."""
        registry = self.registry
        try:
            registry.route(name, version, namespace)
            return
        except TritonError as error:
            refusal = error
        model_id = ModelId(namespace or "", name)
        if not self.options.load_on_demand or self._routes(name, namespace):
            raise refusal
        if not await self._in_repository(name, namespace):
            raise refusal
        began = trio.current_time()
        timeout = timeout_us / 1e6 if timeout_us else math.inf
        self._waiting[model_id] = self._waiting.get(model_id, 0) + 1
        try:
            with trio.move_on_after(timeout):
                while True:
                    load = self._start_load(model_id, name, namespace)
                    await load.done.wait()
                    if load.error is not None:
                        raise load.error
                    try:
                        registry.route(name, version, namespace)
                    except TritonError:
                        if self._routes(name, namespace):
                            raise
                        continue  # unloaded again meanwhile: load it again
                    self.metrics.observe_wait(trio.current_time() - began)
                    return
            raise Unavailable(
                f"Request timeout expired: model '{name}' was still loading after the "
                f"request's timeout of {timeout_us} us"
            )
        finally:
            left = self._waiting[model_id] - 1
            if left:
                self._waiting[model_id] = left
            else:
                del self._waiting[model_id]
            self._changed.set()

    def _routes(self, name: str, namespace: str | None) -> bool:
        """Whether some version of the model is routed to (the request asked for
        one that is not)."""
        routes = self.registry.lifecycle.routes
        if namespace:
            return ModelId(namespace, name) in routes
        return any(getattr(key, "name", key) == name for key in routes)

    async def _in_repository(self, name: str, namespace: str | None) -> bool:
        repository = self.registry.repository
        try:
            if namespace:
                await trio.to_thread.run_sync(repository.find, ModelId(namespace, name))
            else:
                await trio.to_thread.run_sync(repository.find_all, name)
        except NotFound:
            return False
        return True

    def _start_load(self, model_id: ModelId, name: str, namespace: str | None) -> _Load:
        """The load in progress for a model, or a new one; raises the last failure
        while its backoff lasts."""
        failure = self._failures.get(model_id)
        if failure is not None and trio.current_time() < failure.retry_at:
            raise failure.error
        load = self._loads.get(model_id)
        if load is None:
            if self._nursery is None:
                raise Unavailable(f"model '{name}' cannot be loaded: the server is shutting down")
            load = self._loads[model_id] = _Load()
            self._nursery.start_soon(self._load, model_id, name, namespace, load)
        return load

    async def _load(self, model_id: ModelId, name: str, namespace: str | None, load: _Load) -> None:
        target: str = model_id if namespace else name
        self._on_demand.add(model_id)
        try:
            async with self._load_slots:
                if not self._waiting.get(model_id):
                    # Every request that wanted it gave up while it queued.
                    self._abandoned.add(model_id)
                    raise _Abandoned(f"model '{name}' was not loaded: no request waits for it")
                await self.registry.load(target, reason="requested by an inference request")
        except TritonError as error:
            if model_id in self._abandoned:
                load.error = error  # no request waits: not a failure of the model
                return
            previous = self._failures.get(model_id)
            backoff = min(previous.backoff * 2, RETRY_MAX_SECS) if previous else RETRY_FIRST_SECS
            self._failures[model_id] = _Failure(error, trio.current_time() + backoff, backoff)
            load.error = error
            entry = self.registry.entries().get(model_id)
            if entry is not None and not entry.serving:
                # A request must not make the server unready (strict readiness
                # counts failed models): the index, the backoff and the metrics
                # keep the failure.
                entry.failed = False
            self.metrics.load_failures[name] = self.metrics.load_failures.get(name, 0) + 1
            log.warning(
                "on-demand load failed", model=name, reason=error.message, retry_in_s=backoff
            )
        except BaseException:
            load.error = Unavailable(f"model '{name}' was not loaded: the server is shutting down")
            raise
        else:
            self._failures.pop(model_id, None)
            self.metrics.loads[name] = self.metrics.loads.get(name, 0) + 1
        finally:
            self._on_demand.discard(model_id)
            self._abandoned.discard(model_id)
            del self._loads[model_id]
            load.done.set()

    # -- charging loads ------------------------------------------------------------------

    @asynccontextmanager
    async def charging(
        self, entry: ModelEntry, config: ModelConfig, model_dir: Path
    ) -> AsyncIterator[None]:
        """Around one load of ``entry`` by the registry: make room for it under the
        budget (evicting), measure it, and charge it once it serves."""
        declared = declared_charge(config)
        model_id = entry.model_id
        if not self.budgets:
            yield
            self._admitted(entry, config, declared or {})
            return
        outer = _MEASURED_LOAD.get(None)
        nested = outer is not None and outer.active
        if not nested:
            # A load measured now may be the one that asked for this (a model
            # whose initialize loads another, from a thread that did not carry
            # the load's context: a stub's and an in-process model's calls do):
            # past a while, it is taken as such rather than waited for forever.
            limit = NESTED_WAIT_SECS if self._reserved is not None else math.inf
            with trio.move_on_after(limit) as waited:
                await self._measuring.acquire()
            nested = waited.cancelled_caught
            if nested:
                log.warning(
                    "loading without measuring: another load has been measured for "
                    f"{limit:g} s (does its model load this one in its initialize?)",
                    model=entry.name,
                )
        if nested:
            # Loaded by the model whose load is being measured (pb_utils.load_model
            # in its initialize): waiting for that measurement would wait forever,
            # and what this load takes is counted in it. Only a declared size is
            # made room for and charged.
            if declared is not None and model_id not in self.residents:
                await self._make_room(model_id, declared)
            yield
            self._admitted(entry, config, declared or {})
            return
        measuring = _MeasuredLoad()
        token = _MEASURED_LOAD.set(measuring)  # the load's tasks inherit it
        try:
            async with self._load_measured(entry, config, model_dir, declared):
                yield
        finally:
            measuring.active = False
            _MEASURED_LOAD.reset(token)
            self._measuring.release()

    @asynccontextmanager
    async def _load_measured(
        self, entry: ModelEntry, config: ModelConfig, model_dir: Path, declared: Charge | None
    ) -> AsyncIterator[None]:
        """:meth:`charging` with a budget, the caller holding ``_measuring``: room
        made, the load measured and charged."""
        model_id = entry.model_id
        reload = model_id in self.residents
        estimate = declared if declared is not None else self._measured.get(model_id)
        if estimate is None:
            estimate = {HOST: await trio.to_thread.run_sync(files_size, model_dir)}
        if not reload:
            await self._make_room(model_id, estimate)
        self._reserved = (model_id, estimate)
        before = None if declared is not None else await trio.to_thread.run_sync(usage, self._gpus)
        try:
            yield
        finally:
            self._reserved = None
        if declared is None:
            after = await trio.to_thread.run_sync(settled_usage, self._gpus)
            charge = delta(before, after)
        else:
            charge = declared
        measured = declared is None
        if reload:
            previous = self.residents[model_id].charge
            charge = {d: max(v, previous.get(d, 0)) for d, v in {**previous, **charge}.items()}
        else:
            try:
                await self._make_room(model_id, charge)
            except TritonError:
                # Bigger than estimated and no room left: it goes again.
                assert self._nursery is not None
                self._nursery.start_soon(self._unload_unfit, model_id)
                raise
        self._admitted(entry, config, charge, measured)

    async def _unload_unfit(self, model_id: ModelId) -> None:
        try:
            await self.registry.unload(model_id, reason="it does not fit the memory budget")
        except TritonError as error:
            log.warning("unfit model not unloaded", model=model_id.name, reason=error.message)

    def _admitted(
        self, entry: ModelEntry, config: ModelConfig, charge: Charge, measured: bool = False
    ) -> None:
        if not entry.serving:
            return
        model_id = entry.model_id
        resident = self.residents.get(model_id)
        if resident is None:
            resident = self.residents[model_id] = Resident(
                model_id,
                charge,
                trio.current_time(),
                startup=not (self._started and self._may_unload),
            )
        resident.charge = charge
        resident.measured = measured
        resident.pinned = is_pinned(config)
        resident.last_used = trio.current_time()
        self._wake.set()

    async def _make_room(self, model_id: ModelId, need: Charge) -> None:
        """Evict idle models, least recently used first, until ``need`` fits.

        When what stands in the way is only busy for now (requests in flight or
        waiting, a load or unload, an open sequence), an on-demand load waits for
        it to become idle, for as long as a request still waits for the load; any
        other load, and one that could not fit even were those gone (pinned and
        start-up models, ensembles' steps, or more than the budget), fails with
        the budget error at once.
        """
        while True:
            self._prune()  # models unloaded by other means hold no room
            others = [r for m, r in self.residents.items() if m != model_id]
            used = total([r.charge for r in others] + [self.retained])
            excess = over(self.budgets, used, need)
            if not excess:
                return
            reasons = {r.model_id: self.busy(r) for r in others}
            victim = next(
                (
                    r
                    for r in sorted(others, key=lambda r: r.last_used)
                    if reasons[r.model_id] is None and any(r.charge.get(d, 0) > 0 for d in excess)
                ),
                None,
            )
            if victim is not None:
                await self._evict(victim, f"evicted: least recently used to load '{model_id.name}'")
                continue
            staying = [r.charge for r in others if reasons[r.model_id] not in _TRANSIENT]
            staying.append(self.retained)
            if model_id not in self._on_demand or over(self.budgets, total(staying), need):
                resident = {r.model_id.name: r.charge for r in others}
                if any(self.retained.values()):
                    resident["(kept by the server after unloads)"] = self.retained
                raise budget_error(
                    model_id.name,
                    self.budgets,
                    need,
                    resident,
                    {r.model_id.name: why for r in others if (why := reasons[r.model_id])},
                )
            if not self._waiting.get(model_id):
                self._abandoned.add(model_id)
                raise _Abandoned(
                    f"failed to load '{model_id.name}': no request waits for it any more "
                    "(it was waiting for room under the memory budget)"
                )
            await self._room_may_change(others)

    async def _room_may_change(self, residents: list[Resident]) -> None:
        """Wait until one of ``residents`` may have become idle: one of their
        versions finished its last request, a waiter went, or a short while passed
        (an operation ended, a sequence closed)."""
        self._changed = trio.Event()
        events = [self._changed]
        entries = self.registry.entries()
        for resident in residents:
            entry = entries.get(resident.model_id)
            for version in entry.serving.values() if entry is not None else ():
                if not version.idle.is_set():
                    events.append(version.idle)
        async with trio.open_nursery() as nursery:

            async def first(event: trio.Event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            for event in events:
                nursery.start_soon(first, event)
            nursery.cancel_scope.deadline = trio.current_time() + ROOM_RECHECK_SECS

    async def _evict(self, resident: Resident, reason: str) -> None:
        model_id = resident.model_id
        resident.evicting = True
        # Stop routing in the same step as the decision: no request reaches it now.
        self.registry.lifecycle.unroute(model_id)
        entry = self.registry.entries().get(model_id)
        for version in entry.serving.values() if entry is not None else ():
            version.unloaded_reason = reason
        now = trio.current_time()
        log.info(
            "model evicted",
            model=model_id.name,
            reason=reason,
            charge=charge_text(resident.charge),
            idle_s=round(now - resident.last_used, 3),
        )
        kind = "idle" if reason.startswith("idle") else "lru"
        key = (model_id.name, kind)
        self.metrics.evictions[key] = self.metrics.evictions.get(key, 0) + 1
        measure = resident.measured and bool(self.budgets)
        before = await trio.to_thread.run_sync(usage, self._gpus) if measure else None
        try:
            await self.registry.unload(model_id, reason=reason)
        finally:
            self.residents.pop(model_id, None)
            self._measured[model_id] = resident.charge
            self._changed.set()
        if before is not None:
            after = await trio.to_thread.run_sync(settled_usage, self._gpus)
            self._account_release(resident.charge, delta(after, before))

    def _account_release(self, charge: Charge, freed: Charge) -> None:
        """What an evicted model was charged and did not give back stays charged
        (``retained``); what it gave back beyond its charge comes off it."""
        for device, size in charge.items():
            kept = self.retained.get(device, 0) + size - freed.get(device, 0)
            self.retained[device] = max(0, kept)

    # -- idle unload ------------------------------------------------------------------------

    async def _reap_idle(self) -> None:
        idle = self.options.idle_unload_secs
        while True:
            now = trio.current_time()
            due = [
                r
                for r in sorted(self.residents.values(), key=lambda r: r.last_used)
                if not (r.pinned or r.startup) and now - r.last_used >= idle
            ]
            for resident in due:
                async with self._measuring:
                    if self.busy(resident) is None and resident.model_id in self.residents:
                        await self._evict(resident, f"idle for {idle:g} s")
            candidates = [
                r.last_used + idle
                for r in self.residents.values()
                if not (r.pinned or r.startup or r.evicting)
            ]
            # A model busy past its idle time is looked at again a little later.
            next_check = max(min(candidates, default=math.inf), now + min(1.0, idle / 4))
            self._wake = trio.Event()
            with trio.move_on_at(next_check):
                await self._wake.wait()
