"""Simulated models on disk: their config.pbtxt, their files, and a writer that changes
them on the virtual clock (whole installs, copies in pieces, edits, deletions)."""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import trio

from simulations.faults import quantize

MODEL_FILE = "model.sim"
END_MARKER = "END\n"
# File modification times follow the virtual clock from this origin, so that the
# snapshots POLL compares are the same on every replay.
EPOCH_NS = 1_700_000_000 * 10**9


@dataclass(frozen=True)
class Batching:
    """A ``dynamic_batching`` block."""

    max_queue_delay_us: int = 0
    preferred: tuple[int, ...] = ()
    max_queue_size: int = 0
    timeout_us: int = 0
    delay_on_timeout: bool = False
    allow_override: bool = False
    preserve_ordering: bool = False
    priority_levels: int = 0  # with levels, the default level is the lowest priority

    def text(self) -> str:
        policy = []
        if self.max_queue_size:
            policy.append(f"max_queue_size: {self.max_queue_size}")
        if self.timeout_us:
            action = "DELAY" if self.delay_on_timeout else "REJECT"
            policy.append(f"default_timeout_microseconds: {self.timeout_us}")
            policy.append(f"timeout_action: {action}")
        if self.allow_override:
            policy.append("allow_timeout_override: true")
        parts = [f"max_queue_delay_microseconds: {self.max_queue_delay_us}"]
        if self.preferred:
            parts.append(f"preferred_batch_size: [ {', '.join(map(str, self.preferred))} ]")
        if self.preserve_ordering:
            parts.append("preserve_ordering: true")
        if self.priority_levels:
            parts.append(
                f"priority_levels: {self.priority_levels} "
                f"default_priority_level: {self.priority_levels}"
            )
        if policy:
            parts.append("default_queue_policy { " + " ".join(policy) + " }")
        return "dynamic_batching { " + " ".join(parts) + " }"


@dataclass(frozen=True)
class Sequencing:
    """A ``sequence_batching`` block (with START and READY control inputs)."""

    idle_us: int = 10000
    oldest: bool = False
    max_candidates: int = 0
    delay_us: int = 0

    def text(self) -> str:
        if self.oldest:
            strategy = (
                f"oldest {{ max_candidate_sequences: {self.max_candidates} "
                f"max_queue_delay_microseconds: {self.delay_us} }}"
            )
        else:
            strategy = "direct { }"
        controls = ", ".join(
            f'{{ name: "{name}" control [ {{ kind: CONTROL_SEQUENCE_{name} '
            "int32_false_true: [ 0, 1 ] } ] }"
            for name in ("START", "READY")
        )
        return (
            f"sequence_batching {{ max_sequence_idle_microseconds: {self.idle_us} "
            f"{strategy} control_input [ {controls} ] }}"
        )


@dataclass(frozen=True)
class ModelSpec:
    """One simulated model: its configuration and the version directories it has.

    ``kind`` is how its instances run: ``async`` (on the Trio thread, cancellable,
    able to crash their executor) or ``thread`` (through the worker-thread path of
    the executor, uninterruptible once started).
    """

    name: str
    kind: str = "async"
    instances: int = 1
    max_batch_size: int = 4
    batching: Batching | None = None
    sequence: Sequencing | None = None
    versions: tuple[int, ...] = (1,)
    policy: str = ""  # "", "all", or "latest N"
    generation: int = 1
    parameters: tuple[tuple[str, str], ...] = ()  # more config parameters (key, value)

    def config_text(self) -> str:
        dims = "[ 1 ]"
        lines = [
            f'name: "{self.name}"',
            'backend: "sim"',
            f"max_batch_size: {self.max_batch_size}",
            f'input [ {{ name: "INPUT0" data_type: TYPE_INT64 dims: {dims} }} ]',
            f'output [ {{ name: "OUTPUT0" data_type: TYPE_INT64 dims: {dims} }} ]',
            f"instance_group [ {{ kind: KIND_CPU count: {self.instances} }} ]",
        ]
        if self.policy == "all":
            lines.append("version_policy { all { } }")
        elif self.policy.startswith("latest"):
            count = self.policy.split()[1]
            lines.append(f"version_policy {{ latest {{ num_versions: {count} }} }}")
        if self.batching is not None:
            lines.append(self.batching.text())
        if self.sequence is not None:
            lines.append(self.sequence.text())
        for key, value in (
            ("generation", self.generation),
            ("sim_kind", self.kind),
            *self.parameters,
        ):
            lines.append(f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}')
        return "\n".join(lines) + "\n"

    def served_versions(self) -> tuple[int, ...]:
        """The versions its policy selects."""
        ordered = sorted(self.versions)
        if self.policy == "all":
            return tuple(ordered)
        count = int(self.policy.split()[1]) if self.policy.startswith("latest") else 1
        return tuple(ordered[-count:])

    def evolve(self, **changes) -> ModelSpec:
        return replace(self, **changes)


