"""trionserve.testing's ServerProcess, on small Python programs standing in for a
server: stop is a SIGTERM and returns the exit code, kill ends the server alone,
close also ends what it left behind, the log holds its output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trionserve.testing import ServerProcess, TrionServe

# Writes "ready" once SIGTERM has a handler (exit 3), starts a child that sleeps
# and writes its pid, then sleeps.
SERVER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("child", child.pid, flush=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def server(tmp_path):
    ready = tmp_path / "child"
    process = ServerProcess("stand-in", [sys.executable, "-c", SERVER, str(ready)])
    try:
        child = int(wait_for(lambda: ready.exists() and ready.read_text(), "the child's pid"))
        yield process, child
    finally:
        process.close()


def test_stop_is_a_sigterm_and_returns_the_exit_code(server):
    process, child = server
    assert process.stop(timeout=30) == 3
    assert f"child {child}" in process.output()


def test_kill_ends_the_server_alone_and_close_what_it_left(server):
    process, child = server
    process.kill()
    assert process.process.poll() is not None
    assert alive(child)  # as after a server's crash: its children are left to notice
    process.close()
    wait_for(lambda: not alive(child), "the child to end with the server's group")
    process.close()  # again: nothing left to do


def test_trionserve_needs_a_repository():
    with pytest.raises(ValueError, match="model repository"):
        TrionServe()
