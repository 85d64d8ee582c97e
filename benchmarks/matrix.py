"""The same load matrix against several servers in one run, printed as one table.

Every point (workload x concurrency) runs against each server in turn, for
``rounds`` rounds with the order rotated each round, so slow drifts of a noisy
machine hit every server alike; the table gives throughput with its ratio to the
reference server (the first unless named), p50/p99 latency, the server's CPU time per
inference (its whole process tree, from /proc) and the MB/s of large tensors.
The peak RSS of each server's process tree closes the table.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.loadgen import ClientPool, LoadResult, Workload
from trionserve.testing import TrionServe

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"
_TICKS = os.sysconf("SC_CLK_TCK")


def default_cache() -> Path:
    """Where benchmarks keep what they download (peers' environments, perf_analyzer,
    a newer glibc) between runs: outside the repository."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trionserve-benchmarks"


# --------------------------------------------------------------- process trees


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of the given processes."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
    return total / _TICKS


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """A server's CPU seconds by thread, from /proc: ``loop`` (its main thread,
    which runs Trio), ``instance`` (the model instances' threads, which name
    themselves "instance ..."), ``total`` (its whole process tree, threads that
    have ended included); the rest of ``total`` is its other threads (a
    framework's own, worker threads) and child processes (stubs)."""
    split = {"loop": 0.0, "instance": 0.0, "total": cpu_seconds(tree_pids(pid))}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return split
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")]
        fields = stat[stat.rindex(b")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / _TICKS
        if int(tid) == pid:
            split["loop"] += seconds
        elif comm.startswith(b"instance"):
            split["instance"] += seconds
    return split


def peak_rss_mb(pids: Iterable[int]) -> float:
    """Sum of the processes' peak resident set sizes (VmHWM), in MB."""
    total_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total_kb += int(line.split()[1])
                        break
        except OSError:
            continue
    return total_kb / 1024


# --------------------------------------------------------------------- servers


@dataclass
class Target:
    """A running server under test.

    ``models`` maps a workload kind ("simple", "identity") to the model name this
    server serves it under; ``unsupported`` maps workload names it cannot serve
    to why (shown in the table instead of figures).
    """

    label: str
    pid: int
    http_url: str | None = None
    grpc_url: str | None = None
    models: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)

    def url(self, workload: Workload) -> str | None:
        return self.http_url if workload.protocol == "http" else self.grpc_url

    def why_not(self, workload: Workload) -> str | None:
        if self.url(workload) is None:
            return f"no {workload.protocol}"
        return self.unsupported.get(workload.name)

    def adapt(self, workload: Workload) -> Workload:
        model = self.models.get(workload.kind)
        if model is None or model == workload.model:
            return workload
        return Workload(
            workload.name,
            workload.protocol,
            workload.kind,
            model,
            workload.binary,
            workload.elements,
        )


def start_trionserve(
    label: str,
    repository: Path = EXAMPLES,
    args: Iterable[str] = (),
    tree: Path | None = None,
    ready_timeout: float = 120.0,
    python: str | None = None,
) -> tuple[TrionServe, Target]:
    """trionserve on free loopback ports (trionserve.testing's harness, the tests'
    too), ready, without its metrics port; ``tree``: run it from another source tree
    (e.g. a ``git worktree`` of an older commit) instead of this one, with
    ``python``, else the Python of the tree's own ``.venv`` when it has one."""
    server = TrionServe(
        repository,
        args=["--allow-metrics=false", *args],
        label=label,
        tree=tree,
        python=python,
    )
    try:
        server.wait_http(server.http_url, "/v2/health/ready", ready_timeout)
    except BaseException:
        server.close()
        raise
    return server, Target(label, server.pid, server.http_url, server.grpc_url)


# ---------------------------------------------------------------------- the run


@dataclass
class Cell:
    """One server's figures at one point, summed over rounds."""

    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    reported: list[tuple[float, float, float]] = field(default_factory=list)
    first_error: str = ""
    skipped: str = ""

    def add(self, result: LoadResult) -> None:
        self.requests += result.requests
        self.errors += result.errors
        self.seconds += result.seconds
        self.cpu += result.extra or 0.0
        self.latencies_ms.extend(result.latencies_ms)
        if result.reported is not None:
            self.reported.append(result.reported)
        self.first_error = self.first_error or result.first_error

    @property
    def throughput(self) -> float:
        if self.reported:  # the load generator's own figures: their mean over rounds
            return sum(r[0] for r in self.reported) / len(self.reported)
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, p: float) -> float:
        if self.reported and p in (50, 99):
            column = 1 if p == 50 else 2
            known = [r[column] for r in self.reported if r[column] == r[column]]  # not NaN
            return sum(known) / len(known) if known else float("nan")
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _cpu_window(pid: int):
    def sample(start_at: float, stop_at: float) -> float:
        time.sleep(max(0.0, start_at - time.monotonic()))
        pids = tree_pids(pid)
        before = cpu_seconds(pids)
        time.sleep(max(0.0, stop_at - time.monotonic()))
        return cpu_seconds(pids) - before

    return sample


