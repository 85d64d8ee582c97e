"""Triton's own log line formats, ``--log-format=default`` and ``ISO8601``, as
triton-inference-server/common src/logging.cc writes them (LogPreamble,
LogTimestamp in UTC, messages escaped as JSON strings unless
TRITON_SERVER_ESCAPE_LOG_MESSAGES=0), read back as qa/L0_logging reads them."""

from __future__ import annotations

import json
import re

import pytest
import requests

from tests.serverproc import ServerProcess

PREAMBLE = {
    # I1129 08:45:10.465013 13512 server.py:355] ...
    "default": re.compile(
        r"^([IWE])(\d\d)(\d\d) \d\d:\d\d:\d\d\.\d{6} (\d+) ([\w.]+):(\d+)\] (.*)$"
    ),
    # 2026-11-29T08:45:25Z I 14032 server.py:355] ...
    "ISO8601": re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ([IWE]) (\d+) ([\w.]+):(\d+)\] (.*)$"),
}


def _records(text: str, pattern: re.Pattern) -> list[tuple[re.Match, list[str]]]:
    """Each record's first line and the lines that follow it (a table)."""
    records: list[tuple[re.Match, list[str]]] = []
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            records.append((match, []))
        else:
            assert records, f"a line before any record: {line!r}"
            records[-1][1].append(line)
    return records


@pytest.mark.parametrize(
    ("log_format", "escaped"), [("default", True), ("ISO8601", True), ("default", False)]
)
def test_tritons_line_formats(tmp_path, log_format, escaped):
    log_file = tmp_path / "server.log"
    env = {} if escaped else {"TRITON_SERVER_ESCAPE_LOG_MESSAGES": "0"}
    proc = ServerProcess(
        tmp_path,
        args=[f"--log-format={log_format}", f"--log-file={log_file}", "--log-verbose=1"],
        env=env,
    )
    try:
        proc.wait_ready()
        settings = requests.get(f"http://{proc.http_url}/v2/logging", timeout=10).json()
        assert settings["log_format"] == log_format
        assert proc.stop() == 0
    finally:
        proc.close()
    records = _records(log_file.read_text(), PREAMBLE[log_format])
    messages = [match.groups()[-1] for match, _ in records]
    assert len(records) > 5
    pid = {"default": 4, "ISO8601": 2}[log_format]
    assert {int(match.group(pid)) for match, _ in records} == {proc.pid}
    if escaped:
        # Every message is one JSON string: a newline in it cannot start a record.
        decoded = [json.loads(message) for message in messages]
        assert any(d.startswith("server starting") for d in decoded)
    else:
        assert any(m.startswith("server starting") for m in messages)
        assert not any(m.startswith('"') for m in messages)
    # The start-up overview: a record whose message is followed by its table.
    tables = [lines for _, lines in records if lines]
    assert tables and tables[0][0].startswith("+-") and tables[0][1].startswith("| ")
    # The caller's file and line: the server's start is logged in server.py.
    (start,) = [match for match, _ in records if "server starting" in match.group(0)]
    assert start.group(0).split("] ")[0].rsplit(" ", 1)[1].startswith("server.py:")
