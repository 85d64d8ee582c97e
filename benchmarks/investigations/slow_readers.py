"""Clients that never read (issue 42): the server's memory while N clients of a
decoupled model's large stream take nothing, whether another client is still
served meanwhile, and whether the memory is given back once they leave.

Usage: python -m benchmarks.investigations.slow_readers [--sse 200] [--grpc 50] [--responses 300]
       [--response-mib 1] [--hold 20] [--after 10] [--rss-cap-mib 12000]
       [--tree PATH] [--python PATH] [-- server flags...]

Serves the example repository and a decoupled Python model, ``firehose``, that
answers each request with ``--responses`` responses of ``--response-mib`` MiB (a
BYTES output; a thread per request, as a streaming model is written). Then:

- ``--sse`` clients, each a raw socket with a 4 KiB receive buffer, send
  ``POST /v2/models/firehose/generate_stream`` and never read;
- ``--grpc`` clients, each an HTTP/2 connection (h2) that grants no window
  (SETTINGS_INITIAL_WINDOW_SIZE 0, no WINDOW_UPDATE), open a ``ModelStreamInfer``
  stream, send one request and never read.

For ``--hold`` seconds a thread samples the resident memory of the server and of
its stubs (VmRSS from /proc) every 50 ms, and another sends ``simple`` over HTTP
one request at a time; then the clients close, and ``--after`` seconds later the
memory is read again. Printed: idle RSS, the peak, the RSS after, the server's
answers to the clients (status lines), ``simple``'s p50 and longest latency and
its errors. Server flags after ``--`` (e.g. ``--client-buffer-limit=1Gi``) are
passed on.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.matrix import start_trionserve, tree_pids
from tests.serverproc import EXAMPLES
from tests.slow_clients import grpc_client, rss_mib, sse_client, status_line, write_repository


def tree_rss(pid: int) -> tuple[float, float]:
    """(the server's RSS, its children's together), MiB."""
    pids = tree_pids(pid)
    return rss_mib(pid), sum(rss_mib(child) for child in pids if child != pid)


class Watch:
    """Samples the server's tree RSS and probes ``simple`` until stopped."""

    def __init__(self, pid: int, http_url: str, cap_mib: float) -> None:
        self.pid, self.url, self.cap = pid, http_url, cap_mib
        self.peak, self.peak_children = tree_rss(pid)
        self.killed = False
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._sample, daemon=True),
            threading.Thread(target=self._probe, daemon=True),
        ]

    def __enter__(self) -> Watch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            server, children = tree_rss(self.pid)
            self.peak = max(self.peak, server)
            self.peak_children = max(self.peak_children, children)
            if server + children > self.cap and not self.killed:
                self.killed = True
                os.killpg(self.pid, signal.SIGKILL)

    def _probe(self) -> None:
        import numpy as np
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.url, network_timeout=60)
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(np.ones_like(a))
        while not self._stop.wait(0.02):
            began = time.perf_counter()
            try:
                client.infer("simple", inputs)
            except Exception as exc:
                self.errors.append(repr(exc)[:200])
                if self.killed:
                    return
                continue
            self.latencies.append((time.perf_counter() - began) * 1000)
        client.close()


def main() -> None:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sse", type=int, default=200)
    parser.add_argument("--grpc", type=int, default=50)
    parser.add_argument("--responses", type=int, default=300)
    parser.add_argument("--response-mib", type=float, default=1.0)
    parser.add_argument("--hold", type=float, default=20.0, help="seconds the clients stay")
    parser.add_argument("--after", type=float, default=10.0, help="seconds after they leave")
    parser.add_argument("--rss-cap-mib", type=float, default=12_000)
    parser.add_argument("--tree", type=Path, default=None)
    parser.add_argument("--python", default=None)
    args = parser.parse_args(argv)
    size = int(args.response_mib * (1 << 20))

    with tempfile.TemporaryDirectory() as tmp:
        repository = write_repository(Path(tmp))
        server, target = start_trionserve(
            "trionserve",
            EXAMPLES,
            args=[f"--model-repository={repository}", *server_args],
            tree=args.tree,
            python=args.python,
        )
        try:
            time.sleep(2.0)
            idle, idle_children = tree_rss(server.pid)
            print(f"server flags: {' '.join(server_args) or '(defaults)'}")
            print(f"idle: server {idle:,.0f} MiB, stubs {idle_children:,.0f} MiB")
            sockets: list[tuple[str, socket.socket]] = []
            with Watch(server.pid, target.http_url, args.rss_cap_mib) as watch:
                for _ in range(args.sse):
                    sockets.append(("sse", sse_client(target.http_url, args.responses, size)))
                for _ in range(args.grpc):
                    sockets.append(("grpc", grpc_client(target.grpc_url, args.responses, size)))
                time.sleep(args.hold)
            answers: dict[str, int] = {}
            for kind, sock in sockets:
                if kind == "sse":
                    line = f"sse: {status_line(sock)}"
                    answers[line] = answers.get(line, 0) + 1
            for _, sock in sockets:
                sock.close()
            time.sleep(args.after)
            after, after_children = tree_rss(server.pid)
            ordered = sorted(watch.latencies) or [float("nan")]
            print(
                f"{args.sse} SSE + {args.grpc} gRPC clients, {args.responses} x "
                f"{args.response_mib:g} MiB each, held {args.hold:g} s:"
            )
            print(
                f"  server RSS {idle:,.0f} -> peak {watch.peak:,.0f} MiB "
                f"(+{watch.peak - idle:,.0f}), {args.after:g} s after they left "
                f"{after:,.0f} MiB (+{after - idle:,.0f})"
                f"{' (killed at the cap)' if watch.killed else ''}"
            )
            print(
                f"  stubs RSS {idle_children:,.0f} -> peak {watch.peak_children:,.0f} MiB, "
                f"after {after_children:,.0f} MiB"
            )
            for line, n in sorted(answers.items()):
                print(f"  {n} x {line}")
            print(
                f"  simple meanwhile: {len(watch.latencies)} requests, p50 "
                f"{ordered[len(ordered) // 2]:.1f} ms, longest {ordered[-1]:,.1f} ms, "
                f"errors {len(watch.errors)} {watch.errors[:2]}"
            )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
