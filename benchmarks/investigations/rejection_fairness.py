"""Rejection fairness (issue 18 item 9): a flood of requests that one model refuses
must not delay another model's requests.

Usage: python -m benchmarks.investigations.rejection_fairness [--duration 5] [--flooders 3]
       [--threads 8] [--protocol http|grpc] [--rounds 2] [--tree PATH] [--python PATH]
       [--profile PATH]

Builds a temporary repository with two models and serves it with one trionserve on
free loopback ports:

- ``flooded``: a Python-backend identity whose ``execute`` takes 50 ms, behind
  ``dynamic_batching`` with ``max_queue_size: 1``: while it works, nearly every
  request is refused at once (HTTP 503 / gRPC UNAVAILABLE, "Exceeds maximum queue
  size").
- ``simple``: Triton's INT32 add/sub (ONNX), the unrelated model.

Each round measures ``simple`` alone (closed loop, one tritonclient HTTP client,
one request at a time) for ``--duration`` seconds, then again while ``--flooders``
client processes, ``--threads`` threads each, send ``flooded`` requests as fast as
the server answers them (raw keep-alive HTTP/1.1, or tritonclient.grpc). It prints
``simple``'s p50 / p99 / max latency in both phases, the flood's rate by answer,
and the server's CPU time. ``--tree`` runs the server from another source tree (a
``git worktree`` of an older commit) for a before/after figure; ``--python`` the
interpreter to run it with (default: the tree's ``.venv`` if it has one, else
this one). ``--pin`` keeps the server on the first CPU and the clients on the others.
``--profile PATH`` records the server with py-spy during the last flood
(``--format raw``: collapsed stacks, one line a stack) when py-spy is installed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.loadgen import LoadResult
from benchmarks.matrix import EXAMPLES, cpu_seconds, start_trionserve, tree_pids

FLOODED_CONFIG = """
name: "flooded"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { default_queue_policy { max_queue_size: 1 } }
"""

FLOODED_MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.05)  # a slow model: its queue fills at once
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
        return responses
"""

FLOOD_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()


def make_repository(root: Path) -> Path:
    repository = root / "models"
    shutil.copytree(EXAMPLES / "simple", repository / "simple")
    (repository / "flooded" / "1").mkdir(parents=True)
    (repository / "flooded" / "config.pbtxt").write_text(FLOODED_CONFIG)
    (repository / "flooded" / "1" / "model.py").write_text(FLOODED_MODEL)
    return repository


# ------------------------------------------------------------------- the flood


def _flood_http(host: str, port: int, stop_at: float, answers: Counter, lock) -> None:
    headers = {"Content-Type": "application/json"}
    seen: Counter = Counter()
    connection = None
    while time.monotonic() < stop_at:
        if connection is None:
            connection = http.client.HTTPConnection(host, port, timeout=30)
        try:
            connection.request("POST", "/v2/models/flooded/infer", FLOOD_BODY, headers)
            response = connection.getresponse()
            response.read()
            seen[response.status] += 1
            if response.will_close:
                connection.close()
                connection = None
        except (OSError, http.client.HTTPException) as exc:
            seen[type(exc).__name__] += 1
            connection.close()
            connection = None
    if connection is not None:
        connection.close()
    with lock:
        answers.update(seen)


def _flood_grpc(url: str, stop_at: float, answers: Counter, lock) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
    seen: Counter = Counter()
    while time.monotonic() < stop_at:
        try:
            client.infer("flooded", [tensor])
            seen["OK"] += 1
        except InferenceServerException as exc:
            seen[str(exc.status()).removeprefix("StatusCode.")] += 1
    client.close()
    with lock:
        answers.update(seen)


