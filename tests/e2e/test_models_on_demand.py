"""Models loaded on first request, under a memory budget, through tritonclient.

One real server (``--model-control-mode=explicit --model-load-on-demand=true
--model-memory-limit=host:100MiB``) over a repository written here: copies of the
ONNX ``simple`` model that declare what they take (``model_memory``), a Python
model whose load takes a while, one whose load fails, a pinned one, an ensemble
and a BLS caller. Clients are tritonclient over HTTP and gRPC; what a client
cannot see (how many loads ran) is read from the server's metrics and JSON log.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.helpers import cli_usage, expect_error, metric_samples, run_cli, simple_inputs, wait_for
from tests.repository import python_model
from tests.serverproc import EXAMPLES, ServerProcess

MIB = 1 << 20

SLOW_LOAD = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep({seconds})

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)
            ]))
        return responses
"""

FAILING_LOAD = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("this model cannot load (on purpose)")

    def execute(self, requests):
        return []
"""

BLS = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            called = pb_utils.InferenceRequest(
                model_name="bls_target",
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=request.inputs(),
            ).exec()
            if called.has_error():
                responses.append(pb_utils.InferenceResponse(error=called.error()))
            else:
                responses.append(pb_utils.InferenceResponse(called.output_tensors()))
        return responses
"""

IN_PROCESS = 'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'


def simple_copy(repository: Path, name: str, memory: str | None = None, extra: str = "") -> None:
    target = repository / name
    shutil.copytree(EXAMPLES / "simple", target)
    config = target / "config.pbtxt"
    text = config.read_text().replace('name: "simple"', f'name: "{name}"')
    if memory is not None:
        text += f'parameters {{ key: "model_memory" value: {{ string_value: "{memory}" }} }}\n'
    config.write_text(text + extra)


def add_sub_model(repository: Path, name: str, source: str, extra: str = "") -> None:
    """A Python model of ``source`` with add_sub_python's configuration, one instance."""
    config = (EXAMPLES / "add_sub_python" / "config.pbtxt").read_text()
    config = config.replace('name: "add_sub_python"', f'name: "{name}"')
    config = config.replace("count: 2", "count: 1")
    python_model(repository, name, config + extra, source)


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("on-demand")
    for name in ("lru_a", "lru_b", "lru_c"):
        simple_copy(root, name, "host:40MiB")
    simple_copy(root, "huge", "host:1GiB")
    simple_copy(
        root,
        "pinned",
        "host:10MiB",
        'parameters { key: "model_pinned" value: { string_value: "true" } }\n',
    )
    simple_copy(root, "simple", "host:1MiB")
    simple_copy(root, "bls_target", "host:1MiB")
    simple_copy(root, "asked_about", "host:1MiB")
    simple_copy(root, "configured", "host:1MiB")
    shutil.copytree(EXAMPLES / "simple_ensemble", root / "simple_ensemble")
    add_sub_model(root, "slow_load", SLOW_LOAD.format(seconds=1), IN_PROCESS)
    add_sub_model(root, "failing_load", FAILING_LOAD, IN_PROCESS)
    add_sub_model(root, "bls_caller", BLS, IN_PROCESS)
    return root


@pytest.fixture(scope="module")
def server(repository):
    process = ServerProcess(
        repository,
        args=[
            "--log-format=json",
            "--model-control-mode=explicit",
            "--model-load-on-demand=true",
            "--model-memory-limit=host:100MiB",
        ],
    )
    try:
        process.wait_ready()
        yield process
    finally:
        code = process.stop()
        process.close()
        assert code == 0, process.output()


def state(client, name: str) -> tuple[str, str]:
    rows = [r for r in client.get_model_repository_index() if r["name"] == name]
    return (rows[0].get("state", ""), rows[0].get("reason", "")) if rows else ("", "")


def log_events(server: ServerProcess, event: str, **match) -> list[dict]:
    found = []
    for line in server.output().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event and all(record.get(k) == v for k, v in match.items()):
            found.append(record)
    return found


