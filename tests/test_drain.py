"""Graceful drain on SIGTERM, as a rolling update on Kubernetes does it.

A real server serves a slow Python model to HTTP and gRPC tritonclient threads.
While requests execute, the test sends SIGTERM and checks, through the public
surface only: readiness turns false at once; the requests the server had
accepted finish with their results; requests sent after that get UNAVAILABLE or
find the port closed; no call hangs or ends without a clear outcome; the server
exits 0. The model records every request it starts executing, so "accepted"
is observed, not guessed: every request that reached the model must have been
answered with its result.
"""

from __future__ import annotations

import http.client
import signal
import textwrap
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.serverproc import ServerProcess

DELAY = 0.6  # seconds each request spends in the model
EXIT_TIMEOUT = 20  # --exit-timeout-secs: far above what the drain needs
THREADS = 6  # half HTTP, half gRPC; the model has 2 instances, so some queue
MAX_PER_THREAD = 40  # bounds the load even if the server never stops

CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT64 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 2 }} ]
parameters {{ key: "marker_dir" value {{ string_value: "{markers}" }} }}
"""

MODEL = """
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.markers = config["parameters"]["marker_dir"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            # Record that this request was accepted and is executing.
            open(os.path.join(self.markers, str(int(value[0]))), "w").close()
            time.sleep({delay})
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value.copy())])
            )
        return responses
"""


@dataclass
class Outcomes:
    """Every call's outcome, by the value it sent (values are unique)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ok: dict[int, float] = field(default_factory=dict)  # value -> time answered
    unavailable: dict[int, str] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)  # port or connection closed
    other: dict[int, str] = field(default_factory=dict)  # wrong answer or unclear error
    sent: set[int] = field(default_factory=set)

    def record(self, kind: str, value: int, detail) -> None:
        with self.lock:
            getattr(self, kind)[value] = detail


def classify(exc: BaseException) -> str:
    """A failed call's outcome: 'unavailable', 'refused' or 'other'."""
    if isinstance(exc, InferenceServerException):
        status = str(exc.status() or "")
        return "unavailable" if status in ("StatusCode.UNAVAILABLE", "503") else "other"
    # A closed port, or a keep-alive connection the draining server closed before
    # this request reached it (the request never executes: see the markers).
    closed = isinstance(exc, (OSError, http.client.HTTPException))
    return "refused" if closed else "other"


def infer_http(client: httpclient.InferenceServerClient, value: int):
    infer_input = httpclient.InferInput("INPUT0", [1], "INT64")
    infer_input.set_data_from_numpy(np.array([value], dtype=np.int64))
    return client.infer("slow", [infer_input]).as_numpy("OUTPUT0")


def infer_grpc(client: grpcclient.InferenceServerClient, value: int):
    infer_input = grpcclient.InferInput("INPUT0", [1], "INT64")
    infer_input.set_data_from_numpy(np.array([value], dtype=np.int64))
    return client.infer("slow", [infer_input], client_timeout=30).as_numpy("OUTPUT0")


def http_client(port: int) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(
        f"127.0.0.1:{port}", connection_timeout=10, network_timeout=30
    )


def worker(client, infer, base: int, outcomes: Outcomes, stop: threading.Event) -> None:
    """Send requests one after another until one fails or the test stops."""
    try:
        for value in range(base, base + MAX_PER_THREAD):
            if stop.is_set():
                return
            with outcomes.lock:
                outcomes.sent.add(value)
            try:
                result = infer(client, value)
            except Exception as exc:  # every failure is classified and kept
                outcomes.record(classify(exc), value, f"{type(exc).__name__}: {exc}")
                return
            if result is not None and int(result[0]) == value:
                outcomes.record("ok", value, time.monotonic())
            else:
                outcomes.record("other", value, f"wrong answer {result!r}")
    finally:
        client.close()


def ready_status(port: int) -> int | None:
    """HTTP status of /v2/health/ready on a new connection; None if refused."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/v2/health/ready")
        return connection.getresponse().status
    except OSError:
        return None
    finally:
        connection.close()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def test_sigterm_drains_in_flight_requests(tmp_path):
    markers = tmp_path / "entered"
    markers.mkdir()
    model_dir = tmp_path / "repository" / "slow"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(CONFIG.format(markers=markers))
    (model_dir / "1" / "model.py").write_text(textwrap.dedent(MODEL.format(delay=DELAY)))

    def entered() -> set[int]:
        return {int(p.name) for p in markers.iterdir()}

    server = ServerProcess(
        tmp_path / "repository", args=[f"--exit-timeout-secs={EXIT_TIMEOUT}"]
    )
    outcomes = Outcomes()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        server.wait_ready(path="/v2/health/ready")
        for t in range(THREADS):
            if t % 2 == 0:
                client, infer = http_client(server.http_port), infer_http
            else:
                client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
                infer = infer_grpc
            thread = threading.Thread(
                target=worker, args=(client, infer, (t + 1) * 1000, outcomes, stop),
                daemon=True,
            )
            thread.start()
            threads.append(thread)

        # Steady load: both instances busy, the other threads' requests queued.
        wait_for(lambda: len(outcomes.ok) >= 2 and len(entered()) >= 4, 60, "steady load")
        server.process.send_signal(signal.SIGTERM)
        with outcomes.lock:
            in_flight = entered() - set(outcomes.ok)
        assert in_flight, "the test must signal while requests execute"

        # Readiness turns false at once, while the drain is still going on.
        wait_for(lambda: ready_status(server.http_port) != 200, 2.0, "readiness to flip")
        flipped = time.monotonic()
        # A new client is turned away with a clear answer.
        late = Outcomes()
        worker(http_client(server.http_port), infer_http, 900_000, late, threading.Event())
        assert not late.ok and not late.other, (late.ok, late.other)

        code = server.wait_exit(timeout=EXIT_TIMEOUT + 30)
        assert code == 0, server.output()
        for thread in threads:
            thread.join(timeout=40)
        assert not any(thread.is_alive() for thread in threads), "a client call hung"
        log = server.output()
    finally:
        stop.set()
        server.close()

    # Every request that reached the model was answered with its result, among
    # them the ones executing when SIGTERM came, answered after readiness flipped.
    executed = entered()
    assert executed <= set(outcomes.ok), (
        f"accepted but not answered: {sorted(executed - set(outcomes.ok))}: {outcomes}\n{log}"
    )
    assert in_flight <= set(outcomes.ok)
    assert any(outcomes.ok[v] > flipped for v in executed)
    # Every call ended with its result, UNAVAILABLE, or a closed port: no other
    # error, and none without an outcome.
    assert not outcomes.other, outcomes.other
    finished = set(outcomes.ok) | set(outcomes.unavailable) | set(outcomes.refused)
    assert finished == outcomes.sent
    assert outcomes.unavailable or outcomes.refused, "the drain turned nobody away"