def _flooder(protocol: str, http_url: str, grpc_url: str, threads: int, stop_at: float, out):
    answers: Counter = Counter()
    lock = threading.Lock()
    host, port = http_url.rsplit(":", 1)
    if protocol == "http":
        target, args = _flood_http, (host, int(port), stop_at, answers, lock)
    else:
        target, args = _flood_grpc, (grpc_url, stop_at, answers, lock)
    workers = [threading.Thread(target=target, args=args, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    out.put(dict(answers))


# ------------------------------------------------------------------- the probe


def probe_simple(url: str, seconds: float) -> LoadResult:
    """``simple`` one request at a time for ``seconds``: every latency, in ms."""
    import numpy as np
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url, connection_timeout=60, network_timeout=60)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    latencies: list[float] = []
    errors = 0
    first_error = ""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        start = time.perf_counter()
        try:
            result = client.infer("simple", inputs)
            if not (result.as_numpy("OUTPUT0") == a + 1).all():
                raise RuntimeError("wrong OUTPUT0")
        except Exception as exc:
            errors += 1
            first_error = first_error or repr(exc)[:200]
            continue
        latencies.append((time.perf_counter() - start) * 1000)
    client.close()
    return LoadResult(
        "simple", 1, len(latencies), errors, time.monotonic() - began, latencies, first_error
    )


def server_time(url: str) -> tuple[int, int]:
    """``simple``'s successes and their total time in the server (ns), from its
    statistics: from the request's arrival at the data plane to its response."""
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", "/v2/models/simple/stats")
        stats = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    success = stats["model_stats"][0]["inference_stats"]["success"]
    return int(success["count"]), int(success["ns"])


def probe(url: str, seconds: float) -> tuple[LoadResult, float]:
    """:func:`probe_simple`, and the mean time its requests spent in the server (ms)."""
    count, ns = server_time(url)
    result = probe_simple(url, seconds)
    count_after, ns_after = server_time(url)
    return result, (ns_after - ns) / max(1, count_after - count) / 1e6


def describe(phase: str, result: LoadResult, in_server_ms: float) -> str:
    worst = max(result.latencies_ms, default=float("nan"))
    return (
        f"{phase:<10} simple: {result.requests:6d} requests  p50 {result.percentile(50):7.2f} ms"
        f"  p99 {result.percentile(99):7.2f} ms  max {worst:8.2f} ms  errors {result.errors}"
        f"  (in the server: {in_server_ms:.2f} ms mean)"
    )


# ------------------------------------------------------------------- the run


def run(args) -> None:
    with tempfile.TemporaryDirectory(prefix="rejection-fairness-") as root:
        repository = make_repository(Path(root))
        server, target = start_trionserve(
            "trionserve", repository, tree=args.tree, python=args.python
        )
        context = multiprocessing.get_context("spawn")
        if args.pin:
            # The server's process tree on the first CPU, the clients on the others,
            # so that the flood's clients do not take the server's CPU time.
            cpus = sorted(os.sched_getaffinity(0))
            for pid in tree_pids(server.pid):
                os.sched_setaffinity(pid, cpus[:1])
            os.sched_setaffinity(0, cpus[1:])
        try:
            print(
                f"server pid {server.pid}; flood: {args.flooders} processes x {args.threads} "
                f"threads over {args.protocol}; {args.duration:g} s a phase"
            )
            probe_simple(target.http_url, 1.0)  # warm up the client and the model
            for index in range(args.rounds):
                alone, alone_in_server = probe(target.http_url, args.duration)
                print(describe("alone", alone, alone_in_server))
                out = context.Queue()
                stop_at = time.monotonic() + args.duration + 2.0
                flooders = [
                    context.Process(
                        target=_flooder,
                        args=(
                            args.protocol,
                            target.http_url,
                            target.grpc_url,
                            args.threads,
                            stop_at,
                            out,
                        ),
                        daemon=True,
                    )
                    for _ in range(args.flooders)
                ]
                for process in flooders:
                    process.start()
                time.sleep(1.0)  # the flood reaches full rate
                profiler = None
                if args.profile and index == args.rounds - 1:
                    profiler = subprocess.Popen(
                        [
                            args.py_spy,
                            "record",
                            "--pid",
                            str(server.pid),
                            "--duration",
                            str(int(args.duration)),
                            "--format",
                            "raw",
                            "--output",
                            str(args.profile),
                            "--nonblocking",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.STDOUT,
                    )
                pids = tree_pids(server.pid)
                cpu_before = cpu_seconds(pids)
                flood_began = time.monotonic()
                flooded, flooded_in_server = probe(target.http_url, args.duration)
                cpu = cpu_seconds(pids) - cpu_before
                flood_seconds = time.monotonic() - flood_began
                answers: Counter = Counter()
                for _ in flooders:
                    answers.update(out.get(timeout=120))
                for process in flooders:
                    process.join(timeout=30)
                if profiler is not None:
                    profiler.wait(timeout=120)
                print(describe("flooded", flooded, flooded_in_server))
                total = sum(answers.values())
                # The flood ran over the probe window plus 1 s before and 1 s after.
                window = flood_seconds + 2.0
                rates = ", ".join(f"{k}: {v / window:,.0f}/s" for k, v in answers.most_common())
                print(
                    f"{'':<10} flood: {total / window:,.0f} answers/s ({rates}); "
                    f"server CPU {cpu / flood_seconds:.2f} cores"
                )
                print(
                    f"{'':<10} ratio flooded/alone: p50 "
                    f"{flooded.percentile(50) / alone.percentile(50):.2f}x, p99 "
                    f"{flooded.percentile(99) / alone.percentile(99):.2f}x"
                )
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds a phase")
    parser.add_argument("--flooders", type=int, default=3, help="flooding processes")
    parser.add_argument("--threads", type=int, default=8, help="threads per flooder")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--pin", action="store_true", help="the server on one CPU, the clients on the rest"
    )
    parser.add_argument("--tree", type=Path, default=None, help="serve from this source tree")
    parser.add_argument("--python", default=None, help="the server's interpreter")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw output")
    parser.add_argument("--py-spy", default=str(Path(sys.executable).parent / "py-spy"))
    run(parser.parse_args())


if __name__ == "__main__":
    main()
