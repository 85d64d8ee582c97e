"""The server's log as Triton writes its own: the ``default`` format by default,
info lines to stdout and warnings and errors to stderr (common src/logging.cc
Logger::Log), Triton's verbose request lines only at verbose level, the
``backend configuration:`` JSON its onnxruntime and python backends log, and its
warning for a directory that is not a version."""

from __future__ import annotations

import json
import re

import pytest
import structlog

from trionserve.backends.backend_config import parse_backend_config
from trionserve.backends.manager import BackendManager
from trionserve.observability.logging import (
    SETTINGS,
    configure_logging,
    log_grpc_cancellation,
    log_http_request,
    log_infer_failed,
    update_settings,
)
from trionserve.repository.versions import list_versions

# I1129 10:30:00.123456 1234 test_log_lines.py:56] "message"
RECORD = re.compile(r"^([IWE])\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ ([\w.]+):\d+\] (.*)$")


@pytest.fixture
def logging_restored():
    saved = SETTINGS.as_dict()
    yield
    update_settings(saved, network=False)


def records(text: str) -> list[tuple[str, str, str]]:
    found = []
    for line in text.splitlines():
        match = RECORD.match(line)
        assert match, line
        found.append(match.groups())
    return found


def test_the_default_format_and_where_each_level_goes(capsys, logging_restored):
    configure_logging()
    assert SETTINGS.log_format == "default"
    log = structlog.get_logger("test_log_lines")
    log.info("plain", count=1)
    log.debug("not verbose")
    log.warning("careful")
    log.error('bad "quote"\nnext line')
    out, err = capsys.readouterr()
    assert records(out) == [("I", "test_log_lines.py", '"plain count=1"')]
    assert records(err) == [
        ("W", "test_log_lines.py", '"careful"'),
        ("E", "test_log_lines.py", '"bad \\"quote\\"\\nnext line"'),
    ]


def test_tritons_verbose_request_lines_only_when_verbose(capsys, logging_restored):
    configure_logging()
    log_http_request(b"POST", "/v2/models/simple/infer")
    log_infer_failed(None, "unexpected inference input 'x' for model 'simple'")
    assert capsys.readouterr() == ("", "")
    update_settings({"log_verbose_level": 1}, network=False)
    log_http_request(b"GET", "/v2/logging")
    log_http_request(b"BREW", "/coffee")
    log_infer_failed("7", "unexpected inference input 'x' for model 'simple'")
    out, _ = capsys.readouterr()
    assert [message for _, _, message in records(out)] == [
        '"HTTP request: 0 /v2/logging"',
        '"HTTP request: 16 /coffee"',
        "\"[request id: 7] Infer failed: unexpected inference input 'x' for model 'simple'\"",
    ]


def test_tritons_grpc_cancellation_line_for_its_infer_handlers(capsys, logging_restored):
    """server src/grpc/infer_handler.h:850: only the infer handlers log it."""
    configure_logging()
    log_grpc_cancellation("/inference.GRPCInferenceService/ModelInfer", 1)
    assert capsys.readouterr() == ("", "")
    update_settings({"log_verbose_level": 1}, network=False)
    log_grpc_cancellation("/inference.GRPCInferenceService/ModelInfer", 3)
    log_grpc_cancellation("/inference.GRPCInferenceService/ModelStreamInfer", 5)
    log_grpc_cancellation("/inference.GRPCInferenceService/ModelMetadata", 7)
    out, _ = capsys.readouterr()
    assert [message for _, _, message in records(out)] == [
        '"Cancellation notification received for ModelInferHandler, context 3"',
        '"Cancellation notification received for ModelStreamInferHandler, context 5"',
    ]


def test_the_backend_configuration_as_tritons_core_resolves_it():
    given = parse_backend_config(
        ["z-setting=1", "onnxruntime,min-compute-capability=XX", "onnxruntime,a=0", "python,b=2"]
    )
    manager = BackendManager(given, autocomplete=False)
    assert json.loads(manager.backend_configuration("onnxruntime")) == {
        "cmdline": {
            "a": "0",
            "auto-complete-config": "false",
            "backend-directory": "/opt/tritonserver/backends",
            "min-compute-capability": "XX",
            "z-setting": "1",
            "default-max-batch-size": "4",
        }
    }
    # Compact, in that order: the resolved settings sorted, the default last.
    text = BackendManager(parse_backend_config(["default-max-batch-size=8"])).backend_configuration(
        "python"
    )
    assert text == (
        '{"cmdline":{"auto-complete-config":"true","backend-directory":'
        '"/opt/tritonserver/backends","default-max-batch-size":"8",'
        '"min-compute-capability":"6.000000"}}'
    )


def test_directories_that_are_not_versions_are_warned_of(tmp_path, capsys, logging_restored):
    configure_logging()
    for name in ("1", "01", "v2", "0", "warmup", "configs", "initial_state"):
        (tmp_path / name).mkdir()
    (tmp_path / "model.onnx").write_text("")
    assert list_versions(tmp_path) == [1]
    assert capsys.readouterr() == ("", "")  # only when a model loads
    assert list_versions(tmp_path, warn=True) == [1]
    _, err = capsys.readouterr()
    assert sorted(message for _, _, message in records(err)) == [
        "\"ignore version directory '01' which contains leading zeros in its directory name\"",
        "\"ignore version directory 'v2' which fails to convert to integral number\"",
    ]


@pytest.mark.parametrize("readable", [True, False])
async def test_cpu_metrics_start_is_logged_as_triton_logs_it(
    tmp_path, monkeypatch, readable, autojump_clock
):
    """core metrics.cc:770 InitializeCpuMetrics: "Collecting CPU metrics" once /proc
    parses, a warning otherwise; once, not at every sample."""
    import trio

    from trionserve.observability import metrics

    seen: list[tuple[str, str]] = []

    class Recorder:
        def info(self, event, **fields):
            seen.append(("info", event))

        def warning(self, event, **fields):
            seen.append(("warning", event))

    monkeypatch.setattr(metrics, "log", Recorder())
    if readable:
        (tmp_path / "stat").write_text("cpu  10 0 5 100 0 0 0 0 0 0\n")
        (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 400 kB\n")
    collector = metrics.CpuMetricsCollector(str(tmp_path))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(collector.run, 1.0, stop)
        await trio.sleep(3.5)  # virtual time: three more samples
        stop.set()
    if readable:
        assert seen == [("info", "Collecting CPU metrics")]
        assert collector.memory_used == 600 * 1024
    else:
        assert seen == [
            ("warning", "error initializing CPU metrics, CPU utilization may not be available")
        ]
