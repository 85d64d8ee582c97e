"""``--workers N``: a supervisor process and N trionserve worker processes sharing ports.

The supervisor starts N copies of ``python -m trionserve`` with the same arguments
plus hidden worker flags. Each worker is a complete server (its own event loop,
models, schedulers) that binds the HTTP and gRPC ports with ``SO_REUSEPORT``
(:mod:`trionserve.protocol.listeners`), so the kernel spreads incoming
connections across the workers; a connection, and every request on it, stays on
the worker that accepted it.

What the supervisor owns and guarantees:

- Listeners: every one (the supervisor's metrics and private ports, each
  worker's private ports) has the HTTP port's limits (``--http-*`` flags,
  ``HttpOptions.transport_options``). A worker binds its private ports itself
  (port 0) and reports them through its readiness pipe, so no other local
  process can take a port between its choice and its bind.
- Metrics: it serves the metrics port itself. Each worker serves its own metrics
  on a private loopback port; a scrape fetches every
  ready worker's exposition and merges them
  (:mod:`trionserve.observability.aggregate`), plus ``trionserve_workers_ready``
  and ``trionserve_worker_restarts``.
- Statistics: the statistics extension counts every worker's requests, as one
  server would (a load generator such as perf_analyzer reads them on a
  connection of its own, which lands on any worker). Each worker serves its own
  statistics on a private loopback port; a worker asked for statistics checks
  the model and version in its own registry (so errors are a single server's),
  then asks the supervisor, on the supervisor's private loopback port, which
  fetches every ready worker's and adds them up
  (:func:`trionserve.observability.statistics.merge_model_stats`).
- Readiness: a worker is ready when its frontends listen and its models are
  loaded (it reports this, with its private ports, through a pipe). Health
  endpoints are each worker's own: a probe's connection lands on one worker and
  reports that worker's state.
- Restarts: a worker that exits unexpectedly is started again after a backoff
  that doubles with each consecutive failure (0.5 s up to 30 s). A worker that
  fails before becoming ready in the first start, or ``MAX_STARTUP_FAILURES``
  times in a row later, stops the whole server with an error: the same
  configuration would fail the same way again.
- Shutdown: SIGTERM or SIGINT is forwarded to every worker, which drains as a
  single server does; a second signal is forwarded too (workers stop at once).
  The supervisor exits 0 when every worker exited 0, else 1. Workers run in their
  own session, so a terminal's Ctrl-C reaches them once, through the supervisor;
  a worker whose supervisor vanished (SIGKILL) shuts itself down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import urllib.request
from dataclasses import dataclass, field
from functools import partial

import structlog
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import InvalidArgument, TritonError
from trionserve.observability.aggregate import StaticCollector, merge_expositions
from trionserve.observability.metrics import metrics_router
from trionserve.observability.statistics import merge_model_stats, statistics_json
from trionserve.protocol.http.frontend import error_status
from trionserve.protocol.http.transport import HttpServer, HttpServerOptions

log = structlog.get_logger(__name__)

RESTART_BACKOFF_FIRST = 0.5
RESTART_BACKOFF_MAX = 30.0
# A worker that served this long before exiting starts its backoff afresh.
STABLE_SECS = 60.0
MAX_STARTUP_FAILURES = 3
SCRAPE_TIMEOUT_SECS = 5.0
# The private statistics routes: a worker's own, and every worker's at the supervisor.
_OWN_STATISTICS = "/worker/statistics"
_ALL_STATISTICS = "/workers/statistics"
# How often a worker checks that its supervisor is still there.
ORPHAN_CHECK_SECS = 1.0


# -- command line -------------------------------------------------------------------


def parse_workers(text: str) -> int:
    """``--workers``: a positive integer, or ``auto`` for the number of CPUs."""
    if text.strip().lower() == "auto":
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of workers or 'auto', got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 worker, got {value}")
    return value


def add_worker_flags(add) -> None:
    add(
        "--workers",
        type=parse_workers,
        default=1,
        metavar="N|auto",
        help="server processes sharing the HTTP and gRPC ports with SO_REUSEPORT "
        "(default 1; auto: one per CPU)",
    )
    # Set by the supervisor on the processes it starts; not for users.
    add("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    add("--worker-ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    # The supervisor's private loopback port (each worker binds its own and
    # reports it through the pipe of --worker-ready-fd).
    add("--worker-supervisor-port", type=int, default=None, help=argparse.SUPPRESS)


def worker_conflicts(args: argparse.Namespace) -> list[str]:
    """Why these settings cannot run as several workers (empty: they can)."""
    if args.workers <= 1:
        return []
    problems = []
    if ControlMode(args.model_control_mode) is ControlMode.EXPLICIT:
        problems.append(
            "--model-control-mode=explicit cannot be used with --workers > 1: a load "
            "or unload request reaches only the one worker process its connection "
            "lands on; use --model-control-mode=poll or none"
        )
    if args.allow_client_shm:
        problems.append(
            "--allow-client-shm=true cannot be used with --workers > 1: a shared-memory "
            "region is registered in the one worker process its request lands on, and "
            "requests on other connections would not find it"
        )
    for flag, allowed, port in (
        ("--http-port", args.allow_http, args.http_port),
        ("--grpc-port", args.allow_grpc, args.grpc_port),
    ):
        if allowed and port == 0:
            problems.append(
                f"{flag}=0 cannot be used with --workers > 1: each worker would "
                "listen on a different port"
            )
    return problems


# -- the worker side ----------------------------------------------------------------


class _WorkerStatus:
    """The task status given to ``Server.serve`` in a worker: ``started`` runs
    ``on_ready`` and tells the supervisor, through the pipe it passed, that this
    worker is ready and on which loopback ports it serves its metrics and its
    private statistics (``ports()``: one JSON line). The worker binds them itself
    (port 0), so no other process can take them between a choice and a bind."""

    def __init__(self, fd: int | None, on_ready, ports) -> None:
        self._fd = fd
        self._on_ready = on_ready
        self._ports = ports

    def started(self, value=None) -> None:
        if self._fd is not None:
            os.write(self._fd, json.dumps(self._ports()).encode() + b"\n")
            os.close(self._fd)
        self._on_ready()


def read_ready_line(data: bytes) -> dict[str, int | None] | None:
    """The ports a worker reported as it became ready; None: it never did."""
    line = data.split(b"\n", 1)[0]
    if not line:
        return None
    try:
        ports = json.loads(line)
    except ValueError:
        return None
    if not isinstance(ports, dict):
        return None
    return {k: v for k, v in ports.items() if type(v) is int and 0 < v < 65536}


async def serve_worker(
    server,
    index: int,
    ready_fd: int | None,
    supervisor_port: int | None = None,
) -> None:
    """Run ``server`` as worker ``index``: readiness, with the ports it bound,
    through ``ready_fd``; shut down gracefully if the supervisor goes away. Its
    own statistics are served on a loopback port of its own; the statistics it
    answers come from the supervisor at ``supervisor_port`` (every worker's,
    added up)."""
    parent = os.getppid()
    if ready_fd is not None:
        os.set_inheritable(ready_fd, False)  # not into Python-backend stub processes
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_follow_parent, server, parent)
            binds = await nursery.start(_serve_private, server)
            private_port = binds[0][1]

            def ports() -> dict[str, int | None]:
                metrics = server.metrics_binds[0][1] if server.metrics_binds else None
                return {"private": private_port, "metrics": metrics}

            if supervisor_port is not None:
                server.dataplane.statistics_source = partial(
                    _all_workers_statistics, server.dataplane, supervisor_port
                )
            on_ready = partial(warn_sequence_models, server.registry) if index == 0 else _nothing
            try:
                await server.serve(task_status=_WorkerStatus(ready_fd, on_ready, ports))
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Only serve() can fail here: give the caller its exception, as without workers.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def _nothing() -> None:
    pass


async def _follow_parent(server, parent: int) -> None:
    # Another process's end has no event to wait on (no pidfd for a parent).
    while os.getppid() == parent:  # noqa: ASYNC110
        await trio.sleep(ORPHAN_CHECK_SECS)
    log.warning("supervisor process is gone: shutting down")
    server.shutdown()


async def _serve_private(server, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """This worker's own statistics, for the supervisor, on a loopback port it
    binds (any free one), with the HTTP port's limits."""
    dataplane = server.dataplane

    async def own_statistics(headers, body: bytes):
        try:
            name, version = _statistics_query(body)
            return _json_response(200, statistics_json(dataplane.registry, name, version))
        except TritonError as error:  # a model this worker does not have (yet)
            return _json_response(error_status(error), {"error": error.message})

    private = HttpServer(
        _post_route(_OWN_STATISTICS, own_statistics),
        server.options.http.transport_options(reuse_port=False),
    )
    # Never set: the worker's nursery cancels this server when the worker ends.
    await private.serve("127.0.0.1", 0, trio.Event(), 1.0, task_status=task_status)


