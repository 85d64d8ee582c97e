"""The invariants checked after every scenario, each a function of the run's World.

Checks that need to see the run as it happens record their violations live: the
queue bounds (:mod:`simulations.probes`) and "only fully loaded versions serve"
(:mod:`simulations.backend` and the routing probe of :mod:`simulations.harness`).
"""

from __future__ import annotations

import numpy as np

from simulations.world import RequestRecord, World
from trionserve.core.errors import Cancelled, TritonError
from trionserve.core.inference import InferenceResponse
from trionserve.observability.statistics import FailureReason, to_ns

ONE_OUTCOME = "every request gets exactly one final outcome"
NO_LEAKS = "no task outlives shutdown"
STATISTICS = "statistics match what happened"
NOTHING_LOST = "nothing accepted is lost"
NO_FAILURES = "no failed requests during a reload without faults"
SHUTDOWN = "shutdown finishes within its deadline"


def describe(outcome) -> str:
    if outcome is None:
        return "no outcome"
    kind, value = outcome
    if kind == "error":
        return f"error {value!r}"
    return kind


def failure_reason(error: TritonError, backend_errors=("[sim]",)) -> FailureReason:
    """How the statistics should have counted a request that failed with ``error``."""
    message = error.message
    if isinstance(error, Cancelled):
        return FailureReason.CANCELED
    if "Exceeds maximum queue size" in message or "Request timeout expired" in message:
        return FailureReason.REJECTED
    if any(marker in message for marker in backend_errors):
        return FailureReason.BACKEND
    return FailureReason.OTHER


def check_outcomes(world: World) -> None:
    tolerate = world.setup.tolerate_repeated_errors
    for record in world.records:
        if record.client is None:
            world.violate(
                ONE_OUTCOME,
                f"{record}: its client never got an outcome "
                f"(submitted at t={record.submitted_at:.4f})",
            )
        attempts = record.attempts
        if record.accepted and not attempts:
            world.violate(
                ONE_OUTCOME, f"{record}: accepted by {record.version!r} and never answered"
            )
        if not record.accepted and attempts:
            world.violate(
                ONE_OUTCOME,
                f"{record}: answered ({describe(attempts[0])}) though "
                f"no version accepted it ({record.refusal!r})",
            )
        if len(attempts) > 1:
            repeated_errors = all(kind == "error" for kind, _ in attempts)
            if not (tolerate and repeated_errors):
                kinds = ", ".join(describe(a) for a in attempts)
                world.violate(ONE_OUTCOME, f"{record}: {len(attempts)} final outcomes: {kinds}")
        outcome = record.outcome
        delivered = outcome is not None and outcome[1] is record.client_value
        if record.client == "response" and not delivered:
            world.violate(
                ONE_OUTCOME,
                f"{record}: the client got a response that is not the "
                f"request's outcome ({describe(outcome)})",
            )
        if (
            record.client == "error"
            and record.accepted
            and (outcome is None or outcome[1] is not record.client_value)
        ):
            world.violate(
                ONE_OUTCOME,
                f"{record}: the client got {record.client_value!r} but "
                f"the request's outcome was {describe(outcome)}",
            )
        if record.client == "cancelled" and record.cancel_after is None:
            world.violate(ONE_OUTCOME, f"{record}: cancelled though its client never gave up")


def _expected_values(record: RequestRecord) -> np.ndarray:
    return np.arange(record.batch_size, dtype=np.int64).reshape(-1, 1) + record.number * 1000


def check_nothing_lost(world: World) -> None:
    for record in world.records:
        outcome = record.outcome
        if record.accepted and outcome is None:
            world.violate(
                NOTHING_LOST,
                f"{record} was accepted by {record.version!r} and then lost: no response, no error",
            )
        if record.produced is not None and (outcome is None or outcome[1] is not record.produced):
            world.violate(
                NOTHING_LOST,
                f"{record}: the backend produced its response, but the "
                f"request ended with {describe(outcome)}",
            )
        if record.client == "response":
            data = record.client_value.outputs[0].data
            if data.shape != (record.batch_size, 1) or not (data == _expected_values(record)).all():
                world.violate(
                    NOTHING_LOST,
                    f"{record}: got a response carrying {data.ravel()[:4]}"
                    ", which is another request's",
                )


