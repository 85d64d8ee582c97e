"""NVIDIA's AIPerf against the OpenAI port of a real server, for a few requests: it
runs unmodified (chat, streaming, the example model's tokenizer from its folder)
and its export has every request, no errors, and the figures the benchmark
reports (benchmarks/openai_aiperf.py). Skipped where AIPerf is not installed
(``pip install aiperf``; ``$TRIONSERVE_AIPERF`` names the executable, else
``aiperf`` on PATH)."""

from __future__ import annotations

import pytest

from benchmarks.openai_aiperf import MODELS, figures, find_aiperf, run_aiperf
from tests.serverproc import ServerProcess, free_port

pytest.importorskip("tokenizers")
AIPERF = find_aiperf()
pytestmark = pytest.mark.skipif(AIPERF is None, reason="aiperf is not installed")


def test_aiperf_streams_chat_from_the_openai_port(tmp_path):
    assert AIPERF is not None
    port = free_port()
    proc = ServerProcess(MODELS, args=[f"--openai-port={port}", "--allow-grpc=false"])
    try:
        proc.wait_ready()
        export = run_aiperf(
            AIPERF, port, "mock_llm", 2, 4, tmp_path / "run", output_tokens=16, warmup=1
        )
    finally:
        proc.stop()
        proc.close()
    row = figures(export)
    assert row["requests"] == 4 and row["errors"] == 0
    assert export["was_cancelled"] is False
    assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
    assert row["output_tokens_per_s"] > 0 and export["output_sequence_length"]["avg"] > 0
