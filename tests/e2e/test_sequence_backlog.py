"""A backlogged sequence whose client has gone never takes a sequence slot (real
server, one slot, a long idle timeout): as Triton's sequence batcher, which skips a
backlogged sequence with a cancelled request when a slot frees (core
sequence_batch_scheduler.cc, ReleaseSequenceSlot)."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient

from tests.e2e.test_sequence_e2e import STATE, TENSORS, ZERO, accumulator
from tests.serverproc import ServerProcess, scrape_metrics

ABANDONED = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("backlog_repository")
    (repository / "seq_slot" / "1").mkdir(parents=True)
    onnx.save(accumulator(), str(repository / "seq_slot" / "1" / "model.onnx"))
    # One slot, held by an idle sequence for 60 s.
    (repository / "seq_slot" / "config.pbtxt").write_text(
        'name: "seq_slot"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 1\n'
        f"{TENSORS % ''}\nsequence_batching {{\n"
        f"max_sequence_idle_microseconds: 60000000\ndirect {{ }}\n{STATE % ZERO}\n}}\n"
    )
    proc = ServerProcess(repository)
    try:
        proc.wait_ready(path="/v2/health/ready")
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def pending(proc: ServerProcess) -> int:
    family = scrape_metrics(proc)["nv_inference_pending_request_count"]
    return int(sum(s.value for s in family.samples if s.labels.get("model") == "seq_slot"))


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
    return condition()


def start_request(port: int, sequence_id: int) -> socket.socket:
    """A sequence START sent on a raw connection whose answer is never read."""
    body = json.dumps(
        {
            "parameters": {"sequence_id": sequence_id, "sequence_start": True},
            "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}],
        }
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"POST /v2/models/seq_slot/infer HTTP/1.1\r\nhost: x\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def add(client, sequence_id: int, value: int, **flags) -> int:
    infer_input = httpclient.InferInput("INPUT", [1, 1], "INT32")
    infer_input.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    result = client.infer("seq_slot", [infer_input], sequence_id=sequence_id, **flags)
    return int(result.as_numpy("OUTPUT")[0, 0])


def test_abandoned_backlogged_starts_never_take_the_slot(server):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=20)
    try:
        assert add(client, 1, 5, sequence_start=True) == 5  # sequence 1 holds the slot
        sockets = [start_request(server.http_port, 100 + i) for i in range(ABANDONED)]
        assert wait_for(lambda: pending(server) == ABANDONED)
        for sock in sockets:  # their clients give up
            sock.close()
        # Given up at once: nothing of theirs is queued any more.
        assert wait_for(lambda: pending(server) == 0), pending(server)
        assert add(client, 1, 1, sequence_end=True) == 6  # the slot frees
        started = time.monotonic()
        # A fresh sequence gets it now, not after the dead ones' 60 s idle timeouts.
        assert add(client, 200, 7, sequence_start=True, sequence_end=True) == 7
        assert time.monotonic() - started < 10
    finally:
        client.close()
