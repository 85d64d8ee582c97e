"""Triton's sequence batcher testing hooks (real server, real tritonclient): with
TRITONSERVER_DELAY_SCHEDULER=N no batch forms until the sequence slots' queues
together hold N requests, and TRITONSERVER_BACKLOG_DELAY_SCHEDULER=M also waits
for M requests in the backlog (core sequence_batch_scheduler.cc: Create reads the
backlog count, DirectSequenceBatch::BatcherThread the queued count, DelayScheduler
compares them). Triton's qa/L0_sequence_batcher relies on them to see a known batch.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient

from tests.e2e.test_sequence_backlog import wait_for
from tests.e2e.test_sequence_e2e import STATE, TENSORS, ZERO, accumulator
from tests.serverproc import ServerProcess, scrape_metrics


def _repository(tmp_path, slots: int):
    (tmp_path / "seq" / "1").mkdir(parents=True)
    onnx.save(accumulator(), str(tmp_path / "seq" / "1" / "model.onnx"))
    (tmp_path / "seq" / "config.pbtxt").write_text(
        f'name: "seq"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {slots}\n'
        f"{TENSORS % ''}\nsequence_batching {{\ndirect {{ }}\n{STATE % ZERO}\n}}\n"
    )
    return tmp_path


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(slots: int, **env: str) -> ServerProcess:
        proc = ServerProcess(_repository(tmp_path, slots), env=env)
        started.append(proc)
        proc.wait_ready(path="/v2/health/ready")
        return proc

    yield start
    for proc in started:
        assert proc.stop() == 0, proc.output()
        proc.close()


def _send(client, sequence_id: int, value: int):
    infer_input = httpclient.InferInput("INPUT", [1, 1], "INT32")
    infer_input.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return client.async_infer(
        "seq", [infer_input], sequence_id=sequence_id, sequence_start=True, sequence_end=True
    )


def _batch_sizes(client) -> dict[int, int]:
    stats = client.get_inference_statistics("seq")["model_stats"][0]
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}


def _queued(proc: ServerProcess) -> int:
    family = scrape_metrics(proc)["nv_inference_pending_request_count"]
    return int(sum(s.value for s in family.samples if s.labels.get("model") == "seq"))


def test_no_batch_forms_until_the_slots_hold_the_delay_count(serve):
    proc = serve(4, TRITONSERVER_DELAY_SCHEDULER="4")
    client = httpclient.InferenceServerClient(proc.http_url, concurrency=4, network_timeout=20)
    try:
        # Sent one after another: without the hook the first runs alone at once.
        pending = [_send(client, 10 + i, i + 1) for i in range(4)]
        results = [int(p.get_result().as_numpy("OUTPUT")[0, 0]) for p in pending]
        assert results == [1, 2, 3, 4]
        assert _batch_sizes(client) == {4: 1}
    finally:
        client.close()


def test_the_backlog_count_holds_batching_too(serve):
    # One slot; the hold lets go only with 1 request in the slot and 2 in the
    # backlog, so the three sequences run one by one after all three arrived.
    proc = serve(1, TRITONSERVER_DELAY_SCHEDULER="1", TRITONSERVER_BACKLOG_DELAY_SCHEDULER="2")
    client = httpclient.InferenceServerClient(proc.http_url, concurrency=3, network_timeout=20)
    try:
        first = _send(client, 1, 5)
        second = _send(client, 2, 6)
        # Two requests do not release it: both stay queued, nothing has run.
        assert wait_for(lambda: _queued(proc) == 2), _queued(proc)
        stats = client.get_inference_statistics("seq")["model_stats"][0]
        assert int(stats["execution_count"]) == 0
        third = _send(client, 3, 7)
        assert [int(p.get_result().as_numpy("OUTPUT")[0, 0]) for p in (first, second, third)] == [
            5,
            6,
            7,
        ]
        assert _batch_sizes(client) == {1: 3}
    finally:
        client.close()