async def _all_workers_statistics(
    dataplane, supervisor_port: int, name: str | None, version: int | None
) -> dict:
    """Every worker's statistics added up, from the supervisor; this worker's
    own when the supervisor cannot answer (logged)."""
    query = json.dumps({"name": name, "version": version}).encode()
    try:
        answer = await trio.to_thread.run_sync(_post_json, supervisor_port, _ALL_STATISTICS, query)
    except (OSError, ValueError) as exc:
        log.warning("statistics of the other workers unavailable", error=str(exc))
        return statistics_json(dataplane.registry, name, version)
    return answer


def _statistics_query(body: bytes | bytearray | memoryview) -> tuple[str | None, int | None]:
    """The model name and version of a private statistics request."""
    try:
        query = json.loads(bytes(body))
        name, version = query["name"], query["version"]
    except (ValueError, TypeError, KeyError):
        raise InvalidArgument("expected a JSON object with 'name' and 'version'") from None
    if not (name is None or isinstance(name, str)) or not (version is None or type(version) is int):
        raise InvalidArgument("'name' must be a string or null, 'version' an integer or null")
    return name, version


def _post_json(port: int, path: str, body: bytes) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=body,
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT_SECS) as response:
        return json.loads(response.read())


def _json_response(status: int, value: dict):
    data = json.dumps(value).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    return status, headers, [data]


