"""The root actor: wires the runtime and the frontends under one nursery (Triton
core's ``InferenceServer``, src/server.cc, with the server's frontends).

The core (model repository, registry, watcher, DataPlane) runs with or without
network frontends: the HTTP, gRPC and metrics frontends are optional parts attached
to the running core, by the options (the command line's server) or later with
``attach_http`` / ``attach_grpc`` / ``attach_metrics`` (the in-process API,
:mod:`trionserve.api`). Every frontend calls the one DataPlane.

Startup: tracing, the rate limiter, the registry, then the watcher's startup loads,
then the frontends the options ask for; the server reports ready once they listen.
Shutdown (the first SIGINT/SIGTERM, or ``shutdown``) is a drain, as Triton does
it: readiness turns false at once; the frontends keep listening and serving, the
DataPlane refusing every new request with UNAVAILABLE except those that continue a
sequence already open; once nothing is in flight and no sequence is open, or
``exit_timeout_secs`` after the signal, the frontends close their connections,
every model unloads, and every task ends. The exit code is 0 after a complete
drain and 1 when the exit timeout cut it short (Triton's "Exit timeout expired.
Exiting immediately."). A second signal stops at once.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog
import trio

from trionserve import __version__
from trionserve.actors.memory_usage import GpuMemory
from trionserve.actors.rate_limiter import RateLimiter, RateLimiterResource, RateLimitMode
from trionserve.actors.registry import ModelRegistry
from trionserve.actors.residency import ResidencyManager, ResidencyOptions
from trionserve.actors.watcher import ControlMode, RepositoryWatcher
from trionserve.backends.backend_config import BackendConfig
from trionserve.backends.manager import BackendManager
from trionserve.backends.registry import BackendFactory
from trionserve.core.client_budget import DEFAULT_STALL_SECS, ClientBudget
from trionserve.core.errors import InternalError, TritonError, Unavailable
from trionserve.core.inference import DEFAULT_UNDELIVERED_RESPONSE_BYTES
from trionserve.core.memory import fix_mmap_threshold, settle_heap
from trionserve.core.redis_cache import RedisResponseCache, RedisSettings
from trionserve.core.response_cache import ResponseCache
from trionserve.dataplane import DataPlane
from trionserve.observability.metrics import MetricsOptions
from trionserve.observability.trace.manager import TraceManager
from trionserve.observability.trace.settings import TraceConfig
from trionserve.options_table import options_rows
from trionserve.protocol.grpc.service import GrpcOptions, serve_grpc
from trionserve.protocol.http.frontend import HttpOptions, serve_http
from trionserve.protocol.http.sagemaker import SagemakerOptions, serve_sagemaker
from trionserve.protocol.metrics import serve_metrics
from trionserve.protocol.openai.frontend import OpenAIOptions, error_body, serve_openai
from trionserve.repository.repository import ModelRepository

log = structlog.get_logger(__name__)

# When the drain ends late (or the exit timeout cut it short), the frontends still
# get this long to send their last answers, GOAWAYs and closes.
CLOSE_GRACE_SECS = 1.0
_START_ORDER = {"GRPC": 0, "HTTP": 1, "Metrics": 2, "SageMaker": 3, "OpenAI": 4}


@dataclass
class ServerOptions:
    """Every server setting, named after Triton's command-line flags."""

    model_repositories: list[Path | str] = field(default_factory=list)  # str: s3:// etc.
    # --model-namespacing: each repository is a namespace (same names side by side)
    model_namespacing: bool = False
    model_control_mode: ControlMode = ControlMode.NONE
    model_cache_dir: Path | None = None  # where object-storage repositories are copied
    repository_poll_secs: float = 15.0
    load_models: list[str] = field(default_factory=list)
    strict_model_config: bool = False
    disable_auto_complete_config: bool = False
    strict_readiness: bool = True  # ready only when every model is
    # --max-undelivered-response-bytes: one request's responses held for its client
    max_undelivered_response_bytes: int = DEFAULT_UNDELIVERED_RESPONSE_BYTES
    # --client-buffer-limit: the bytes held for clients, all listeners together
    # (None: a quarter of the host's memory), and --client-buffer-stall-secs
    client_buffer_limit: int | None = None
    client_buffer_stall_secs: float = DEFAULT_STALL_SECS
    model_config_name: str | None = None  # configs/<name>.pbtxt where it exists
    # --backend-config: backend ("" for all) -> setting -> value
    backend_config: BackendConfig = field(default_factory=dict)
    # --backend-directory: where Python-based backends are looked for
    backend_directory: Path | None = None
    allow_http: bool = True
    http_address: str = "0.0.0.0"
    http_port: int = 8000
    http: HttpOptions = field(default_factory=HttpOptions)
    allow_grpc: bool = True
    grpc_address: str = "0.0.0.0"
    grpc_port: int = 8001
    grpc: GrpcOptions = field(default_factory=GrpcOptions)
    allow_metrics: bool = True
    metrics_port: int = 8002
    # None: --http-address when HTTP is served, else 0.0.0.0 (as Triton).
    metrics_address: str | None = None
    metrics: MetricsOptions = field(default_factory=MetricsOptions)
    # The OpenAI-compatible API (--openai-port; None: not served), on
    # --openai-address (None: --http-address), with the HTTP port's limits.
    openai_port: int | None = None
    openai_address: str | None = None
    openai: OpenAIOptions = field(default_factory=OpenAIOptions)
    sagemaker: SagemakerOptions | None = None  # --allow-sagemaker (None: not served)
    trace: TraceConfig = field(default_factory=TraceConfig)
    model_load_thread_count: int = 4
    # --model-load-on-demand, --model-memory-limit, --model-idle-unload-secs
    # (actors/residency.py)
    residency: ResidencyOptions = field(default_factory=ResidencyOptions)
    # --rate-limit and --rate-limit-resource (see actors/rate_limiter.py)
    rate_limit: RateLimitMode = RateLimitMode.OFF
    rate_limit_resources: list[RateLimiterResource] = field(default_factory=list)
    allow_client_shm: bool = False
    response_cache_bytes: int = 0  # --cache-config local,size=N; 0: no cache
    redis_cache: RedisSettings | None = None  # --cache-config redis,...
    exit_timeout_secs: float = 30.0
    exit_on_error: bool = True
    log_verbose: int = 0
    log_format: str = "default"
    log_file: str = ""  # "": stderr
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    server_id: str = "triton"
    # The command line's server owns its process: once the exit timeout has passed,
    # work that still holds it (a stub's finalize, a backend's release) is cut and
    # the process exits. False when serving inside another program.
    exit_process: bool = False
    # SIGINT/SIGTERM start the drain (only possible in the main thread). False when
    # serving inside another program (trionserve.api), which calls shutdown itself.
    handle_signals: bool = True

    @property
    def autocomplete(self) -> bool:
        return not (self.strict_model_config or self.disable_auto_complete_config)