def _expected_statistics(world: World, version) -> dict:
    records = [r for r in world.records if r.version is version]
    expected = {
        "success": 0,
        "fail": 0,
        "inference_count": 0,
        **{reason.value: 0 for reason in FailureReason},
    }
    for record in records:
        refusal = record.refusal
        if not record.accepted:
            if isinstance(refusal, TritonError) and "Exceeds maximum queue size" in refusal.message:
                expected["fail"] += 1
                expected[FailureReason.REJECTED.value] += 1
            continue
        outcome = record.outcome
        if outcome is None:
            continue
        if outcome[0] == "response":
            expected["success"] += 1
            expected["inference_count"] += record.batch_size
        elif outcome[0] == "error":
            expected["fail"] += 1
            reason = failure_reason(outcome[1], world.setup.backend_errors)
            expected[reason.value] += 1
    executions = [
        e for e in world.executions if e.version is version and e.returned and e.responses
    ]
    expected["execution_count"] = len(executions)
    sizes: dict[int, int] = {}
    for execution in executions:
        sizes[execution.batch_size] = sizes.get(execution.batch_size, 0) + 1
    expected["batch_stats"] = dict(sorted(sizes.items()))
    compute = 0
    for execution in executions:
        end = max(r.ended_at for r in execution.records)
        duration = to_ns(end - execution.started_at)
        for record in execution.records:
            if record.outcome is not None and record.outcome[0] == "response":
                compute += duration
    expected["compute_infer_ns"] = compute
    return expected


def _actual_statistics(statistics) -> dict:
    return {
        "success": statistics.success.count,
        "fail": statistics.fail.count,
        "inference_count": statistics.inference_count,
        **{reason.value: count for reason, count in statistics.failures.items()},
        "execution_count": statistics.execution_count,
        "batch_stats": {
            size: stats.compute_infer.count
            for size, stats in sorted(statistics.batch_stats.items())
        },
        "compute_infer_ns": statistics.compute_infer.ns,
    }


EXECUTION_KEYS = ("execution_count", "batch_stats", "compute_infer_ns")


def check_statistics(world: World) -> None:
    for version in world.versions:
        expected = _expected_statistics(world, version)
        if not world.setup.observes_executions:
            for key in EXECUTION_KEYS:
                del expected[key]
        actual = _actual_statistics(version.statistics)
        wrong = {k: (actual[k], v) for k, v in expected.items() if actual[k] != v}
        if wrong:
            detail = ", ".join(f"{k}: counted {a}, observed {e}" for k, (a, e) in wrong.items())
            world.violate(STATISTICS, f"{version!r}: {detail}")
        if version.statistics.queue.count != version.statistics.success.count:
            world.violate(STATISTICS, f"{version!r}: queue count differs from success count")


def check_no_failures(world: World) -> None:
    if not world.setup.expect_no_failures:
        return
    for record in world.records:
        if world.shutdown_at is not None and record.submitted_at >= world.shutdown_at:
            continue
        if record.client != "response":
            world.violate(
                NO_FAILURES,
                f"{record} (t={record.submitted_at:.4f}) ended with "
                f"{record.client}: {record.client_value!r}",
            )


def check_tasks(world: World) -> None:
    for task in world.leaked_tasks:
        world.violate(NO_LEAKS, f"task {task} was still alive after the server stopped")


def check_shutdown(world: World) -> None:
    limit = world.setup.shutdown_limit
    if world.stopped_at is None:
        world.violate(SHUTDOWN, "the server never stopped")
    elif limit is not None and world.shutdown_at is not None:
        took = world.stopped_at - world.shutdown_at
        if took > limit:
            world.violate(SHUTDOWN, f"the server took {took:.3f}s to stop; the limit is {limit}s")


ALL_CHECKS = (
    check_outcomes,
    check_nothing_lost,
    check_statistics,
    check_no_failures,
    check_tasks,
    check_shutdown,
)


def check_all(world: World) -> None:
    for check in ALL_CHECKS:
        check(world)


def is_response(outcome) -> bool:
    return outcome is not None and isinstance(outcome[1], InferenceResponse)