def metric(server: ServerProcess, name: str, **labels) -> float:
    return metric_samples(server.metrics_port).get((name, tuple(sorted(labels.items()))), 0.0)


def check_simple(result, module=httpclient) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 1)


def test_a_request_loads_its_model_over_http_and_grpc(server):
    http = httpclient.InferenceServerClient(server.http_url)
    assert state(http, "simple") == ("", "")  # in the repository, never loaded
    check_simple(http.infer("simple", simple_inputs()))
    assert state(http, "simple") == ("READY", "")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    check_simple(grpc.infer("bls_target", simple_inputs(module=grpcclient)))
    assert http.is_model_ready("bls_target")
    assert metric(server, "trionserve_model_on_demand_loads_total", model="simple") == 1


def test_metadata_and_configuration_of_a_model_not_loaded_load_it(server):
    # perf_analyzer and tritonclient's examples ask before their first request.
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    metadata = grpc.get_model_metadata("asked_about")
    assert [t.name for t in metadata.inputs] == ["INPUT0", "INPUT1"]
    http = httpclient.InferenceServerClient(server.http_url)
    assert state(http, "asked_about") == ("READY", "")
    config = http.get_model_config("configured")
    assert config["name"] == "configured" and config["max_batch_size"] == 8
    assert state(http, "configured") == ("READY", "")
    expect_error(lambda: http.get_model_metadata("no_such_model"), "unknown model", 404)


def test_an_unknown_model_is_still_not_found(server):
    http = httpclient.InferenceServerClient(server.http_url)
    expect_error(lambda: http.infer("no_such_model", simple_inputs()), "unknown model", 404)


def test_concurrent_requests_share_one_load(server):
    results: list = []

    def client() -> None:
        http = httpclient.InferenceServerClient(server.http_url)
        try:
            results.append(http.infer("slow_load", simple_inputs()))
        except Exception as exc:  # collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 8
    for result in results:
        assert not isinstance(result, Exception), result
        check_simple(result)
    assert len(log_events(server, "model ready", model="slow_load")) == 1
    assert metric(server, "trionserve_model_on_demand_loads_total", model="slow_load") == 1
    waits = metric(server, "trionserve_model_load_wait_seconds_count")
    assert waits >= 8


def test_a_failed_load_answers_every_waiter_once_and_is_not_retried_at_once(server):
    errors: list = []

    def client() -> None:
        http = httpclient.InferenceServerClient(server.http_url)
        try:
            http.infer("failing_load", simple_inputs())
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(errors) == 5
    for error in errors:
        assert "this model cannot load (on purpose)" in error.message(), error.message()
        assert str(error.status()) == "400"
    # Within the backoff, a request gets the same error without another load.
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    expect_error(
        lambda: grpc.infer("failing_load", simple_inputs(module=grpcclient)),
        "cannot load (on purpose)",
        "INVALID_ARGUMENT",
    )
    assert len(log_events(server, "on-demand load failed", model="failing_load")) == 1
    # A request for a broken model does not make the server unready.
    assert httpclient.InferenceServerClient(server.http_url).is_server_ready()
    assert (
        metric(server, "trionserve_model_on_demand_load_failures_total", model="failing_load") == 1
    )


def test_a_wait_is_bounded_by_the_request_timeout(server, repository):
    add_sub_model(repository, "slower_load", SLOW_LOAD.format(seconds=2), IN_PROCESS)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    expect_error(
        lambda: grpc.infer("slower_load", simple_inputs(module=grpcclient), timeout=200_000),
        "Request timeout expired",
        "UNAVAILABLE",
    )
    # The load goes on for the requests that wait longer.
    check_simple(grpc.infer("slower_load", simple_inputs(module=grpcclient)))


