"""Graceful drain on SIGTERM, as a rolling update on Kubernetes does it.

A real server serves a slow Python model to HTTP and gRPC tritonclient threads.
While requests execute, the test sends SIGTERM and checks, through the public
surface only: readiness turns false at once (503) while liveness stays 200; the
requests the server had accepted finish with their results; requests sent after
that get UNAVAILABLE (the listeners keep accepting during the drain, so a new
client gets a clean answer, not a refused connection); no call hangs or ends
without a clear outcome; the server exits 0. The model records every request it
starts executing, so "accepted" is observed, not guessed: every request that
reached the model must have been answered with its result.

The sequence tests serve the example ``accumulate`` model (a running sum kept as
implicit state) beside ``simple``: sequences open at SIGTERM go on to their END
over HTTP (on a new connection too), gRPC unary calls and a gRPC stream, while new
requests and new sequences are refused; the server exits 0 once the last sequence
ended, or once an abandoned one is released for being idle; a sequence that never
ends is cut by --exit-timeout-secs, and the server then exits 1, as Triton does.
"""

from __future__ import annotations

import http.client
import queue
import shutil
import signal
import textwrap
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.helpers import simple_inputs, wait_for
from tests.serverproc import EXAMPLES, ServerProcess

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
        if status == "StatusCode.CANCELLED":
            # These clients never cancel: seen (rarely) for a call the gRPC
            # client started on its connection just as the server closed it after
            # the drain, one the server never read; the markers prove it never
            # reached the model.
            return "refused"
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


