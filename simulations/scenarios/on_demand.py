"""Models loaded on demand under a memory budget: many clients over many models.

Models are loaded by the requests that need them (``--model-load-on-demand``)
under a host budget smaller than all of them together, so loads evict the least
recently used; some loads fail, some take long enough that clients give up
waiting; some runs unload idle models too. Besides the usual invariants, checked
as the run goes: the charged bytes never pass the budget, no model is evicted
while one of its requests is outstanding, a model never has two loads at once,
and a model whose load failed is not loaded again before its backoff has passed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

from simulations.clients import steady_load
from simulations.faults import FaultPlan
from simulations.repository import ModelSpec
from simulations.scenario import Setup, scenario
from simulations.scenarios.common import KINDS
from simulations.world import World
from trionserve.actors.residency import RETRY_FIRST_SECS, ResidencyManager, ResidencyOptions
from trionserve.actors.residency_budget import MemoryLimit
from trionserve.actors.watcher import ControlMode

MIB = 1 << 20
BUDGET = 100 * MIB
WITHIN_BUDGET = "charged bytes never pass the budget"
NO_BUSY_EVICTION = "no model is evicted while it has a request outstanding"
ONE_LOAD = "a model has at most one load at a time"
BACKOFF = "a failed on-demand load is not retried before its backoff"
EVICTS = "the budget makes the run evict (the eviction path is exercised)"


def _setup(world: World) -> Setup:
    rng = world.random("setup")
    count = rng.randint(6, 10)
    models = [
        ModelSpec(
            f"m{index}",
            kind=rng.choice(KINDS),
            instances=rng.randint(1, 2),
            max_batch_size=rng.choice([1, 4]),
            parameters=(("model_memory", f"host:{rng.randint(15, 40)}MiB"),),
        )
        for index in range(count)
    ]
    load_models: tuple[str, ...] = ()
    if rng.random() < 0.5:  # one model loaded at start-up and pinned
        models[0] = models[0].evolve(
            parameters=(("model_memory", "host:10MiB"), ("model_pinned", "true"))
        )
        load_models = (models[0].name,)
    faults = FaultPlan(
        latency=(0.001, 0.01),
        load_seconds=(0.0, 0.05),
        p_load_failure=rng.choice([0.0, 0.05, 0.1]),
        p_slow_load=0.1,
        slow_load_seconds=0.5,
    )
    residency = ResidencyOptions(
        load_on_demand=True,
        memory_limits=[MemoryLimit("host", size=BUDGET)],
        idle_unload_secs=rng.choice([0.0, 0.0, 0.3]),
    )
    return Setup(
        models,
        faults,
        mode=ControlMode.EXPLICIT,
        load_models=load_models,
        residency=residency,
        exit_timeout=5.0,
        shutdown_limit=6.0,
    )


@contextlib.contextmanager
def _watched(world: World, manager: ResidencyManager) -> Iterator[None]:
    """Check the policy's promises at the moments they could break."""
    original_admitted = manager._admitted
    original_evict = manager._evict
    original_load = manager._load
    lifecycle = world.registry.lifecycle
    original_lifecycle_load = lifecycle.load
    loading: dict[str, int] = {}
    failed_at: dict[str, float] = {}

    def within_budget(when: str) -> None:
        used = manager.used().get("host", 0)
        if used > BUDGET:
            world.violate(WITHIN_BUDGET, f"{when}: {used} bytes charged, the budget is {BUDGET}")

    def admitted(entry, config, charge, *rest):
        original_admitted(entry, config, charge, *rest)
        within_budget(f"after '{entry.name}' was charged")

    async def evict(resident, reason):
        name = resident.model_id.name
        outstanding = [
            record
            for record in world.records
            if record.model == name
            and record.accepted
            and record.outcome is None
            and record.client is None  # its client still waits (one gone is not busy)
            and record.version is not None
            and record.version.state.value in ("READY", "LOADING")
        ]
        if outstanding:
            world.violate(
                NO_BUSY_EVICTION,
                f"'{name}' was evicted ({reason}) with {len(outstanding)} requests "
                f"outstanding, e.g. {outstanding[0]}",
            )
        world.notes["evictions"] = world.notes.get("evictions", 0) + 1
        await original_evict(resident, reason)

    async def lifecycle_load(entry, *args, **kwargs):
        name = entry.name
        loading[name] = loading.get(name, 0) + 1
        if loading[name] > 1:
            world.violate(ONE_LOAD, f"'{name}' had {loading[name]} loads at once")
        try:
            return await original_lifecycle_load(entry, *args, **kwargs)
        finally:
            loading[name] -= 1

    async def on_demand_load(model_id, name, namespace, load):
        now = trio.current_time()
        last = failed_at.get(name)
        if last is not None and now - last < RETRY_FIRST_SECS:
            world.violate(
                BACKOFF, f"'{name}' was loaded again {now - last:.4f} s after its load failed"
            )
        try:
            await original_load(model_id, name, namespace, load)
        finally:
            # A load given up for want of waiters is no failure of the model.
            failure = manager._failures.get(model_id)
            if failure is not None and failure.error is load.error:
                failed_at[name] = trio.current_time()
            world.notes["on_demand_loads"] = world.notes.get("on_demand_loads", 0) + 1

    manager._admitted = admitted  # type: ignore[method-assign]
    manager._evict = evict  # type: ignore[method-assign]
    manager._load = on_demand_load  # type: ignore[method-assign]
    lifecycle.load = lifecycle_load  # type: ignore[method-assign]
    try:
        within_budget("at the start")
        yield
    finally:
        manager._admitted = original_admitted  # type: ignore[method-assign]
        manager._evict = original_evict  # type: ignore[method-assign]
        manager._load = original_load  # type: ignore[method-assign]
        lifecycle.load = original_lifecycle_load  # type: ignore[method-assign]


def _zipf_names(world: World, names: list[str]) -> list[str]:
    """Model names repeated by a Zipf(1.1)-like weight, so that a uniform choice
    among them favours a few models (and the rest are evicted and loaded again)."""
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(names))]
    smallest = min(weights)
    pool: list[str] = []
    for name, weight in zip(names, weights):
        pool += [name] * max(1, round(weight / smallest))
    world.random("clients").shuffle(pool)
    return pool


def check_evicts(world: World) -> None:
    if not world.notes.get("evictions"):
        world.violate(EVICTS, "no model was evicted: the budget never bound")


@scenario(
    "models_on_demand",
    "clients over more models than the memory budget holds, loaded on first request: "
    "loads evict the least recently used, some loads fail or take long and clients "
    "give up waiting, idle models unload; charges stay within the budget, no busy "
    "model is evicted, one load per model at a time",
    setup=_setup,
    checks=(check_evicts,),
    fast_seeds=12,
)
async def models_on_demand(world: World) -> None:
    manager = world.server.residency
    assert manager is not None
    names = [spec.name for spec in world.setup.models]
    pool = _zipf_names(world, names)
    with _watched(world, manager):
        await steady_load(
            world,
            pool,
            duration=2.0,
            mean_gap=0.004,
            rng=world.random("clients"),
            max_batch=1,
            p_cancel=0.2,
            cancel_span=(0.0, 0.3),
            p_stream=0.2,
        )
        await trio.sleep(0.6)
