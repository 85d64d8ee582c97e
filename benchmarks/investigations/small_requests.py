"""The event loop's CPU per small request: this tree against others, one run.

Usage:
    python -m benchmarks.investigations.small_requests --tree before=PATH [--duration 3]
        [--rounds 3] [--concurrency 1,16] [--models simple,add_sub_inproc,add_sub_loop]

Every server runs from its own source tree (``--tree LABEL=PATH``, e.g. ``git
archive`` of an older commit unpacked outside the repository; this checkout is
``after``) and serves ONNX ``simple`` and Triton's add_sub ``model.py`` as an
in-process Python model (``add_sub_inproc``, one instance; ``add_sub_loop``, the
same with ``INPROCESS_EXECUTE_ON`` ``event_loop``), all add/sub of INT32 [1,16].
The load is a closed loop of raw keep-alive HTTP/1.1 connections, all on
one selector thread of this process, sending one prepared binary-tensor request
each: it costs far less CPU than tritonclient's clients, so more of the machine's
two cores is left to the server. Points are interleaved, the order of the servers
rotated each round.

Per point: infer/s, the server's CPU ms per inference (all its threads) and the
event loop thread's (from ``/proc/PID/task/PID/stat``), each with its ratio to
the first tree's.
"""

from __future__ import annotations

import argparse
import json
import selectors
import shutil
import socket
import tempfile
import time
from pathlib import Path

from benchmarks.investigations.loop_cpu import thread_cpu_seconds
from benchmarks.matrix import EXAMPLES, ROOT, cpu_seconds, start_trionserve

_INPROC = 'parameters { key: "EXECUTION_MODE" value: { string_value: "in_process" } }\n'
_ON_LOOP = 'parameters { key: "INPROCESS_EXECUTE_ON" value: { string_value: "event_loop" } }\n'


def write_repository(root: Path) -> Path:
    """ONNX ``simple``, the in-process ``add_sub_inproc`` and ``add_sub_loop``
    (the same, its execute on the event loop)."""
    repository = root / "models"
    shutil.copytree(EXAMPLES / "simple", repository / "simple")
    model = repository / "add_sub_inproc"
    shutil.copytree(EXAMPLES / "add_sub_python", model)
    config = (model / "config.pbtxt").read_text()
    config = config.replace('name: "add_sub_python"', 'name: "add_sub_inproc"')
    (model / "config.pbtxt").write_text(config.replace("count: 2", "count: 1") + _INPROC)
    loop = repository / "add_sub_loop"
    shutil.copytree(model, loop)
    config = (loop / "config.pbtxt").read_text()
    config = config.replace('name: "add_sub_inproc"', 'name: "add_sub_loop"')
    (loop / "config.pbtxt").write_text(config + _ON_LOOP)
    return repository


def request_bytes(model: str) -> bytes:
    """One keep-alive infer request: two INT32 [1,16] inputs, binary outputs."""
    header = {
        "inputs": [
            {
                "name": name,
                "shape": [1, 16],
                "datatype": "INT32",
                "parameters": {"binary_data_size": 64},
            }
            for name in ("INPUT0", "INPUT1")
        ],
        "outputs": [
            {"name": name, "parameters": {"binary_data": True}} for name in ("OUTPUT0", "OUTPUT1")
        ],
    }
    head = json.dumps(header).encode()
    body = head + bytes(range(64)) + bytes(64)
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: bench\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(head)}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def closed_loop(address: tuple[str, int], request: bytes, concurrency: int, seconds: float):
    """(responses, errors) of ``concurrency`` connections for ``seconds``."""
    selector = selectors.DefaultSelector()
    sockets = []
    for _ in range(concurrency):
        sock = socket.create_connection(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(request)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, bytearray())
        sockets.append(sock)
    done = errors = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for key, _ in selector.select(1.0):
                sock, buffer = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("the server closed a connection")
                buffer += chunk
                while (head_end := buffer.find(b"\r\n\r\n")) >= 0:
                    head = bytes(buffer[:head_end]).lower()
                    start = head.index(b"\r\ncontent-length:") + 17
                    stop = head.find(b"\r\n", start)
                    length = int(head[start : stop if stop > 0 else None])
                    if len(buffer) < head_end + 4 + length:
                        break
                    errors += not buffer.startswith(b"HTTP/1.1 200")
                    del buffer[: head_end + 4 + length]
                    done += 1
                    sock.setblocking(True)
                    sock.sendall(request)
                    sock.setblocking(False)
    finally:
        for sock in sockets:
            sock.close()
    return done, errors


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH (repeatable)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--models", default="simple,add_sub_inproc,add_sub_loop")
    args = parser.parse_args()
    trees = [(label, Path(path)) for label, _, path in (t.partition("=") for t in args.tree)]
    trees.append(("after", ROOT))
    cells: dict[tuple[str, int, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repository = write_repository(Path(tmp))
        servers = [start_trionserve(label, repository, tree=tree) for label, tree in trees]
        try:
            for round_ in range(args.rounds):
                shift = round_ % len(servers)
                order = servers[shift:] + servers[:shift]
                for model in args.models.split(","):
                    request = request_bytes(model)
                    for concurrency in map(int, args.concurrency.split(",")):
                        for _, target in order:
                            host, port = target.http_url.rsplit(":", 1)
                            address = (host, int(port))
                            closed_loop(address, request, concurrency, 0.5)  # warm up
                            pid = target.pid
                            cpu, loop = cpu_seconds([pid]), thread_cpu_seconds(pid, pid)
                            began = time.monotonic()
                            done, errors = closed_loop(address, request, concurrency, args.duration)
                            cell = cells.setdefault((model, concurrency, target.label), [0.0] * 5)
                            cell[0] += done
                            cell[1] += time.monotonic() - began
                            cell[2] += cpu_seconds([pid]) - cpu
                            cell[3] += thread_cpu_seconds(pid, pid) - loop
                            cell[4] += errors
        finally:
            for server, _ in servers:
                server.stop()
    first = trees[0][0]
    print(
        f"{'model':15} {'c':>3} {'tree':8} {'infer/s':>8} {'x':>5} "
        f"{'CPU ms/inf':>10} {'x':>5} {'loop ms/inf':>11} {'errors':>6}"
    )
    for (model, concurrency, label), (done, seconds, cpu, loop, errors) in cells.items():
        base = cells[(model, concurrency, first)]
        rate, cpu_each = done / seconds, cpu / done * 1e3
        print(
            f"{model:15} {concurrency:3} {label:8} {rate:8.0f} {rate / (base[0] / base[1]):5.2f} "
            f"{cpu_each:10.3f} {cpu_each / (base[2] / base[0] * 1e3):5.2f} "
            f"{loop / done * 1e3:11.3f} {int(errors):6}"
        )


if __name__ == "__main__":
    main()
