"""What every peer server shares: its own virtual environment, bounded installs,
and the models' arithmetic, written out at run time (no peer code is committed)."""

from __future__ import annotations

import subprocess
import sys
import time
import venv
from dataclasses import dataclass
from pathlib import Path

from benchmarks.matrix import Target
from trionserve.testing import ServerProcess, free_port

# The two models every server serves, with the same tensors as trionserve's
# examples: `simple` (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, INT32
# [-1, 16], at most 8 per batch) and `identity_fp32` (FP32 [-1, -1] echoed).
SIMPLE_SHAPE = 16
MAX_BATCH = 8
# The batched model's dynamic batcher (trionserve and Triton alike); MLServer's
# adaptive batching gets the same size and delay.
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 500 }"
BATCH_DELAY_SECONDS = 0.0005


class PeerUnavailable(Exception):
    """The peer cannot run here (its package does not install, or it fails to start)."""


@dataclass
class Running:
    """A started peer: its process and what the load generator needs."""

    process: ServerProcess
    target: Target

    def stop(self) -> None:
        try:
            self.process.stop()
        finally:
            self.process.close()


class Peer:
    """One peer server. Subclasses say which packages, how to write the models,
    and how to start it on loopback ports."""

    name = ""
    packages: list[str] = []
    description = ""

    def __init__(self, venv_root: Path, install_timeout: float) -> None:
        self.venv = venv_root / self.name
        self.install_timeout = install_timeout

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def site_packages(self) -> Path:
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        return self.venv / "lib" / version / "site-packages"

    def install(self, log=print) -> None:
        """Create the environment and pip-install the packages (once; bounded in
        time). Raises PeerUnavailable when that fails."""
        marker = self.venv / ".installed"
        wanted = " ".join(self.packages)
        if marker.exists() and marker.read_text() == wanted:
            return
        log(f"[{self.name}] installing {wanted} into its own environment ...")
        started = time.monotonic()
        if not self.python.exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(self.venv)
        command = [str(self.python), "-m", "pip", "install", "-q", *self.packages]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=self.install_timeout
            )
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(
                f"pip install did not finish in {self.install_timeout:g} s"
            ) from None
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
            raise PeerUnavailable(
                "pip install failed: " + ("; ".join(errors[-3:]) or done.stderr[-500:])
            )
        marker.write_text(wanted)
        log(f"[{self.name}] installed in {time.monotonic() - started:.0f} s")

    def start(self, workdir: Path, ready_timeout: float) -> Running:
        raise NotImplementedError

    # -- helpers for subclasses --------------------------------------------------

    def _launch(
        self,
        command: list[str],
        http_port: int,
        grpc_port: int,
        ready_path: str,
        ready_timeout: float,
        env: dict | None = None,
        cwd: Path | None = None,
        unsupported: dict[str, str] | None = None,
    ) -> Running:
        process = ServerProcess(self.name, command, env=env, cwd=cwd)
        http_url = f"127.0.0.1:{http_port}"
        try:
            process.wait_http(http_url, ready_path, ready_timeout)
            self._wait_model(http_url, ready_timeout)
        except RuntimeError as exc:
            process.close()
            raise PeerUnavailable(str(exc)) from None
        target = Target(
            self.name,
            process.pid,
            http_url,
            f"127.0.0.1:{grpc_port}",
            unsupported=dict(unsupported or {}),
        )
        return Running(process, target)

    @staticmethod
    def _wait_model(http_url: str, timeout: float) -> None:
        """Wait until both models answer their readiness endpoint."""
        import http.client

        host, port = http_url.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        for model in ("simple", "identity_fp32"):
            while True:
                connection = http.client.HTTPConnection(host, int(port), timeout=5)
                try:
                    connection.request("GET", f"/v2/models/{model}/ready")
                    if connection.getresponse().status == 200:
                        break
                except OSError:
                    pass
                finally:
                    connection.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"model {model} did not become ready")
                time.sleep(0.2)


def ports() -> tuple[int, int, int]:
    """Free loopback ports for HTTP, gRPC and metrics."""
    return free_port(), free_port(), free_port()
