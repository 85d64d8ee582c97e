"""Server CPU per unary call over gRPC and over HTTP, by thread, interleaved.

Usage:
    python -m benchmarks.investigations.grpc_http_cpu [--tree LABEL=PATH ...]
        [--variant 'LABEL=FLAGS' ...]
        [--rounds 10] [--calls 300] [--model simple] [--repository DIR] [--flags "..."]
        [--callgrind] [--cnn]

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
are printed, with the median of the per-round gRPC/HTTP ratios, and this
checkout's event loop against each other tree's, as the median of per-round
ratios (the trees run in turn within a round, so the machine's drift cancels). CPU time, not
wall time: on a shared machine it moves much less with the load than infer/s.

With ``--cnn`` the servers serve benchmarks.served_vs_direct's ``cnn_onnx``
(written into a temporary repository) and each call sends one 602 KB FP32
image [1,3,224,224] (issue 39's large request): the model runs on its
instance's thread ("others"), the event loop's column is the transport's and
the data plane's work per large call.

With ``--callgrind`` each server runs under ``valgrind --tool=callgrind
--instr-atstart=no --separate-threads=yes`` instead, and the figure is
instructions per call, which the machine's load does not move: after the
warm-up, instrumentation is switched on for ``--calls`` calls of each protocol
(``callgrind_control -i on``, then ``--dump``, then ``-i off``; one round), and
the dumps' totals are read by thread as above (thread 1 is the event loop).
Under valgrind a run of the model is slow enough that batches an idle instance
runs inline on a quiet machine may go to the instance's thread: read the event
loop's column and the total together.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from benchmarks.matrix import EXAMPLES
from benchmarks.served_vs_direct import IMAGE, build_repository
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


def _callgrind_python(directory: Path) -> str:
    """A launcher that runs this interpreter under callgrind, counting nothing
    until told to, each thread's counts apart, its dumps in ``directory``."""
    launcher = directory / "python-callgrind"
    out = directory / "callgrind.out.%p"
    launcher.write_text(
        "#!/bin/sh\n"
        "exec valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes "
        f'--callgrind-out-file={shlex.quote(str(out))} {shlex.quote(sys.executable)} "$@"\n'
    )
    launcher.chmod(0o755)
    return str(launcher)


def _dumped(directory: Path, pid: int, label: str) -> tuple[int, int]:
    """(event loop thread, every other thread) instructions of the dump made with
    ``label``, once valgrind has written it (callgrind_control returns before it
    has; dumps are found by their label, as the server may dump on its own)."""
    trigger = f"desc: Trigger: dump {label}\n".encode()
    deadline = time.monotonic() + 120
    while True:
        counts = {}
        for path in directory.glob(f"callgrind.out.{pid}.*"):
            text = path.read_bytes()
            if trigger in text[:2048]:
                found = re.search(rb"^totals: (\d+)", text, re.MULTILINE)
                counts[path.name] = int(found.group(1)) if found else None
        if counts and None not in counts.values():
            time.sleep(0.5)  # every thread's file written
            names = {p.name for p in directory.glob(f"callgrind.out.{pid}.*")}
            if all(name in names for name in counts):
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"callgrind wrote no whole dump {label} for {pid}")
        time.sleep(0.2)
    loop = others = 0
    for name, count in counts.items():
        assert count is not None
        if count >= 2**62:  # a thread that ended: its counter wrapped below zero
            continue
        if name.endswith("-01"):
            loop += count
        else:
            others += count
    return loop, others


def _control(pid: int, *options: str) -> None:
    subprocess.run(["callgrind_control", *options, str(pid)], check=True, capture_output=True)


