"""trionserve on Ray Serve, on a real two-node Ray cluster of this machine: a
head node and a worker node, each its own ``ray start`` process on loopback
(tests/ray_cluster.py), Serve's proxy on a free port, ``tritonclient.http``
pointed at it. Skipped only where Ray Serve is not installed
(``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Self

import numpy as np
import pytest
import yaml

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")

import ray
import tritonclient.http as httpclient
from ray import serve
from tritonclient.utils import InferenceServerException

from tests.helpers import simple_inputs, wait_for
from tests.ray_cluster import RayCluster
from tests.serverproc import free_port
from trionserve.ray_serve import app

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = str(ROOT / "examples" / "model_repository")
EXAMPLE = ROOT / "examples" / "ray_serve" / "serve.yaml"
APP = "triton"
# Each node has one CPU and each replica takes one: two replicas are one per node.
ONE_PER_NODE = {"ray_actor_options": {"num_cpus": 1}, "max_replicas_per_node": 1}
# Serve's proxy bounds every request (docs/scaling_out.md, "A replica that dies"):
# a call Ray sent to a replica killed mid-request is answered 408 by then even
# when the actor's death reaches the proxy late (ray-project/ray#26772), never
# left to the client's own timeout.
REQUEST_TIMEOUT_S = 10.0

pytestmark = [
    pytest.mark.timeout(240),
    # Serve's own deprecation (the field still sets the interval, in this run)
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def cluster():
    with RayCluster(nodes=2, cpus_per_node=1, cwd=ROOT) as cluster:
        ray.init(
            address=cluster.address,
            _node_ip_address="127.0.0.1",
            logging_level="ERROR",
            log_to_driver=False,
        )
        try:
            port = free_port()
            serve.start(
                http_options={
                    "host": "127.0.0.1",
                    "port": port,
                    "request_timeout_s": REQUEST_TIMEOUT_S,
                },
                proxy_location="HeadOnly",
            )
            cluster.serve_url = f"127.0.0.1:{port}"
            yield cluster
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def simple_only(tmp_path_factory) -> str:
    """A repository of the example ``simple`` alone, for the tests that call only
    it: each replica they start (and restart, and add) loads one ONNX model, not
    the six of the example repository and their Python stubs."""
    repository = tmp_path_factory.mktemp("simple_only")
    shutil.copytree(Path(REPOSITORY) / "simple", repository / "simple")
    return str(repository)


@pytest.fixture
def deploy(cluster):
    """``deploy(repository, **deployment_options)``: the repository (the example
    one unless given) as the Serve application, replacing the one before; deleted
    after the test."""

    def run(repository=REPOSITORY, **options):
        serve.run(app(repository, **options), name=APP, route_prefix="/")
        return cluster.serve_url

    yield run
    serve.delete(APP)


def replicas() -> dict[str, tuple[str, str]]:
    """The application's live replicas: actor name -> (actor id, node id), as the
    GCS knows them."""
    found = {}
    for actor_id, actor in ray._private.state.actors().items():
        name = actor["Name"]
        if name.startswith(f"SERVE_REPLICA::{APP}#") and actor["State"] == "ALIVE":
            found[name] = (actor_id, actor["Address"]["NodeID"])
    return found


def running_replicas() -> int:
    status = serve.status().applications.get(APP)
    if status is None:
        return 0
    return status.deployments["trionserve"].replica_states.get("RUNNING", 0)


class Load:
    """``threads`` tritonclient callers of ``simple`` until stopped, each
    outcome counted: "ok", the HTTP status of an error answer, or the
    exception's type for a request with no answer."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url = url
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._call) for _ in range(threads)]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in self._threads), "a caller hung"

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.outcomes)

    def _call(self) -> None:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = simple_inputs(a)
        client = httpclient.InferenceServerClient(
            self.url, connection_timeout=30.0, network_timeout=30.0
        )
        try:
            while not self._stop.is_set():
                try:
                    result = client.infer("simple", inputs)
                    assert (result.as_numpy("OUTPUT0") == a + 1).all()
                    outcome = "ok"
                except InferenceServerException as error:
                    outcome = str(error.status())
                    self._record_error(f"{error.status()}: {error.message()}")
                except Exception as error:  # noqa: BLE001 (no answer: the connection broke)
                    outcome = type(error).__name__
                    self._record_error(repr(error))
                    client.close()
                    client = httpclient.InferenceServerClient(
                        self.url, connection_timeout=30.0, network_timeout=30.0
                    )
                with self._lock:
                    self.outcomes[outcome] += 1
        finally:
            client.close()

    def _record_error(self, text: str) -> None:
        with self._lock:
            self.errors.append(text)


def example_config() -> tuple[dict, dict]:
    """The example Serve config file, checked against Serve's schema: its
    application's args and its deployment's options."""
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    (application,) = config.applications
    assert application.import_path == "trionserve.ray_serve:build_app"
    (deployment,) = application.deployments
    options = deployment.model_dump(exclude_unset=True)
    assert options.pop("name") == "trionserve"
    return dict(application.args), options


