"""Model control through tritonclient against a real server: NONE, EXPLICIT and POLL.

Tests wait on what a client can observe (the repository index, readiness, the
server's JSON log) with bounded loops; POLL servers poll every 0.1 s.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.helpers import expect_error, simple_inputs, wait_for
from tests.serverproc import EXAMPLES, ServerProcess
from tests.unit.test_model_control_support import (
    copy_example,
    index_rows,
    slow_model,
    states,
)

POLL_SECS = "0.1"


def start(*repositories: Path, args: list[str]) -> ServerProcess:
    server = ServerProcess(*repositories, args=["--log-format=json", *args])
    try:
        server.wait_ready()
    except BaseException:
        server.close()
        raise
    return server


def stop(server: ServerProcess) -> None:
    try:
        code = server.stop()
        assert code == 0, f"server exited with {code}:\n{server.output()}"
    finally:
        server.close()


def events(server: ServerProcess, event: str | None, **match) -> list[dict]:
    """The server's log records of ``event`` (any event: None) matching ``match``, in
    log order."""
    found = []
    for line in server.output().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if event in (None, record.get("event")) and all(
            record.get(k) == v for k, v in match.items()
        ):
            found.append(record)
    return found


def ready_transitions(server: ServerProcess, model: str) -> int:
    return len(events(server, "model state", model=model, to="READY"))


def infer_simple(client, name: str, value: int = 1):
    result = client.infer(name, simple_inputs(np.full((1, 16), value, np.int32)))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), value + 1))
    return result


def slow_infer(url: str, name: str, iterations: int):
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        data = np.array([iterations], dtype=np.int64)
        infer_input = httpclient.InferInput("ITERS", [1], "INT64")
        infer_input.set_data_from_numpy(data)
        return float(client.infer(name, [infer_input]).as_numpy("OUT")[0])
    finally:
        client.close()


def post(server: ServerProcess, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", path, body=json.dumps(body))
        response = connection.getresponse()
        data = response.read()
        return response.status, (json.loads(data) if data else {})
    finally:
        connection.close()


class SteadyLoad:
    """Requests to one model back to back from a few threads; counts the outcomes."""

    def __init__(self, url: str, name: str, threads: int = 3) -> None:
        self.url, self.name = url, name
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop) for _ in range(threads)]

    def _loop(self) -> None:
        client = httpclient.InferenceServerClient(self.url, network_timeout=30)
        try:
            while not self._stop.is_set():
                try:
                    infer_simple(client, self.name, 3)
                    with self._lock:
                        self.ok += 1
                except Exception as exc:  # every failure counts, whatever it is
                    with self._lock:
                        self.failures.append(repr(exc))
        finally:
            client.close()

    def __enter__(self) -> SteadyLoad:
        for thread in self._threads:
            thread.start()
        wait_for(lambda: self.ok >= 10, "the first requests")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def touch(path: Path) -> None:
    """Give a file a new mtime, as copying a new model file over it would."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


# -- NONE ------------------------------------------------------------------------------


