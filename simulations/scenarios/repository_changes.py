"""The repository changing under load: POLL with torn writes, deletes and edits during
loads; reloads that must not fail a single request; unloads that drain."""

from __future__ import annotations

from functools import partial

import trio

from simulations.clients import steady_load, wait_for
from simulations.faults import FaultPlan, quantize
from simulations.scenario import Setup, scenario
from simulations.scenarios.common import (
    change_repository,
    loading,
    model_names,
    settle,
    two_models,
    verify_converged,
)
from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import TritonError

ACCEPTED_SUCCEED = "accepted requests finish with their results"


def _poll_setup(world) -> Setup:
    rng = world.random("setup")
    faults = FaultPlan(latency=(0.001, 0.004), load_seconds=(0.2, 2.0), instance_seconds=(0.0, 0.3))
    return Setup(
        two_models(rng),
        faults,
        mode=ControlMode.POLL,
        poll_secs=1.0,
        exit_timeout=5.0,
        shutdown_limit=6.0,
        load_threads=rng.randint(1, 3),
    )


async def _during_load(world, rng, name: str) -> str:
    """Change a model again while its last change is loading."""
    writer = world.writer
    if name not in writer.specs:
        return "nothing"
    what = rng.choice(["delete_model", "instances", "redeploy", "delete_version"])
    if what == "delete_model":
        writer.delete_model(name)
    elif what == "instances":
        spec = writer.revise(name, instances=rng.randint(1, 3))
        await writer.write(spec, max_gap=world.setup.poll_secs, versions=[])
    elif what == "redeploy":
        await writer.write(writer.revise(name), max_gap=world.setup.poll_secs)
    elif len(writer.specs[name].versions) > 1:
        writer.delete_version(name, max(writer.specs[name].versions))
    return what


@scenario(
    "poll_changes",
    "POLL follows a repository written in pieces, with deletes, config edits and "
    "redeploys while loads are under way; it never loads a torn model and converges",
    setup=_poll_setup,
    fast_seeds=15,
)
async def poll_changes(world) -> None:
    rng = world.random("script")
    poll = world.setup.poll_secs
    stop = trio.Event()
    world.activity.start_soon(
        partial(
            steady_load,
            world,
            partial(model_names, world),
            duration=1e9,
            mean_gap=0.02,
            rng=world.random("clients"),
            p_cancel=0.05,
            cancel_span=(0.0, 0.05),
            stop=stop,
        )
    )
    changes = []
    for _ in range(rng.randint(4, 8)):
        action, name = await change_repository(world, rng, max_gap=poll, deletions=True)
        changes.append(action)
        if rng.random() < 0.5 and await wait_for(
            lambda name=name: loading(world, name), limit=3 * poll
        ):
            changes.append("during load: " + await _during_load(world, rng, name))
        await trio.sleep(quantize(rng.uniform(0.0, 2.5 * poll)))
    world.notes["changes"] = changes
    await settle(world, polls=3, load_limit=60.0)
    stop.set()
    await verify_converged(world)


def _reload_setup(world) -> Setup:
    rng = world.random("setup")
    faults = FaultPlan(
        latency=(0.001, 0.004), load_seconds=(0.05, 1.0), instance_seconds=(0.0, 0.2)
    )
    mode = rng.choice([ControlMode.EXPLICIT, ControlMode.POLL])
    return Setup(
        two_models(rng),
        faults,
        mode=mode,
        poll_secs=1.0,
        load_models=("*",),
        exit_timeout=5.0,
        shutdown_limit=6.0,
        expect_no_failures=True,
    )


@scenario(
    "reload_under_load",
    "configs, versions, instance counts and files change and reload (EXPLICIT or "
    "POLL) under steady load without faults: not one request may fail",
    setup=_reload_setup,
    fast_seeds=15,
)
async def reload_under_load(world) -> None:
    rng = world.random("script")
    explicit = world.setup.mode is ControlMode.EXPLICIT
    stop = trio.Event()
    world.activity.start_soon(
        partial(
            steady_load,
            world,
            ["plain", "batched"],
            duration=1e9,
            mean_gap=0.01,
            rng=world.random("clients"),
            max_batch=2,
            stop=stop,
        )
    )
    changes = []
    for _ in range(rng.randint(3, 6)):
        action, name = await change_repository(
            world, rng, max_gap=world.setup.poll_secs, deletions=False, additions=False
        )
        changes.append(action)
        if explicit:
            try:
                await world.dataplane.load_model(name)
            except TritonError as exc:
                world.violate(
                    "no failed requests during a reload without faults",
                    f"reloading '{name}' after {action} failed: {exc.message}",
                )
        await trio.sleep(quantize(rng.uniform(0.2, 1.5)))
    world.notes["changes"] = changes
    if not explicit:
        await settle(world, polls=3, load_limit=60.0)
    stop.set()
    await verify_converged(world)


def _unload_setup(world) -> Setup:
    rng = world.random("setup")
    faults = FaultPlan(latency=(0.001, 0.01), load_seconds=(0.0, 0.3))
    return Setup(
        two_models(rng),
        faults,
        mode=ControlMode.EXPLICIT,
        load_models=("*",),
        exit_timeout=10.0,
        shutdown_limit=11.0,
    )


def check_accepted_succeed(world) -> None:
    for record in world.records:
        if record.accepted and record.client != "response":
            world.violate(
                ACCEPTED_SUCCEED,
                f"{record} was accepted by {record.version!r} but "
                f"ended with {record.client}: {record.client_value!r}",
            )


@scenario(
    "unload_under_load",
    "models unload and load again under load (EXPLICIT): refused requests get clear "
    "errors, and every accepted request drains to its result",
    setup=_unload_setup,
    checks=(check_accepted_succeed,),
    fast_seeds=20,
)
async def unload_under_load(world) -> None:
    rng = world.random("script")
    stop = trio.Event()
    world.activity.start_soon(
        partial(
            steady_load,
            world,
            ["plain", "batched"],
            duration=1e9,
            mean_gap=0.005,
            rng=world.random("clients"),
            max_batch=2,
            stop=stop,
        )
    )
    for _ in range(rng.randint(2, 4)):
        await trio.sleep(quantize(rng.uniform(0.05, 0.4)))
        name = rng.choice(["plain", "batched"])
        await world.dataplane.unload_model(name)
        await trio.sleep(quantize(rng.uniform(0.0, 0.2)))
        await world.dataplane.load_model(name)
    stop.set()
    await trio.sleep(0.2)
