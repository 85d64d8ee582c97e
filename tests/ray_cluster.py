"""A real Ray cluster on loopback for the Ray Serve tests and benchmark: a head
node and worker nodes, each a ``ray start --block`` process of its own (as on
separate machines), every port chosen free, a temporary directory of its own.

``stop()`` ends what ``start()`` started and nothing else: it signals each
``ray start --block`` process (which stops the daemons it started), then kills
each one's process group, which it leads (``start_new_session``). ``ray stop``
is never called: it would stop every Ray process of the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

from tests.serverproc import free_port

RAY = Path(sys.executable).with_name("ray")
# What ``ray start`` prints once its node is up.
STARTED = "Ray runtime started."


def _node_ports() -> list[str]:
    """Every port a node opens, chosen free, so that two clusters (or other
    servers of the machine) never meet on Ray's fixed defaults."""
    ports = [free_port() for _ in range(7)]
    # Below the kernel's ephemeral range (32768 up), where the others were chosen.
    first_worker = 10000 + (ports[0] % 20000)
    return [
        f"--node-manager-port={ports[0]}",
        f"--object-manager-port={ports[1]}",
        f"--metrics-export-port={ports[2]}",
        f"--runtime-env-agent-port={ports[3]}",
        f"--dashboard-agent-listen-port={ports[4]}",
        f"--dashboard-agent-grpc-port={ports[5]}",
        f"--min-worker-port={first_worker}",
        f"--max-worker-port={first_worker + 199}",
    ]


def _session_members(session: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces
        fields = stat.rpartition(")")[2].split()
        if int(fields[3]) == session:
            members.append(int(entry.name))
    return members


class RayCluster:
    """``RayCluster(nodes=2, cpus_per_node=1)``: ``start()``, ``stop()``, or as
    a context manager. ``address`` is the head's GCS address for ``ray.init``."""

    def __init__(
        self,
        nodes: int = 2,
        cpus_per_node: int = 1,
        timeout: float = 90.0,
        cwd: str | Path | None = None,
    ) -> None:
        self.nodes = nodes
        self.cwd = cwd  # the nodes' (their workers take relative paths from it)
        self.cpus_per_node = cpus_per_node
        self.timeout = timeout
        self.address = ""
        self.processes: list[subprocess.Popen] = []
        self._directory = ""
        self.start_seconds = 0.0

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        began = time.monotonic()
        # Short: Ray's Unix socket paths live under it (108 bytes at most).
        self._directory = tempfile.mkdtemp(prefix="ray")
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        common = [
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.cpus_per_node}",
            "--num-gpus=0",
            "--disable-usage-stats",
            f"--object-store-memory={100 * 1024 * 1024}",
        ]
        self._spawn(
            "head",
            [
                "--head",
                f"--port={port}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                *common,
                *_node_ports(),
            ],
        )
        # The worker nodes start once the head's is up (a worker started beside a
        # starting head on a loaded host timed out registering with it).
        self._wait_for_log("head", began)
        for index in range(1, self.nodes):
            self._spawn(f"worker{index}", [f"--address={self.address}", *common, *_node_ports()])
        self._wait_for_nodes(self.nodes, began)
        self.start_seconds = time.monotonic() - began

    def _spawn(self, name: str, arguments: list[str]) -> None:
        temp_dir = Path(self._directory) / name
        temp_dir.mkdir()
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        with open(Path(self._directory) / f"{name}.log", "wb") as log:
            process = subprocess.Popen(
                [str(RAY), "start", f"--temp-dir={temp_dir}", *arguments],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=self.cwd,
            )
        self.processes.append(process)

    def _check(self, began: float, waiting_for: str) -> float:
        """The seconds left to wait; raises when a node's ``ray start`` exited or
        the time is up."""
        for process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(f"ray start exited with {process.returncode}:\n{self.logs()}")
        left = self.timeout - (time.monotonic() - began)
        if left <= 0:
            raise TimeoutError(f"{waiting_for} not in {self.timeout} s:\n{self.logs()}")
        return left

    def _wait_for_log(self, name: str, began: float) -> None:
        """Until node ``name``'s ``ray start`` says its node is up (what it prints
        once its node has registered with the GCS: no process connects to ask)."""
        log = Path(self._directory) / f"{name}.log"
        while True:
            self._check(began, f"Ray node {name} up")
            if STARTED in log.read_text(errors="replace"):
                return
            time.sleep(0.05)

    def _wait_for_nodes(self, count: int, began: float) -> None:
        """Until ``count`` nodes are alive, asked of the GCS by one short
        subprocess that connects once and asks again every 50 ms (the test process
        itself connects later, once); started again if it fails to connect."""
        probe = (
            "import ray, sys, time\n"
            "ray.init(address=sys.argv[1], _node_ip_address='127.0.0.1',"
            " logging_level='ERROR', log_to_driver=False)\n"
            "while sum(1 for n in ray.nodes() if n['Alive']) < int(sys.argv[2]):\n"
            "    time.sleep(0.05)\n"
            "print('alive')\n"
        )
        while True:
            left = self._check(began, f"{count} Ray nodes alive")
            with subprocess.Popen(
                [sys.executable, "-c", probe, self.address, str(count)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            ) as asking:
                try:
                    while asking.poll() is None:
                        self._check(began, f"{count} Ray nodes alive")
                        time.sleep(0.05)
                finally:
                    if asking.poll() is None:
                        asking.kill()
                out = asking.stdout.read() if asking.stdout else ""
            if asking.returncode == 0 and out.strip().endswith("alive"):
                return
            time.sleep(min(left, 0.5))

    def logs(self) -> str:
        texts = []
        for path in sorted(Path(self._directory).glob("*.log")):
            texts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(texts)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            # Daemons of the node that outlived it: it leads their session
            # (Ray's worker processes make groups of their own in it).
            for pid in _session_members(process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
        self.processes.clear()
        if self._directory and not os.environ.get("TRIONSERVE_KEEP_RAY_LOGS"):
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = ""
