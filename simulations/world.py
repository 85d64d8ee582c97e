"""What one simulation run observed: its requests, executions, model versions, violations."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse

# At most this many violations are kept per invariant (the first ones matter).
MAX_VIOLATIONS_PER_INVARIANT = 10


@dataclass(frozen=True)
class Violation:
    """An invariant that did not hold, and the evidence."""

    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.detail}"


@dataclass(eq=False)
class RequestRecord:
    """Everything observed about one request, from its client to its final outcome.

    ``attempts`` lists every final delivery made to the request object, accepted or
    not: exactly one is expected for a request a scheduler accepted.
    """

    number: int
    model: str
    submitted_at: float
    batch_size: int
    cancel_after: float | None = None
    version: Any = None  # the ModelVersion whose ``infer`` the request reached
    accepted: bool = False
    refusal: BaseException | None = None  # what that ``infer`` raised instead
    attempts: list[tuple[str, Any]] = field(default_factory=list)
    taken_at: float | None = None  # an executor took its batch
    begun_at: float | None = None  # the simulated backend started it
    ended_at: float | None = None  # the simulated backend returned
    produced: InferenceResponse | None = None  # the response the backend made for it
    client: str | None = None  # "response", "error" or "cancelled"
    client_value: Any = None
    cancel_phase: str | None = None
    finished_at: float | None = None
    tags: dict[str, Any] = field(default_factory=dict)  # what a scenario wants to remember

    @property
    def outcome(self) -> tuple[str, Any] | None:
        """The request's final outcome: the first final delivery."""
        return self.attempts[0] if self.attempts else None

    def __repr__(self) -> str:
        return f"request #{self.number} for '{self.model}'"


class TrackedRequest(InferenceRequest):
    """An InferenceRequest that reports every final delivery to its record."""

    __slots__ = ("record",)

    def send(self, response: InferenceResponse | None, *, final: bool) -> bool:
        if final:
            self.record.attempts.append(("response" if response is not None else "end", response))
        return InferenceRequest.send(self, response, final=final)

    def respond(self, response: InferenceResponse) -> bool:
        self.record.attempts.append(("response", response))
        return InferenceRequest.respond(self, response)

    def fail(self, error: TritonError) -> bool:
        self.record.attempts.append(("error", error))
        return InferenceRequest.fail(self, error)


@dataclass(eq=False)
class Execution:
    """One batch the simulated backend started."""

    instance: str
    version: Any  # ModelVersion
    records: list[RequestRecord]
    batch_size: int
    started_at: float
    fate: Any
    returned: bool = False  # returned results (not raised, not cancelled)
    responses: int = 0


class World:
    """The shared state of one run: set up by the harness, filled in by the probes,
    the simulated backend and the clients, read by the invariant checks."""

    def __init__(self, scenario: str, seed: int, root: Path) -> None:
        self.scenario = scenario
        self.seed = seed
        self.root = root
        self.repository = root / "models"
        self.repository.mkdir(parents=True, exist_ok=True)
        self._streams: dict[str, random.Random] = {}
        self.setup: Any = None
        self.server: Any = None
        self.records: list[RequestRecord] = []
        self.executions: list[Execution] = []
        self.versions: list[Any] = []  # every ModelVersion that ran, in start order
        self.live_versions: list[Any] = []
        self.violations: list[Violation] = []
        self._violation_counts: dict[str, int] = {}
        # (model, config generation, version, file generation) the writer completed.
        self.complete_states: set[tuple[str, int, int, int]] = set()
        self.queue_peaks: dict[str, int] = {}
        self.crashes = 0
        self.notes: dict[str, Any] = {}
        self.log: deque[str] = deque(maxlen=300)
        self.activity: trio.Nursery | None = None
        self.server_task = None
        self.stopped = trio.Event()
        self.started_at = 0.0
        self.shutdown_at: float | None = None
        self.stopped_at: float | None = None
        self.clients_hung = False
        self.leaked_tasks: list[str] = []

    def random(self, stream: str) -> random.Random:
        """A generator for one purpose, seeded from the run's seed and its name, so
        draws for one purpose do not shift the draws of another."""
        rng = self._streams.get(stream)
        if rng is None:
            rng = self._streams[stream] = random.Random(f"{self.seed}/{stream}")
        return rng

    def violate(self, invariant: str, detail: str) -> None:
        count = self._violation_counts.get(invariant, 0)
        self._violation_counts[invariant] = count + 1
        if count < MAX_VIOLATIONS_PER_INVARIANT:
            self.violations.append(Violation(invariant, detail))

    @property
    def dataplane(self):
        return self.server.dataplane

    @property
    def registry(self):
        return self.server.registry

    def shutdown(self) -> None:
        """Ask the server to stop (once)."""
        if self.shutdown_at is None:
            self.shutdown_at = trio.current_time()
            self.server.shutdown()

    def record_for(self, request: InferenceRequest) -> RequestRecord | None:
        return getattr(request, "record", None)
