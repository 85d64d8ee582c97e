"""trionserve on Ray Serve: throughput with 1 and 2 replicas, and what Serve adds
per request compared with the plain server, in one run.

Usage: python -m benchmarks.ray_serve [--duration 5] [--rounds 2]

Starts a two-node Ray cluster on loopback (tests/ray_cluster.py: a head and a
worker node, one CPU each, so two replicas are one per node), Serve's proxy on a
free port, and a plain ``trionserve`` on free ports, all serving
examples/model_repository. The same client (tritonclient.http, binary tensors,
``simple``) in the same client processes loads each in turn: the plain server,
Serve with one replica, Serve with two; ``--rounds`` repeats the sequence with
its order reversed, and each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from ray import serve

from benchmarks.loadgen import ClientPool, LoadResult, standard_workloads
from benchmarks.matrix import EXAMPLES
from tests.ray_cluster import RayCluster
from trionserve.ray_serve import app
from trionserve.testing import TrionServe, free_port

CONCURRENCIES = (1, 8)


def deploy(replicas: int) -> None:
    serve.run(
        app(
            str(EXAMPLES),
            num_replicas=replicas,
            ray_actor_options={"num_cpus": 1},
            max_replicas_per_node=1,
        ),
        name="triton",
        route_prefix="/",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    workload = standard_workloads()["simple http binary"]
    results: dict[tuple[str, int], list[LoadResult]] = {}
    began = time.monotonic()
    plain = TrionServe(EXAMPLES)
    try:
        plain.wait_ready()
        with RayCluster(nodes=2, cpus_per_node=1) as cluster, ClientPool(2) as pool:
            print(f"Ray cluster of 2 nodes started in {cluster.start_seconds:.1f} s")
            ray.init(
                address=cluster.address,
                _node_ip_address="127.0.0.1",
                logging_level="ERROR",
                log_to_driver=False,
            )
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
            targets = {
                "plain trionserve": plain.http_url,
                "Serve, 1 replica": f"127.0.0.1:{port}",
                "Serve, 2 replicas": f"127.0.0.1:{port}",
            }
            for round_index in range(args.rounds):
                order = list(targets)
                if round_index % 2:
                    order.reverse()
                for label in order:
                    if label.startswith("Serve"):
                        started = time.monotonic()
                        deploy(1 if "1 replica" in label else 2)
                        print(f"  deployed {label} in {time.monotonic() - started:.1f} s")
                    for concurrency in CONCURRENCIES:
                        result = pool.run(workload, targets[label], concurrency, args.duration)
                        result.label = label
                        print(f"  round {round_index + 1}: {result.line()}")
                        results.setdefault((label, concurrency), []).append(result)
            serve.shutdown()
            ray.shutdown()
        plain.stop()
    finally:
        plain.close()
    print(f"\nmedians over {args.rounds} rounds ({time.monotonic() - began:.0f} s in all):")
    throughput = {}
    p50 = {}
    for (label, concurrency), points in results.items():
        throughput[label, concurrency] = statistics.median(p.throughput for p in points)
        p50[label, concurrency] = statistics.median(p.percentile(50) for p in points)
        errors = sum(p.errors for p in points)
        print(
            f"{label:<20} c={concurrency:<2} {throughput[label, concurrency]:8.1f} infer/s"
            f"  p50 {p50[label, concurrency]:6.2f} ms  errors {errors}"
        )
    for concurrency in CONCURRENCIES:
        one = throughput["Serve, 1 replica", concurrency]
        two = throughput["Serve, 2 replicas", concurrency]
        plain_rate = throughput["plain trionserve", concurrency]
        print(
            f"c={concurrency}: 2 replicas / 1 replica {two / one:.2f}x; "
            f"Serve 1 replica / plain {one / plain_rate:.2f}x"
        )
    added = p50["Serve, 1 replica", 1] - p50["plain trionserve", 1]
    print(f"Serve adds {added:.2f} ms per request at c=1 (p50, 1 replica vs plain)")


if __name__ == "__main__":
    main()