def test_an_ensemble_loads_its_steps(server):
    http = httpclient.InferenceServerClient(server.http_url)
    result = http.infer("simple_ensemble", simple_inputs())
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
    assert state(http, "simple") == ("READY", "")


def test_a_bls_target_loads_when_first_called(server):
    http = httpclient.InferenceServerClient(server.http_url)
    check_simple(http.infer("bls_target", simple_inputs()))  # loaded, whatever ran before
    http.unload_model("bls_target")
    wait_for(lambda: state(http, "bls_target")[0] == "UNAVAILABLE", "bls_target unloaded")
    check_simple(http.infer("bls_caller", simple_inputs()))
    assert state(http, "bls_target") == ("READY", "")


def test_the_least_recently_used_model_is_evicted_to_make_room(server):
    http = httpclient.InferenceServerClient(server.http_url)
    check_simple(http.infer("lru_a", simple_inputs()))
    check_simple(http.infer("lru_b", simple_inputs()))
    check_simple(http.infer("lru_a", simple_inputs()))  # b is now the least recently used
    check_simple(http.infer("lru_c", simple_inputs()))
    assert state(http, "lru_b") == ("UNAVAILABLE", "evicted: least recently used to load 'lru_c'")
    assert state(http, "lru_a")[0] == "READY"
    assert metric(server, "trionserve_model_evictions_total", model="lru_b", reason="lru") == 1
    (evicted,) = log_events(server, "model evicted", model="lru_b")
    assert "host 40.0 MiB" in evicted["charge"]
    samples = metric_samples(server.metrics_port)
    used = samples[("trionserve_memory_budget_used_bytes", (("device", "host"),))]
    assert used <= 100 * MIB
    assert samples[("trionserve_memory_budget_bytes", (("device", "host"),))] == 100 * MIB
    # The evicted model loads again on its next request.
    check_simple(http.infer("lru_b", simple_inputs()))


def test_a_model_bigger_than_the_budget_is_a_clear_error(server):
    http = httpclient.InferenceServerClient(server.http_url)
    error = expect_error(lambda: http.infer("huge", simple_inputs()), "memory budget", 400)
    message = error.message()
    assert "host 1.0 GiB" in message and "host 100.0 MiB" in message
    assert "more than the whole memory budget" in message
    # The server goes on serving.
    check_simple(http.infer("simple", simple_inputs()))


def test_a_pinned_model_is_never_evicted(server):
    http = httpclient.InferenceServerClient(server.http_url)
    check_simple(http.infer("pinned", simple_inputs()))
    for name in ("lru_a", "lru_b", "lru_c", "lru_a"):
        check_simple(http.infer(name, simple_inputs()))
    assert state(http, "pinned") == ("READY", "")


def _start_error(repository: Path, *flags: str) -> tuple[int, str]:
    done = run_cli(f"--model-repository={repository}", *flags, timeout=120)
    return done.returncode, done.stderr


def test_a_budget_that_does_not_parse_is_refused_at_start(repository):
    # Usage errors, found as the command line is read (tests.helpers.cli_usage); the GPU
    # that is not there is found as the server starts.
    refused = cli_usage(f"--model-repository={repository}", "--model-memory-limit=host:lots")
    assert refused.returncode == 1
    assert "--model-memory-limit" in refused.stderr and "'lots'" in refused.stderr
    refused = cli_usage(f"--model-repository={repository}", "--model-load-on-demand=true")
    assert refused.returncode == 1 and "--model-control-mode=explicit" in refused.stderr
    code, stderr = _start_error(
        repository,
        "--model-memory-limit=gpu:99:1GiB",
        "--http-port=0",
        "--grpc-port=0",
        "--metrics-port=0",
    )
    assert code == 1
    assert "--model-memory-limit=gpu:99:1GiB: there is no gpu:99 here" in stderr


