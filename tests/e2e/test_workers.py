"""--workers N: a supervisor and worker processes sharing the ports with SO_REUSEPORT.

Real processes on free loopback ports, real tritonclient. Which worker served a
connection is read from the workers themselves: the supervisor logs each worker's
pid and private metrics port ("worker ready"), and each worker's own
``nv_inference_count`` says how many inferences it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import time

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.helpers import cli_usage, metric_samples, simple_inputs, tcp_sockets
from tests.serverproc import EXAMPLES, ServerProcess
from trionserve.observability.aggregate import merge_expositions
from trionserve.observability.exposition import exposition_text
from trionserve.workers import parse_workers

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """`simple` and the sequence model `accumulate` (both ONNX: quick to load)."""
    root = tmp_path_factory.mktemp("workers-repo")
    for name in ("simple", "accumulate"):
        shutil.copytree(EXAMPLES / name, root / name)
    return root


def _events(proc: ServerProcess) -> list[dict]:
    events = []
    for line in proc.output().splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return events


def _wait_for(proc: ServerProcess, predicate, what: str, timeout: float = 90.0):
    """Poll the server's log until ``predicate(events)`` returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate(_events(proc))
        if found:
            return found
        if proc.process.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no {what} in the server log:\n{proc.output()[-5000:]}")


