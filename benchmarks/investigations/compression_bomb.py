"""Compression bombs (issue 18 item 4): the server's peak memory while it refuses a
small compressed request that inflates to gigabytes, and the stall of another
model's requests meanwhile.

Usage: python -m benchmarks.investigations.compression_bomb [--http-mib 4] [--grpc-mib 1]
       [--tree PATH] [--python PATH] [--rss-cap-mib 12000]

Serves the example repository with one trionserve on free loopback ports, then,
one at a time:

- HTTP: ``POST /v2/models/identity_fp32/infer`` with ``Content-Encoding: gzip`` and
  a body of ``--http-mib`` MiB: gzip of zeros (about 1,000 times as much inflated:
  4 MiB inflates to 4 GiB).
- gRPC: ModelInfer over a channel with gzip compression, the message carrying
  ``--grpc-mib`` GiB of zeros as raw_input_contents (about 1 MiB compressed a GiB;
  grpcio compresses the message itself, so its size is bounded by the client's
  memory and protobuf's 2 GiB).

While each runs, a thread sends ``simple`` requests over HTTP one at a time, and
another samples the server's resident memory (VmRSS) every 10 ms. Printed per bomb:
the answer and how long it took, the server's RSS before and at its peak, and
``simple``'s p50 and longest latency during the bomb (its stall). The server is
killed if its RSS passes ``--rss-cap-mib`` (the figure is then a lower bound).
``--tree`` / ``--python`` as in benchmarks.investigations.rejection_fairness, for a before/after.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import signal
import threading
import time
import zlib
from pathlib import Path

from benchmarks.matrix import EXAMPLES, start_trionserve


def gzip_of_zeros(compressed_mib: float) -> bytes:
    """A gzip stream of zeros about ``compressed_mib`` MiB long (~1,030x inflated)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(64 << 20)
    parts = []
    size = 0
    while size < compressed_mib * (1 << 20):
        part = compressor.compress(chunk)
        parts.append(part)
        size += len(part) or 65_000  # zlib holds output back; about 65 KB a chunk
    parts.append(compressor.flush())
    return b"".join(parts)


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Watch:
    """Samples a process's RSS and probes ``simple`` until stopped."""

    def __init__(self, pid: int, http_url: str, cap_mib: float) -> None:
        self.pid, self.url, self.cap = pid, http_url, cap_mib
        self.peak = rss_mib(pid)
        self.killed = False
        self.latencies: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._sample, daemon=True),
            threading.Thread(target=self._probe, daemon=True),
        ]

    def __enter__(self) -> Watch:
        for thread in self._threads:
            thread.start()
        time.sleep(0.3)  # the probe is running before the bomb goes
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            rss = rss_mib(self.pid)
            self.peak = max(self.peak, rss)
            if rss > self.cap and not self.killed:
                self.killed = True
                os.kill(self.pid, signal.SIGKILL)

    def _probe(self) -> None:
        import numpy as np
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(
            self.url, connection_timeout=300, network_timeout=300
        )
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(np.ones_like(a))
        while not self._stop.is_set():
            began = time.perf_counter()
            try:
                client.infer("simple", inputs)
            except Exception:
                self.errors += 1
                if self.killed:
                    return
                continue
            self.latencies.append((time.perf_counter() - began) * 1000)
        client.close()

    def line(self, baseline: float) -> str:
        ordered = sorted(self.latencies) or [float("nan")]
        return (
            f"RSS {baseline:,.0f} -> peak {self.peak:,.0f} MiB"
            f"{' (killed at the cap)' if self.killed else ''}; simple during it: "
            f"{len(self.latencies)} requests, p50 {ordered[len(ordered) // 2]:.1f} ms, "
            f"longest {ordered[-1]:,.1f} ms, errors {self.errors}"
        )


def http_bomb(url: str, body: bytes) -> str:
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        connection.request(
            "POST",
            "/v2/models/identity_fp32/infer",
            body,
            {"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        response = connection.getresponse()
        return f"{response.status} {response.read()[:120]!r}"
    except (OSError, http.client.HTTPException) as exc:
        return repr(exc)
    finally:
        connection.close()


def grpc_bomb(url: str, gib: float) -> str:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="identity_fp32")
    request.raw_input_contents.append(bytes(int(gib * (1 << 30))))
    with grpc.insecure_channel(url, compression=grpc.Compression.Gzip) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(request, timeout=600)
            return "OK"
        except grpc.RpcError as error:
            return f"{error.code().name} {error.details()[:120]!r}"


def _send(bomb, url: str, payload, answers) -> None:
    """Send one bomb; put when it started (for gRPC that includes grpcio building and
    compressing the message), then its answer."""
    answers.put(time.monotonic())
    answers.put(bomb(url, payload))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-mib", type=float, default=4.0, help="gzip body, MiB")
    parser.add_argument("--grpc-gib", type=float, default=1.0, help="inflated message, GiB")
    parser.add_argument("--tree", type=Path, default=None)
    parser.add_argument("--python", default=None)
    parser.add_argument("--rss-cap-mib", type=float, default=12_000)
    args = parser.parse_args()

    body = gzip_of_zeros(args.http_mib)
    print(f"HTTP body: {len(body) / (1 << 20):.1f} MiB gzip of zeros")
    bombs = [
        ("HTTP gzip", lambda target: (http_bomb, target.http_url, body)),
        ("gRPC gzip", lambda target: (grpc_bomb, target.grpc_url, args.grpc_gib)),
    ]
    context = multiprocessing.get_context("spawn")
    for label, bomb in bombs:
        # A fresh server for each: its peak is this bomb's alone.
        server, target = start_trionserve(
            "trionserve", EXAMPLES, tree=args.tree, python=args.python
        )
        try:
            baseline = rss_mib(server.pid)
            with Watch(server.pid, target.http_url, args.rss_cap_mib) as watch:
                # The bomb goes from its own process: building and compressing a GiB
                # message holds its process's GIL, which must not stall the probe.
                answers = context.Queue()
                sender = context.Process(target=_send, args=(*bomb(target), answers))
                sender.start()
                began_at = answers.get(timeout=600)
                answer = answers.get(timeout=600)
                took = time.monotonic() - began_at
                sender.join(timeout=60)
            print(f"{label}: {answer} in {took:.2f} s; {watch.line(baseline)}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