def model_file_text(name: str, version: int, generation: int, rng: random.Random) -> str:
    padding = "".join(f"weights {rng.randrange(10**6)}\n" for _ in range(rng.randint(2, 8)))
    return f"sim-model {name} version {version} generation {generation}\n{padding}{END_MARKER}"


def parse_model_file(text: str) -> tuple[int | None, bool]:
    """(generation, complete) of a model file; generation None if unreadable."""
    first = text.split("\n", 1)[0].split()
    generation = int(first[-1]) if len(first) == 6 and first[-1].isdigit() else None
    return generation, text.endswith(END_MARKER)


class RepositoryWriter:
    """Changes the model repository on the virtual clock, as a person or a deploy
    tool would: whole installs, copies in pieces, config edits, deletions.

    It remembers what it last completed for each model (``specs`` and the file
    generation of each version) and declares every completed state to the world,
    so that the simulated backend can tell a fully written model from a torn one.
    """

    def __init__(self, world) -> None:
        self.world = world
        self.root: Path = world.repository
        self.rng = world.random("writer")
        self.specs: dict[str, ModelSpec] = {}
        self.file_generations: dict[str, dict[int, int]] = {}
        self._tick = 0
        self._generation = 0

    # -- primitives -----------------------------------------------------------------

    def _stamp(self, path: Path) -> None:
        self._tick += 1
        ns = EPOCH_NS + round(trio.current_time() * 1e9) + self._tick
        os.utime(path, ns=(ns, ns))

    def _write(self, path: Path, text: str, *, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a" if append else "w") as file:
            file.write(text)
        self._stamp(path)

    def _declare(self, spec: ModelSpec) -> None:
        self.specs[spec.name] = spec
        for version, file_generation in self.file_generations.get(spec.name, {}).items():
            self.world.complete_states.add((spec.name, spec.generation, version, file_generation))

    # -- whole changes at one instant -------------------------------------------------

    def next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def revise(self, name: str, **changes) -> ModelSpec:
        """The model's spec with ``changes`` and a new config generation."""
        return self.specs[name].evolve(generation=self.next_generation(), **changes)

    def install(self, spec: ModelSpec) -> None:
        """Write a whole model at once (before the server starts)."""
        model_dir = self.root / spec.name
        self._write(model_dir / "config.pbtxt", spec.config_text())
        generations = self.file_generations.setdefault(spec.name, {})
        for version in spec.versions:
            generations[version] = generation = self.next_generation()
            text = model_file_text(spec.name, version, generation, self.rng)
            self._write(model_dir / str(version) / MODEL_FILE, text)
        self._declare(spec)

    def delete_model(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)
        self.specs.pop(name, None)
        self.file_generations.pop(name, None)

    def delete_version(self, name: str, version: int) -> None:
        shutil.rmtree(self.root / name / str(version), ignore_errors=True)
        self.file_generations.get(name, {}).pop(version, None)
        spec = self.specs[name]
        self._declare(spec.evolve(versions=tuple(v for v in spec.versions if v != version)))

    # -- changes in pieces, over virtual time ------------------------------------------

    async def _pause(self, max_gap: float) -> None:
        # Strictly shorter than max_gap: a poll interval always sees a write.
        await trio.sleep(quantize(self.rng.uniform(0.0, 0.9 * max_gap)))

    async def _write_in_pieces(self, path: Path, text: str, max_gap: float) -> None:
        """Truncate and write ``text`` in 1-3 pieces with pauses between them."""
        pieces = self.rng.randint(1, 3)
        cuts = sorted(self.rng.randrange(1, len(text)) for _ in range(pieces - 1))
        start = 0
        for index, cut in enumerate([*cuts, len(text)]):
            self._write(path, text[start:cut], append=index > 0)
            start = cut
            if cut < len(text):
                await self._pause(max_gap)

    async def write(
        self, spec: ModelSpec, *, max_gap: float, config: bool = True, versions=None
    ) -> None:
        """Write ``spec``'s config (if ``config``) and new files for ``versions``
        (default: all of its versions), piece by piece and in random order, never
        pausing ``max_gap`` or longer; then declare the result complete.

        ``spec.generation`` must change whenever the config is written.
        """
        model_dir = self.root / spec.name
        todo = list(spec.versions if versions is None else versions)
        steps: list[tuple[Path, str, int | None]] = []
        if config:
            steps.append((model_dir / "config.pbtxt", spec.config_text(), None))
        for version in todo:
            generation = self.next_generation()
            text = model_file_text(spec.name, version, generation, self.rng)
            steps.append((model_dir / str(version) / MODEL_FILE, text, version))
        self.rng.shuffle(steps)
        generations = self.file_generations.setdefault(spec.name, {})
        for index, (path, text, version) in enumerate(steps):
            await self._write_in_pieces(path, text, max_gap)
            if version is not None:
                generations[version] = int(text.split("\n", 1)[0].split()[-1])
            if index < len(steps) - 1:
                await self._pause(max_gap)
        self._declare(spec.evolve(versions=tuple(sorted(generations))))