def health_status(port: int, kind: str = "ready") -> int | None:
    """HTTP status of /v2/health/<kind> on a new connection; None if refused."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", f"/v2/health/{kind}")
        return connection.getresponse().status
    except OSError:
        return None
    finally:
        connection.close()


def ready_status(port: int) -> int | None:
    return health_status(port, "ready")


def test_sigterm_drains_in_flight_requests(tmp_path):
    markers = tmp_path / "entered"
    markers.mkdir()
    model_dir = tmp_path / "repository" / "slow"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(CONFIG.format(markers=markers))
    (model_dir / "1" / "model.py").write_text(textwrap.dedent(MODEL.format(delay=DELAY)))

    def entered() -> set[int]:
        return {int(p.name) for p in markers.iterdir()}

    server = ServerProcess(tmp_path / "repository", args=[f"--exit-timeout-secs={EXIT_TIMEOUT}"])
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
                target=worker,
                args=(client, infer, (t + 1) * 1000, outcomes, stop),
                daemon=True,
            )
            thread.start()
            threads.append(thread)

        # Steady load: both instances busy, the other threads' requests queued.
        wait_for(lambda: len(outcomes.ok) >= 2 and len(entered()) >= 4, "steady load", 60)
        server.process.send_signal(signal.SIGTERM)
        with outcomes.lock:
            in_flight = entered() - set(outcomes.ok)
        assert in_flight, "the test must signal while requests execute"

        # Readiness turns false at once, while the drain is still going on.
        wait_for(lambda: ready_status(server.http_port) != 200, "readiness to flip", 2.0)
        flipped = time.monotonic()
        # A new client is turned away with a clear answer (UNAVAILABLE while the
        # drain lasts; the sequence tests below hold the drain open to see it).
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


# -- sequences through the drain ---------------------------------------------------


def sequence_repository(tmp_path, idle_us: int):
    """``accumulate`` (with ``idle_us`` as its max_sequence_idle_microseconds) and
    ``simple``, copied from the example repository."""
    repository = tmp_path / "repository"
    for name in ("accumulate", "simple"):
        shutil.copytree(EXAMPLES / name, repository / name)
    config = repository / "accumulate" / "config.pbtxt"
    text = config.read_text()
    assert "max_sequence_idle_microseconds: 5000000" in text
    config.write_text(
        text.replace(
            "max_sequence_idle_microseconds: 5000000",
            f"max_sequence_idle_microseconds: {idle_us}",
        )
    )
    return repository


def accumulate_input(module, value: int):
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return [tensor]


def total(result) -> int:
    return int(result.as_numpy("OUTPUT")[0][0])


def refused(call) -> InferenceServerException:
    """The error of a call the draining server must refuse with UNAVAILABLE."""
    try:
        call()
    except InferenceServerException as exc:
        assert str(exc.status()) in ("StatusCode.UNAVAILABLE", "503"), exc
        assert "server is shutting down" in exc.message(), exc
        return exc
    raise AssertionError("the draining server accepted a new request")


def sigterm_and_wait_not_ready(server: ServerProcess) -> None:
    server.process.send_signal(signal.SIGTERM)
    wait_for(lambda: ready_status(server.http_port) != 200, "readiness to flip", 5.0)


def test_open_sequences_continue_to_their_end_during_the_drain(tmp_path):
    """The drain is the DataPlane's: HTTP and gRPC serve it alike."""
    repository = sequence_repository(tmp_path, idle_us=60_000_000)
    server = ServerProcess(
        repository,
        args=[
            "--exit-timeout-secs=60",
        ],
    )
    stream_results: queue.Queue = queue.Queue()
    try:
        server.wait_ready(path="/v2/health/ready")
        http = http_client(server.http_port)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        grpc.start_stream(callback=lambda result, error: stream_results.put((result, error)))

        def streamed(value: int, **flags) -> int:
            grpc.async_stream_infer("accumulate", accumulate_input(grpcclient, value), **flags)
            result, error = stream_results.get(timeout=30)
            assert error is None, error
            return total(result)

        # Three sequences open before SIGTERM: over HTTP, gRPC unary and a gRPC stream.
        assert (
            total(
                http.infer(
                    "accumulate",
                    accumulate_input(httpclient, 1),
                    sequence_id=101,
                    sequence_start=True,
                )
            )
            == 1
        )
        assert (
            total(
                grpc.infer(
                    "accumulate",
                    accumulate_input(grpcclient, 10),
                    sequence_id=102,
                    sequence_start=True,
                )
            )
            == 10
        )
        assert streamed(100, sequence_id=103, sequence_start=True) == 100

        sigterm_and_wait_not_ready(server)
        # Not ready (503, as Triton while it exits), still live, on both protocols.
        assert ready_status(server.http_port) == 503
        assert health_status(server.http_port, "live") == 200
        assert grpc.is_server_live() and not grpc.is_server_ready()
        # Metadata and statistics keep answering.
        assert grpc.get_model_metadata("accumulate").name == "accumulate"
        assert http.get_inference_statistics("accumulate")["model_stats"]

        # New requests are refused, on open connections and on new ones alike...
        refused(lambda: http.infer("simple", simple_inputs()))
        refused(lambda: grpc.infer("simple", simple_inputs(module=grpcclient)))
        late_http = http_client(server.http_port)
        refused(lambda: late_http.infer("simple", simple_inputs()))
        # ...and so are new sequences, on every path.
        refused(
            lambda: http.infer(
                "accumulate", accumulate_input(httpclient, 1), sequence_id=201, sequence_start=True
            )
        )
        refused(
            lambda: grpc.infer(
                "accumulate", accumulate_input(grpcclient, 1), sequence_id=202, sequence_start=True
            )
        )
        grpc.async_stream_infer(
            "accumulate", accumulate_input(grpcclient, 1), sequence_id=203, sequence_start=True
        )
        result, error = stream_results.get(timeout=30)
        assert result is None and "server is shutting down" in error.message(), error
        # A request for a sequence that was never open is refused too.
        refused(lambda: http.infer("accumulate", accumulate_input(httpclient, 1), sequence_id=204))

        # The open sequences go on, each with its own state; a client that
        # reconnects (a new HTTP connection) reaches its sequence too.
        assert (
            total(late_http.infer("accumulate", accumulate_input(httpclient, 2), sequence_id=101))
            == 3
        )
        assert (
            total(grpc.infer("accumulate", accumulate_input(grpcclient, 20), sequence_id=102)) == 30
        )
        assert streamed(200, sequence_id=103) == 300
        # END closes each sequence; the drain waits for the last one.
        assert (
            total(
                http.infer(
                    "accumulate",
                    accumulate_input(httpclient, 3),
                    sequence_id=101,
                    sequence_end=True,
                )
            )
            == 6
        )
        assert (
            total(
                grpc.infer(
                    "accumulate",
                    accumulate_input(grpcclient, 30),
                    sequence_id=102,
                    sequence_end=True,
                )
            )
            == 60
        )
        assert server.process.poll() is None, "the server left before the last END"
        # After its END a sequence is closed: its id cannot continue it.
        refused(lambda: grpc.infer("accumulate", accumulate_input(grpcclient, 1), sequence_id=102))
        assert streamed(300, sequence_id=103, sequence_end=True) == 600

        # Nothing in flight, no sequence open: the server closes and exits 0.
        code = server.wait_exit(timeout=60)
        assert code == 0, server.output()
        # The stream still open at the close is ended UNAVAILABLE, not reset.
        result, error = stream_results.get(timeout=30)
        assert result is None and error.status() == "StatusCode.UNAVAILABLE", error
        grpc.stop_stream()
        grpc.close()
        http.close()
        late_http.close()
        log = server.output()
    finally:
        server.close()
    assert "drained" in log and "Exit timeout expired" not in log, log