class ClientPoolLoad:
    """The matrix's default load generator: benchmarks.loadgen's client processes,
    the server's CPU time sampled over the measured window."""

    def __init__(self, pool: ClientPool) -> None:
        self.pool = pool

    @staticmethod
    def unsupported(workload: Workload) -> str | None:
        return None

    def run(
        self,
        target: Target,
        workload: Workload,
        concurrency: int,
        duration: float,
        warmup: float,
        max_requests: int,
    ) -> LoadResult:
        return self.pool.run(
            workload,
            target.url(workload),
            concurrency,
            duration,
            warmup,
            max_requests,
            on_window=_cpu_window(target.pid),
        )


def run_matrix(
    targets: list[Target],
    workloads: list[Workload],
    concurrencies: list[int],
    duration: float,
    warmup: float = 1.0,
    rounds: int = 1,
    client_processes: int | None = None,
    max_requests: int = 1_000_000,
    log=print,
    load=None,
) -> dict[tuple[str, int, str], Cell]:
    """Run every point against every target; returns (workload, concurrency,
    target label) -> Cell. ``load``: the load generator (``run`` one point,
    ``unsupported`` says why a workload cannot run), by default client processes
    of benchmarks.loadgen."""
    cells: dict[tuple[str, int, str], Cell] = {}
    with contextlib.ExitStack() as stack:
        if load is None:
            load = ClientPoolLoad(stack.enter_context(ClientPool(client_processes)))
        for workload in workloads:
            for concurrency in concurrencies:
                order = list(targets)
                for round_index in range(rounds):
                    shift = round_index % len(order)
                    for target in order[shift:] + order[:shift]:
                        cell = cells.setdefault((workload.name, concurrency, target.label), Cell())
                        why = target.why_not(workload) or load.unsupported(workload)
                        if why:
                            cell.skipped = why
                            continue
                        result = load.run(
                            target,
                            target.adapt(workload),
                            concurrency,
                            duration,
                            warmup,
                            max_requests,
                        )
                        cell.add(result)
                        log(
                            f"  {workload.name:<20} c={concurrency:<3} {target.label:<16} "
                            f"{result.reported[0] if result.reported else result.throughput:9.1f}"
                            f" infer/s  errors {result.errors}"
                            + (f"  ({result.first_error})" if result.first_error else ""),
                        )
    return cells


def format_table(
    targets: list[Target],
    workloads: list[Workload],
    concurrencies: list[int],
    cells: dict[tuple[str, int, str], Cell],
    peak_rss: dict[str, float] | None = None,
    reference: str | None = None,
) -> str:
    """One table: a row per point and server, ratios to ``reference`` (a target's
    label; the first by default)."""
    reference = reference or targets[0].label
    width = max([20, *(len(w.name) for w in workloads)])
    lines = [
        f"{'workload':<{width}} {'c':>3}  {'server':<16} {'infer/s':>9} {'x ' + reference:>14} "
        f"{'MB/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'cpu ms/inf':>10} {'errors':>6}"
    ]
    lines.append("-" * len(lines[0]))
    for workload in workloads:
        for concurrency in concurrencies:
            ref = cells.get((workload.name, concurrency, reference))
            ref_rate = ref.throughput if ref is not None else 0.0
            for target in targets:
                cell = cells.get((workload.name, concurrency, target.label))
                if cell is None:
                    continue
                head = f"{workload.name:<{width}} {concurrency:>3}  {target.label:<16}"
                if cell.skipped and not cell.requests:
                    lines.append(f"{head} {'-':>9}   ({cell.skipped})")
                    continue
                rate = cell.throughput
                ratio = f"{rate / ref_rate:.2f}x" if ref_rate else "-"
                mbs = rate * workload.request_bytes / 1e6 if workload.kind == "identity" else None
                cpu = cell.cpu / cell.requests * 1000 if cell.requests else float("nan")
                lines.append(
                    f"{head} {rate:9.1f} {ratio:>14} "
                    f"{(f'{mbs:.0f}' if mbs is not None else ''):>7} "
                    f"{cell.percentile(50):7.2f} {cell.percentile(99):7.2f} {cpu:10.3f} "
                    f"{cell.errors:>6}"
                )
                if cell.first_error:
                    what = "first error" if cell.errors else "note"
                    lines.append(f"{'':<26}{what}: {cell.first_error[:150]}")
    if peak_rss:
        lines.append("")
        lines.append(
            "peak RSS of each server's process tree: "
            + ", ".join(f"{label} {mb:.0f} MB" for label, mb in peak_rss.items())
        )
    return "\n".join(lines)


def peak_rss_of(targets: list[Target]) -> dict[str, float]:
    return {t.label: peak_rss_mb(tree_pids(t.pid)) for t in targets}
