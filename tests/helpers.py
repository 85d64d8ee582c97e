"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.serverproc import ROOT

T = TypeVar("T")


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``python -m trionserve ARGS`` from the repository's root, run to its end, with
    its output captured as text (a command that should fail or print and exit; a
    server that keeps running is :class:`tests.serverproc.ServerProcess`)."""
    return subprocess.run(
        [sys.executable, "-m", "trionserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def printed_by_new_interpreter(code: str) -> str:
    """What ``python -c CODE`` prints, run to its end from the repository's root in
    a new interpreter (what importing a module pulls in, with nothing loaded yet)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


class _Accepted(Exception):
    """The command line parsed: :func:`cli_usage` stops the run before it would serve."""


def cli_usage(*args: str) -> subprocess.CompletedProcess:
    """``trionserve ARGS`` for a command line the server refuses, run in this process
    as ``python -m trionserve`` runs it (``trionserve.__main__.run``, ``sys.argv``
    set) with its exit code and output as :func:`run_cli` returns them, without a
    new interpreter importing the whole server first (about a second each; usage
    errors are found before the server is made). A command line that parses stops
    at the logging set-up that follows, before anything is configured or served,
    with exit code 0. ``run_cli`` is the real process: the tests of what the
    interpreter adds (one line, the exit status) run it."""
    from unittest import mock

    import trionserve.cli
    from trionserve.__main__ import run

    def accepted(*_args: Any, **_kwargs: Any) -> None:
        raise _Accepted

    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        mock.patch.object(sys, "argv", ["trionserve", *args]),
        mock.patch.object(trionserve.cli, "configure_logging", accepted),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        try:
            code = run()
        except SystemExit as exit_:  # as the interpreter ends on it
            code = 0 if exit_.code is None else exit_.code
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except _Accepted:
            code = 0
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def wait_for(
    predicate: Callable[[], T], what: str, timeout: float = 30.0, interval: float = 0.02
) -> T:
    """Poll ``predicate`` (state of another process: a server, a cluster, a file)
    until it returns something truthy, and return that; fail naming ``what`` and
    the last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def tcp_sockets(pid: int) -> list[tuple[int, str]]:
    """The TCP sockets process ``pid`` holds, as (local port, state) with the kernel's
    state codes ("0A" listening, "01" established, "08" close-wait, ...): its socket
    inodes (``/proc/PID/fd``) matched against the kernel's tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    sockets = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):  # a kernel without IPv6
            continue
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if fields[9] in inodes:
                    sockets.append((int(fields[1].rsplit(":", 1)[1], 16), fields[3]))
    return sockets


def simple_inputs(
    a: np.ndarray | None = None,
    b: np.ndarray | None = None,
    module: Any = httpclient,
    binary: bool = True,
) -> list:
    """INPUT0 and INPUT1 of the ``simple`` model for ``module`` (tritonclient.http
    or tritonclient.grpc): ``a`` (default ``arange(16)`` as ``[1, 16]`` INT32) and
    ``b`` (default ones shaped as ``a``); ``binary`` picks HTTP's binary tensors."""
    if a is None:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
    if b is None:
        b = np.ones_like(a)
    extra = {"binary_data": binary} if module is httpclient else {}
    inputs = []
    for name, data in (("INPUT0", a), ("INPUT1", b)):
        tensor = module.InferInput(name, list(data.shape), "INT32")
        tensor.set_data_from_numpy(data, **extra)
        inputs.append(tensor)
    return inputs


def expect_error(
    call: Callable[[], object], fragment: str, status: int | str | None = None
) -> InferenceServerException:
    """The tritonclient error ``call`` raises; its message must contain ``fragment``
    and, when given, its status be ``status`` (an HTTP code, or a gRPC code name
    such as ``"INVALID_ARGUMENT"``)."""
    with pytest.raises(InferenceServerException) as info:
        call()
    error = info.value
    assert fragment in error.message(), error.message()
    if status is not None:
        got = str(error.status())
        assert got in (str(status), f"StatusCode.{status}"), got
    return error


def metrics_text(port: int) -> str:
    """The exposition a server (or a worker) serves on ``port``'s /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def metric_samples(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of ``port``'s /metrics as {(name as written, sorted labels): value}."""
    return {
        (wire_name(family, sample), tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics_text(port))
        for sample in family.samples
    }


def wire_name(family, sample) -> str:
    """A sample's name as the server wrote it: prometheus-client's parser reports the
    samples of a text-format counter as ``<family>_total``, but Triton's ``nv_*``
    counters are written without that suffix."""
    if family.type == "counter" and family.name.startswith("nv_"):
        return family.name
    return sample.name


@contextlib.contextmanager
def emulator(
    command: list[str], log: Path, what: str, started: Callable[[], bool]
) -> Iterator[subprocess.Popen]:
    """Run ``command``, a cloud service's emulator on loopback, with its output in
    ``log``, for the block: entered once ``started()`` says it serves (within 60 s,
    else the test fails with the log), terminated at the end."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not started():
            if process.poll() is not None or time.monotonic() > deadline:
                code = process.poll()
                ended = "did not start" if code is None else f"exited with {code}"
                pytest.fail(f"{what} {ended}:\n{log.read_text()}")
            time.sleep(0.05)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def decoupled_model(name: str):
    """What a data-plane stand-in's ``model()`` returns for a decoupled model (the
    gRPC stream answers its requests as they are ready, in any order)."""
    from types import SimpleNamespace

    from trionserve._generated import model_config_pb2 as mc

    config = mc.ModelConfig(name=name)
    config.model_transaction_policy.decoupled = True
    return SimpleNamespace(config=config)
