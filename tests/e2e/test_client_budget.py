"""One budget of bytes held for clients, the whole server's (--client-buffer-limit):
clients that never read, over HTTP (generate_stream) and gRPC (ModelStreamInfer
with no window), each asking for far more than the budget, on a real server with a
real decoupled Python model (tests/slow_clients.py)."""

from __future__ import annotations

import shutil
import socket
import threading
import time

import numpy as np
import tritonclient.http as httpclient

from tests.helpers import wait_for
from tests.serverproc import EXAMPLES, serving
from tests.slow_clients import grpc_client, rss_mib, sse_client, status_line, write_repository

MIB = 1 << 20
BUDGET = 128 * MIB
RESPONSES, SIZE = 300, MIB  # 300 MiB asked by each client
SSE, GRPC = 10, 5  # together 4.5 GB asked of a 128 MiB budget
# What RSS may show beyond idle + budget: the transient copies of the responses
# being encoded and written (not held for a client), Python's and glibc's slack.
MARGIN = 96 * MIB


def simple_inputs():
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return inputs


def test_clients_that_never_read_hold_the_budget_and_no_more(tmp_path):
    repository = write_repository(tmp_path / "repo")
    shutil.copytree(EXAMPLES / "simple", repository / "simple")
    args = [
        f"--client-buffer-limit={BUDGET // MIB}Mi",
        "--client-buffer-stall-secs=1",
        f"--http-max-input-size={1 << 30}",
    ]
    with serving(repository, args=args) as server:
        # A body that would take the budget past its limit is refused from its
        # head, before it is read.
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
            sock.sendall(
                b"POST /v2/models/simple/infer HTTP/1.1\r\nhost: x\r\n"
                b"content-length: %d\r\n\r\n" % (BUDGET + 1)
            )
            refused = sock.recv(65536)
        assert refused.startswith(b"HTTP/1.1 503"), refused
        assert b"a request body refused" in refused and b"--client-buffer-limit" in refused
        client = httpclient.InferenceServerClient(server.http_url)
        inputs = simple_inputs()
        # Warm: the paths the clients take, once read in full.
        sock = sse_client(server.http_url, 4, SIZE)
        sock.settimeout(30)
        received = b""
        while received.count(b"data: ") < 4:
            received += sock.recv(1 << 20)
        sock.close()
        client.infer("simple", inputs)
        time.sleep(0.5)
        idle = rss_mib(server.process.pid) * MIB

        peak = idle
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.02):
                peak = max(peak, rss_mib(server.process.pid) * MIB)

        sampler = threading.Thread(target=sample)
        sampler.start()
        served = 0
        try:
            sockets = [sse_client(server.http_url, RESPONSES, SIZE) for _ in range(SSE)]
            sockets += [
                grpc_client(f"127.0.0.1:{server.grpc_port}", RESPONSES, SIZE) for _ in range(GRPC)
            ]
            # Another client is served meanwhile, while the budget is full and
            # the pressure policy cancels the stalled streams.
            # (at least 2.5 s, 20 requests, and until the pressure policy acted)
            ends, limit = time.monotonic() + 2.5, time.monotonic() + 60
            evicted = "cancelled under memory pressure"
            while time.monotonic() < limit and (
                time.monotonic() < ends or served < 20 or evicted not in server.output()
            ):
                result = client.infer("simple", inputs)
                assert result.as_numpy("OUTPUT0").tolist() == [[i + 1 for i in range(16)]]
                served += 1
            answers = [status_line(sock, 5.0) for sock in sockets[:SSE]]
        finally:
            done.set()
            sampler.join()
        print(
            f"idle {idle / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB "
            f"(+{(peak - idle) / MIB:.0f}), simple served {served}, SSE answers {answers}"
        )
        assert all(a in ("HTTP/1.1 200 OK", "HTTP/1.1 503 Service Unavailable") for a in answers)
        assert peak <= idle + BUDGET + MARGIN, (peak - idle) / MIB
        # The pressure policy cancelled stalled streams (clients that took nothing
        # for --client-buffer-stall-secs while the budget was full).
        assert evicted in server.output()
        for sock in sockets:
            sock.close()
        # What the burst took is given back.
        wait_for(
            lambda: rss_mib(server.process.pid) * MIB <= idle + 50 * MIB,
            "the server's memory to come back to idle",
            timeout=10,
        )
        client.infer("simple", inputs)
        client.close()
