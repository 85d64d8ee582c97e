"""The readiness pipe between a worker and its supervisor.

A worker writes one JSON line on the pipe the supervisor passed it
(``--worker-ready-fd``) once its frontends listen and its models are loaded, and
closes it: the loopback ports it has bound for the supervisor (its own statistics
and, with metrics enabled, its metrics). The ports are read from the worker's
listening sockets after the bind, never chosen in advance, so they are the ones
it serves. A pipe closed without a line means the worker never became ready.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

# The longest line a worker writes; more is a broken worker, not a ready one.
MAX_READY_LINE = 1024


@dataclass(frozen=True)
class WorkerPorts:
    """The loopback ports a ready worker serves the supervisor on."""

    statistics: int  # its own statistics (the private statistics route)
    metrics: int | None  # its metrics exposition; None: metrics are off

    def line(self) -> bytes:
        return json.dumps({"statistics": self.statistics, "metrics": self.metrics}).encode() + b"\n"


def _port(value: object) -> int | None:
    return value if type(value) is int and 0 < value < 65536 else None


def parse_ready_line(data: bytes) -> WorkerPorts | None:
    """The ports a worker reported as it became ready; None: it never did."""
    line = data.split(b"\n", 1)[0]
    try:
        ports = json.loads(line)
    except ValueError:
        return None
    if not isinstance(ports, dict):
        return None
    statistics = _port(ports.get("statistics"))
    if statistics is None:
        return None
    return WorkerPorts(statistics, _port(ports.get("metrics")))


class ReadyReporter:
    """The task status given to ``Server.serve`` in a worker: ``started`` (the
    server listens and its models are loaded) writes ``ports()``, read at that
    moment from the bound sockets, on the pipe ``fd`` and closes it, then runs
    ``on_ready``. Without a pipe (``fd`` None) it only runs ``on_ready``."""

    def __init__(
        self, fd: int | None, on_ready: Callable[[], None], ports: Callable[[], WorkerPorts]
    ) -> None:
        self._fd = fd
        self._on_ready = on_ready
        self._ports = ports

    def started(self, value: object = None) -> None:
        if self._fd is not None:
            os.write(self._fd, self._ports().line())
            os.close(self._fd)
            self._fd = None
        self._on_ready()


async def receive_ready(read_fd: int) -> WorkerPorts | None:
    """Wait on the read end of a worker's readiness pipe (closed on return) for
    its line: the ports it reported, or None when it closed the pipe (exited)
    without becoming ready."""
    async with trio.lowlevel.FdStream(read_fd) as pipe:
        data = b""
        while len(data) < MAX_READY_LINE and b"\n" not in data:
            chunk = await pipe.receive_some(MAX_READY_LINE)
            if not chunk:
                break
            data += chunk
    return parse_ready_line(data)
