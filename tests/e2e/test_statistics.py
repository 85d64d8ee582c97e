"""Statistics: what the executor records, and the statistics extension over HTTP."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from tritonclient.utils import InferenceServerException

from tests.helpers import simple_inputs
from trionserve.actors.executor import InstanceExecutor
from trionserve.backends.base import InstanceSpec
from trionserve.core.errors import InvalidArgument, TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.observability.statistics import ComputeTimes, FailureReason, ModelStatistics
from trionserve.schedulers.default import DefaultScheduler

DURATIONS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)


class FakeInstance:
    """Answers every request at once; fails requests with a negative input."""

    def __init__(self) -> None:
        self.compute_times: ComputeTimes | None = None

    def execute(self, requests):
        self.compute_times = ComputeTimes(1_000, 5_000, 2_000)
        outcomes = []
        for r in requests:
            if r.inputs["X"].data.min() < 0:
                outcomes.append(InvalidArgument("negative input"))
            else:
                outcomes.append(InferenceResponse("m", "1", r.id, []))
        return outcomes

    def close(self) -> None:
        pass


def request(id: str, batch: int, value: float = 1.0) -> InferenceRequest:
    r = InferenceRequest(
        "m", id=id, inputs={"X": Tensor("X", "FP32", np.full((batch, 2), value, np.float32))}
    )
    r.batch_size = batch
    return r


async def test_executor_records_successes_failures_and_batches():
    statistics = ModelStatistics("m", 1)
    scheduler = DefaultScheduler()
    executor = InstanceExecutor(
        InstanceSpec("m_0_0", "m_0", "KIND_CPU", 0), FakeInstance(), scheduler.outlet(), statistics
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        ok = [request("a", 2), request("b", 3), request("c", 2)]
        bad = request("d", 1, value=-1.0)
        gone = request("e", 4)
        gone.cancelled = True
        for r in (*ok, bad, gone):
            await scheduler.submit(r)
        for r in ok:
            assert isinstance(await r.wait(), InferenceResponse)
        with pytest.raises(TritonError, match="negative input"):
            await bad.wait()
        with pytest.raises(TritonError, match="cancelled"):
            await gone.wait()
        scheduler.close()

    assert statistics.success.count == 3
    assert statistics.inference_count == 7  # batch sizes summed, successes only
    assert statistics.execution_count == 3  # the failing request's batch is not one
    assert statistics.fail.count == 2
    assert statistics.failures[FailureReason.BACKEND] == 1
    assert statistics.failures[FailureReason.CANCELED] == 1
    assert sorted(statistics.batch_stats) == [2, 3]
    assert statistics.batch_stats[2].compute_input.count == 2
    # The backend's split is kept for input and output; infer is the rest.
    assert statistics.compute_input.ns == 3 * 1_000
    assert statistics.compute_output.ns == 3 * 2_000
    for name in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert getattr(statistics, name).count == 3
    assert statistics.success.ns >= statistics.queue.ns
    assert statistics.last_inference > 0


async def test_json_has_triton_shape():
    statistics = ModelStatistics("m", 3)
    statistics.record_success(4, 900, 100, 10, 700, 20)
    statistics.record_execution(4, 10, 700, 20, trio.current_time())
    entry = statistics.as_json()
    assert entry["name"] == "m" and entry["version"] == "3"
    assert entry["inference_count"] == 4 and entry["execution_count"] == 1
    assert set(entry["inference_stats"]) == set(DURATIONS)
    assert entry["inference_stats"]["compute_infer"] == {"count": 1, "ns": 700}
    assert entry["batch_stats"] == [
        {
            "batch_size": 4,
            "compute_input": {"count": 1, "ns": 10},
            "compute_infer": {"count": 1, "ns": 700},
            "compute_output": {"count": 1, "ns": 20},
        }
    ]
    assert ModelStatistics("n", 1).as_json()["last_inference"] == 0


def test_statistics_extension_through_tritonclient(http_client):
    before = http_client.get_inference_statistics("simple", "1")["model_stats"][0]
    for batch in (1, 3, 3):
        http_client.infer("simple", simple_inputs(np.ones((batch, 16), np.int32)))
    after = http_client.get_inference_statistics("simple")["model_stats"][0]
    assert after["name"] == "simple" and after["version"] == "1"

    def delta(*path):
        a, b = after, before
        for key in path:
            a, b = a[key], b[key]
        return a - b

    assert delta("inference_count") == 7
    assert delta("execution_count") == 3
    assert delta("inference_stats", "success", "count") == 3
    assert delta("inference_stats", "compute_infer", "count") == 3
    assert delta("inference_stats", "compute_input", "ns") > 0  # onnxruntime reports it
    assert delta("inference_stats", "success", "ns") >= delta("inference_stats", "queue", "ns")
    assert after["last_inference"] >= before["last_inference"]
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    old = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
    assert sizes[3] - old.get(3, 0) == 2

    everything = http_client.get_inference_statistics()["model_stats"]
    assert {"simple", "identity_fp32", "identity_bytes"} <= {m["name"] for m in everything}
    with pytest.raises(InferenceServerException, match="unknown model"):
        http_client.get_inference_statistics("no_such_model")
    with pytest.raises(InferenceServerException, match="version 9"):
        http_client.get_inference_statistics("simple", "9")
