"""Running scenarios over many seeds, and reporting failures with their replay command."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from simulations.harness import RunResult, replay_command, run_seed
from simulations.scenario import SCENARIOS, Scenario


def scenarios_named(names: Iterable[str]) -> list[Scenario]:
    import simulations.scenarios  # noqa: F401  (registers them)

    names = list(names)
    if not names or names == ["all"]:
        return list(SCENARIOS.values())
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise KeyError(f"unknown scenario(s) {unknown}; known: {sorted(SCENARIOS)}")
    return [SCENARIOS[n] for n in names]


def failure_report(result: RunResult, *, log_lines: int = 40) -> str:
    lines = [f"FAIL {result.scenario} seed {result.seed}: {len(result.violations)} violation(s)"]
    lines += [f"  {v}" for v in result.violations]
    if log_lines and result.log:
        lines.append("  last server log lines:")
        lines += [f"    {line}" for line in result.log[-log_lines:]]
    lines.append(f"  replay: {replay_command(result.scenario, result.seed)}")
    return "\n".join(lines)


@dataclass
class SweepTotals:
    scenario: str
    seeds: int = 0
    failures: list[RunResult] = field(default_factory=list)
    requests: int = 0
    seconds: float = 0.0
    cancel_phases: dict[str, int] = field(default_factory=dict)

    def add(self, result: RunResult, seconds: float) -> None:
        self.seeds += 1
        self.seconds += seconds
        self.requests += result.summary.get("requests", 0)
        for phase, count in result.summary.get("cancel_phases", {}).items():
            self.cancel_phases[phase] = self.cancel_phases.get(phase, 0) + count
        if not result.ok:
            self.failures.append(result)

    def line(self) -> str:
        state = "ok" if not self.failures else f"{len(self.failures)} FAILED"
        return (
            f"{self.scenario:24} {self.seeds:5} seeds  {self.requests:7} requests  "
            f"{self.seconds:7.1f}s  {state}"
        )


def sweep(scenario: Scenario, seeds: Iterable[int]) -> Iterator[tuple[RunResult, float]]:
    for seed in seeds:
        started = time.perf_counter()
        result = run_seed(scenario, seed)
        yield result, time.perf_counter() - started
