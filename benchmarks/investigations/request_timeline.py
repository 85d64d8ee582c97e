"""Where one request's wall time goes: timestamps in the client and the server.

Usage:
    python -m benchmarks.investigations.request_timeline [--requests 2000] [--skip 200]
        [--delay-us 0] [--direct-runs 1000]

Serves ``cnn_onnx`` of benchmarks.served_vs_direct (FP32 [1,3,224,224], 602 KB a
request, one instance, dynamic batching at ``--delay-us``) and sends it requests
one at a time (c=1) with tritonclient over HTTP, from this process. Both sides
take CLOCK_MONOTONIC timestamps (``time.monotonic_ns``: one clock for every
process of the host) at the steps of each request, by wrapping the functions that
do them:

- the client: tritonclient's request building, the socket's ``sendall`` of the
  request, ``infer`` returning, ``as_numpy``;
- the server (a trionserve started with the wrappers installed): httptools'
  message-begin and headers-complete callbacks, the end of the body read, the data
  plane's ``infer``, the ONNX Runtime instance's ``execute`` and its session's
  run (``SessionRun``) in its thread, the response written.

Printed: the median and mean of each step in us, the same model's direct
``Session.run`` for reference, and the event loop's passes (``epoll_wait``) and
task steps per request, counted with a Trio instrument. The wrappers cost a few
microseconds per step. The wrapped names are internal: a refactoring that moves
them breaks this benchmark (tests/unit/test_request_timeline.py says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.served_vs_direct import IMAGE, build_repository, direct_runner
from trionserve.testing import ServerProcess, free_port

# The server: trionserve with timestamps at each step of each request, written as
# JSON to $TIMELINE_OUT when it exits.
_SERVER = r"""
import atexit, functools, json, os, sys, time
import trio
from trionserve import dataplane
from trionserve.backends.onnxruntime import backend as ort_backend
from trionserve.backends.onnxruntime import session_run
from trionserve.protocol.http import answer, h1, transport

now = time.monotonic_ns
current, rows, steps = {}, [], []

def stamp(cls, name, before=None, after=None, begin=False):
    original = getattr(cls, name)
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if begin:
            current.clear()
        if before:
            current[before] = now()
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                current[after] = now()
    setattr(cls, name, wrapper)

def stamp_async(cls, name, before=None, after=None, done=False):
    original = getattr(cls, name)
    @functools.wraps(original)
    async def wrapper(*args, **kwargs):
        if before:
            current[before] = now()
        try:
            return await original(*args, **kwargs)
        finally:
            if after:
                current[after] = now()
            if done:
                rows.append(dict(current))
    setattr(cls, name, wrapper)

class Steps(trio.abc.Instrument):
    started = 0
    def before_task_step(self, task):
        self.started = now()
    def after_task_step(self, task):
        steps.append((task.name, self.started, now()))
    def before_io_wait(self, timeout):
        self.started = now()
    def after_io_wait(self, timeout):
        steps.append(("<io_wait>", self.started, now()))

stamp(h1.H1Connection, "on_message_begin", "s_first_byte", begin=True)
stamp(h1.H1Connection, "on_headers_complete", "s_head")
stamp_async(transport, "read_body", after="s_body")  # (transport.py reads it by this name)
# A request whose head repeats the connection's last one is made without the
# parser's callbacks (h1_request.LastHead): its first byte and head are stamped there.
again = h1.H1Connection._again
@functools.wraps(again)
def again_stamped(self, last, buffer, size):
    current.clear()
    current["s_first_byte"] = now()
    try:
        return again(self, last, buffer, size)
    finally:
        current["s_head"] = now()
        if size == last.length:  # its body came whole with it: no read_body
            current["s_body"] = current["s_head"]
h1.H1Connection._again = again_stamped
# ... or, when that one read is the whole request, made and taken in one step (take_again).
take_again = h1.H1Connection.take_again
@functools.wraps(take_again)
def take_again_stamped(self, size, head, body):
    started = now()
    request = take_again(self, size, head, body)
    if request is not None:  # (else received as any: stamped above)
        current.clear()
        current["s_first_byte"] = started
        current["s_head"] = current["s_body"] = now()
    return request
