"""Tracing a client can turn on is bounded (a real server, loopback): finished
traces held in memory are written once they pass MAX_BUFFERED_TRACE_BYTES, not
held until tracing is turned off, and one trace file name gets at most
MAX_TRACE_FILES indexed files, the rest appended to the trace file itself."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.serverproc import EXAMPLES, ServerProcess
from trionserve.observability.trace.manager import MAX_BUFFERED_TRACE_BYTES
from trionserve.observability.trace.trace_file import MAX_TRACE_FILES


@pytest.fixture
def traced(tmp_path):
    repository = tmp_path / "repository"
    shutil.copytree(EXAMPLES / "identity_fp32", repository / "identity_fp32")
    trace_file = tmp_path / "traces" / "trace.json"
    trace_file.parent.mkdir()
    proc = ServerProcess(
        repository,
        args=[f"--trace-config=triton,file={trace_file}", "--trace-config=level=OFF"],
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        client = httpclient.InferenceServerClient(proc.http_url, network_timeout=60)
        yield proc, client, trace_file
        client.close()
    finally:
        proc.close()


def infer(client, data: np.ndarray) -> None:
    infer_input = httpclient.InferInput("INPUT0", [1, data.size], "FP32")
    infer_input.set_data_from_numpy(data.reshape(1, -1), binary_data=True)
    client.infer("identity_fp32", [infer_input])


def rss_kib(proc: ServerProcess) -> int:
    with open(f"/proc/{proc.process.pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_buffered_tensor_traces_are_written_past_the_bound(traced):
    proc, client, trace_file = traced
    client.update_trace_settings(
        settings={
            "trace_level": ["TIMESTAMPS", "TENSORS"],
            "trace_rate": "1",
            "trace_count": "-1",
            "log_frequency": "0",
        }
    )
    data = np.random.default_rng(0).random(1 << 17, dtype=np.float32)  # 512 KiB
    before = rss_kib(proc)
    requests = 12  # about 2.4 MB of trace text each
    for _ in range(requests):
        infer(client, data)
    grown_mib = (rss_kib(proc) - before) / 1024
    # Written while tracing is still on: held no longer than the bound.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not trace_file.exists():
        time.sleep(0.05)
    assert trace_file.exists(), f"nothing written; the server grew {grown_mib:.0f} MiB"
    assert trace_file.stat().st_size >= MAX_BUFFERED_TRACE_BYTES
    assert proc.stop() == 0, proc.output()
    objects = json.loads(trace_file.read_text())  # one JSON array, across the writes
    ids = {o["id"] for o in objects if "model_name" in o}
    assert len(ids) == requests
    tensors = [o for o in objects if "activity" in o]
    assert len(tensors) == 2 * requests


def test_indexed_trace_files_are_bounded(traced):
    proc, client, trace_file = traced
    client.update_trace_settings(
        settings={
            "trace_level": ["TIMESTAMPS"],
            "trace_rate": "1",
            "trace_count": "-1",
            "log_frequency": "1",
        }
    )
    data = np.zeros(4, dtype=np.float32)
    for _ in range(MAX_TRACE_FILES + 5):
        infer(client, data)
    assert proc.stop() == 0, proc.output()
    names = {p.name for p in trace_file.parent.iterdir()}
    assert f"trace.json.{MAX_TRACE_FILES - 1}" in names
    assert len(names) == MAX_TRACE_FILES + 1, sorted(names)[-3:]  # and trace.json
    rest = json.loads(trace_file.read_text())
    assert len([o for o in rest if "model_name" in o]) == 5
