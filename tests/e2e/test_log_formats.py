"""Triton's own log line formats, ``--log-format=default`` and ``ISO8601``, as
triton-inference-server/common src/logging.cc writes them (LogPreamble,
LogTimestamp in UTC, messages escaped as JSON strings unless
TRITON_SERVER_ESCAPE_LOG_MESSAGES=0), read back as qa/L0_logging reads them."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import requests

from tests.serverproc import EXAMPLES, ServerProcess

INJECTED = "I0205 18:34:18.707423 1 file.cc:123] THIS ENTRY WAS INJECTED"

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
    repository = tmp_path / "models"
    shutil.copytree(EXAMPLES / "simple", repository / "simple")
    proc = ServerProcess(
        repository,
        args=[f"--log-format={log_format}", f"--log-file={log_file}", "--log-verbose=1"],
        env=env,
    )
    try:
        proc.wait_ready()
        settings = requests.get(f"http://{proc.http_url}/v2/logging", timeout=10).json()
        assert settings["log_format"] == log_format
        # An input name that carries a record of its own: Triton logs the
        # rejection verbatim in its verbose "Infer failed" line, so only the
        # escaping keeps it from reading as a record (qa/L0_logging test_injection).
        tensor = {"name": f"\n{INJECTED}\n", "shape": [1], "datatype": "FP32", "data": [1.0]}
        body = {"inputs": [tensor]}
        answer = requests.post(f"http://{proc.http_url}/v2/models/simple/infer", json=body)
        assert answer.status_code == 400
        assert proc.stop() == 0
    finally:
        proc.close()
    text = log_file.read_text()
    records = _records(text, PREAMBLE[log_format])
    # Triton's messages: its services' start, each HTTP request and the drain.
    for message in (
        f"Started HTTPService at 127.0.0.1:{proc.http_port}",
        f"Started GRPCInferenceService at 127.0.0.1:{proc.grpc_port}",
        "HTTP request: 0 /v2/logging",
        "HTTP request: 2 /v2/models/simple/infer",
        "Infer failed: unexpected inference input",
        "Waiting for in-flight requests to complete.",
    ):
        assert message in text, message
    assert (INJECTED in text.splitlines()) is not escaped
    records = [(match, lines) for match, lines in records if match.group(0) != INJECTED]
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
    tables = [lines for _, lines in records if lines and lines[0].startswith("+-")]
    assert tables and tables[0][1].startswith("| ")
    # The onnxruntime backend's configuration at its first load, as Triton's backend
    # logs it (onnxruntime_backend src/onnxruntime.cc:2963), read as qa/L0_backend_config
    # reads it: the JSON after the message's first line.
    (configuration,) = [m for m in messages if m.lstrip('"').startswith("backend configuration:")]
    if escaped:
        configuration = json.loads(configuration)
    else:
        (lines,) = [lines for match, lines in records if match.group(0).endswith("configuration:")]
        configuration += "\n" + "\n".join(lines)
    cmdline = json.loads(configuration.split("\n", 1)[1])["cmdline"]
    assert cmdline == {
        "auto-complete-config": "true",
        "backend-directory": "/opt/tritonserver/backends",
        "min-compute-capability": "6.000000",
        "default-max-batch-size": "4",
    }
    # The caller's file and line: the server's start is logged in server.py.
    (start,) = [match for match, _ in records if "server starting" in match.group(0)]
    assert start.group(0).split("] ")[0].rsplit(" ", 1)[1].startswith("server.py:")