def test_an_abandoned_sequence_ends_the_drain_when_it_goes_idle(tmp_path):
    repository = sequence_repository(tmp_path, idle_us=1_000_000)
    server = ServerProcess(repository, args=["--exit-timeout-secs=60"])
    try:
        server.wait_ready(path="/v2/health/ready")
        http = http_client(server.http_port)
        http.infer(
            "accumulate", accumulate_input(httpclient, 1), sequence_id=7, sequence_start=True
        )
        http.close()
        signalled = time.monotonic()
        sigterm_and_wait_not_ready(server)
        # The client never comes back: max_sequence_idle_microseconds (1 s)
        # releases the sequence, and the drain ends long before the exit timeout.
        code = server.wait_exit(timeout=60)
        took = time.monotonic() - signalled
        log = server.output()
    finally:
        server.close()
    assert code == 0, log
    assert took < 30, f"the drain took {took:.1f} s"
    assert "drained" in log, log


def test_exit_timeout_bounds_a_sequence_that_never_ends(tmp_path):
    exit_timeout = 2
    repository = sequence_repository(tmp_path, idle_us=600_000_000)
    server = ServerProcess(repository, args=[f"--exit-timeout-secs={exit_timeout}"])
    try:
        server.wait_ready(path="/v2/health/ready")
        http = http_client(server.http_port)
        http.infer(
            "accumulate", accumulate_input(httpclient, 1), sequence_id=9, sequence_start=True
        )
        signalled = time.monotonic()
        sigterm_and_wait_not_ready(server)
        # The sequence holds the drain open: its requests are still served...
        assert total(http.infer("accumulate", accumulate_input(httpclient, 2), sequence_id=9)) == 3
        http.close()
        # ...until the exit timeout, when the server stops anyway and, as Triton
        # ("Exit timeout expired. Exiting immediately."), exits 1.
        code = server.wait_exit(timeout=60)
        took = time.monotonic() - signalled
        log = server.output()
    finally:
        server.close()
    assert code == 1, log
    assert exit_timeout - 0.5 <= took < exit_timeout + 20, took
    assert "Exit timeout expired" in log and "open_sequences=1" in log, log


def test_a_second_signal_stops_at_once(tmp_path):
    repository = sequence_repository(tmp_path, idle_us=600_000_000)
    server = ServerProcess(repository, args=["--exit-timeout-secs=600"])
    try:
        server.wait_ready(path="/v2/health/ready")
        http = http_client(server.http_port)
        http.infer(
            "accumulate", accumulate_input(httpclient, 1), sequence_id=5, sequence_start=True
        )
        http.close()
        sigterm_and_wait_not_ready(server)
        # The open sequence would hold the drain for ten minutes; a second
        # signal ends it now, and the exit code says the drain did not finish.
        server.process.send_signal(signal.SIGTERM)
        code = server.wait_exit(timeout=60)
        log = server.output()
    finally:
        server.close()
    assert code == 1, log
    assert "stopping now" in log, log


# -- requests models make on behalf of an accepted request --------------------------

ENSEMBLE = """
name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "blocking" model_version: -1
    input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "mid" } },
  { model_name: "blocking" model_version: -1
    input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""


async def test_ensemble_steps_of_an_accepted_request_run_during_the_drain(tmp_path):
    """An ensemble's second step is submitted after the drain began: it belongs to
    a request already taken, so it runs (BLS calls go the same way); a new request
    for the step's model from outside is refused."""
    import trio
    import trio.testing

    from tests.blocking_backend import BACKENDS, GATE, make_model, wait_entered
    from trionserve.core.errors import Unavailable
    from trionserve.core.inference import InferenceRequest, Tensor
    from trionserve.server import Server, ServerOptions

    GATE.reset()
    make_model(tmp_path, "blocking")
    (tmp_path / "chain" / "1").mkdir(parents=True)
    (tmp_path / "chain" / "config.pbtxt").write_text(ENSEMBLE)
    server = Server(
        ServerOptions(
            model_repositories=[tmp_path],
            allow_http=False,
            allow_grpc=False,
            allow_metrics=False,
            exit_timeout_secs=30.0,
        ),
        backends=BACKENDS,
    )

    def request(model: str, name: str, value: float) -> InferenceRequest:
        data = np.full((1, 4), value, dtype=np.float32)
        return InferenceRequest(model, inputs={name: Tensor(name, "FP32", data)})

    results: dict[str, object] = {}
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)

            async def chain() -> None:
                results["chain"] = await server.dataplane.infer(request("chain", "IN", 3.0))

            nursery.start_soon(chain)
            await wait_entered()  # step one executes
            server.shutdown()
            await trio.testing.wait_all_tasks_blocked()
            assert server.dataplane.drain.draining and not server.dataplane.drain.drained()
            with pytest.raises(Unavailable, match="server is shutting down"):
                await server.dataplane.infer(request("blocking", "INPUT0", 1.0))
            GATE.release.set()  # step one answers; step two is submitted and runs
    finally:
        GATE.release.set()
    np.testing.assert_array_equal(results["chain"].outputs[0].data, np.full((1, 4), 3.0))
    assert server.exit_code == 0
