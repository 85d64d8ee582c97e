"""The supervisor of ``--workers``: starts N worker processes, watches, restarts
and stops them, and serves what belongs to all of them (the metrics port, every
worker's statistics).

What the supervisor owns and guarantees:

- Ports: it binds its own (the metrics port, its private statistics port) before
  it starts any worker; each worker binds its private ports itself and reports
  them through its readiness pipe (:mod:`trionserve.workers.readiness`). No port
  is chosen by one process and bound by another.
- Metrics: it serves the metrics port itself, every ready worker's exposition
  merged (:mod:`trionserve.workers.metrics`).
- Statistics: every ready worker's, added up, for the workers on its private
  loopback port (:mod:`trionserve.workers.statistics`).
- Readiness: a worker is ready when it reported so on its pipe (its frontends
  listen and its models are loaded), and no longer once it exits.
- Restarts: a worker that exits unexpectedly is started again after a backoff
  that doubles with each consecutive failure (0.5 s up to 30 s). A worker that
  fails before becoming ready in the first start, or ``MAX_STARTUP_FAILURES``
  times in a row later, stops the whole server with an error: the same
  configuration would fail the same way again.
- Shutdown: SIGTERM or SIGINT is forwarded to every worker, which drains as a
  single server does; a second signal is forwarded too (workers stop at once).
  The supervisor exits 0 when every worker exited 0, else 1. Workers run in their
  own session, so a terminal's Ctrl-C reaches them once, through the supervisor.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
import trio

from trionserve.protocol.http.transport import HttpServerOptions
from trionserve.workers.metrics import MergedMetrics
from trionserve.workers.readiness import receive_ready
from trionserve.workers.statistics import serve_all_statistics

if TYPE_CHECKING:
    from trionserve.server import ServerOptions

log = structlog.get_logger(__name__)

RESTART_BACKOFF_FIRST = 0.5
RESTART_BACKOFF_MAX = 30.0
# A worker that served this long before exiting starts its backoff afresh.
STABLE_SECS = 60.0
MAX_STARTUP_FAILURES = 3


@dataclass
class WorkerSlot:
    """One worker position: its current process and its history."""

    index: int
    process: trio.Process | None = None
    metrics_port: int | None = None
    statistics_port: int | None = None  # its own statistics, for the supervisor
    ready: bool = False
    ever_ready: bool = False
    startup_failures: int = 0
    crashes: int = 0  # consecutive unexpected exits after readiness
    restarts: int = 0
    exit_code: int | None = None


@dataclass
class SupervisorPlan:
    """What the supervisor runs: the worker command line and where it serves metrics."""

    count: int
    argv: list[str]  # the user's arguments, given to every worker
    metrics_bind: tuple[str, int] | None  # None: --allow-metrics=false
    # The limits of every listener it serves: the HTTP port's (--http-* flags).
    http: HttpServerOptions = field(default_factory=HttpServerOptions)
    python: list[str] = field(default_factory=lambda: [sys.executable, "-m", "trionserve"])


class Supervisor:
    """Owns the worker processes (one :class:`WorkerSlot` each) and the metrics
    endpoint; ``run`` returns the exit code once every worker has exited."""

    def __init__(self, plan: SupervisorPlan) -> None:
        self.plan = plan
        self.slots = [WorkerSlot(i) for i in range(plan.count)]
        self._stopping = trio.Event()
        self._failure: str | None = None
        self._metrics = MergedMetrics(self.slots)
        self._statistics_port = 0  # where workers ask for every worker's statistics

    async def run(self) -> int:
        log.info("supervisor starting", workers=self.plan.count, pid=os.getpid())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals)
            binds = await nursery.start(serve_all_statistics, self.plan.http, self._worker_ports)
            self._statistics_port = binds[0][1]
            log.info("supervisor statistics service started", listening=binds)
            if self.plan.metrics_bind is not None:
                binds = await nursery.start(
                    self._metrics.serve, self.plan.metrics_bind, self.plan.http
                )
                log.info("Metrics service started", listening=binds, workers=self.plan.count)
            async with trio.open_nursery() as workers:
                for slot in self.slots:
                    workers.start_soon(self._supervise, slot)
            # Every worker has exited: the signal watcher and metrics end with them.
            nursery.cancel_scope.cancel()
        if self._failure is not None:
            log.error("supervisor stopped", reason=self._failure)
            return 1
        codes = {slot.index: slot.exit_code for slot in self.slots}
        ok = all(code == 0 for code in codes.values())
        log.info("supervisor stopped", exit_codes=codes)
        return 0 if ok else 1

    # -- workers ----------------------------------------------------------------

    async def _supervise(self, slot: WorkerSlot) -> None:
        """Start, watch and restart one worker until the supervisor stops."""
        while not self._stopping.is_set():
            started_at = trio.current_time()
            ready, code = await self._run_worker(slot)
            slot.exit_code = code
            if self._stopping.is_set():
                return
            if not ready:
                slot.startup_failures += 1
                if not slot.ever_ready or slot.startup_failures >= MAX_STARTUP_FAILURES:
                    self._fail(
                        f"worker {slot.index} exited with {code} before it was ready "
                        f"({slot.startup_failures} time(s) in a row)"
                    )
                    return
                delay = _backoff(slot.startup_failures)
            else:
                if trio.current_time() - started_at >= STABLE_SECS:
                    slot.crashes = 0
                slot.crashes += 1
                delay = _backoff(slot.crashes)
            log.warning(
                "worker exited unexpectedly",
                worker=slot.index,
                exit_code=code,
                restart_in_secs=delay,
            )
            with trio.move_on_after(delay):
                await self._stopping.wait()
            slot.restarts += 1

    async def _run_worker(self, slot: WorkerSlot) -> tuple[bool, int]:
        """One process of ``slot`` from start to exit: (became ready, exit code)."""
        slot.metrics_port = slot.statistics_port = None  # reported once it is ready
        read_fd, write_fd = os.pipe()
        command = [
            *self.plan.python,
            *self.plan.argv,
            f"--worker-index={slot.index}",
            f"--worker-ready-fd={write_fd}",
            f"--worker-supervisor-port={self._statistics_port}",
        ]
        if self.plan.metrics_bind is not None:
            command += ["--metrics-address=127.0.0.1", "--metrics-port=0"]
        try:
            process = await trio.lowlevel.open_process(
                command, pass_fds=(write_fd,), start_new_session=True
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        slot.process = process
        log.info("worker started", worker=slot.index, pid=process.pid)
        if self._stopping.is_set():
            process.send_signal(signal.SIGTERM)
        ports = await receive_ready(read_fd)
        ready = ports is not None
        if ports is not None:
            slot.statistics_port = ports.statistics
            slot.metrics_port = ports.metrics if self.plan.metrics_bind else None
            slot.ready = slot.ever_ready = True
            slot.startup_failures = 0
            log.info(
                "worker ready",
                worker=slot.index,
                pid=process.pid,
                metrics=f"127.0.0.1:{slot.metrics_port}" if slot.metrics_port else None,
                statistics=f"127.0.0.1:{slot.statistics_port}",
            )
            if all(s.ready for s in self.slots):
                log.info("all workers ready", workers=len(self.slots))
        try:
            code = await process.wait()
        finally:
            slot.ready = False
            slot.process = None
        return ready, code

    def _worker_ports(self) -> list[tuple[int, int]]:
        """(index, private statistics port) of each ready worker."""
        return [(s.index, s.statistics_port) for s in self.slots if s.ready and s.statistics_port]

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            log.error("stopping all workers", reason=reason)
        self._stop(signal.SIGTERM)

    def _stop(self, signum: int) -> None:
        self._stopping.set()
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                slot.process.send_signal(signum)

    async def _watch_signals(self) -> None:
        """Forward SIGINT / SIGTERM to every worker (the second one too)."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                log.info("shutdown requested; forwarding to workers", signal=name)
                self._stop(signum)


def _backoff(failures: int) -> float:
    return min(RESTART_BACKOFF_MAX, RESTART_BACKOFF_FIRST * 2 ** max(failures - 1, 0))


def metrics_bind(options: ServerOptions) -> tuple[str, int] | None:
    """Where the supervisor serves metrics: Triton's rule, as ``Server`` applies it."""
    if not options.allow_metrics:
        return None
    address = options.metrics_address or (options.http_address if options.allow_http else "0.0.0.0")
    return address, options.metrics_port


def run_supervisor(options: ServerOptions, count: int, argv: list[str]) -> int:
    plan = SupervisorPlan(
        count=count,
        argv=list(argv),
        metrics_bind=metrics_bind(options),
        http=options.http.transport_options(reuse_port=False),
    )
    return trio.run(Supervisor(plan).run)
