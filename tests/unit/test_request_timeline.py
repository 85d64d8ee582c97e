"""benchmarks.investigations.request_timeline: the internal functions it wraps still exist, and a
short run gives every step of a request its time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_times_every_step():
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.investigations.request_timeline",
            "--requests",
            "20",
            "--skip",
            "2",
            "--direct-runs",
            "5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    rows = {line.split("|")[1].strip() for line in lines if line.startswith("| ")}
    from benchmarks.investigations.request_timeline import ANSWERED_BY, STEPS

    # A wrapped function that moved leaves its steps out of the table: every step
    # common to both ways of answering, and all of one way's.
    ways = set().union(*ANSWERED_BY.values())
    assert {label for label, _, _ in STEPS} - ways <= rows
    assert any(steps <= rows for steps in ANSWERED_BY.values()), rows
    assert any("epoll waits" in line for line in lines)
