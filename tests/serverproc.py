"""Start the real trionserve as a subprocess on free loopback ports, for tests."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_port() -> socket.socket:
    """A free loopback port, held by a socket bound with SO_REUSEADDR and never
    listening. Until it is closed no other bind can take the port (neither a port-0
    bind nor an explicit one without SO_REUSEADDR), while the server's own listener
    (SO_REUSEADDR, as Trio's listeners set) binds it and listens. With free_port()
    alone, another process could take the port between the choice and the server's
    bind, and the test would talk to that process's server."""
    hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.bind(("127.0.0.1", 0))
    return hold


class ServerProcess:
    """A trionserve subprocess; ``stop`` sends SIGTERM and returns the exit code."""

    def __init__(
        self,
        *repositories: Path,
        args: list[str] | None = None,
        workers: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        # The ports stay held until close(): see held_port.
        self._holds = [held_port() for _ in range(3)]
        self.http_port, self.grpc_port, self.metrics_port = (
            hold.getsockname()[1] for hold in self._holds
        )
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="trionserve-", suffix=".log", delete=False
        )
        command = [sys.executable, "-m", "trionserve"]
        for repository in repositories or (EXAMPLES,):
            command.append(f"--model-repository={repository}")
        command += [
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=10",
            *(args or []),
            *([f"--workers={workers}"] if workers is not None else []),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def status(self, path: str) -> int | None:
        """HTTP status of GET path, or None while the server does not answer."""
        connection = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=5)
        try:
            connection.request("GET", path)
            return connection.getresponse().status
        except OSError:
            return None
        finally:
            connection.close()

    def wait_ready(self, timeout: float = 60.0, path: str = "/v2/health/live") -> None:
        """Block until the server answers ``path`` with 200 (process start-up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"trionserve exited with {self.process.returncode}:\n{self.output()}"
                )
            if self.status(path) == 200:
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"trionserve did not become ready:\n{self.output()}")

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        self.kill()
        for hold in self._holds:
            hold.close()
        self.log.close()
        os.unlink(self.log.name)


@contextlib.contextmanager
def serving(*repositories: Path, args: list[str] | None = None):
    """A started server for a ``with`` block; it must then stop cleanly (exit 0)."""
    proc = ServerProcess(*repositories, args=args)
    try:
        proc.wait_ready()
        yield proc
        code = proc.stop()
        assert code == 0, f"trionserve exited with {code}:\n{proc.output()}"
    finally:
        proc.close()


@contextlib.contextmanager
def http_client(proc: ServerProcess):
    """tritonclient's HTTP client for ``proc``, closed at the end of the block."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(proc.http_url)
    try:
        yield client
    finally:
        client.close()


def scrape_metrics(proc: ServerProcess) -> dict:
    """The server's /metrics, parsed: family name -> prometheus_client family."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.helpers import metrics_text

    text = metrics_text(proc.metrics_port)
    return {family.name: family for family in text_string_to_metric_families(text)}