def _ready_workers(events: list[dict], count: int) -> dict[int, dict] | None:
    """The latest "worker ready" event of each worker, once all ``count`` have one."""
    ready = {e["worker"]: e for e in events if e.get("event") == "worker ready"}
    return ready if len(ready) == count else None


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on."""
    return {port for port, state in tcp_sockets(pid) if state == "0A"}  # 0A: LISTEN


def _start(repository, *args: str, workers: int = 2) -> ServerProcess:
    proc = ServerProcess(repository, args=["--log-format=json", *args], workers=workers)
    proc.wait_ready()
    return proc


def _infer_on_fresh_connections(proc: ServerProcess, http: int, grpc: int = 0) -> None:
    """``http`` + ``grpc`` inferences of `simple`, each on a new client (connection)."""
    for _ in range(http):
        client = httpclient.InferenceServerClient(proc.http_url)
        try:
            result = client.infer("simple", simple_inputs())
            assert result.as_numpy("OUTPUT0")[0, 3] == 4
        finally:
            client.close()
    for _ in range(grpc):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.grpc_port}")
        try:
            result = client.infer("simple", simple_inputs(module=grpcclient))
            assert result.as_numpy("OUTPUT0")[0, 3] == 4
        finally:
            client.close()


SIMPLE_COUNT = ("nv_inference_count", (("model", "simple"), ("version", "1")))


def test_workers_share_the_ports_and_metrics_add_up(repository):
    proc = _start(repository)
    try:
        ready = _wait_for(proc, lambda events: _ready_workers(events, 2), "two ready workers")
        pids = {event["pid"] for event in ready.values()}
        assert len(pids) == 2 and proc.process.pid not in pids
        # Each worker reported the private ports it had bound itself: they are
        # listening sockets of that worker's process, not of the supervisor's.
        supervisor_ports = _listening_ports(proc.process.pid)
        for event in ready.values():
            reported = {int(event[key].rsplit(":", 1)[1]) for key in ("metrics", "statistics")}
            assert reported <= _listening_ports(event["pid"]), event
            assert not reported & supervisor_ports, event

        _infer_on_fresh_connections(proc, http=40, grpc=20)

        per_worker = {
            index: metric_samples(int(event["metrics"].rsplit(":", 1)[1]))[SIMPLE_COUNT]
            for index, event in ready.items()
        }
        # Both workers served some of the fresh connections, and no inference is lost.
        assert all(count > 0 for count in per_worker.values()), per_worker
        assert sum(per_worker.values()) == 60
        merged = metric_samples(proc.metrics_port)
        assert merged[SIMPLE_COUNT] == 60
        assert merged[("nv_inference_request_success", SIMPLE_COUNT[1])] == 60
        assert merged[("trionserve_workers_ready", ())] == 2

        # The statistics extension counts both workers' requests too, whichever
        # worker a client asking for them lands on (perf_analyzer reads them on a
        # connection of its own at every measurement window).
        _assert_statistics_count(proc, 60)

        # The sequence model is reported once (by worker 0), naming it.
        warnings = [e for e in _events(proc) if "sequence models" in e.get("event", "")]
        assert [(w["worker"], w["models"]) for w in warnings] == [(0, ["accumulate"])]

        assert proc.stop() == 0, proc.output()[-5000:]
        stopped = {e["worker"] for e in _events(proc) if e.get("event") == "server stopped"}
        assert stopped == {0, 1}
    finally:
        proc.close()


def _assert_statistics_count(proc: ServerProcess, expected: int) -> None:
    """Statistics asked on fresh connections, HTTP and gRPC, count ``expected``
    inferences of `simple`, in one batch_stats entry, whichever worker answers."""
    for _ in range(4):
        client = httpclient.InferenceServerClient(proc.http_url)
        try:
            (stats,) = client.get_inference_statistics("simple")["model_stats"]
            everything = client.get_inference_statistics()["model_stats"]
            with pytest.raises(InferenceServerException, match="unknown model"):
                client.get_inference_statistics("no_such_model")
        finally:
            client.close()
        assert stats["inference_count"] == stats["execution_count"] == expected
        assert stats["inference_stats"]["success"]["count"] == expected
        assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
            (1, expected)
        ]
        assert [(s["name"], s["version"]) for s in everything] == [
            ("accumulate", "1"),
            ("simple", "1"),
        ]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.grpc_port}")
        try:
            answer = client.get_inference_statistics("simple", as_json=True)
        finally:
            client.close()
        (stats,) = answer["model_stats"]
        assert int(stats["inference_count"]) == expected


def test_statistics_add_up_without_the_metrics_port(repository):
    """Each worker's own statistics are served on a private port of their own,
    which does not depend on the metrics port being enabled."""
    proc = _start(repository, "--allow-metrics=false")
    try:
        _wait_for(proc, lambda events: _ready_workers(events, 2), "two ready workers")
        _infer_on_fresh_connections(proc, http=30, grpc=10)
        _assert_statistics_count(proc, 40)
        assert proc.stop() == 0, proc.output()[-5000:]
    finally:
        proc.close()


def test_a_killed_worker_is_restarted_and_serving_resumes(repository):
    proc = _start(repository)
    try:
        ready = _wait_for(proc, lambda events: _ready_workers(events, 2), "two ready workers")
        victim = ready[1]["pid"]
        os.kill(victim, signal.SIGKILL)

        def restarted(events):
            again = _ready_workers(events, 2)
            return again if again and again[1]["pid"] != victim else None

        ready = _wait_for(proc, restarted, "restarted worker 1")
        # The new process reported the ports it bound, not its predecessor's.
        reported = {int(ready[1][key].rsplit(":", 1)[1]) for key in ("metrics", "statistics")}
        assert reported <= _listening_ports(ready[1]["pid"]), ready[1]
        exits = [e for e in _events(proc) if e.get("event") == "worker exited unexpectedly"]
        assert [(e["worker"], e["exit_code"]) for e in exits] == [(1, -signal.SIGKILL)]

        _infer_on_fresh_connections(proc, http=30)
        per_worker = [
            metric_samples(int(event["metrics"].rsplit(":", 1)[1]))[SIMPLE_COUNT]
            for event in ready.values()
        ]
        assert sum(per_worker) == 30 and all(count > 0 for count in per_worker), per_worker
        merged = metric_samples(proc.metrics_port)
        assert merged[("trionserve_worker_restarts_total", ())] == 1
        assert merged[SIMPLE_COUNT] == 30
        assert proc.stop() == 0, proc.output()[-5000:]
    finally:
        proc.close()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--model-control-mode=explicit"], "--model-control-mode=explicit"),
        (["--allow-client-shm=true"], "--allow-client-shm"),
        (["--http-port=0"], "--http-port=0"),
    ],
)
def test_settings_that_cannot_be_shared_are_refused(repository, flags, named):
    result = cli_usage(f"--model-repository={repository}", "--workers=2", *flags)
    assert result.returncode == 1  # tritonserver main.cc: exit(1)
    assert named in result.stderr and "--workers > 1" in result.stderr, result.stderr


def test_workers_that_fail_at_startup_stop_the_supervisor(tmp_path):
    broken = tmp_path / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text('name: "broken"\nplatform: "no_such_platform"\n')
    proc = ServerProcess(tmp_path, args=["--log-format=json"], workers=2)
    try:
        code = proc.wait_exit(120)
        events = _events(proc)
        assert code == 1, proc.output()[-5000:]
        assert any("before it was ready" in e.get("reason", "") for e in events)
        # Given up at once: no worker was started again.
        assert sum(e.get("event") == "worker started" for e in events) == 2
    finally:
        proc.close()


@pytest.mark.parametrize("workers", [None, 2])
def test_a_port_held_by_another_server_is_an_error(repository, workers):
    """SO_REUSEPORT shares a port only among sockets that all ask for it."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = ServerProcess(repository, args=[f"--http-port={port}"], workers=workers)
        try:
            code = proc.wait_exit(120)
            assert code != 0
            expected = f"Socket '127.0.0.1:{port}' already in use (--http-port)"
            assert expected in proc.output(), proc.output()[-3000:]
        finally:
            proc.close()