def test_none_mode_loads_all_ignores_changes_and_refuses_control(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    copy_example(one, "simple")
    broken = copy_example(one, "simple", "broken")
    (broken / "config.pbtxt").write_text('name: "broken"\nmax_batch_size: -1\n')
    copy_example(one, "identity_fp32", "dup")
    copy_example(two, "identity_fp32", "dup")  # one name in two repositories
    server = start(one, two, args=["--exit-on-error=false", f"--repository-poll-secs={POLL_SECS}"])
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert states(client, "simple") == {"1": "READY"}
        (row,) = index_rows(client, "broken")
        assert row["state"] == "UNAVAILABLE" and "max_batch_size" in row["reason"]
        assert not client.is_server_ready()  # a model failed to load (strict readiness)
        (row,) = index_rows(client, "dup")
        assert row["state"] == "UNAVAILABLE"
        assert "multiple model repositories" in row["reason"]
        assert str(one) in row["reason"] and str(two) in row["reason"]
        assert not client.is_model_ready("dup")

        error = expect_error(lambda: client.load_model("simple"), "model control mode NONE")
        assert error.status() == "503"
        expect_error(lambda: client.unload_model("simple"), "model control mode NONE")

        copy_example(one, "simple", "added")
        shutil.rmtree(one / "simple" / "1")
        # Nothing is watching: after many poll intervals the change is still ignored.
        time.sleep(0.5)
        assert states(client, "added") == {"": ""}  # listed by the index, never loaded
        assert states(client, "simple") == {"1": "READY"}
        infer_simple(client, "simple")
    finally:
        client.close()
        stop(server)


# -- EXPLICIT -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def explicit(tmp_path_factory):
    repo = tmp_path_factory.mktemp("explicit")
    copy_example(repo, "simple")
    copy_example(repo, "identity_fp32")
    copy_example(repo, "simple", "reloaded")
    slow_model(repo, "slow", count=2)
    server = start(
        repo,
        args=[
            "--model-control-mode=explicit",
            "--load-model=simple",
            "--load-model=reloaded",
            "--log-verbose=1",
        ],
    )
    server.repository = repo
    yield server
    stop(server)


@pytest.fixture
def explicit_client(explicit):
    client = httpclient.InferenceServerClient(explicit.http_url, network_timeout=60)
    yield client
    client.close()


def test_explicit_loads_only_the_named_models_then_follows_the_api(explicit_client):
    client = explicit_client
    assert states(client, "simple") == {"1": "READY"}
    assert states(client, "identity_fp32") == {"": ""}  # in the repository, not loaded
    assert not client.is_model_ready("identity_fp32")
    client.load_model("identity_fp32")
    assert client.is_model_ready("identity_fp32")
    assert states(client, "identity_fp32") == {"1": "READY"}
    client.unload_model("identity_fp32")
    assert not client.is_model_ready("identity_fp32")
    assert client.get_model_repository_index()  # still answers
    (row,) = [r for r in client.get_model_repository_index() if r["name"] == "identity_fp32"]
    assert (row["state"], row["reason"]) == ("UNAVAILABLE", "unloaded")
    expect_error(lambda: client.load_model("no_such_model"), "no_such_model")
    client.unload_model("no_such_model")  # unloading what is not loaded succeeds


def test_repository_index_ready_filter(explicit):
    status, rows = post(explicit, "/v2/repository/index", {"ready": True})
    assert status == 200
    assert {r["name"] for r in rows} >= {"simple"}
    assert all(r["state"] == "READY" for r in rows)
    assert "identity_fp32" not in {r["name"] for r in rows}
    status, reply = post(explicit, "/v2/repository/index", {"ready": "yes"})
    assert status == 400 and "'ready'" in reply["error"]


def test_explicit_load_with_a_config_override(explicit_client):
    client = explicit_client
    config = client.get_model_config("simple")
    config["max_batch_size"] = 4
    # Its config lists inputs and outputs, so ONNX auto-complete adds no dynamic
    # batcher (onnxruntime_backend onnxruntime.cc AutoCompleteConfig skips it).
    assert "dynamic_batching" not in config
    client.load_model("simple", config=json.dumps(config))
    assert client.get_model_config("simple")["max_batch_size"] == 4
    expect_error(
        lambda: client.infer("simple", simple_inputs(np.ones((8, 16), np.int32))),
        "batch-size must be <= 4",
    )
    client.load_model("simple")  # back to config.pbtxt
    assert client.get_model_config("simple")["max_batch_size"] == 8
    client.infer("simple", simple_inputs(np.ones((8, 16), np.int32)))
    expect_error(
        lambda: client.load_model("simple", config='{"max_batch_size": "x"}'),
        "invalid config override",
    )
    infer_simple(client, "simple")  # a failed reload leaves the model serving


def test_explicit_load_with_file_override(explicit, explicit_client):
    """Triton's `file:<version>/<name>` load parameters: a model from the request alone."""
    client = explicit_client
    model = base64.b64encode((EXAMPLES / "simple" / "1" / "model.onnx").read_bytes()).decode()
    config = client.get_model_config("simple")
    config["name"] = "from_files"
    body = {"parameters": {"config": json.dumps(config), "file:1/model.onnx": model}}
    status, reply = post(explicit, "/v2/repository/models/from_files/load", body)
    assert status == 200, reply
    infer_simple(client, "from_files", 5)
    assert not (explicit.repository / "from_files").exists()  # nothing written there
    assert states(client, "from_files") == {"1": "READY"}

    status, reply = post(
        explicit,
        "/v2/repository/models/from_files/load",
        {"parameters": {"file:1/model.onnx": model}},
    )
    # Triton: INTERNAL "failed to poll from model repository" (the override is
    # localized while the model is polled); the reason follows here.
    assert status == 500 and "failed to poll from model repository" in reply["error"]
    assert "'config' must be specified" in reply["error"]
    status, reply = post(
        explicit,
        "/v2/repository/models/from_files/load",
        {"parameters": {"config": json.dumps(config), "file:../../escape": model}},
    )
    assert status == 500 and "must stay within model directory" in reply["error"]
    infer_simple(client, "from_files", 6)  # failed loads leave it serving
    client.unload_model("from_files")
    assert not client.is_model_ready("from_files")


def test_explicit_concurrent_loads_of_one_model_load_it_once(explicit, explicit_client):
    """Triton #7018: two concurrent explicit loads of one model loaded it twice."""
    before = ready_transitions(explicit, "identity_fp32")
    threads = [
        threading.Thread(
            target=lambda: httpclient.InferenceServerClient(explicit.http_url).load_model(
                "identity_fp32"
            )
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert explicit_client.is_model_ready("identity_fp32")
    assert ready_transitions(explicit, "identity_fp32") == before + 1


def test_explicit_reload_under_steady_load_has_no_failed_request(explicit, explicit_client):
    model_file = explicit.repository / "reloaded" / "1" / "model.onnx"
    before = ready_transitions(explicit, "reloaded")
    with SteadyLoad(explicit.http_url, "reloaded") as load:
        for i in range(1, 4):
            touch(model_file)
            explicit_client.load_model("reloaded")
            assert ready_transitions(explicit, "reloaded") == before + i  # a real reload
            ok = load.ok
            wait_for(lambda ok=ok: load.ok > ok + 5, "requests after the reload")
    assert load.failures == []
    assert load.ok > 30


def test_unload_waits_for_in_flight_requests(explicit, explicit_client):
    """The unload ends (the version becomes UNAVAILABLE) only after the request in
    flight has its answer. The order is the server's log order: the two answers
    reach the test's threads in either order once both are sent."""
    client = explicit_client
    client.load_model("slow")
    seen = len(events(explicit, "infer request", model="slow"))
    result: dict[str, float] = {}

    def run() -> None:
        result["out"] = slow_infer(explicit.http_url, "slow", 400_000)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(
        lambda: len(events(explicit, "infer request", model="slow")) > seen,
        "the request to reach the server",
    )
    client.unload_model("slow")
    thread.join(30)
    assert result["out"] == 400_000.0
    order = [
        (record["event"], record.get("to"))
        for record in events(explicit, None, model="slow")
        if record["event"] == "infer response" or record.get("to") == "UNAVAILABLE"
    ]
    assert order[-2:] == [("infer response", None), ("model state", "UNAVAILABLE")], order
    assert not client.is_model_ready("slow")


# -- POLL ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def poll(tmp_path_factory):
    repo = tmp_path_factory.mktemp("poll")
    copy_example(repo, "simple")
    server = start(
        repo,
        args=[
            "--model-control-mode=poll",
            f"--repository-poll-secs={POLL_SECS}",
            "--log-verbose=1",
        ],
    )
    server.repository = repo
    yield server
    stop(server)


@pytest.fixture
def poll_client(poll):
    client = httpclient.InferenceServerClient(poll.http_url, network_timeout=60)
    yield client
    client.close()


def test_poll_refuses_the_load_api(poll_client):
    expect_error(lambda: poll_client.load_model("simple"), "polling is enabled")
    expect_error(lambda: poll_client.unload_model("simple"), "polling is enabled")
    assert poll_client.is_model_ready("simple")


def test_poll_adds_and_removes_a_model(poll, poll_client):
    """MLServer #104 / KServe: no poll mode at all. Here a directory is a model."""
    client = poll_client
    copy_example(poll.repository, "simple", "added")
    wait_for(lambda: states(client, "added") == {"1": "READY"}, "the added model to load")
    infer_simple(client, "added")
    shutil.rmtree(poll.repository / "added")
    wait_for(lambda: states(client, "added") == {"1": "UNAVAILABLE"}, "the model to unload")
    assert not client.is_model_ready("added")


def test_poll_adds_and_removes_versions(poll, poll_client):
    client = poll_client
    model = copy_example(poll.repository, "simple", "versioned")
    wait_for(lambda: states(client, "versioned") == {"1": "READY"}, "version 1")
    shutil.copytree(model / "1", model / "2")
    wait_for(
        lambda: states(client, "versioned") == {"1": "UNAVAILABLE", "2": "READY"},
        "version 2 to replace version 1 (latest 1)",
    )
    assert infer_simple(client, "versioned").get_response()["model_version"] == "2"
    shutil.rmtree(model / "2")
    wait_for(
        lambda: states(client, "versioned") == {"1": "READY", "2": "UNAVAILABLE"},
        "version 1 to come back",
    )
    assert infer_simple(client, "versioned").get_response()["model_version"] == "1"


def test_poll_config_edit_reloads(poll, poll_client):
    client = poll_client
    model = copy_example(poll.repository, "simple", "edited")
    wait_for(lambda: client.is_model_ready("edited"), "the model to load")
    config = model / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 2"))
    wait_for(lambda: client.get_model_config("edited")["max_batch_size"] == 2, "the new config")
    expect_error(
        lambda: client.infer("edited", simple_inputs(np.ones((4, 16), np.int32))),
        "batch-size must be <= 2",
    )


def test_poll_label_file_edit_reloads(poll, poll_client):
    client = poll_client
    model = copy_example(poll.repository, "simple", "labelled")
    config = model / "config.pbtxt"
    config.write_text(
        config.read_text().replace(
            'name: "OUTPUT0"', 'name: "OUTPUT0"\n    label_filename: "labels.txt"'
        )
    )
    (model / "labels.txt").write_text("\n".join(f"old{i}" for i in range(16)) + "\n")
    wait_for(lambda: client.is_model_ready("labelled"), "the model to load")

    def top_label() -> str:
        data = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = simple_inputs(np.zeros((1, 16), np.int32))
        inputs[0].set_data_from_numpy(data)
        output = httpclient.InferRequestedOutput("OUTPUT0", class_count=1)
        value = client.infer("labelled", inputs, outputs=[output]).as_numpy("OUTPUT0")
        item = value.reshape(-1)[0]
        return (item.decode() if isinstance(item, bytes) else str(item)).split(":")[-1]

    assert top_label() == "old15"
    (model / "labels.txt").write_text("\n".join(f"new{i}" for i in range(16)) + "\n")
    wait_for(lambda: top_label() == "new15", "the new labels")


def test_poll_never_loads_a_partially_copied_model(poll, poll_client):
    """Triton #356: POLL picked up partially copied files."""
    client = poll_client
    source = (EXAMPLES / "simple" / "1" / "model.onnx").read_bytes()
    target = poll.repository / "copying"
    (target / "1").mkdir(parents=True)
    config = (EXAMPLES / "simple" / "config.pbtxt").read_text().replace('"simple"', '"copying"')
    (target / "config.pbtxt").write_text(config)
    chunk = max(1, len(source) // 40)
    with open(target / "1" / "model.onnx", "wb") as out:
        for start in range(0, len(source), chunk):
            out.write(source[start : start + chunk])
            out.flush()
            assert states(client, "copying") == {"": ""}  # never loaded, never tried
            time.sleep(0.01)  # a slow copy: several writes between two polls
    wait_for(lambda: states(client, "copying") == {"1": "READY"}, "the complete model")
    infer_simple(client, "copying")
    assert events(poll, "model load failed", model="copying") == []
    assert ready_transitions(poll, "copying") == 1


def test_poll_broken_new_version_keeps_the_old_one_serving(poll, poll_client):
    client = poll_client
    model = copy_example(poll.repository, "simple", "brokenv")
    wait_for(lambda: client.is_model_ready("brokenv"), "the model to load")
    (model / "2").mkdir()
    (model / "2" / "model.onnx").write_bytes(b"this is not an onnx file")
    # Auto-complete reads the newest version's file, so the whole reload fails: the
    # index gives the reason beside version 1, which keeps serving.
    rows = wait_for(
        lambda: [r for r in index_rows(client, "brokenv") if r.get("reason")],
        "the reason of the failed reload",
    )
    assert "brokenv/2/model.onnx" in rows[0]["reason"]
    assert states(client, "brokenv")["1"] == "READY"
    assert client.is_server_ready()  # every wanted version of the old set serves
    assert infer_simple(client, "brokenv").get_response()["model_version"] == "1"


def test_poll_reload_under_steady_load_has_no_failed_request(poll, poll_client):
    """Triton #2076: a reload unloaded before loading. Here no request fails."""
    model = copy_example(poll.repository, "simple", "steady")
    wait_for(lambda: poll_client.is_model_ready("steady"), "the model to load")
    with SteadyLoad(poll.http_url, "steady") as load:
        for i in range(1, 4):
            touch(model / "1" / "model.onnx")
            wait_for(lambda i=i: ready_transitions(poll, "steady") == 1 + i, f"reload {i}")
            ok = load.ok
            wait_for(lambda ok=ok: load.ok > ok + 5, "requests after the reload")
    assert load.failures == []
    assert load.ok > 30


def test_poll_model_deleted_while_requests_run(poll, poll_client):
    slow_model(poll.repository, "slowdel", count=3)
    wait_for(lambda: poll_client.is_model_ready("slowdel"), "the model to load")
    seen = len(events(poll, "infer request", model="slowdel"))
    results: list[float] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(slow_infer(poll.http_url, "slowdel", 300_000))
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    wait_for(
        lambda: len(events(poll, "infer request", model="slowdel")) >= seen + 3,
        "the requests to reach the server",
    )
    shutil.rmtree(poll.repository / "slowdel")
    wait_for(lambda: not poll_client.is_model_ready("slowdel"), "the model to unload")
    for thread in threads:
        thread.join(30)
    assert results == [300_000.0] * 3


def test_poll_instance_count_change_does_not_reload(poll, poll_client, tmp_path):
    """The seed's case: an editor's swap file beside config.pbtxt made Triton fully
    reload a model whose instance count alone changed."""
    client = poll_client
    staging = copy_example(tmp_path, "simple", "scaled")  # moved in whole, below
    config = staging / "config.pbtxt"
    config.write_text(config.read_text() + "instance_group [ { kind: KIND_CPU count: 1 } ]\n")
    model = Path(shutil.move(staging, poll.repository / "scaled"))
    wait_for(lambda: client.is_model_ready("scaled"), "the model to load")
    (model / ".config.pbtxt.swp").write_bytes(b"\0" * 4096)
    config = model / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 1", "count: 3"))
    wait_for(
        lambda: client.get_model_config("scaled")["instance_group"][0]["count"] == 3,
        "the new instance count",
    )
    assert ready_transitions(poll, "scaled") == 1  # executors added, no reload
    assert events(poll, "model instances changed", model="scaled")
    infer_simple(client, "scaled")
