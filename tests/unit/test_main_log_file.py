"""The command creates its ``--log-file`` before it imports the server (Triton opens
it while reading its options; qa/L0_logging's log_format_test gives a started
server 5 s to create it, which importing the server alone can take on a loaded
host)."""

from __future__ import annotations

import subprocess
import sys

from trionserve.__main__ import create_log_file


def test_the_last_log_file_option_is_created(tmp_path):
    first, last = tmp_path / "first.log", tmp_path / "last.log"
    create_log_file(["--log-file", str(first), "--model-repository=m", f"--log-file={last}"])
    assert last.exists() and not first.exists()
    last.write_text("kept\n")
    create_log_file([f"--log-file={last}"])  # appended to, never truncated
    assert last.read_text() == "kept\n"
    create_log_file(["--log-file"])  # no value: the parser reports it
    create_log_file([f"--log-file={tmp_path / 'missing' / 'x.log'}"])  # reported later too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.log"]


def test_the_log_file_exists_before_the_server_is_imported(tmp_path):
    log = tmp_path / "server.log"
    probe = (
        "import sys, trionserve.__main__ as entry\n"
        f"entry.create_log_file(['--log-file={log}'])\n"
        "assert 'trionserve.cli' not in sys.modules, 'the server was imported first'\n"
        "assert 'trio' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
    assert log.exists()