h1.H1Connection.take_again = take_again_stamped
stamp(ort_backend.OnnxInstance, "execute", "s_stage", after="s_finish")
stamp(session_run.SessionRun, "__call__", "s_run", "s_run_end")
stamp_async(transport._Connection, "respond", "s_respond", "s_sent", done=True)
# An answer the instance's thread encodes and writes itself (protocol/http/answer.py)
# never reaches the connection's respond: stamped where the thread wrote it whole.
thread_write = answer.ConnectionAnswer.write
@functools.wraps(thread_write)
def thread_answer(self, *args, **kwargs):
    current["s_thread_write"] = now()
    written = thread_write(self, *args, **kwargs)
    if written:
        current["s_sent"] = now()
        rows.append(dict(current))
    return written
answer.ConnectionAnswer.write = thread_answer
infer = dataplane.DataPlane.infer
instrumented = []
async def data_plane_infer(self, *args, **kwargs):
    if not instrumented:
        trio.lowlevel.add_instrument(Steps())
        instrumented.append(True)
    current["s_decoded"] = now()
    try:
        return await infer(self, *args, **kwargs)
    finally:
        current["s_inferred"] = now()
dataplane.DataPlane.infer = data_plane_infer
# A repeated request the instance's thread answers is begun (DataPlane.begin_now, as
# plain calls, or the rest of begin) and its outcome taken without a wait (end):
# decoded as it is begun.
begin_now = dataplane.DataPlane.begin_now
def data_plane_begin_now(self, *args, **kwargs):
    if not instrumented:
        trio.lowlevel.add_instrument(Steps())
        instrumented.append(True)
    current["s_decoded"] = now()
    return begin_now(self, *args, **kwargs)
dataplane.DataPlane.begin_now = data_plane_begin_now

def write():
    with open(os.environ["TIMELINE_OUT"], "w") as f:
        json.dump({"rows": rows, "steps": steps}, f)
atexit.register(write)

from trionserve.cli import main
sys.exit(main())
"""

# (label, from, to): the steps of a request, in order.
STEPS = [
    ("client: serialize the request (tritonclient)", "c_start", "c_serialized"),
    ("client: head + body joined for sendall", "c_serialized", "c_sendall"),
    ("loopback, the loop's wake-up, first read parsed", "c_sendall", "s_first_byte"),
    ("server: head parsed", "s_first_byte", "s_head"),
    ("server: rest of the body received", "s_head", "s_body"),
    ("server: decode, admission, to the data plane", "s_body", "s_decoded"),
    ("queue: data plane -> batcher -> executor -> instance thread", "s_decoded", "s_stage"),
    ("instance thread: inputs fed", "s_stage", "s_run"),
    ("instance thread: Session.run", "s_run", "s_run_end"),
    ("instance thread: responses built", "s_run_end", "s_finish"),
    ("back to the event loop, data plane returns", "s_finish", "s_inferred"),
    ("server: encode the response", "s_inferred", "s_respond"),
    ("server: write the response", "s_respond", "s_sent"),
    ("instance thread: encode and write the answer", "s_thread_write", "s_sent"),
    ("client: receive and parse the response", "s_sent", "c_infer_done"),
    ("client: as_numpy", "c_infer_done", "c_end"),
]

# The steps of one way of answering or the other: the event loop encodes and
# writes the answer, or the instance's thread does (protocol/http/answer.py); a
# request goes one way, a run may see both.
ANSWERED_BY = {
    "loop": {
        "back to the event loop, data plane returns",
        "server: encode the response",
        "server: write the response",
    },
    "thread": {"instance thread: encode and write the answer"},
}


def run_client(url: str, requests: int) -> list[dict[str, int]]:
    """``requests`` requests one after the other, with the client's timestamps."""
    import gevent.socket
    import tritonclient.http as httpclient
    from tritonclient.http import _client as client_module

    now = time.monotonic_ns
    current: dict[str, int] = {}
    build = client_module._get_inference_request
    sendall = gevent.socket.socket.sendall

    def timed_build(*args, **kwargs):
        built = build(*args, **kwargs)
        current["c_serialized"] = now()
        return built

    def timed_sendall(self, data, *args):
        if len(data) > 65536:  # the request, not a small write
            current["c_sendall"] = now()
        return sendall(self, data, *args)

    client_module._get_inference_request = timed_build
    gevent.socket.socket.sendall = timed_sendall
    try:
        client = httpclient.InferenceServerClient(url)
        data = np.random.default_rng(1).random((1, *IMAGE), dtype=np.float32)
        tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        rows = []
        for _ in range(requests):
            current.clear()
            current["c_start"] = now()
            result = client.infer("cnn_onnx", [tensor])
            current["c_infer_done"] = now()
            result.as_numpy("OUTPUT0")
            current["c_end"] = now()
            rows.append(dict(current))
        client.close()
        return rows
    finally:
        client_module._get_inference_request = build
        gevent.socket.socket.sendall = sendall


