"""The seeded fault plan: how long simulated work takes and what goes wrong with it."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# Virtual durations are whole multiples of this, so that events of different
# actors often fall on the same instant and their order is left to the seeded
# scheduler: that is how races are explored.
QUANTUM = 0.0005


def quantize(seconds: float) -> float:
    return round(seconds / QUANTUM) * QUANTUM


@dataclass(frozen=True)
class Fate:
    """What happens to one batch in the simulated backend."""

    seconds: float  # virtual time it takes (inf: hangs until cancelled)
    exception: bool = False  # execute raises: the whole batch fails
    errors: frozenset[int] = frozenset()  # indexes of requests answered with an error
    crash: bool = False  # the instance's task dies (async instances only)
    drop: bool = False  # a response is never delivered (deliberate-break tests only)

    @property
    def hang(self) -> bool:
        return math.isinf(self.seconds)


@dataclass
class FaultPlan:
    """Probabilities and durations for one run; every draw comes from seeded streams.

    ``thread_hang_seconds`` is how long a hang lasts in an instance that runs in a
    worker thread: such a call cannot be interrupted, so it must end some time.
    """

    latency: tuple[float, float] = (0.001, 0.005)
    load_seconds: tuple[float, float] = (0.0, 0.0)
    instance_seconds: tuple[float, float] = (0.0, 0.0)
    p_exception: float = 0.0
    p_request_error: float = 0.0
    p_hang: float = 0.0
    p_crash: float = 0.0
    max_crashes: int = 1
    p_drop: float = 0.0
    p_load_failure: float = 0.0
    # A load that takes ``slow_load_seconds`` instead (clients give up waiting on it).
    p_slow_load: float = 0.0
    slow_load_seconds: float = 0.0
    thread_hang_seconds: float = 30.0
    slow_models: dict[str, float] = field(default_factory=dict)  # name -> latency factor

    def duration(self, rng: random.Random, span: tuple[float, float]) -> float:
        low, high = span
        return quantize(rng.uniform(low, high)) if high > 0 else 0.0

    def batch_fate(
        self, rng: random.Random, model: str, size: int, *, can_crash: bool, crashes: int
    ) -> Fate:
        seconds = self.duration(rng, self.latency) * self.slow_models.get(model, 1.0)
        seconds = max(QUANTUM, quantize(seconds))
        if rng.random() < self.p_hang:
            return Fate(math.inf)
        if can_crash and crashes < self.max_crashes and rng.random() < self.p_crash:
            return Fate(seconds, crash=True)
        if rng.random() < self.p_exception:
            return Fate(seconds, exception=True)
        errors = frozenset(i for i in range(size) if rng.random() < self.p_request_error)
        drop = rng.random() < self.p_drop
        return Fate(seconds, errors=errors, drop=drop)