def _post_route(path: str, handler):
    """A router with one handler, for POST ``path``; a JSON 404 elsewhere."""

    async def not_found(headers, body: bytes):
        return _json_response(404, {"error": "Not Found"})

    def route(method: bytes, request_path: str):
        return handler if method == b"POST" and request_path == path else not_found

    return route


def warn_sequence_models(registry) -> None:
    """Log which loaded models keep sequence state in one worker."""
    names = []
    for entry in sorted(registry.entries().values(), key=lambda e: e.model_id.order()):
        try:
            version = registry.route(entry.name, None, entry.model_id.namespace)
        except Exception:
            continue
        if version.config.HasField("sequence_batching"):
            names.append(entry.model_id.display)
    if names:
        log.warning(
            "sequence models with --workers > 1: each sequence's state lives in the "
            "worker that received its START; send all its requests over one "
            "connection (one gRPC client or stream, one keep-alive HTTP connection)",
            models=names,
        )


# -- the supervisor -----------------------------------------------------------------


@dataclass
class WorkerSlot:
    """One worker position: its current process and its history."""

    index: int
    process: trio.Process | None = None
    metrics_port: int | None = None
    private_port: int | None = None  # its own statistics, for the supervisor
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
        self._collector = StaticCollector()
        self._private_port = 0  # where workers ask for every worker's statistics

    async def run(self) -> int:
        log.info("supervisor starting", workers=self.plan.count, pid=os.getpid())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals)
            await nursery.start(self._serve_private)
            if self.plan.metrics_bind is not None:
                binds = await nursery.start(self._serve_metrics, self.plan.metrics_bind)
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
        slot.metrics_port = slot.private_port = None  # reported once it is ready
        read_fd, write_fd = os.pipe()
        command = [
            *self.plan.python,
            *self.plan.argv,
            f"--worker-index={slot.index}",
            f"--worker-ready-fd={write_fd}",
            f"--worker-supervisor-port={self._private_port}",
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
        ports = None
        async with trio.lowlevel.FdStream(read_fd) as pipe:
            data = b""
            while len(data) < 1024 and b"\n" not in data:
                chunk = await pipe.receive_some(1024)
                if not chunk:
                    break
                data += chunk
            ports = read_ready_line(data)
        ready = ports is not None
        if ports is not None:
            slot.private_port = ports.get("private")
            slot.metrics_port = ports.get("metrics") if self.plan.metrics_bind else None
            slot.ready = slot.ever_ready = True
            slot.startup_failures = 0
            log.info(
                "worker ready",
                worker=slot.index,
                pid=process.pid,
                metrics=f"127.0.0.1:{slot.metrics_port}" if slot.metrics_port else None,
                statistics=f"127.0.0.1:{slot.private_port}",
            )
            if all(s.ready for s in self.slots):
                log.info("all workers ready", workers=len(self.slots))
        try:
            code = await process.wait()
        finally:
            slot.ready = False
            slot.process = None
        return ready, code

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

    # -- statistics -------------------------------------------------------------

    async def _serve_private(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Every worker's statistics added up, for the workers, on a loopback port."""

        async def all_statistics(headers, body: bytes):
            try:
                name, version = _statistics_query(body)
            except TritonError as error:
                return _json_response(error_status(error), {"error": error.message})
            query = json.dumps({"name": name, "version": version})
            ports = [(s.index, s.private_port) for s in self.slots if s.ready and s.private_port]
            parts: dict[int, list[dict]] = {}

            async def fetch(index: int, port: int) -> None:
                try:
                    answer = await trio.to_thread.run_sync(
                        _post_json, port, _OWN_STATISTICS, query.encode()
                    )
                    parts[index] = answer["model_stats"]
                except (OSError, ValueError, KeyError) as exc:
                    # A worker that does not know the model (yet) says so with a 4xx.
                    log.debug("worker statistics unavailable", worker=index, error=str(exc))

            async with trio.open_nursery() as nursery:
                for index, port in ports:
                    nursery.start_soon(fetch, index, port)
            merged = merge_model_stats([parts[i] for i in sorted(parts)])
            return _json_response(200, {"model_stats": merged})

        server = HttpServer(_post_route(_ALL_STATISTICS, all_statistics), self.plan.http)

        async def serve(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            # Never set: the supervisor's nursery cancels it once the workers exit.
            await server.serve("127.0.0.1", 0, trio.Event(), 1.0, task_status=task_status)

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve)
            self._private_port = binds[0][1]
            log.info("supervisor statistics service started", listening=binds)
            task_status.started(binds)

    # -- metrics ----------------------------------------------------------------

    async def _serve_metrics(
        self, bind: tuple[str, int], *, task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve the merged metrics until cancelled."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        server = HttpServer(metrics_router(registry, self._refresh_metrics), self.plan.http)
        address, port = bind
        # Never set: the supervisor's nursery cancels this server once the workers exit.
        await server.serve(address, port, trio.Event(), 1.0, task_status=task_status)

    async def _refresh_metrics(self) -> None:
        """Fetch every ready worker's exposition, concurrently, and merge them."""
        ports = [(s.index, s.metrics_port) for s in self.slots if s.ready and s.metrics_port]
        texts: dict[int, str] = {}

        async def fetch(index: int, port: int) -> None:
            try:
                texts[index] = await trio.to_thread.run_sync(_get_metrics, port)
            except OSError as exc:
                log.warning("worker metrics unavailable", worker=index, error=str(exc))

        async with trio.open_nursery() as nursery:
            for index, port in ports:
                nursery.start_soon(fetch, index, port)
        families = merge_expositions([texts[i] for i in sorted(texts)])
        ready = GaugeMetricFamily(
            "trionserve_workers_ready", "Worker processes ready to serve (--workers)"
        )
        ready.add_metric([], sum(s.ready for s in self.slots))
        restarts = CounterMetricFamily(
            "trionserve_worker_restarts",
            "Worker processes started again after exiting unexpectedly",
        )
        restarts.add_metric([], sum(s.restarts for s in self.slots))
        self._collector.families = [*families, ready, restarts]


def _get_metrics(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_SECS) as response:
        return response.read().decode("utf-8")


def _backoff(failures: int) -> float:
    return min(RESTART_BACKOFF_MAX, RESTART_BACKOFF_FIRST * 2 ** max(failures - 1, 0))


def metrics_bind(options) -> tuple[str, int] | None:
    """Where the supervisor serves metrics: Triton's rule, as ``Server`` applies it."""
    if not options.allow_metrics:
        return None
    address = options.metrics_address or (options.http_address if options.allow_http else "0.0.0.0")
    return address, options.metrics_port


def run_supervisor(options, count: int, argv: list[str]) -> int:
    plan = SupervisorPlan(
        count=count,
        argv=list(argv),
        metrics_bind=metrics_bind(options),
        http=options.http.transport_options(reuse_port=False),
    )
    return trio.run(Supervisor(plan).run)