class StartupError(InternalError):
    """The server could not start as asked: a frontend's port cannot be bound, or
    (with --exit-on-error) a model failed to load: INTERNAL, as Triton's "failed to
    load all models".

    ``message`` names each failed model with its reason (what an in-process caller
    sees); ``summary`` is the one line the command prints after the per-model error
    lines it has logged already."""

    def __init__(self, message: str, summary: str | None = None) -> None:
        super().__init__(message)
        self.summary = summary if summary is not None else message


def check_port(service: str, address: str, port: int, flag: str) -> None:
    """Fail fast, before any model loads, if ``service`` cannot listen on
    ``address``:``port``: bind a probe socket as the frontend will (SO_REUSEADDR,
    one socket per address ``address`` resolves to) and close it. ``flag`` is the
    command-line flag that chose the port (Triton's main.cc logs "failed to start
    HTTP service" and exits 1; its http_server.cc names "Socket 'address:port'
    already in use")."""
    try:
        infos = socket.getaddrinfo(
            address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise StartupError(
            f"failed to start {service} service: cannot resolve address '{address}': "
            f"{exc.strerror} ({flag.replace('-port', '-address')})"
        ) from None
    for family, kind, proto, _, sockaddr in infos:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError as exc:
            if exc.errno == errno.EAFNOSUPPORT:
                continue  # no IPv6 here: the frontend skips it too (as Trio's listeners)
            raise _bind_error(service, address, port, flag, exc) from None
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                raise _bind_error(service, address, port, flag, exc) from None


def _bind_error(service: str, address: str, port: int, flag: str, exc: OSError) -> StartupError:
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"failed to start {service} service: Unavailable - Socket '{address}:{port}' "
            f"already in use ({flag})"
        )
    return StartupError(
        f"failed to start {service} service: cannot listen on {address}:{port}: "
        f"{exc.strerror or exc} ({flag.replace('-port', '-address')})"
    )


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError a frontend's start raised, also from inside exception groups."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _os_error(inner)
            if found is not None:
                return found
    return None


