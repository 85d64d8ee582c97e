"""A gRPC stream's answers to a model that is not decoupled come back in request
order (real server, real tritonclient), as Triton writes them from the front of
the stream's queue (server src/grpc/infer_handler.h WriteResponseIfReady,
stream_infer_handler.cc StreamInferResponseComplete); qa/L0_sequence_batcher's
SequenceBatcherPreserveOrderingTest checks it with backlogged sequences.

One sequence slot makes a later request finish first: sequence 2's START waits in
the backlog until sequence 1's END, sent after it, has run.
"""

from __future__ import annotations

import queue

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.test_sequence_e2e import STATE, TENSORS, ZERO, accumulator
from tests.serverproc import ServerProcess


@pytest.fixture
def server(tmp_path):
    (tmp_path / "one_slot" / "1").mkdir(parents=True)
    onnx.save(accumulator(), str(tmp_path / "one_slot" / "1" / "model.onnx"))
    (tmp_path / "one_slot" / "config.pbtxt").write_text(
        'name: "one_slot"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 1\n'
        f"{TENSORS % ''}\nsequence_batching {{\n"
        f"max_sequence_idle_microseconds: 60000000\ndirect {{ }}\n{STATE % ZERO}\n}}\n"
    )
    proc = ServerProcess(tmp_path)
    try:
        proc.wait_ready(path="/v2/health/ready")
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def test_a_later_request_finishing_first_is_answered_after_the_earlier_one(server):
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        sends = [
            ("a", 1, 5, {"sequence_start": True}),  # sequence 1 takes the slot
            ("b", 2, 7, {"sequence_start": True}),  # backlogged behind it
            ("c", 1, 1, {"sequence_end": True}),  # runs first, frees the slot for b
            ("d", 2, 1, {"sequence_end": True}),
        ]
        for request_id, sequence_id, value, flags in sends:
            infer_input = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            infer_input.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            client.async_stream_infer(
                "one_slot", [infer_input], request_id=request_id, sequence_id=sequence_id, **flags
            )
        got = []
        for _ in sends:
            result, error = answers.get(timeout=20)
            assert error is None, error
            got.append((result.get_response().id, int(result.as_numpy("OUTPUT")[0, 0])))
        assert got == [("a", 5), ("b", 7), ("c", 6), ("d", 8)]
    finally:
        client.stop_stream()
        client.close()