def test_parse_workers():
    assert parse_workers("3") == 3
    assert parse_workers("auto") == (os.cpu_count() or 1)
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1 worker"):
        parse_workers("0")


class StaticCollectorOf:
    def __init__(self, families) -> None:
        self.families = list(families)

    def collect(self):
        return self.families


def test_merge_expositions_sums_per_process_figures_only():
    def exposition(count: float, utilization: float, started: float) -> str:
        return (
            "# TYPE nv_inference_count counter\n"
            f'nv_inference_count{{model="simple",version="1"}} {count}\n'
            f'nv_inference_count{{model="other",version="1"}} 1\n'
            "# TYPE nv_cpu_utilization gauge\n"
            f"nv_cpu_utilization {utilization}\n"
            "# TYPE nv_gpu_utilization gauge\n"
            f'nv_gpu_utilization{{gpu_uuid="GPU-0"}} {utilization}\n'
            "# TYPE process_cpu_seconds_total counter\n"
            f"process_cpu_seconds_total {count}\n"
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {started}\n"
            "# TYPE nv_inference_first_response_histogram_ms histogram\n"
            'nv_inference_first_response_histogram_ms_bucket{model="simple",le="100.0"} 2\n'
            'nv_inference_first_response_histogram_ms_bucket{model="simple",le="+Inf"} 3\n'
            'nv_inference_first_response_histogram_ms_count{model="simple"} 3\n'
            'nv_inference_first_response_histogram_ms_sum{model="simple"} 120\n'
        )

    families = {
        f.name: f for f in merge_expositions([exposition(5, 0.5, 100.0), exposition(7, 0.6, 90.0)])
    }
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert values[("nv_inference_count", (("model", "simple"), ("version", "1")))] == 12
    assert values[("nv_inference_count", (("model", "other"), ("version", "1")))] == 2
    assert values[("nv_cpu_utilization", ())] == 0.5  # the machine's, not summed
    assert values[("nv_gpu_utilization", (("gpu_uuid", "GPU-0"),))] == 0.5
    assert values[("process_start_time_seconds", ())] == 90.0
    bucket = (
        "nv_inference_first_response_histogram_ms_bucket",
        (("le", "+Inf"), ("model", "simple")),
    )
    assert values[bucket] == 6
    assert families["nv_inference_first_response_histogram_ms"].type == "histogram"
    # Counters come back under Triton's names, typed, and prometheus-client's own
    # counters keep their _total.
    assert values[("process_cpu_seconds_total", ())] == 12
    text = exposition_text(StaticCollectorOf(families.values())).decode()
    assert "# TYPE nv_inference_count counter\n" in text
    assert 'nv_inference_count{model="simple",version="1"} 12.0\n' in text
    assert "# TYPE process_cpu_seconds_total counter\n" in text
