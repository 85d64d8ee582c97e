"""What a user sees when the real ``trionserve`` starts, fails to start, or is
asked for help: one line that names what is wrong, the start-up overview, and
``server ready`` only when the readiness API answers 200."""

from __future__ import annotations

import queue
import re
import shutil
import socket

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.helpers import run_cli
from tests.serverproc import EXAMPLES, ServerProcess, free_port


def broken_repository(tmp_path):
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text(
        'name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: -3\n'
    )
    return tmp_path


def test_a_port_in_use_fails_fast_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            f"--model-repository={EXAMPLES}",
            "--http-address=127.0.0.1",
            f"--http-port={port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={free_port()}",
            f"--metrics-port={free_port()}",
        )
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "error: failed to start HTTP service: Unavailable - Socket "
        f"'127.0.0.1:{port}' already in use (--http-port)"
    )
    assert "Traceback" not in result.stderr
    assert "model ready" not in result.stderr  # before any model loads


def test_a_failed_model_under_exit_on_error_ends_in_one_summary_line(tmp_path):
    result = run_cli(
        f"--model-repository={broken_repository(tmp_path)}",
        "--allow-http=false",
        "--allow-grpc=false",
        "--allow-metrics=false",
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[-1] == "error: failed to load all models: broken"
    # An error record in Triton's default format (its letter, time, pid, file:line).
    assert re.search(
        r'^E\d{4} [\d:.]+ \d+ registry\.py:\d+\] "model load failed model=broken reason=.*'
        r"max_batch_size",
        result.stderr,
        re.M,
    )
    assert "Traceback" not in result.stderr
    # --log-verbose asks for the traceback too.
    verbose = run_cli(
        f"--model-repository={tmp_path}",
        "--allow-http=false",
        "--allow-grpc=false",
        "--allow-metrics=false",
        "--log-verbose=1",
    )
    assert verbose.returncode == 1
    assert "Traceback" in verbose.stderr
    assert verbose.stderr.splitlines()[-1] == "error: failed to load all models: broken"


def test_a_command_line_error_is_one_line_and_where_help_is():
    result = run_cli("--no-such-flag")
    assert result.returncode == 1
    assert result.stderr == (
        "trionserve: error: unrecognized arguments: --no-such-flag\nsee trionserve --help\n"
    )


def test_help_shows_the_listening_flags_and_their_defaults():
    result = run_cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--http-port PORT port of the HTTP/REST API; 0: any free port (default 8000)" in text
    assert "--grpc-port PORT port of the gRPC API; 0: any free port (default 8001)" in text
    assert "--metrics-port PORT port of Prometheus /metrics" in text and "(default 8002)" in text
    assert "--http-address ADDRESS address the HTTP/REST API listens on (default 0.0.0.0" in text
    assert "--grpc-address ADDRESS address the gRPC API listens on (default 0.0.0.0" in text
    assert "GPU metrics are not collected" not in text
    assert "--allow-gpu-metrics BOOL report each GPU's utilization" in text


def test_startup_overview_and_ready_only_when_ready(tmp_path):
    server = ServerProcess(EXAMPLES)
    try:
        server.wait_ready(path="/v2/health/ready")
        output = server.output()
        assert re.search(r"\| simple +\| 1 +\| READY +\|", output)
        assert re.search(rf"\| HTTP +\| 127\.0\.0\.1:{server.http_port} +\|", output)
        assert re.search(rf"\| GRPC +\| 127\.0\.0\.1:{server.grpc_port} +\|", output)
        assert "server ready" in output
        # Triton's options table (core src/tritonserver.cc:2504), this server's values.
        assert re.search(r"\| server_id +\| triton +\|", output)
        assert re.search(r"\| model_control_mode +\| MODE_NONE +\|", output)
        assert re.search(
            rf"\| model_repository_path\[0\] +\| {re.escape(str(EXAMPLES))} +\|", output
        )
        assert re.search(r"\| strict_model_config +\| 0 +\|", output)
        # A plain start does not tell of loads joined (ensembles load their steps).
        info = [line for line in output.splitlines() if re.match(r"I\d{4} ", line)]
        assert not any("already in progress" in line for line in info)
        assert sum("model ready" in line for line in info) == len(list(EXAMPLES.iterdir()))
        assert not any("model state" in line for line in info)
        # Verbose level 1 (set at run time): an access-log line per request, with its outcome.
        inputs = [np.arange(16, dtype=np.int32).reshape(1, 16)] * 2
        http = httpclient.InferenceServerClient(server.http_url)
        assert http.update_log_settings({"log_verbose_level": 1})["log_verbose_level"] == 1
        # Triton's line format is the default, and the logging extension says so.
        assert http.get_log_settings()["log_format"] == "default"
        http_inputs = [httpclient.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in (0, 1)]
        for given, data in zip(http_inputs, inputs):
            given.set_data_from_numpy(data)
        http.infer("simple", http_inputs)
        http.close()
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        assert grpc.get_log_settings().settings["log_format"].string_param == "default"
        grpc_inputs = [grpcclient.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in (0, 1)]
        for given, data in zip(grpc_inputs, inputs):
            given.set_data_from_numpy(data)
        grpc.infer("simple", grpc_inputs)
        try:
            grpc.infer("absent", grpc_inputs)
        except Exception:
            pass
        # A tensor the server cannot decode (a BYTES element cut short): Triton's
        # Execute logs it as any failure (grpc/infer_handler.cc:987).
        malformed = grpcclient.InferInput("INPUT0", [1], "BYTES")
        malformed.set_data_from_numpy(np.array([b"abc"], dtype=np.object_))
        malformed._raw_content = b"\x05\x00\x00\x00ab"
        with pytest.raises(Exception, match="BYTES|byte"):
            grpc.infer("identity_bytes", [malformed], request_id="cut-short")
        answers: queue.Queue = queue.Queue()
        grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
        grpc.async_stream_infer("simple", grpc_inputs)
        result, error = answers.get(timeout=30)
        assert error is None, error
        grpc.stop_stream()
        grpc.close()
        assert server.stop() == 0
        output = server.output()
        assert re.search(
            r"infer response protocol=HTTP model=simple status=200 latency_ms=[\d.]+", output
        )
        assert re.search(
            r"infer response protocol=GRPC model=simple id=\S* status=OK latency_ms=[\d.]+",
            output,
        )
        assert re.search(r"protocol=GRPC model=absent id=\S* status=NOT_FOUND", output)
        assert re.search(
            r"infer response protocol=GRPC stream model=simple id=\S* status=OK latency_ms=[\d.]+",
            output,
        )
        # Triton's verbose lines: each HTTP request, and a request that failed
        # (server src/http_server.cc:4857, grpc/infer_handler.cc:1030).
        assert re.search(r"HTTP request: 2 /v2/models/simple/infer", output)
        assert "[request id: <id_unknown>] Infer failed: " in output
        assert "[request id: cut-short] Infer failed: " in output
    finally:
        server.close()

    failed = ServerProcess(EXAMPLES, broken_repository(tmp_path), args=["--exit-on-error=false"])
    try:
        failed.wait_ready()
        assert failed.status("/v2/health/ready") == 400
        output = failed.output()
        assert "server ready" not in output
        assert re.search(r"\| broken +\| +\| UNAVAILABLE +\| .*max_batch_size", output)
        assert re.search(
            r'^E\d{4} .*\] "server started but not ready: models failed to load '
            r"failed=\['broken'\]",
            output,
            re.M,
        )
        assert failed.stop() == 0
    finally:
        failed.close()


def test_a_python_model_whose_initialize_raises_is_an_error(tmp_path):
    model = tmp_path / "raises"
    shutil.copytree(EXAMPLES / "add_sub_python", model)
    config = (model / "config.pbtxt").read_text().replace('"add_sub_python"', '"raises"')
    (model / "config.pbtxt").write_text(config)
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('cannot initialize')\n"
    )
    result = run_cli(
        f"--model-repository={tmp_path}",
        "--allow-http=false",
        "--allow-grpc=false",
        "--allow-metrics=false",
    )
    assert result.returncode == 1
    assert re.search(
        r'^E\d{4} .*\] "model load failed model=raises reason=.*cannot initialize',
        result.stderr,
        re.M,
    ), result.stderr
    assert "model unavailable" not in result.stderr + result.stdout
    assert result.stderr.splitlines()[-1] == "error: failed to load all models: raises"


def test_an_address_that_cannot_be_used_names_its_flag():
    result = run_cli(
        f"--model-repository={EXAMPLES}",
        "--http-address=no-such-host.invalid",
        f"--http-port={free_port()}",
        "--allow-grpc=false",
        "--allow-metrics=false",
    )
    assert result.returncode == 1
    last = result.stderr.splitlines()[-1]
    assert last.startswith(
        "error: failed to start HTTP service: cannot resolve address 'no-such-host.invalid': "
    ), result.stderr
    assert last.endswith("(--http-address)")
    assert "Traceback" not in result.stderr