def test_example_config_serves_tritonclient_from_two_replicas_on_two_nodes(cluster, deploy):
    """examples/ray_serve/serve.yaml as Serve would apply it (its relative
    repository path too), with a small body limit to see the 413."""
    args, options = example_config()
    assert options["num_replicas"] == 2
    url = deploy(args.pop("model_repository"), **{**args, "max_input_size": 4096}, **options)
    placed = replicas()
    assert len(placed) == 2
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2
    assert {node for _, node in placed.values()} == nodes, "a replica on each node"

    client = httpclient.InferenceServerClient(url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata()["name"] == "triton"
        assert client.is_model_ready("simple")
        assert client.get_model_metadata("simple")["platform"] == "onnxruntime_onnx"
        for binary in (True, False):  # binary tensor extension, then JSON
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            inputs = simple_inputs(a, binary=binary)
            outputs = [
                httpclient.InferRequestedOutput(n, binary_data=binary)
                for n in ("OUTPUT0", "OUTPUT1")
            ]
            result = client.infer("simple", inputs, outputs=outputs, request_id="r1")
            assert (result.as_numpy("OUTPUT0") == a + 1).all()
            assert (result.as_numpy("OUTPUT1") == a - 1).all()
            assert result.get_response()["id"] == "r1"
        # BYTES through the binary extension, and a Python-backend model
        text = np.array([[b"one", b"\x00two"]], dtype=np.object_)
        bytes_input = httpclient.InferInput("INPUT0", [1, 2], "BYTES")
        bytes_input.set_data_from_numpy(text)
        assert (client.infer("identity_bytes", [bytes_input]).as_numpy("OUTPUT0") == text).all()
        # Errors are the route table's: status and message as the HTTP port's.
        with pytest.raises(InferenceServerException) as refused:
            client.infer("nosuchmodel", simple_inputs())
        assert refused.value.status() == "404" and "nosuchmodel" in refused.value.message()
        big = httpclient.InferInput("INPUT0", [1, 4096], "INT32")
        big.set_data_from_numpy(np.zeros((1, 4096), dtype=np.int32))
        with pytest.raises(InferenceServerException) as too_large:
            client.infer("simple", [big, big])
        assert too_large.value.status() == "413"
        assert "--http-max-input-size" in too_large.value.message()
    finally:
        client.close()


def test_replica_killed_under_load_loses_no_request(cluster, deploy, simple_only):
    """A replica's actor killed while four callers keep sending: every request
    is answered (no hang, no broken connection) and the only failures are
    answers a client can retry: 5xx, or the proxy's 408 for a call that went
    to the dying replica and whose end Ray reported late; Serve restarts the
    replica."""
    url = deploy(simple_only, num_replicas=2, **ONE_PER_NODE)
    victim = min(replicas())
    with Load(url, threads=4) as load:
        wait_for(lambda: load.snapshot()["ok"] >= 40, "40 answers before the kill", 60)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed_at = load.snapshot()
        wait_for(lambda: victim not in replicas(), "the killed replica gone", 30)
        wait_for(lambda: len(replicas()) == 2 and running_replicas() == 2, "a new replica", 90)
        wait_for(lambda: load.snapshot()["ok"] >= killed_at["ok"] + 40, "40 answers after", 60)
    outcomes = load.snapshot()
    failed = {key: count for key, count in outcomes.items() if key != "ok"}
    print(f"outcomes {dict(outcomes)}; errors {load.errors[:5]}")
    assert set(failed) <= {"408", "500", "502", "503"}, (failed, load.errors[:5])
    # At most the requests in flight on the killed replica when it died.
    assert sum(failed.values()) <= 4, (failed, load.errors[:5])


def test_autoscaling_one_to_two_replicas_and_back_without_errors(cluster, deploy, simple_only):
    """Ray's autoscaling config, honoured: load past the target adds the second
    replica, the end of the load takes it away, and the replica stopping drains
    (Serve's wait for its ongoing requests, then the core's) so that no request
    fails on the way up or down."""
    url = deploy(
        simple_only,
        autoscaling_config={
            "min_replicas": 1,
            "max_replicas": 2,
            "initial_replicas": 1,
            "target_ongoing_requests": 1,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 2.0,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 1.0,
        },
        graceful_shutdown_wait_loop_s=0.5,
        **ONE_PER_NODE,
    )
    assert running_replicas() == 1
    with Load(url, threads=6) as load:
        wait_for(lambda: running_replicas() == 2, "scaled up to 2 replicas", 90)
        assert len({node for _, node in replicas().values()}) == 2
        scaled_up = load.snapshot()
        wait_for(lambda: load.snapshot()["ok"] >= scaled_up["ok"] + 40, "answers at 2", 60)
    # One caller stays: one replica's target, so the other is taken away while
    # it sends.
    with Load(url, threads=1) as light:
        wait_for(lambda: running_replicas() == 1 and len(replicas()) == 1, "back to 1", 90)
        wait_for(lambda: light.snapshot()["ok"] >= 20, "answers at 1", 60)
    for counted in (load, light):
        outcomes = counted.snapshot()
        assert set(outcomes) == {"ok"}, (dict(outcomes), counted.errors[:5])
