"""Command-line behaviour of the real ``trionserve`` process."""

from __future__ import annotations

import pytest
import tritonclient.http as httpclient

from tests.helpers import cli_usage, run_cli
from tests.serverproc import EXAMPLES, ServerProcess


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ([f"--model-repository={EXAMPLES}", "--http-port=99999"], "port must be in 0..65535"),
        ([f"--model-repository={EXAMPLES}", "--model-control-mode=sometimes"], "invalid choice"),
        (
            [f"--model-repository={EXAMPLES}", "--strict-model-config=maybe"],
            "expected true or false",
        ),
        ([], "--model-repository must be specified"),
        (
            [
                f"--model-repository={EXAMPLES}",
                "--model-control-mode=explicit",
                "--load-model=*",
                "--load-model=simple",
            ],
            "cannot be combined",
        ),
    ],
)
def test_usage_errors(args, fragment):
    result = cli_usage(*args)
    assert result.returncode == 1  # tritonserver main.cc: exit(1)
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_repository_is_a_clear_error(tmp_path):
    result = run_cli(f"--model-repository={tmp_path / 'absent'}", "--allow-http=false")
    assert result.returncode == 1
    assert "absent" in result.stderr
    assert "Traceback" not in result.stderr


def broken_repository(tmp_path):
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text(
        'name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: -3\n'
    )
    return tmp_path


def test_exit_on_error_when_a_model_fails(tmp_path):
    repository = broken_repository(tmp_path)
    server = ServerProcess(EXAMPLES, repository)
    try:
        code = server.wait_exit(60)
        assert code == 1
        output = server.output()
        assert "failed to load all models" in output
        assert "broken" in output
    finally:
        server.close()


def test_failed_model_is_unavailable_and_others_serve(tmp_path):
    repository = broken_repository(tmp_path)
    server = ServerProcess(EXAMPLES, repository, args=["--exit-on-error=false"])
    try:
        server.wait_ready()
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.is_server_live()
        assert not client.is_server_ready()  # strict readiness: a model failed
        assert client.is_model_ready("simple")
        assert not client.is_model_ready("broken")
        rows = {row["name"]: row for row in client.get_model_repository_index()}
        assert rows["broken"]["state"] == "UNAVAILABLE"
        assert "max_batch_size" in rows["broken"]["reason"]
        client.close()
        assert server.stop() == 0
    finally:
        server.close()
