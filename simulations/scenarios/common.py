"""Pieces several scenarios share: model line-ups, repository changes, convergence."""

from __future__ import annotations

import random

import trio

from simulations.clients import infer, wait_for
from simulations.repository import Batching, ModelSpec
from simulations.world import World

KINDS = ("async", "thread")
CONVERGES = "the served models converge to the repository"


def two_models(rng: random.Random, *, kinds=KINDS, max_queue_size: int = 0) -> list[ModelSpec]:
    """A model on the default scheduler and one on the dynamic batcher."""
    return [
        ModelSpec("plain", kind=rng.choice(kinds), instances=rng.randint(1, 2)),
        ModelSpec(
            "batched",
            kind=rng.choice(kinds),
            instances=rng.randint(1, 2),
            max_batch_size=8,
            batching=random_batching(rng, max_queue_size=max_queue_size),
        ),
    ]


def random_batching(rng: random.Random, *, max_queue_size: int = 0) -> Batching:
    return Batching(
        max_queue_delay_us=rng.choice([0, 1000, 2000]),
        preferred=rng.choice([(), (4,), (2, 4)]),
        preserve_ordering=rng.random() < 0.5,
        max_queue_size=max_queue_size,
    )


async def change_repository(
    world: World, rng: random.Random, *, max_gap: float, deletions: bool, additions: bool = True
) -> tuple[str, str]:
    """Make one random change to the repository, written in pieces; (what, model).

    Without ``deletions`` no change removes a model or the last version of one,
    so that no request need fail because of it.
    """
    writer = world.writer
    names = sorted(writer.specs)
    actions = ["instances", "batching", "add_version", "redeploy", "policy"]
    if len(names) > 0 and any(len(s.versions) > 1 for s in writer.specs.values()):
        actions.append("delete_version")
    if deletions and names:
        actions.append("delete_model")
    if additions or not names:
        actions.append("add_model")
    action = rng.choice(actions)
    name = rng.choice(names) if names else ""
    spec = writer.specs.get(name)
    if action == "add_model" or spec is None:
        name = f"m{len(world.notes.setdefault('added', []))}"
        world.notes["added"].append(name)
        spec = ModelSpec(
            name,
            kind=rng.choice(KINDS),
            instances=rng.randint(1, 2),
            batching=random_batching(rng) if rng.random() < 0.5 else None,
            generation=writer.next_generation(),
        )
        await writer.write(spec, max_gap=max_gap)
        return "add_model", name
    if action == "instances":
        await writer.write(
            writer.revise(name, instances=rng.randint(1, 3)), max_gap=max_gap, versions=[]
        )
    elif action == "batching":
        drop = spec.batching is not None and rng.random() < 0.3
        batching = None if drop else random_batching(rng)
        await writer.write(writer.revise(name, batching=batching), max_gap=max_gap, versions=[])
    elif action == "policy":
        policy = rng.choice(["", "all", "latest 2"])
        await writer.write(writer.revise(name, policy=policy), max_gap=max_gap, versions=[])
    elif action == "add_version":
        version = max(spec.versions) + 1
        await writer.write(
            spec.evolve(versions=(*spec.versions, version)),
            max_gap=max_gap,
            config=False,
            versions=[version],
        )
    elif action == "redeploy":
        await writer.write(writer.revise(name), max_gap=max_gap)
    elif action == "delete_version":
        spec = next(s for s in map(writer.specs.get, names) if len(s.versions) > 1)
        name = spec.name
        writer.delete_version(name, rng.choice(spec.versions))
    elif action == "delete_model":
        writer.delete_model(name)
    return action, name


def model_names(world: World) -> list[str]:
    """Every model name the run has used, on disk or not (clients ask for all)."""
    return ["plain", "batched", *world.notes.get("added", [])]


def loading(world: World, name: str) -> bool:
    """Whether a load (or any other operation) of the model is under way."""
    entry = world.registry.entries().get(name)
    return entry is not None and bool(entry.loading or entry.operations)


async def verify_converged(world: World) -> None:
    """Every model on disk serves exactly its policy's versions, each loaded from
    the files the writer last completed; models no longer on disk serve nothing."""
    writer = world.writer
    for name, spec in sorted(writer.specs.items()):
        served = spec.served_versions()
        for version in sorted(spec.versions):
            expected = (name, spec.generation, version, writer.file_generations[name][version])
            if version not in served:
                if world.dataplane.model_ready(name, version):
                    world.violate(
                        CONVERGES,
                        f"'{name}' version {version} is served, but its version policy excludes it",
                    )
                continue
            record = await infer(world, name, version=version)
            if record.client != "response":
                world.violate(
                    CONVERGES,
                    f"'{name}' version {version} is not served after the "
                    f"repository settled: {record.client_value!r}",
                )
            elif record.client_value.parameters.get("sim_state") != expected:
                world.violate(
                    CONVERGES,
                    f"'{name}' version {version} serves "
                    f"{record.client_value.parameters.get('sim_state')}; "
                    f"the repository holds {expected}",
                )
        record = await infer(world, name)
        if record.client == "response" and record.client_value.model_version != str(max(served)):
            world.violate(
                CONVERGES,
                f"'{name}' defaults to version "
                f"{record.client_value.model_version}, not {max(served)}",
            )
    for name in world.notes.get("added", []) + ["plain", "batched"]:
        if name not in writer.specs and world.dataplane.model_ready(name, None):
            world.violate(CONVERGES, f"'{name}' was deleted from the repository but still serves")


async def settle(world: World, *, polls: int, load_limit: float) -> None:
    """Wait until POLL has seen the repository unchanged and finished acting on it."""
    await trio.sleep(polls * world.setup.poll_secs)
    await wait_for(
        lambda: not any(loading(world, n) for n in world.registry.entries()), limit=load_limit
    )
    await trio.sleep(world.setup.poll_secs)