def test_a_start_up_model_that_does_not_fit_stops_the_start(repository):
    code, stderr = _start_error(
        repository,
        "--model-control-mode=explicit",
        "--load-model=huge",
        "--model-memory-limit=host:100MiB",
        "--http-port=0",
        "--grpc-port=0",
        "--metrics-port=0",
    )
    assert code == 1, stderr
    assert "failed to load all models: huge" in stderr


def test_idle_models_unload_and_start_up_models_stay(repository):
    process = ServerProcess(
        repository,
        args=[
            "--log-format=json",
            "--model-control-mode=explicit",
            "--load-model=lru_a",
            "--model-load-on-demand=true",
            "--model-idle-unload-secs=0.5",
        ],
    )
    try:
        process.wait_ready()
        http = httpclient.InferenceServerClient(process.http_url)
        check_simple(http.infer("lru_b", simple_inputs()))
        wait_for(
            lambda: state(http, "lru_b") == ("UNAVAILABLE", "idle for 0.5 s"),
            "lru_b unloaded as idle",
        )
        assert state(http, "lru_a") == ("READY", "")  # loaded at start-up: stays
        assert (
            metric(process, "trionserve_model_evictions_total", model="lru_b", reason="idle") == 1
        )
        # Used again, it loads again.
        check_simple(http.infer("lru_b", simple_inputs()))
    finally:
        code = process.stop()
        process.close()
    assert code == 0, process.output()


def test_outside_explicit_mode_a_budget_refuses_and_evicts_nothing(tmp_path):
    simple_copy(tmp_path, "lru_a", "host:40MiB")
    process = ServerProcess(
        tmp_path,
        args=[
            "--model-control-mode=poll",
            "--repository-poll-secs=0.1",
            "--model-memory-limit=host:100MiB",
        ],
    )
    try:
        process.wait_ready()
        http = httpclient.InferenceServerClient(process.http_url)
        simple_copy(tmp_path, "lru_b", "host:40MiB")  # loaded by POLL after the start
        wait_for(lambda: state(http, "lru_b")[0] == "READY", "lru_b loaded")
        simple_copy(tmp_path, "lru_c", "host:40MiB")  # POLL loads it: it does not fit
        wait_for(lambda: state(http, "lru_c")[0] == "UNAVAILABLE", "lru_c refused")
        assert "does not fit the memory budget" in state(http, "lru_c")[1]
        assert "(kept outside explicit mode)" in state(http, "lru_c")[1]
        assert state(http, "lru_a") == ("READY", "") and state(http, "lru_b") == ("READY", "")
        check_simple(http.infer("lru_a", simple_inputs()))
    finally:
        process.stop()
        process.close()


LOADS_IN_INITIALIZE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.load_model("{target}")

    def execute(self, requests):
        return [
            pb_utils.InferenceRequest(
                model_name="{target}",
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=request.inputs(),
            ).exec()
            for request in requests
        ]
"""


@pytest.mark.parametrize("mode", ["stub", "in_process"])
def test_a_model_that_loads_another_in_initialize_loads_under_a_budget(tmp_path, mode):
    # Its load is measured while its initialize loads the other model: that load
    # must not wait for the measurement it is part of.
    simple_copy(tmp_path, "inner", "host:1MiB")
    extra = IN_PROCESS if mode == "in_process" else ""
    add_sub_model(tmp_path, "outer", LOADS_IN_INITIALIZE.format(target="inner"), extra)
    process = ServerProcess(
        tmp_path,
        args=[
            "--model-control-mode=explicit",
            "--model-load-on-demand=true",
            "--model-memory-limit=host:1GiB",
        ],
    )
    try:
        process.wait_ready()
        http = httpclient.InferenceServerClient(process.http_url, network_timeout=60)
        check_simple(http.infer("outer", simple_inputs()))
        assert state(http, "inner") == ("READY", "")
        # Known as part of the outer load, not waited for behind it until the
        # fallback (NESTED_WAIT_SECS) gives up on it.
        assert "loading without measuring" not in process.output()
    finally:
        process.stop()
        process.close()
