"""Servers run as subprocesses on loopback, for tests and benchmarks.

:class:`TrionServe` starts ``python -m trionserve`` on free loopback ports held
until it is closed, waits for it to answer, stops it with SIGTERM (as a container
runtime or a terminal would) and reports its exit code and its log: the one
harness of the project's tests (``tests/serverproc.py``) and benchmarks
(``benchmarks/matrix.py``), and a way for a user's own tests to serve a model
repository with the real server. :class:`ServerProcess` runs any other server
command the same way (the benchmarks run Triton, KServe and MLServer with it).

Each server leads a process group of its own, so :meth:`ServerProcess.close`
also ends what it left behind (Python backend stubs, worker processes); SIGTERM
and SIGKILL from :meth:`~ServerProcess.stop` and :meth:`~ServerProcess.kill` go
to the server alone, as they would from outside.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import trionserve

#: The directory ``python -m trionserve`` imports this trionserve from (a source
#: checkout's root, or site-packages): a TrionServe runs from there, so the server
#: is the code this process imported.
SOURCE = Path(trionserve.__file__).resolve().parent.parent
# Seconds between two looks for a starting server's answer: it is seen half of
# this after it answers, on average, at every start (a connection refused costs
# the looking process about a tenth of a millisecond).
READY_POLL_SECS = 0.01


def free_port() -> int:
    """A loopback port free now (another process may take it before it is bound:
    :func:`held_port` keeps it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def held_port() -> socket.socket:
    """A free loopback port, held by a socket bound with SO_REUSEADDR and never
    listening. Until it is closed no other bind can take the port (neither a port-0
    bind nor an explicit one without SO_REUSEADDR), while the server's own listener
    (SO_REUSEADDR, as Trio's listeners set) binds it and listens. With free_port()
    alone, another process could take the port between the choice and the server's
    bind, and the caller would talk to that process's server."""
    hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.bind(("127.0.0.1", 0))
    return hold


class ServerProcess:
    """A server command run as a subprocess leading a process group of its own,
    its output (stdout and stderr) in a temporary log file until :meth:`close`."""

    def __init__(
        self,
        label: str,
        command: list[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> None:
        self.label = label
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{label}-", suffix=".log")
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            cwd=cwd,
            start_new_session=True,
        )
        self._closed = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self, tail: int | None = None) -> str:
        """The server's output so far (its last ``tail`` characters)."""
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return text if tail is None else text[-tail:]

    @staticmethod
    def http_status(url: str, path: str) -> int | None:
        """The HTTP status of GET ``path`` at ``url`` (``host:port``), or None while
        nothing answers there."""
        host, port = url.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            connection.request("GET", path)
            return connection.getresponse().status
        except OSError:
            return None
        finally:
            connection.close()

    def wait_http(self, url: str, path: str, timeout: float = 60.0) -> None:
        """Block until GET ``path`` at ``url`` answers 200; raise RuntimeError with
        the server's log when it exits first or ``timeout`` seconds pass (it is then
        killed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.label} exited with {self.process.returncode}:\n{self.output()}"
                )
            if self.http_status(url, path) == 200:
                return
            time.sleep(READY_POLL_SECS)
        self.kill()
        raise RuntimeError(f"{self.label} did not become ready in {timeout:g} s:\n{self.output()}")

    def wait_exit(self, timeout: float = 60.0) -> int:
        """The server's exit code once it exits; killed, and TimeoutExpired raised,
        when it is still running after ``timeout`` seconds."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the server (a graceful stop) and return its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        """SIGKILL the server alone (what it started is left to notice)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        """Kill the server if it still runs and whatever is left of its process
        group, and remove its log. Safe to call again."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone
            pass
        self.log.close()


class TrionServe(ServerProcess):
    """``python -m trionserve`` serving ``repositories`` on loopback, its HTTP, gRPC
    and metrics ports held from their choice until :meth:`close`, with
    ``--exit-timeout-secs=10`` (before ``args``, which may override it).

    ``tree`` runs another source tree's trionserve (a ``git worktree`` of an older
    commit, for before/after figures), with ``python``, or else the tree's own
    ``.venv`` when it has one (an older tree may need other dependencies), or else
    this interpreter."""

    def __init__(
        self,
        *repositories: Path,
        args: Iterable[str] = (),
        workers: int | None = None,
        env: Mapping[str, str] | None = None,
        label: str = "trionserve",
        tree: Path | None = None,
        python: str | None = None,
    ) -> None:
        if not repositories:
            raise ValueError("TrionServe needs a model repository")
        self._holds = [held_port() for _ in range(3)]
        self.http_port, self.grpc_port, self.metrics_port = (
            hold.getsockname()[1] for hold in self._holds
        )
        if python is None:
            python = sys.executable
            if tree is not None and (Path(tree) / ".venv" / "bin" / "python").exists():
                python = str(Path(tree) / ".venv" / "bin" / "python")
        command = [python, "-m", "trionserve"]
        command += [f"--model-repository={repository}" for repository in repositories]
        command += [
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=10",
            *args,
            *([f"--workers={workers}"] if workers is not None else []),
        ]
        env = dict(env or {})
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        try:
            super().__init__(label, command, env, cwd=tree or SOURCE)
        except BaseException:
            for hold in self._holds:
                hold.close()
            raise

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def status(self, path: str) -> int | None:
        """HTTP status of GET ``path`` on the HTTP port, or None while the server
        does not answer."""
        return self.http_status(self.http_url, path)

    def wait_ready(self, timeout: float = 60.0, path: str = "/v2/health/live") -> None:
        """Block until the server answers ``path`` with 200 (process start-up)."""
        self.wait_http(self.http_url, path, timeout)

    def close(self) -> None:
        super().close()
        for hold in self._holds:
            hold.close()
