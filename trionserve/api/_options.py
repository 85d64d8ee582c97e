"""``tritonserver.Options`` under Triton's field names, and the enums it uses.

Every field of Triton's ``Options`` (core ``python/tritonserver/_api/_server.py``)
is here with Triton's default, so code written for ``tritonserver`` constructs it
unchanged. Each field either configures the command line's server
(:class:`trionserve.server.ServerOptions`), configures a part of Triton this
server has no counterpart for and is accepted with no effect (as the command line
accepts the same flags, ``trionserve/cli/compat.py``), or names a feature this
server does not have yet and is refused, naming the field, when set to anything
but its default.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from trionserve.actors import rate_limiter
from trionserve.actors.watcher import ControlMode
from trionserve.core import errors
from trionserve.observability.metrics import MetricsOptions, parse_metrics_config
from trionserve.server import ServerOptions

log = structlog.get_logger(__name__)


# Triton's enums (tritonserver/_c/tritonserver_pybind.cc), with its values.
class ModelControlMode(enum.IntEnum):
    """TRITONSERVER_ModelControlMode."""

    NONE = 0
    POLL = 1
    EXPLICIT = 2


class RateLimitMode(enum.IntEnum):
    """TRITONSERVER_RateLimitMode."""

    OFF = 0
    EXEC_COUNT = 1


class LogFormat(enum.IntEnum):
    """TRITONSERVER_LogFormat."""

    DEFAULT = 0
    ISO8601 = 1


class InstanceGroupKind(enum.IntEnum):
    """TRITONSERVER_InstanceGroupKind."""

    AUTO = 0
    CPU = 1
    GPU = 2
    MODEL = 3


class MetricFormat(enum.IntEnum):
    """TRITONSERVER_MetricFormat."""

    PROMETHEUS = 0


class ModelBatchFlag(enum.IntFlag):
    """TRITONSERVER_ModelBatchFlag."""

    UNKNOWN = 1
    FIRST_DIM = 2


class ModelTxnPropertyFlag(enum.IntFlag):
    """TRITONSERVER_ModelTxnPropertyFlag."""

    ONE_TO_ONE = 1
    DECOUPLED = 2


@dataclass(slots=True)
class RateLimiterResource:
    """A resource the rate limiter hands out: ``count`` of ``name`` on ``device``."""

    name: str
    count: int
    device: int


@dataclass(slots=True)
class ModelLoadDeviceLimit:
    """Triton's limit on a device's memory for loading models (no effect here)."""

    kind: InstanceGroupKind
    device: int
    fraction: float


# Fields that configure parts of Triton with no counterpart here: accepted with no
# effect, as the command line's flags for them (cli.compat._NO_EFFECT).
_NO_EFFECT = {
    "pinned_memory_pool_size": "there is no pinned memory pool",
    "cuda_memory_pool_sizes": "there is no CUDA memory pool",
    "cache_directory": "the response cache is built in (cache_config={'local': ...})",
    "min_supported_compute_capability": "every GPU the frameworks can use is used",
    "buffer_manager_thread_count": "tensor copies run in the request's own task",
    "model_load_retry_count": "a model that fails to load is not retried",
    "enable_peer_access": "CUDA peer access is left to the frameworks",
    "repo_agent_directory": "repository agents are not supported",
    "model_load_device_limits": "device memory is not checked before a load",
    "host_policies": "there are no host policies (NUMA placement, CPU pinning)",
}
# Fields naming a feature this server does not have (yet): refused unless default.
_NOT_SUPPORTED: dict[str, str] = {}


@dataclass(slots=True)
class Options:
    """Server settings, as Triton's ``tritonserver.Options`` (same fields, same
    defaults). Checked when the server starts: a value of the wrong type raises
    TypeError, an unusable one InvalidArgumentError naming the field.

    Settings this server has beyond these (frontends started with it, tracing,
    client shared memory) are set by passing the command line's own
    :class:`trionserve.server.ServerOptions` to ``Server`` instead.
    """

    model_repository: str | Path | Sequence[str | Path] | None = field(default_factory=list)
    server_id: str = "triton"
    model_control_mode: ModelControlMode | ControlMode | str = ModelControlMode.NONE
    startup_models: list[str] = field(default_factory=list)
    strict_model_config: bool = False

    rate_limiter_mode: RateLimitMode = RateLimitMode.OFF
    rate_limiter_resources: list[RateLimiterResource] = field(default_factory=list)

    pinned_memory_pool_size: int = 1 << 28
    cuda_memory_pool_sizes: dict[int, int] = field(default_factory=dict)

    # {"local": {"size": bytes}}: the response cache (--cache-config)
    cache_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    cache_directory: str = "/opt/tritonserver/caches"

    min_supported_compute_capability: float = 6.0

    exit_on_error: bool = True
    strict_readiness: bool = True
    exit_timeout: float = 30  # seconds a stop() waits for the drain
    buffer_manager_thread_count: int = 0
    model_load_thread_count: int = 4
    model_load_retry_count: int = 0
    model_namespacing: bool = False
    enable_peer_access: bool = True

    # Logging is process-wide, as in Triton; each level turns on the ones above it.
    log_file: str | None = None
    log_info: bool = False
    log_warn: bool = False
    log_error: bool = False
    log_format: LogFormat | str = LogFormat.DEFAULT
    log_verbose: int = 0

    metrics: bool = True
    gpu_metrics: bool = True
    cpu_metrics: bool = True
    metrics_interval: int = 2000  # milliseconds

    # Where Python-based backends are looked for (<dir>/<backend>/model.py).
    backend_directory: str | Path | None = "/opt/tritonserver/backends"
    repo_agent_directory: str = "/opt/tritonserver/repoagents"
    model_load_device_limits: list[ModelLoadDeviceLimit] = field(default_factory=list)
    # backend name ("" for every backend) -> setting -> value (--backend-config)
    backend_configuration: dict[str, dict[str, str]] = field(default_factory=dict)
    host_policies: dict[str, dict[str, str]] = field(default_factory=dict)
    # config name ("" for the general one) -> setting -> value (--metrics-config)
    metrics_configuration: dict[str, dict[str, str]] = field(default_factory=dict)

    # Polling interval with ModelControlMode.POLL (--repository-poll-secs); not
    # one of Triton's fields (its in-process POLL mode polls on request only).
    repository_poll_secs: float = 15.0

    def server_options(self) -> ServerOptions:
        """The same settings as the command line's server takes them, with no
        network frontend and no signal handling (the host program owns those).
        Raises TypeError or InvalidArgumentError for a field that cannot be used."""
        _check_types(self)
        for name, reason in _NOT_SUPPORTED.items():
            if getattr(self, name) != _DEFAULTS[name]:
                raise errors.InvalidArgument(
                    f"Options.{name}={getattr(self, name)!r}: {reason} by this server"
                )
        for name, reason in _NO_EFFECT.items():
            if getattr(self, name) != _DEFAULTS[name]:
                log.info("option has no effect", option=f"Options.{name}", reason=reason)
        log_info = self.log_info or self.log_verbose > 0
        log_warn = self.log_warn or log_info
        return ServerOptions(
            model_repositories=_repositories(self.model_repository),
            model_namespacing=self.model_namespacing,
            model_control_mode=_control_mode(self.model_control_mode),
            repository_poll_secs=self.repository_poll_secs,
            load_models=list(self.startup_models),
            strict_model_config=self.strict_model_config,
            exit_on_error=self.exit_on_error,
            strict_readiness=self.strict_readiness,
            exit_timeout_secs=float(self.exit_timeout),
            model_load_thread_count=self.model_load_thread_count,
            rate_limit=_rate_limit_mode(self.rate_limiter_mode),
            rate_limit_resources=_rate_limit_resources(self.rate_limiter_resources),
            backend_config={k: dict(v) for k, v in self.backend_configuration.items()},
            backend_directory=_backend_directory(self.backend_directory),
            response_cache_bytes=_cache_bytes(self.cache_config),
            metrics=self._metrics_options(),
            log_file=self.log_file or "",
            log_info=log_info,
            log_warning=log_warn,
            log_error=self.log_error or log_warn,
            log_verbose=self.log_verbose,
            log_format=_log_format(self.log_format),
            server_id=self.server_id,
            allow_http=False,
            allow_grpc=False,
            allow_metrics=False,
            handle_signals=False,
        )

    def _metrics_options(self) -> MetricsOptions:
        settings = [
            f"{setting}={value}"
            for section, values in self.metrics_configuration.items()
            for setting, value in values.items()
            if not section
        ]
        named = sorted(section for section in self.metrics_configuration if section)
        if named:
            raise errors.InvalidArgument(
                f"Options.metrics_configuration: unknown metrics configuration {named}; "
                "settings go under the name '' ({'': {'counter_latencies': 'false'}})"
            )
        try:
            latencies = parse_metrics_config(settings)
        except ValueError as exc:
            raise errors.InvalidArgument(f"Options.metrics_configuration: {exc}") from None
        return MetricsOptions(
            allow_cpu_metrics=self.metrics and self.cpu_metrics,
            allow_gpu_metrics=self.metrics and self.gpu_metrics,
            interval_ms=float(self.metrics_interval),
            **latencies,
        )


_DEFAULTS = {
    f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    for f in dataclasses.fields(Options)
}

# field -> the types it takes (Triton's binding raises TypeError for others)
_TYPES: dict[str, tuple[type, ...]] = {
    "server_id": (str,),
    "startup_models": (list, tuple),
    "strict_model_config": (bool,),
    "exit_on_error": (bool,),
    "strict_readiness": (bool,),
    "exit_timeout": (int, float),
    "model_load_thread_count": (int,),
    "log_file": (str, type(None)),
    "log_info": (bool,),
    "log_warn": (bool,),
    "log_error": (bool,),
    "log_verbose": (int,),
    "metrics": (bool,),
    "gpu_metrics": (bool,),
    "cpu_metrics": (bool,),
    "metrics_interval": (int, float),
    "backend_configuration": (dict,),
    "metrics_configuration": (dict,),
    "cache_config": (dict,),
    "repository_poll_secs": (int, float),
}


def _check_types(options: Options) -> None:
    for name, types in _TYPES.items():
        value = getattr(options, name)
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            expected = " or ".join(t.__name__ for t in types)
            raise TypeError(f"Options.{name} must be {expected}, got {value!r}")


def _repositories(value: Any) -> list[str | Path]:
    if value is None or (isinstance(value, (list, tuple)) and not value):
        raise errors.InvalidArgument("Model repository must be specified.")
    paths = [value] if isinstance(value, (str, Path)) else value
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, Path)) for p in paths):
        raise TypeError(
            f"Options.model_repository must be a path or a list of paths, got {value!r}"
        )
    return list(paths)


def _control_mode(value: Any) -> ControlMode:
    if isinstance(value, ControlMode):
        return value
    if isinstance(value, ModelControlMode):
        return ControlMode[value.name]
    if isinstance(value, str):
        try:
            return ControlMode(value.lower())
        except ValueError:
            pass
    raise errors.InvalidArgument(
        f"Options.model_control_mode: expected a ModelControlMode (NONE, POLL, EXPLICIT), "
        f"got {value!r}"
    )


def _rate_limit_mode(value: Any) -> rate_limiter.RateLimitMode:
    if isinstance(value, RateLimitMode):
        return rate_limiter.RateLimitMode[value.name]
    if isinstance(value, rate_limiter.RateLimitMode):
        return value
    if isinstance(value, str):
        try:
            return rate_limiter.RateLimitMode(value.lower())
        except ValueError:
            pass
    raise errors.InvalidArgument(
        f"Options.rate_limiter_mode: expected a RateLimitMode (OFF, EXEC_COUNT), got {value!r}"
    )


def _rate_limit_resources(value: Any) -> list[rate_limiter.RateLimiterResource]:
    """Each RateLimiterResource as the server takes it; a device of -1 gives the
    count to every device (--rate-limit-resource without a device)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"Options.rate_limiter_resources must be a list, got {value!r}")
    resources = []
    for item in value:
        if not isinstance(item, (RateLimiterResource, rate_limiter.RateLimiterResource)):
            raise TypeError(
                f"Options.rate_limiter_resources: expected RateLimiterResource items, got {item!r}"
            )
        if not item.name or item.count < 0 or item.device < -1:
            raise errors.InvalidArgument(
                f"Options.rate_limiter_resources: {item!r}: expected a name, a count >= 0 "
                "and a device id (-1: every device)"
            )
        resources.append(rate_limiter.RateLimiterResource(item.name, item.count, item.device))
    return resources