def loop_steps(
    rows: list[dict[str, int]], steps: list[list]
) -> tuple[float, list[tuple[str, float, float]]]:
    """(epoll waits per request, [(task, steps per request, us per request)]) over
    the requests' span."""
    begin, end = rows[0]["s_first_byte"], rows[-1]["s_sent"]
    counts: Counter[str] = Counter()
    spent: Counter[str] = Counter()
    for name, started, ended in steps:
        if begin <= started < end:
            counts[name] += 1
            spent[name] += ended - started
    n = len(rows)
    waits = counts.pop("<io_wait>", 0) / n
    spent.pop("<io_wait>", None)
    tasks = [(name, count / n, spent[name] / n / 1000) for name, count in counts.most_common()]
    return waits, tasks


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--skip", type=int, default=200, help="first requests left out")
    parser.add_argument("--delay-us", type=int, default=0, help="the batch delay")
    parser.add_argument("--direct-runs", type=int, default=1000, help="direct Session.runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="timeline-") as scratch:
        root = Path(scratch)
        [spec] = build_repository(root / "models", ["cnn_onnx"], False, print, [args.delay_us])
        port = free_port()
        out = root / "server.json"
        command = [
            sys.executable,
            "-c",
            _SERVER,
            f"--model-repository={root / 'models'}",
            "--http-address=127.0.0.1",
            f"--http-port={port}",
            "--grpc-port=0",
            "--allow-metrics=false",
        ]
        server = ServerProcess("timeline", command, {"TIMELINE_OUT": str(out)}, cwd=os.getcwd())
        try:
            server.wait_http(f"127.0.0.1:{port}", "/v2/health/ready", 120)
            client_rows = run_client(f"127.0.0.1:{port}", args.requests)
        finally:
            server.stop()
        if not out.exists():
            raise SystemExit("the server wrote no timestamps:\n" + server.output())
        dump = json.loads(out.read_text())
        server_rows = dump["rows"][-len(client_rows) :]
        if len(server_rows) != len(client_rows):
            raise SystemExit(f"{len(client_rows)} requests sent, {len(server_rows)} answered")
        rows = [c | s for c, s in zip(client_rows, server_rows)][args.skip :]
        runner = direct_runner(spec, root / "models" / "cnn_onnx" / "1" / "model.onnx")
    batch = np.random.default_rng(1).random((1, *IMAGE), dtype=np.float32)
    for _ in range(min(100, args.direct_runs)):
        runner(batch)
    direct = []
    for _ in range(args.direct_runs):
        began = time.monotonic_ns()
        runner(batch)
        direct.append((time.monotonic_ns() - began) / 1000)

    print(
        f"\ncnn_onnx over HTTP, c=1, batch delay {args.delay_us} us, {len(rows)} requests; "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| step | median us | mean us |")
    print("| --- | ---: | ---: |")
    for label, start, end in STEPS:
        spans = [(r[end] - r[start]) / 1000 for r in rows if start in r and end in r]
        if spans:
            print(f"| {label} | {statistics.median(spans):,.0f} | {statistics.mean(spans):,.0f} |")
    whole = [(r["c_end"] - r["c_start"]) / 1000 for r in rows]
    print(f"| **the whole request, as the client sees it** | **{statistics.median(whole):,.0f}** |")
    print(f"\ndirect Session.run, batch 1, same input: median {statistics.median(direct):,.0f} us")
    waits, tasks = loop_steps(rows, dump["steps"])
    print(f"\nthe event loop per request: {waits:.2f} epoll waits; task steps:")
    for name, count, us in tasks:
        print(f"  {name[-72:]:<72} {count:5.2f} steps {us:8.1f} us")


if __name__ == "__main__":
    main()
