"""The readiness pipe of --workers: a worker's line, written when its server has
started, is read back by the supervisor as the ports it reported; a pipe closed
without a line, or a line that names no statistics port, is a worker that never
became ready."""

from __future__ import annotations

import os

import pytest

from trionserve.workers.readiness import (
    ReadyReporter,
    WorkerPorts,
    parse_ready_line,
    receive_ready,
)


async def test_the_reported_ports_reach_the_supervisor_once_started():
    read_fd, write_fd = os.pipe()
    calls: list[str] = []

    def ports() -> WorkerPorts:
        calls.append("ports")
        return WorkerPorts(statistics=40001, metrics=40002)

    reporter = ReadyReporter(write_fd, lambda: calls.append("on_ready"), ports)
    assert calls == []  # nothing is read before the server has started
    reporter.started()
    # Ports read at started(), then the pipe closed, then on_ready.
    assert calls == ["ports", "on_ready"]
    # The line is read without waiting for the worker to exit: the pipe is closed.
    assert await receive_ready(read_fd) == WorkerPorts(statistics=40001, metrics=40002)


async def test_a_pipe_closed_without_a_line_is_not_ready():
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    assert await receive_ready(read_fd) is None


@pytest.mark.parametrize(
    "line, expected",
    [
        (b'{"statistics": 5000, "metrics": null}\n', WorkerPorts(5000, None)),
        (b'{"statistics": 5000, "metrics": 5001}\nextra', WorkerPorts(5000, 5001)),
        (b'{"statistics": 5000, "metrics": 70000}\n', WorkerPorts(5000, None)),
        (b'{"metrics": 5001}\n', None),
        (b'{"statistics": 0}\n', None),
        (b'{"statistics": true}\n', None),
        (b"[5000]\n", None),
        (b"not json\n", None),
        (b"", None),
    ],
)
def test_parse_ready_line(line, expected):
    assert parse_ready_line(line) == expected