def _response_cache(options: ServerOptions) -> ResponseCache | None:
    """The one cache of --cache-config (Triton's: core server.cc supports one)."""
    if options.redis_cache is not None:
        return RedisResponseCache(options.redis_cache)
    return ResponseCache(options.response_cache_bytes) if options.response_cache_bytes else None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Server:
    """Root of the actor tree; ``shutdown`` may be called from any Trio task.

    ``exit_code`` says how ``serve`` ended: 0, or 1 when the drain did not finish
    (the exit timeout passed, or a second signal stopped the server at once).
    """

    def __init__(
        self, options: ServerOptions, *, backends: Mapping[str, BackendFactory] | None = None
    ) -> None:
        """``backends``: backends this server has besides the installed ones, by
        backend or platform name (an embedding program's own; tests' stand-ins)."""
        self.options = options
        self.repository = ModelRepository(
            options.model_repositories,
            cache_dir=options.model_cache_dir,
            refresh_on_find=options.model_control_mode is ControlMode.EXPLICIT,
            config_name=options.model_config_name,
            namespacing=options.model_namespacing,
        )
        # This server's backend settings (Triton's TritonBackendManager, one per
        # server): every model's backend is made through it.
        self.backends = BackendManager(
            options.backend_config,
            [options.backend_directory] if options.backend_directory is not None else None,
            backends,
            autocomplete=options.autocomplete,
        )
        self.rate_limiter = RateLimiter(options.rate_limit, options.rate_limit_resources)
        self.registry = ModelRegistry(
            self.repository,
            autocomplete=options.autocomplete,
            load_concurrency=options.model_load_thread_count,
            drain_timeout=options.exit_timeout_secs,
            rate_limiter=self.rate_limiter if self.rate_limiter.enabled else None,
            backends=self.backends,
            summary_quantiles=options.metrics.summary_quantiles
            if options.metrics.summary_latencies
            else None,
        )
        self.residency = self._residency(options)
        self.watcher = RepositoryWatcher(
            self.registry,
            options.model_control_mode,
            options.load_models,
            options.repository_poll_secs,
        )
        self.dataplane = DataPlane(
            self.registry,
            options.model_control_mode,
            options.server_id,
            allow_client_shm=options.allow_client_shm,
            response_cache=_response_cache(options),
            tracing=TraceManager(options.trace),
            first_response_histogram=options.metrics.histogram_latencies,
            strict_readiness=options.strict_readiness,
            undelivered_response_limit=options.max_undelivered_response_bytes,
            budget=ClientBudget(options.client_buffer_limit, options.client_buffer_stall_secs),
        )
        # Set by ``shutdown``: the drain begins.
        self._shutdown = trio.Event()
        # Given to the frontends: set once the drain is over, and they close.
        self._close_frontends = trio.Event()
        # Where the metrics frontend listens once attached (port 0 binds any).
        self.metrics_binds: list[tuple[str, int]] = []
        self._drain_deadline = math.inf
        # The nursery of the network frontends while the server serves.
        self._frontends: trio.Nursery | None = None
        self.exit_code = 0
        # With ``exit_process``: ends the process if serve has not ended in time.
        self._exit_timer: threading.Timer | None = None

    def _residency(self, options: ServerOptions) -> ResidencyManager | None:
        """The residency policy when one of its flags is set; a start error for
        settings that cannot work (on demand outside EXPLICIT mode, a budget that
        names a missing GPU or a fraction of an unknown total)."""
        residency = options.residency
        if not residency.enabled:
            return None
        if residency.load_on_demand and options.model_control_mode is not ControlMode.EXPLICIT:
            raise StartupError(
                "--model-load-on-demand=true needs --model-control-mode=explicit (got "
                f"{options.model_control_mode.value}): in the other modes every model "
                "is loaded at start"
            )
        if options.exit_process:
            # Unloaded models' tensors go back to the system. A setting of the
            # whole process: only the command line's server, which owns its
            # process, makes it (not a server inside another program or a test).
            fix_mmap_threshold()
        gpus = (
            GpuMemory()
            if any(limit.device != "host" for limit in residency.memory_limits)
            else None
        )
        try:
            return ResidencyManager(
                self.registry,
                residency,
                gpus,
                may_unload=options.model_control_mode is ControlMode.EXPLICIT,
            )
        except ValueError as exc:
            if gpus is not None:
                gpus.close()
            raise StartupError(str(exc)) from None

    def shutdown(self) -> None:
        """Begin the graceful drain (see the module docstring)."""
        if not self._shutdown.is_set():
            self._drain_deadline = trio.current_time() + self.options.exit_timeout_secs
            self.dataplane.drain.begin()
            self._shutdown.set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._serve(task_status)
        finally:
            if self.dataplane.response_cache is not None:
                self.dataplane.response_cache.close()
            # Everything ended in time: the process exits as main() decides.
            if self._exit_timer is not None:
                self._exit_timer.cancel()

    async def _serve(self, task_status: trio.TaskStatus[None]) -> None:
        options = self.options
        log.info(
            "server starting",
            version=__version__,
            repositories=[str(p) for p in options.model_repositories],
            mode=options.model_control_mode.value,
        )
        ports = self._ports()
        # In tritonserver's order (main.cc StartEndpoints: GRPC, HTTP, Metrics).
        for service, address, port, flag, reuse in sorted(ports, key=lambda p: _START_ORDER[p[0]]):
            if port and not reuse:
                check_port(service, address, port, flag)
        cache = self.dataplane.response_cache
        if cache is not None:
            # Before any model loads, as core's InferenceServer::Init creates the
            # cache (a Redis cache it cannot reach stops the server).
            try:
                await cache.connect()
            except TritonError as exc:
                raise StartupError(exc.message) from None
        async with trio.open_nursery() as nursery:
            if options.handle_signals:
                nursery.start_soon(self._watch_signals, nursery.cancel_scope)
            await nursery.start(self.dataplane.tracing.run)
            await nursery.start(self.rate_limiter.run)
            await nursery.start(self.dataplane.budget.run)
            await nursery.start(self.registry.run)
            if self.residency is not None:
                await nursery.start(self.residency.run)
            await nursery.start(self.watcher.run)
            if self.residency is not None:
                self.residency.serving()
            if self.watcher.startup_errors and options.exit_on_error:
                await self._unload_all()
                nursery.cancel_scope.cancel()
                # Each model's reason is logged (at error) as it failed: the
                # command's summary names the models only.
                failed = sorted(self.watcher.startup_errors.items())
                raise StartupError(
                    "failed to load all models: "
                    + "; ".join(f"{name}: {reason}" for name, reason in failed),
                    summary="failed to load all models: " + ", ".join(name for name, _ in failed),
                )
            settle_heap(options.exit_process)  # (before the first request comes)
            async with trio.open_nursery() as frontends:
                self._frontends = frontends
                endpoints = []
                attach: dict[str, Callable[[str, int], Awaitable[list[tuple[str, int]]]]] = {
                    "HTTP": self.attach_http,
                    "GRPC": self.attach_grpc,
                    "Metrics": self.attach_metrics,
                    "OpenAI": self.attach_openai,
                    "SageMaker": self.attach_sagemaker,
                }
                for service, address, port, flag, _ in ports:
                    try:
                        binds = await attach[service](address, port)
                    except BaseException as exc:
                        failure = _os_error(exc)
                        if failure is None:
                            raise
                        # Taken between the check and now: the same one line.
                        await self._unload_all()
                        nursery.cancel_scope.cancel()
                        raise _bind_error(service, address, port, flag, failure) from None
                    endpoints += [
                        {"endpoint": service, "address": _address(host, bound)}
                        for host, bound in binds
                    ]
                self.dataplane.started = True
                self._log_overview(endpoints)
                task_status.started()
                await self._shutdown.wait()
                await self._drain()
                self._close_frontends.set()
                frontends.cancel_scope.deadline = max(
                    self._drain_deadline, trio.current_time() + CLOSE_GRACE_SECS
                )
            self._frontends = None
            await self._unload_all(max(0.0, self._drain_deadline - trio.current_time()))
            await self.dataplane.tracing.aclose()
            log.info("server stopped", exit_code=self.exit_code)
            self._exit_process_soon()
            nursery.cancel_scope.cancel()

    # -- start-up overview ----------------------------------------------------------

    def _ports(self) -> list[tuple[str, str, int, str, bool]]:
        """(service, address, port, flag, shared port) of each frontend the options
        ask for, metrics first: by the time HTTP answers, /metrics does too."""
        options = self.options
        ports = []
        if options.allow_metrics:
            ports.append(
                ("Metrics", self._metrics_address(), options.metrics_port, "--metrics-port", False)
            )
        if options.allow_http:
            ports.append(
                (
                    "HTTP",
                    options.http_address,
                    options.http_port,
                    "--http-port",
                    options.http.reuse_port,
                )
            )
        if options.allow_grpc:
            ports.append(
                (
                    "GRPC",
                    options.grpc_address,
                    options.grpc_port,
                    "--grpc-port",
                    options.grpc.reuse_port,
                )
            )
        if (sagemaker := options.sagemaker) is not None:
            ports.append(
                ("SageMaker", sagemaker.address, sagemaker.port, "--sagemaker-port", False)
            )
        if options.openai_port is not None:
            ports.append(
                (
                    "OpenAI",
                    options.openai_address or options.http_address,
                    options.openai_port,
                    "--openai-port",
                    options.http.reuse_port,
                )
            )
        return ports

    def _log_overview(self, endpoints: list[dict]) -> None:
        """The start-up overview, as tritonserver's model table: every model version
        with its state (or why it is not ready), the endpoints with their
        addresses, then ``server ready`` only when the readiness API says so."""
        models = [
            {
                "model": row["name"],
                "version": row.get("version", ""),
                "state": row.get("state", ""),
                "reason": row.get("reason", ""),
            }
            for row in self.registry.index()
        ]
        if backends := self.backends.backend_rows():
            log.info("backends", table=backends)  # core server.cc:667
        log.info("models", table=models or [{"model": "(none)"}])
        log.info("options", table=options_rows(self.options))  # Triton's options table
        if endpoints:
            log.info("endpoints", table=endpoints)
        if self.dataplane.ready():
            log.info("server ready", models=len(models))
            return
        failed = sorted(
            {row["model"] for row in models if row["state"] not in ("READY", "")}
            | set(self.watcher.startup_errors)
        )
        log.error(
            "server started but not ready: models failed to load",
            failed=failed,
            hint="see each model's error above; /v2/health/ready answers 400",
        )

    # -- frontends ---------------------------------------------------------------

    def _frontend_nursery(self, what: str) -> trio.Nursery:
        """Where a frontend runs: beside the others, closed with them after the drain."""
        if self._frontends is None or self._shutdown.is_set():
            state = "shutting down" if self._shutdown.is_set() else "not started"
            raise Unavailable(f"cannot attach the {what} frontend: the server is {state}")
        return self._frontends

    async def attach_http(
        self, address: str, port: int, options: HttpOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve the HTTP/REST protocol on ``address``:``port`` (0: any free port)
        from the running core; returns the bound (host, port) pairs. The frontend
        keeps serving through the drain and closes with the others after it."""
        binds = await self._frontend_nursery("HTTP").start(
            serve_http,
            self.dataplane,
            address,
            port,
            self._close_frontends,
            self.options.exit_timeout_secs,
            self.options.log_verbose > 0,
            options if options is not None else self.options.http,
        )
        # Triton's words (server src/http_server.cc:4971), as the next two.
        log.info("Started HTTPService at " + ", ".join(_address(*b) for b in binds))
        return binds

    async def attach_grpc(
        self, address: str, port: int, options: GrpcOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve the gRPC protocol from the running core (as :meth:`attach_http`)."""
        binds = await self._frontend_nursery("GRPC").start(
            serve_grpc,
            self.dataplane,
            address,
            port,
            self._close_frontends,
            self.options.exit_timeout_secs,
            options if options is not None else self.options.grpc,
            self.options.log_verbose > 0,
        )
        log.info("Started GRPCInferenceService at " + ", ".join(_address(*b) for b in binds))
        return binds

    async def attach_openai(
        self, address: str, port: int, options: OpenAIOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve the OpenAI-compatible API from the running core (as
        :meth:`attach_http`), with the HTTP port's limits and its errors in
        OpenAI's shape."""
        transport = replace(
            self.options.http.transport_options(),
            error_body=error_body,
            budget=self.dataplane.budget,
        )
        binds = await self._frontend_nursery("OpenAI").start(
            serve_openai,
            self.dataplane,
            address,
            port,
            self._close_frontends,
            self.options.exit_timeout_secs,
            options if options is not None else self.options.openai,
            transport,
            self.options.metrics,
        )
        log.debug("OpenAI service started", listening=binds)
        return binds

    async def attach_sagemaker(self, address: str, port: int) -> list[tuple[str, int]]:
        """SageMaker's port, with the HTTP port's limits; log line: sagemaker_server.cc:291."""
        options, sagemaker = self.options, self.options.sagemaker or SagemakerOptions()
        args = (self.dataplane, address, port, self._close_frontends, options.exit_timeout_secs)
        more = (options.log_verbose > 0, options.http, sagemaker)
        binds = await self._frontend_nursery("SageMaker").start(serve_sagemaker, *args, *more)
        log.info("Started Sagemaker HTTPService at " + ", ".join(_address(*b) for b in binds))
        return binds

    async def attach_metrics(
        self, address: str, port: int, options: MetricsOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve Prometheus ``/metrics`` from the running core (as :meth:`attach_http`)."""
        binds = await self._frontend_nursery("metrics").start(
            serve_metrics,
            self.registry,
            options if options is not None else self.options.metrics,
            address,
            port,
            self._close_frontends,
            replace(
                self.options.http.transport_options(reuse_port=False),
                budget=self.dataplane.budget,
            ),
        )
        log.info("Started Metrics Service at " + ", ".join(_address(*b) for b in binds))
        self.metrics_binds = binds
        return binds

    async def _drain(self) -> None:
        """Wait, until the exit timeout, for the requests in flight and the open
        sequences to finish; the frontends serve meanwhile."""
        dataplane = self.dataplane
        log.info(  # Triton's words (core src/server.cc:312)
            "Waiting for in-flight requests to complete.",
            inflight=dataplane.drain.inflight,
            open_sequences=dataplane.drain.open_sequences(),
            exit_timeout_secs=self.options.exit_timeout_secs,
        )
        with trio.move_on_at(self._drain_deadline):
            await dataplane.drain.wait_drained()
            log.info("drained: no request in flight, no sequence open")
            return
        self.exit_code = 1
        log.error(
            "Exit timeout expired. Exiting immediately.",
            inflight=dataplane.drain.inflight,
            open_sequences=dataplane.drain.open_sequences(),
            exit_timeout_secs=self.options.exit_timeout_secs,
        )

    def _metrics_address(self) -> str:
        """Triton's rule: --metrics-address, else the HTTP address when HTTP is
        served, else all interfaces."""
        options = self.options
        if options.metrics_address:
            return options.metrics_address
        return options.http_address if options.allow_http else "0.0.0.0"

    async def _unload_all(self, timeout: float | None = None) -> None:
        """Unload every model within ``timeout`` (default: the exit timeout); what
        is left then is cancelled, and still releases its backend."""
        if timeout is None:
            timeout = self.options.exit_timeout_secs
        with trio.move_on_after(timeout) as scope:
            await self.registry.unload_all()
        if scope.cancelled_caught:
            self.exit_code = 1
            log.warning("models did not unload within the exit timeout")

    def _exit_process_soon(self) -> None:
        """With ``exit_process``: if what is left (model releases running in threads,
        which cancellation cannot stop) still holds the process CLOSE_GRACE_SECS
        from now, exit it (code 1), as Triton does once its exit timeout expired."""
        if not self.options.exit_process:
            return

        def exit_now() -> None:
            log.error(
                "Exit timeout expired. Exiting immediately.",
                left="model releases still running (a model's finalize, a stub process)",
            )
            # What a file override wrote is not left behind (nothing loads it now).
            self.registry.lifecycle.remove_overrides()
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(1)

        if self._exit_timer is None:
            self._exit_timer = threading.Timer(CLOSE_GRACE_SECS, exit_now)
            self._exit_timer.daemon = True
            self._exit_timer.start()

    async def _watch_signals(self, everything: trio.CancelScope) -> None:
        """First signal: graceful shutdown. Second signal: stop at once."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self._shutdown.is_set() or not self.dataplane.started:
                    log.warning("stopping now", signal=signal.Signals(signum).name)
                    if self._shutdown.is_set() and not self.dataplane.drain.drained():
                        self.exit_code = 1
                    self.shutdown()
                    self._exit_process_soon()
                    everything.cancel()
                    return
                log.info("shutdown requested", signal=signal.Signals(signum).name)
                self.shutdown()