def _callgrind(servers: list, clients: list, labels: list[str], args, directory: Path) -> None:
    print(f"server instructions per call ({args.calls} calls a dump), model {args.model}")
    print(f"{'tree':<10} {'protocol':<8} {'event loop':>12} {'others':>10} {'total':>12}")
    totals: dict[tuple[str, str], list[float]] = {}
    # A first command reaches a server late (valgrind's gdbserver starting up):
    # a dump before any measured one, so that every measured batch is counted.
    for server, by_protocol in zip(servers, clients, strict=True):
        control = functools.partial(_control, server.pid)
        control("-i", "on")
        client, inputs = by_protocol["http"]
        for _ in range(20):
            client.infer(args.model, inputs)
        control("-d", "first")
        control("-i", "off")
        _dumped(directory, server.pid, "first")
    for index in range(args.rounds):
        for label, server, by_protocol in zip(labels, servers, clients, strict=True):
            control = functools.partial(_control, server.pid)
            for protocol in PROTOCOLS[:: 1 if index % 2 == 0 else -1]:
                client, inputs = by_protocol[protocol]
                for attempt in range(3):
                    control("-i", "on")
                    for _ in range(args.calls):
                        client.infer(args.model, inputs)
                    dump = f"{protocol}-{index}-{attempt}"
                    control("-d", dump)
                    control("-i", "off")
                    counted = _dumped(directory, server.pid, dump)
                    # Now and then a command reaches the server after the batch
                    # (nothing counted): the batch is run again.
                    if counted[0]:
                        break
                loop, others = (count / args.calls for count in counted)
                totals.setdefault((label, protocol), []).append(loop)
                print(
                    f"{label:<10} {protocol:<8} {loop:>12,.0f} {others:>10,.0f} "
                    f"{loop + others:>12,.0f}"
                )
    for label in labels:
        grpc, http = (statistics.median(totals[(label, p)]) for p in ("grpc", "http"))
        print(
            f"{label:<10} event loop gRPC/HTTP: {grpc / http:.2f}x "
            f"(medians {grpc:,.0f} / {http:,.0f})"
        )


def _inputs(module, cnn: bool = False):
    if cnn:  # one 602 KB image, as benchmarks.served_vs_direct sends it
        image = np.random.default_rng(0).random((1, *IMAGE), dtype=np.float32)
        tensor = module.InferInput("INPUT0", list(image.shape), "FP32")
        if module is httpclient:
            tensor.set_data_from_numpy(image, binary_data=True)
        else:
            tensor.set_data_from_numpy(image)
        return [tensor]
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
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='LABEL="FLAGS"',
        help="this checkout's server again with more flags, compared as a --tree",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--model", default="simple")
    parser.add_argument(
        "--repository", type=Path, default=EXAMPLES, help="the model repository served"
    )
    parser.add_argument("--flags", default="", help="more trionserve flags, space-separated")
    parser.add_argument(
        "--callgrind", action="store_true", help="instructions per call under callgrind"
    )
    parser.add_argument(
        "--cnn",
        action="store_true",
        help="serve benchmarks.served_vs_direct's cnn_onnx and send it 602 KB images",
    )
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="grpc-http-callgrind-")
    directory = Path(scratch.name)
    if args.cnn:
        args.model = "cnn_onnx"
        args.repository = directory / "models"
        build_repository(args.repository, [args.model], False, print)
    python = _callgrind_python(directory) if args.callgrind else None
    trees: list[tuple[str, Path | None]] = [("this", None)]
    trees += [(label, Path(path)) for label, path in (t.split("=", 1) for t in args.tree)]
    # A variant: this checkout with more flags of its own (compared as a tree is).
    variants = dict(v.split("=", 1) for v in args.variant)
    trees += [(label, None) for label in variants]
    servers = []
    try:
        for label, tree in trees:
            flags = ["--allow-metrics=false", *args.flags.split()]
            flags += variants.get(label, "").split()
            server = TrionServe(args.repository, args=flags, label=label, tree=tree, python=python)
            servers.append(server)
            server.wait_http(server.http_url, f"/v2/models/{args.model}/ready", 900)
        clients = [
            {
                "http": (
                    httpclient.InferenceServerClient(s.http_url),
                    _inputs(httpclient, args.cnn),
                ),
                "grpc": (
                    grpcclient.InferenceServerClient(s.grpc_url),
                    _inputs(grpcclient, args.cnn),
                ),
            }
            for s in servers
        ]
        for by_protocol in clients:  # warm-up
            for client, inputs in by_protocol.values():
                for _ in range(200):
                    client.infer(args.model, inputs)
        if args.callgrind:
            _callgrind(servers, clients, [label for label, _ in trees], args, directory)
            return
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
        scratch.cleanup()
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
    # Each other tree's event loop and other threads (the instance's) against
    # this checkout's, round by round (the servers run in turn within a round:
    # the machine's drift cancels).
    for label, _ in trees[1:]:
        for protocol in PROTOCOLS:
            for column, thread in enumerate(("event loop", "others")):
                pairs = zip(rounds[("this", protocol)], rounds[(label, protocol)], strict=True)
                paired = [this[column] / other[column] for this, other in pairs if other[column]]
                if not paired:  # (none on that thread: a model run inline on the loop)
                    continue
                lower = sum(r < 1 for r in paired)
                print(
                    f"this / {label} {thread}, {protocol}: {statistics.median(paired):.3f} "
                    f"(median of per-round ratios; lower in {lower}/{len(paired)} rounds)"
                )


if __name__ == "__main__":
    main()
