"""The executor's hand-off to a blocking backend instance and back, measured alone.

Usage:
    python -m benchmarks.investigations.executor_hop [--requests 2000] [--rounds 3] [--tree PATH]

One ``InstanceExecutor`` behind a ``DefaultScheduler``, in this process, with an
instance whose ``execute`` does nothing but answer (and declares no inline budget,
so every batch crosses to the instance's thread). One request at a time is
submitted and awaited: the round trip is the event loop -> instance thread -> event
loop hop and the executor's own work. Reported: median and p90 round trip in µs and
the process's CPU time per request. ``--tree`` also runs, interleaved round by round,
the executor of another source tree (``trionserve/actors/executor.py`` of, say, an
older commit checked out there), against the same scheduler and instance.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import trio

from trionserve.backends.base import InstanceSpec
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.schedulers.default import DefaultScheduler

SPEC = InstanceSpec("hop_0_0", "hop_0", "KIND_CPU", 0)
DATA = np.zeros((1, 16), dtype=np.float32)


class Answer:
    """Answers at once: what is measured is everything around ``execute``."""

    def execute(self, requests):
        return [InferenceResponse("hop", "1", r.id) for r in requests]

    def close(self) -> None:
        pass


def load_executor(tree: Path | None):
    if tree is None:
        from trionserve.actors.executor import InstanceExecutor

        return InstanceExecutor
    path = tree / "trionserve" / "actors" / "executor.py"
    spec = importlib.util.spec_from_file_location("_other_executor", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.InstanceExecutor


async def measure(executor_class, count: int) -> tuple[list[float], float]:
    scheduler = DefaultScheduler()
    executor = executor_class(SPEC, Answer(), scheduler.outlet())
    trips = []
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        cpu = time.process_time()
        for index in range(count):
            request = InferenceRequest(
                "hop", id=str(index), inputs={"INPUT0": Tensor("INPUT0", "FP32", DATA)}
            )
            request.batch_size = 1
            started = time.perf_counter()
            await scheduler.submit(request)
            await request.wait()
            trips.append((time.perf_counter() - started) * 1e6)
        cpu = time.process_time() - cpu
        scheduler.close()
        executor.stop()
    return trips, cpu / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=Path, default=None, help="another source tree")
    args = parser.parse_args()
    executors = {"this tree": load_executor(None)}
    if args.tree is not None:
        executors[f"{args.tree}"] = load_executor(args.tree)
    results: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in executors}
    for _ in range(args.rounds):
        for name, executor_class in executors.items():
            trips, cpu = trio.run(measure, executor_class, args.requests)
            results[name][0].extend(trips)
            results[name][1].append(cpu)
    print("| executor | round trip p50 us | p90 us | CPU us/request |")
    print("| --- | ---: | ---: | ---: |")
    for name, (trips, cpus) in results.items():
        trips.sort()
        p90 = trips[int(len(trips) * 0.9)]
        print(
            f"| {name} | {statistics.median(trips):.1f} | {p90:.1f} | "
            f"{statistics.median(cpus):.1f} |"
        )


if __name__ == "__main__":
    main()
