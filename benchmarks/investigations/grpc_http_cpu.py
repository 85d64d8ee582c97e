"""Server CPU per unary call over gRPC and over HTTP, by thread, interleaved.

Usage:
    python -m benchmarks.investigations.grpc_http_cpu [--tree LABEL=PATH ...]
        [--rounds 10] [--calls 300] [--model simple] [--repository DIR] [--flags "..."]

Each server (this checkout, or each ``--tree LABEL=PATH``: another source tree,
e.g. ``git archive`` of an older commit unpacked outside the repository) serves
the example repository (or ``--repository``, whose ``--model`` takes `simple`'s
tensors); one tritonclient client per protocol, in this process,
sends ``--calls`` sync ``simple`` requests (INT32 [1,16] twice, as perf_analyzer
sends them) per round, HTTP (binary tensors) and gRPC alternating, the order of
protocols and servers swapped every round. Per round, the server's CPU time
(``/proc/PID/task/TID/schedstat``, nanoseconds on a CPU) is read by thread: the
event loop (the main thread, which runs Trio, the transports and, for `simple`,
the model inline) and all the others (instance threads, worker threads, and any
child process such as a Python stub). The medians over rounds of µs per call
are printed, with the median of the per-round gRPC/HTTP ratios. CPU time, not
wall time: on a shared machine it moves much less with the load than infer/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from benchmarks.matrix import EXAMPLES
from trionserve.testing import TrionServe

PROTOCOLS = ("http", "grpc")


def cpu_ns(pid: int) -> tuple[int, int]:
    """(event loop thread, every other thread and child process) CPU ns."""
    loop = others = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            continue
        if int(tid) == pid:
            loop = ns
        else:
            others += ns
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    for child in children:
        try:
            sub_loop, sub_others = cpu_ns(child)
        except OSError:
            continue
        others += sub_loop + sub_others
    return loop, others


def _inputs(module):
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        module.InferInput("INPUT0", [1, 16], "INT32"),
        module.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    for tensor in inputs:
        if module is httpclient:
            tensor.set_data_from_numpy(data, binary_data=True)
        else:
            tensor.set_data_from_numpy(data)
    return inputs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--model", default="simple")
    parser.add_argument(
        "--repository", type=Path, default=EXAMPLES, help="the model repository served"
    )
    parser.add_argument("--flags", default="", help="more trionserve flags, space-separated")
    args = parser.parse_args()
    trees: list[tuple[str, Path | None]] = [("this", None)]
    trees += [(label, Path(path)) for label, path in (t.split("=", 1) for t in args.tree)]
    servers = []
    try:
        for label, tree in trees:
            flags = ["--allow-metrics=false", *args.flags.split()]
            server = TrionServe(args.repository, args=flags, label=label, tree=tree)
            servers.append(server)
            server.wait_http(server.http_url, f"/v2/models/{args.model}/ready", 120)
        clients = [
            {
                "http": (httpclient.InferenceServerClient(s.http_url), _inputs(httpclient)),
                "grpc": (grpcclient.InferenceServerClient(s.grpc_url), _inputs(grpcclient)),
            }
            for s in servers
        ]
        for by_protocol in clients:  # warm-up
            for client, inputs in by_protocol.values():
                for _ in range(200):
                    client.infer(args.model, inputs)
        # (label, protocol) -> per round [loop µs, others µs]
        rounds: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for index in range(args.rounds):
            order = list(zip(trees, servers, clients, strict=True))
            if index % 2:
                order.reverse()
            for (label, _), server, by_protocol in order:
                for protocol in PROTOCOLS[:: 1 if index % 2 == 0 else -1]:
                    client, inputs = by_protocol[protocol]
                    before = cpu_ns(server.pid)
                    for _ in range(args.calls):
                        client.infer(args.model, inputs)
                    after = cpu_ns(server.pid)
                    rounds.setdefault((label, protocol), []).append(
                        tuple((a - b) / args.calls / 1000 for a, b in zip(after, before))  # type: ignore[misc]
                    )
        for by_protocol in clients:
            for client, _ in by_protocol.values():
                client.close()
    finally:
        for server in servers:
            server.close()
    print(
        f"server CPU µs per call, median of {args.rounds} rounds of {args.calls} "
        f"calls, model {args.model}"
    )
    print(f"{'tree':<10} {'protocol':<8} {'event loop':>10} {'others':>8} {'total':>8}")
    for label, _ in trees:
        totals = {}
        for protocol in PROTOCOLS:
            per_round = rounds[(label, protocol)]
            totals[protocol] = [loop + others for loop, others in per_round]
            loop = statistics.median(r[0] for r in per_round)
            others = statistics.median(r[1] for r in per_round)
            total = statistics.median(totals[protocol])
            print(f"{label:<10} {protocol:<8} {loop:>10.1f} {others:>8.1f} {total:>8.1f}")
        ratios = [g / h for g, h in zip(totals["grpc"], totals["http"], strict=True)]
        ratio = statistics.median(ratios)
        print(f"{label:<10} gRPC/HTTP: {ratio:.2f}x (median of per-round ratios)")


if __name__ == "__main__":
    main()