def _log_format(value: Any) -> str:
    """TRITONSERVER_LOG_DEFAULT and ISO8601 are Triton's line formats (common
    logging.h Logger::LogFormatString names them "default" and "ISO8601");
    "console" and "json" are this server's structured ones."""
    if isinstance(value, LogFormat):
        return "ISO8601" if value == LogFormat.ISO8601 else "default"
    if value in ("default", "ISO8601", "console", "json"):
        return str(value)
    raise errors.InvalidArgument(
        "Options.log_format: expected a LogFormat (DEFAULT, ISO8601), 'console' or 'json', "
        f"got {value!r}"
    )


def _backend_directory(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise TypeError(f"Options.backend_directory must be a path, got {value!r}")
    return Path(value)


def _cache_bytes(cache_config: dict[str, dict[str, Any]]) -> int:
    unknown = set(cache_config) - {"local"}
    if unknown:
        raise errors.InvalidArgument(
            f"Options.cache_config: unknown cache {sorted(unknown)}; this server has the "
            "'local' cache only ({'local': {'size': bytes}})"
        )
    size = cache_config.get("local", {}).get("size", 0)
    try:
        return int(size)
    except (TypeError, ValueError):
        raise errors.InvalidArgument(
            f"Options.cache_config: 'local' 'size' must be a number of bytes, got {size!r}"
        ) from None


def server_options(options: Options | ServerOptions | None, kwargs: dict) -> ServerOptions:
    """``Server(options)`` or ``Server(**kwargs)``, as Triton's Server takes them."""
    if options is not None and kwargs:
        raise errors.InvalidArgument("give either an Options object or keyword arguments, not both")
    if options is None:
        options = Options(**kwargs)
    if isinstance(options, Options):
        return options.server_options()
    if isinstance(options, ServerOptions):
        # Signals belong to the host program (and reach only its main thread).
        return dataclasses.replace(options, handle_signals=False)
    raise errors.InvalidArgument(
        f"options must be trionserve.api.Options or ServerOptions, got {type(options).__name__}"
    )
