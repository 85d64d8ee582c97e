"""Command line: Triton's flag names mapped onto ServerOptions, then trio.run."""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import structlog
import trio

from trionserve import __version__
from trionserve.actors.rate_limiter import RateLimiterResource, RateLimitMode, parse_resource
from trionserve.actors.watcher import ControlMode
from trionserve.backends.backend_config import parse_backend_config
from trionserve.cli_compat import add_compat_flags, compat_notes
from trionserve.core.errors import TritonError
from trionserve.core.inference import DEFAULT_UNDELIVERED_RESPONSE_BYTES
from trionserve.core.response_cache import parse_cache_config
from trionserve.observability.logging import configure_logging
from trionserve.observability.metrics import MetricsOptions, parse_metrics_config
from trionserve.observability.trace.settings import TraceConfig, parse_trace_config
from trionserve.protocol.grpc.service import GrpcOptions, GrpcSsl
from trionserve.protocol.http.frontend import HttpOptions
from trionserve.protocol.openai.chat import ChatTemplates
from trionserve.protocol.openai.frontend import OpenAIOptions, parse_restricted_apis
from trionserve.protocol.restricted import (
    GRPC_HEADER_PREFIX,
    RestrictedCategory,
    RestrictedFeatures,
    parse_restricted_features,
)
from trionserve.repository.object_store import is_remote
from trionserve.server import Server, ServerOptions, StartupError
from trionserve.workers import (
    add_worker_flags,
    run_supervisor,
    serve_worker,
    worker_conflicts,
)

log = structlog.get_logger(__name__)

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def _int_at_least(minimum: int):
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


_RESTRICTED_GROUPS = ", ".join(c.value for c in RestrictedCategory)


class _Parser(argparse.ArgumentParser):
    """argparse with tritonserver's usage-error exit code (1, main.cc) and, instead
    of the whole usage, one error line and where the help is."""

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="trionserve",
        description="A Triton-compatible inference server on Trio.",
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"trionserve {__version__}")
    add = p.add_argument
    add(
        "--model-repository",
        "--model-store",
        dest="model_repositories",
        action="append",
        type=_repository,
        metavar="PATH",
        help="model repository: a directory, or s3://, gs://, as:// (repeatable)",
    )
    add(
        "--model-namespacing",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="each model repository is a namespace: models with the same name in "
        "different repositories are served side by side (default false)",
    )
    add(
        "--model-cache-dir",
        type=Path,
        metavar="DIR",
        help="where object-storage repositories are copied (default: a temporary "
        "directory removed at exit)",
    )
    add(
        "--model-control-mode",
        choices=[m.value for m in ControlMode],
        default="none",
        type=str.lower,
        help="none | explicit | poll (default none)",
    )
    add(
        "--repository-poll-secs",
        type=_non_negative_float,
        default=15.0,
        help="seconds between repository polls in poll mode (default 15)",
    )
    add(
        "--load-model",
        dest="load_models",
        action="append",
        default=[],
        metavar="NAME",
        help="model to load at startup in explicit mode (repeatable; '*' = all)",
    )
    add(
        "--strict-model-config",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="require complete config.pbtxt files: no auto-complete (default false)",
    )
    add(
        "--disable-auto-complete-config",
        action="store_true",
        help="do not auto-complete configurations from model files",
    )
    add(
        "--strict-readiness",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="ready only when every model is ready (default true); false: ready "
        "once the server started, whatever the models' state",
    )
    add(
        "--max-undelivered-response-bytes",
        type=_int_at_least(1024 * 1024),
        default=DEFAULT_UNDELIVERED_RESPONSE_BYTES,
        metavar="BYTES",
        help="bytes of one request's responses the server holds before its client "
        "reads them (a decoupled model streaming to a client that stops "
        "reading); past it the request is cancelled with RESOURCE_EXHAUSTED "
        f"(default {DEFAULT_UNDELIVERED_RESPONSE_BYTES})",
    )
    add(
        "--model-config-name",
        type=_config_name,
        metavar="NAME",
        help="read <model>/configs/NAME.pbtxt where it exists, else config.pbtxt",
    )
    add(
        "--backend-directory",
        type=Path,
        default=None,
        metavar="DIR",
        help="where Python-based backends live: DIR/<backend>/model.py serves every "
        'model with backend: "<backend>" (default /opt/tritonserver/backends)',
    )
    add(
        "--backend-config",
        action="append",
        default=[],
        metavar="BACKEND,SETTING=VALUE",
        help="python,shm-default-byte-size=N, shm-growth-byte-size=N, "
        "stub-timeout-seconds=N, ...: defaults of every Python model (its own "
        "parameters win); other backends' settings are accepted without effect",
    )
    add(
        "--allow-http",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="serve the HTTP/REST API (default true)",
    )
    add(
        "--http-address",
        default="0.0.0.0",
        metavar="ADDRESS",
        help="address the HTTP/REST API listens on (default 0.0.0.0: every interface)",
    )
    add(
        "--http-port",
        type=_port,
        default=8000,
        metavar="PORT",
        help="port of the HTTP/REST API; 0: any free port (default 8000)",
    )
    add(
        "--http-max-input-size",
        type=_positive_int,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="largest HTTP request body accepted, after decompression too; 413 beyond "
        "it (default 67108864: 64 MiB, as Triton)",
    )
    add(
        "--http-max-connections",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="HTTP connections served at once; more are answered 503 and closed (default 1024)",
    )
    add(
        "--http-header-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="a connection must send a whole request head within this time of opening "
        "(or of a later request's first byte), and a request body must not pause for "
        "longer, else 408 and closed (default 30)",
    )
    add(
        "--http-keep-alive-timeout",
        type=_positive_float,
        default=60.0,
        metavar="SECONDS",
        help="an idle keep-alive connection is closed after this time; at "
        "--http-max-connections the longest idle ones are closed first to make room "
        "(default 60; not in Triton, whose HTTP server keeps idle connections open)",
    )
    add(
        "--reuse-http-port",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="bind the HTTP port with SO_REUSEPORT (default false)",
    )
    add(
        "--http-header-forward-pattern",
        type=_header_pattern,
        metavar="REGEX",
        help="forward infer request headers matching REGEX (case-insensitive; "
        "(?-i) prefix: case-sensitive) to the model as parameters",
    )
    add(
        "--http-restricted-api",
        action="append",
        default=[],
        metavar="<API>[,<API>...]:<KEY>=<VALUE>",
        help="requests to these APIs must carry the header KEY with VALUE, else 403 "
        f"(repeatable, each API in one flag only); APIs: {_RESTRICTED_GROUPS}",
    )
    add(
        "--allow-grpc",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="serve the gRPC API (default true)",
    )
    add(
        "--grpc-address",
        default="0.0.0.0",
        metavar="ADDRESS",
        help="address the gRPC API listens on (default 0.0.0.0: every interface)",
    )
    add(
        "--grpc-port",
        type=_port,
        default=8001,
        metavar="PORT",
        help="port of the gRPC API; 0: any free port (default 8001)",
    )
    add(
        "--reuse-grpc-port",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="bind the gRPC port with SO_REUSEPORT (default false)",
    )
    _add_grpc_flags(add)
    _add_grpc_ssl_flags(add)
    _add_metrics_flags(add)
    _add_openai_flags(add)
    _add_trace_flags(add)
    add(
        "--allow-client-shm",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="let clients register system shared memory regions (default false)",
    )
    add(
        "--cache-config",
        action="append",
        default=[],
        metavar="local,size=BYTES",
        help="response cache for models with response_cache enabled (repeatable)",
    )
    add(
        "--response-cache-byte-size",
        type=_non_negative_int,
        default=None,
        metavar="BYTES",
        help="deprecated: --cache-config local,size=BYTES",
    )
    add(
        "--model-load-thread-count",
        type=_positive_int,
        default=4,
        help="models loaded concurrently (default 4)",
    )
    add(
        "--rate-limit",
        type=str.lower,
        default="off",
        choices=[mode.value for mode in RateLimitMode],
        help="off (default): an instance executes as soon as it is free; execution_count: "
        "instances whose instance group has a rate_limiter block execute once their "
        "resources are free, in the order of their priority and execution count",
    )
    add(
        "--rate-limit-resource",
        dest="rate_limit_resources",
        action="append",
        default=[],
        type=_rate_limit_resource,
        metavar="<name>:<count>[:<device>]",
        help="copies of a rate-limiter resource (repeatable); without <device> on every "
        "device; default: the largest count any loaded instance needs",
    )
    add(
        "--exit-timeout-secs",
        type=_non_negative_float,
        default=30.0,
        help="seconds to finish in-flight requests at shutdown (default 30)",
    )
    add(
        "--exit-on-error",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="exit if a model fails to load at startup (default true)",
    )
    add(
        "--log-verbose",
        type=int,
        default=0,
        metavar="LEVEL",
        help="verbose logging level; > 0 logs every request",
    )
    add(
        "--log-format",
        choices=["console", "json", "default", "ISO8601"],
        default="console",
        help="console (default; Triton's 'default' and 'ISO8601' name it too) or json",
    )
    for level in ("info", "warning", "error"):
        add(
            f"--log-{level}",
            type=_bool,
            default=True,
            metavar="BOOL",
            help=f"log {level}-level events (default true)",
        )
    add("--log-file", default="", metavar="PATH", help="append the log to PATH instead of stderr")
    add(
        "--id",
        dest="server_id",
        default="triton",
        help="server name in server metadata (Triton's default: triton)",
    )
    add_worker_flags(add)
    add_compat_flags(add, _bool)
    return p


def _repository(text: str) -> Path | str:
    """A local repository path, or an object-storage location kept as written."""
    return text if is_remote(text) else Path(text)


def _rate_limit_resource(text: str) -> RateLimiterResource:
    try:
        return parse_resource(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"invalid regular expression {text!r}: {exc}") from None
    return text


def _header_pattern(text: str) -> str:
    """A header-forwarding pattern as Triton applies it: case-insensitive (header
    names are), unless it begins with ``(?-i)``."""
    if text.startswith("(?-i)"):
        return _regex(text[len("(?-i)") :])
    return _regex("(?i)" + text)


def _compression_level(text: str) -> str:
    level = text.lower()
    return "med" if level == "medium" else level  # Triton spells it "medium"


def _config_name(text: str) -> str:
    if not text or any(c.isspace() for c in text) or "/" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(
            f"expected a configuration name without spaces or '/', got {text!r}"
        )
    return text


def _add_grpc_flags(add) -> None:
    """tritonserver's gRPC tuning flags (see GrpcOptions for what each one does)."""
    add(
        "--grpc-max-message-size",
        type=_int_at_least(1024),
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="largest request message, after decompression; larger "
        "ones get RESOURCE_EXHAUSTED (default 67108864, as --http-max-input-size)",
    )
    add(
        "--grpc-max-concurrent-streams",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="calls one connection may have open at once; clients queue the rest (default 1024)",
    )
    add(
        "--grpc-max-connection-buffer",
        type=_int_at_least(1024 * 1024),
        default=256 * 1024 * 1024,
        metavar="BYTES",
        help="bytes one connection may hold, all its streams together, for requests not "
        "yet taken, requests taken and not answered, and responses the client has not "
        "read; past it no request is taken and the client is held back by flow control "
        "(default 268435456)",
    )
    add(
        "--grpc-max-connections",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="connections served at once; past it a new one is closed (default 1024)",
    )
    add(
        "--grpc-first-call-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection that starts no call within SECONDS of opening (default 30)",
    )
    add(
        "--grpc-idle-timeout",
        type=_positive_float,
        default=300.0,
        metavar="SECONDS",
        help="close (GOAWAY) a connection that has had no call in flight for SECONDS; at "
        "--grpc-max-connections the longest idle one is closed to make room (default 300; "
        "not in Triton, whose gRPC server keeps idle connections open)",
    )
    add(
        "--grpc-header-forward-pattern",
        type=_header_pattern,
        metavar="REGEX",
        help="forward request headers matching REGEX (case-insensitive; (?-i) "
        "prefix: case-sensitive) to the model as parameters",
    )
    add(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        metavar="<PROTOCOL>[,<PROTOCOL>...]:<KEY>=<VALUE>",
        help="calls of these protocols must carry the header triton-grpc-protocol-KEY "
        "with VALUE, else UNAVAILABLE (repeatable, each protocol in one flag only); "
        f"protocols: {_RESTRICTED_GROUPS}",
    )
    add(
        "--grpc-infer-allocation-pool-size",
        type=_non_negative_int,
        metavar="N",
        help="accepted, no effect: responses are built for each call",
    )
    add(
        "--grpc-infer-response-compression-level",
        default="none",
        choices=["none", "low", "med", "high"],
        type=_compression_level,
        help="gzip level for responses to clients that accept it (default none)",
    )
    add(
        "--grpc-keepalive-time",
        type=_non_negative_int,
        default=7_200_000,
        metavar="MS",
        help="ping a client after MS milliseconds (default 7200000)",
    )
    add(
        "--grpc-keepalive-timeout",
        type=_non_negative_int,
        default=20_000,
        metavar="MS",
        help="close a connection whose ping is not answered in MS ms (default 20000)",
    )
    add(
        "--grpc-keepalive-permit-without-calls",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="send keepalive pings also on connections without calls (default false)",
    )
    for flag, default in (
        ("--grpc-http2-max-pings-without-data", 2),
        ("--grpc-http2-min-recv-ping-interval-without-data", 300_000),
        ("--grpc-http2-max-ping-strikes", 2),
    ):
        add(
            flag,
            type=_non_negative_int,
            default=default,
            metavar="N",
            help="client ping policy: accepted, not policed",
        )


def _add_grpc_ssl_flags(add) -> None:
    """tritonserver's gRPC TLS and connection-age flags."""
    add(
        "--grpc-use-ssl",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="serve gRPC over TLS with --grpc-server-cert and --grpc-server-key (PEM files)",
    )
    add(
        "--grpc-use-ssl-mutual",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="TLS requiring client certificates signed by --grpc-root-cert; implies --grpc-use-ssl",
    )
    add("--grpc-server-cert", metavar="PEM", help="the server's certificate (PEM file)")
    add("--grpc-server-key", metavar="PEM", help="the server's private key (PEM file)")
    add(
        "--grpc-root-cert",
        metavar="PEM",
        help="the CA certificate client certificates must chain to (PEM file)",
    )
    add(
        "--grpc-max-connection-age",
        type=_non_negative_int,
        metavar="MS",
        help="accepted, no effect: connections are not closed by age",
    )
    add(
        "--grpc-max-connection-age-grace",
        type=_non_negative_int,
        metavar="MS",
        help="accepted, no effect (see --grpc-max-connection-age)",
    )


def _grpc_ssl(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GrpcSsl | None:
    """--grpc-use-ssl(-mutual) as a GrpcSsl; the PEM files must be readable now."""
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    files = [
        ("--grpc-server-cert", args.grpc_server_cert),
        ("--grpc-server-key", args.grpc_server_key),
    ]
    if args.grpc_use_ssl_mutual:
        files.append(("--grpc-root-cert", args.grpc_root_cert))
    elif args.grpc_root_cert:
        files.append(("--grpc-root-cert", args.grpc_root_cert))
    for flag, path in files:
        if not path:
            parser.error(
                f"--grpc-use-ssl{'-mutual' if args.grpc_use_ssl_mutual else ''} requires {flag}"
            )
        if not os.access(path, os.R_OK) or not Path(path).is_file():
            parser.error(f"{flag}: cannot read '{path}'")
    return GrpcSsl(
        server_cert=args.grpc_server_cert,
        server_key=args.grpc_server_key,
        root_cert=args.grpc_root_cert or None,
        mutual=args.grpc_use_ssl_mutual,
    )


def _add_metrics_flags(add) -> None:
    """tritonserver's metrics flags."""
    add(
        "--allow-metrics",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="serve Prometheus metrics at /metrics on the metrics port (default true)",
    )
    add(
        "--allow-gpu-metrics",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="report each GPU's utilization, memory, power and energy (nv_gpu_*, "
        "nv_energy_consumption) through NVML, where nvidia-ml-py (the cuda12 or cuda13 "
        "extra) is installed and a "
        "GPU is visible (default true)",
    )
    add(
        "--allow-cpu-metrics",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="report nv_cpu_utilization and CPU memory (default true)",
    )
    add(
        "--metrics-address",
        metavar="ADDRESS",
        help="metrics address (default: --http-address, or 0.0.0.0 without HTTP)",
    )
    add(
        "--metrics-port",
        type=_port,
        default=8002,
        metavar="PORT",
        help="port of Prometheus /metrics; 0: any free port (default 8002)",
    )
    add(
        "--metrics-interval-ms",
        type=_non_negative_float,
        default=2000.0,
        metavar="MS",
        help="how often per-interval metrics (CPU) are sampled (default 2000)",
    )
    add(
        "--metrics-config",
        action="append",
        default=[],
        metavar="SETTING=VALUE",
        help="counter_latencies=<bool> (default true), histogram_latencies=<bool> "
        "(nv_inference_first_response_histogram_ms, default false), "
        "summary_latencies=<bool> (nv_inference_*_summary_us, default false), "
        "summary_quantiles=<q>:<error>[,...] (default "
        "0.5:0.05,0.9:0.01,0.95:0.001,0.99:0.001,0.999:0.001)",
    )


def _add_openai_flags(add) -> None:
    """The OpenAI-compatible API's flags (Triton's python/openai/openai_frontend/main.py)."""
    add(
        "--openai-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
        "/v1/models, ...) on PORT; 0: any free port (default: not served)",
    )
    add(
        "--openai-address",
        metavar="ADDRESS",
        help="address the OpenAI-compatible API listens on (default: --http-address)",
    )
    add(
        "--openai-api-key",
        metavar="KEY",
        help="every /v1 endpoint requires the header 'Authorization: Bearer KEY' (401 "
        "without it); OpenAI clients send it from their api_key",
    )
    add(
        "--openai-restricted-api",
        nargs=3,
        action="append",
        default=[],
        metavar=("APIs", "KEY", "VALUE"),
        help="requests to these APIs (inference, model-repository, metrics, health; "
        "comma-separated) must carry the header KEY with VALUE, else 401 (repeatable)",
    )
    add(
        "--openai-tokenizer",
        type=Path,
        metavar="DIR",
        help="a folder of Hugging Face tokenizer files whose chat template serves the "
        "models without one in their own folder (read from disk only)",
    )
    add(
        "--openai-chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template used for every model instead of its tokenizer's",
    )
    add(
        "--openai-default-max-tokens",
        type=_positive_int,
        default=16,
        metavar="N",
        help="max_tokens of a request that sets none (default 16, as Triton)",
    )
    add(
        "--openai-backend",
        choices=["vllm", "tensorrtllm"],
        default=None,
        help="the request format (input names) of every model, instead of the one its "
        "backend implies",
    )


def _openai_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> OpenAIOptions:
    if args.openai_port is not None and args.workers > 1:
        parser.error("--openai-port cannot be combined with --workers yet")
    try:
        restricted = parse_restricted_apis(args.openai_restricted_api)
    except ValueError as exc:
        parser.error(f"--openai-restricted-api: {exc}")
    for flag, path in (
        ("--openai-tokenizer", args.openai_tokenizer),
        ("--openai-chat-template", args.openai_chat_template),
    ):
        if path is not None and not path.exists():
            parser.error(f"{flag}: '{path}' does not exist")
    try:  # read and compiled now, so that a bad one stops the start with one line
        ChatTemplates(args.openai_tokenizer, args.openai_chat_template)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    return OpenAIOptions(
        tokenizer=args.openai_tokenizer,
        chat_template=args.openai_chat_template,
        default_max_tokens=args.openai_default_max_tokens,
        backend=args.openai_backend,
        api_key=args.openai_api_key,
        restricted_apis=restricted,
    )


def _add_trace_flags(add) -> None:
    """tritonserver's trace flags: --trace-config and the deprecated --trace-*."""
    add(
        "--trace-config",
        action="append",
        default=[],
        metavar="[MODE,]SETTING=VALUE",
        help="level=OFF|TIMESTAMPS|TENSORS, rate=N, count=N, mode=triton|opentelemetry, "
        "triton,file=PATH, triton,log-frequency=N, opentelemetry,url=URL, "
        "opentelemetry,resource=KEY=VALUE (repeatable)",
    )
    add("--trace-file", help="deprecated: --trace-config triton,file=PATH")
    add("--trace-level", action="append", default=[], help="deprecated: --trace-config level=LEVEL")
    add("--trace-rate", type=int, help="deprecated: --trace-config rate=N")
    add("--trace-count", type=int, help="deprecated: --trace-config count=N")
    add("--trace-log-frequency", type=int, help="deprecated: --trace-config triton,log-frequency=N")


def _metrics_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> MetricsOptions:
    try:
        latencies = parse_metrics_config(args.metrics_config)
    except ValueError as exc:
        parser.error(str(exc))
    return MetricsOptions(
        allow_cpu_metrics=args.allow_cpu_metrics,
        allow_gpu_metrics=args.allow_gpu_metrics,
        interval_ms=args.metrics_interval_ms,
        **latencies,
    )


def _trace_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TraceConfig:
    try:
        return parse_trace_config(
            args.trace_config,
            levels=args.trace_level,
            rate=args.trace_rate,
            count=args.trace_count,
            log_frequency=args.trace_log_frequency,
            file=args.trace_file,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _restricted(
    parser: argparse.ArgumentParser, settings: list[str], flag: str, kind: str, prefix: str = ""
) -> RestrictedFeatures:
    try:
        return parse_restricted_features(settings, flag, kind, prefix)
    except ValueError as exc:
        parser.error(str(exc))


def _grpc_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GrpcOptions:
    if args.grpc_max_message_size >= 2**32:
        parser.error(
            "--grpc-max-message-size: expected less than 4 GiB (2**32), "
            f"got {args.grpc_max_message_size}"
        )
    return GrpcOptions(
        ssl=_grpc_ssl(parser, args),
        max_message_size=args.grpc_max_message_size,
        max_concurrent_streams=args.grpc_max_concurrent_streams,
        max_connection_buffer=args.grpc_max_connection_buffer,
        max_connections=args.grpc_max_connections,
        first_call_timeout=args.grpc_first_call_timeout,
        idle_timeout=args.grpc_idle_timeout,
        header_forward_pattern=args.grpc_header_forward_pattern,
        **(
            {"infer_allocation_pool_size": args.grpc_infer_allocation_pool_size}
            if args.grpc_infer_allocation_pool_size is not None
            else {}
        ),
        infer_response_compression_level=args.grpc_infer_response_compression_level,
        keepalive_time_ms=args.grpc_keepalive_time,
        keepalive_timeout_ms=args.grpc_keepalive_timeout,
        keepalive_permit_without_calls=args.grpc_keepalive_permit_without_calls,
        http2_max_pings_without_data=args.grpc_http2_max_pings_without_data,
        http2_min_recv_ping_interval_without_data_ms=(
            args.grpc_http2_min_recv_ping_interval_without_data
        ),
        http2_max_ping_strikes=args.grpc_http2_max_ping_strikes,
        restricted_protocols=_restricted(
            parser,
            args.grpc_restricted_protocol,
            "--grpc-restricted-protocol",
            "protocol",
            GRPC_HEADER_PREFIX,
        ),
    )


def options_from_args(argv: list[str] | None = None) -> ServerOptions:
    return _parse(argv)[0]


def _parse(argv: list[str] | None) -> tuple[ServerOptions, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    for problem in worker_conflicts(args):
        parser.error(problem)
    # Worker processes of --workers N share the HTTP and gRPC ports, and write
    # trace files of their own.
    reuse_port = args.worker_index is not None
    trace = _trace_config(parser, args)
    if reuse_port and trace.file:
        trace = replace(trace, file=f"{trace.file}.worker{args.worker_index}")
    if not args.model_repositories:
        parser.error("--model-repository must be specified")
    try:
        cache_bytes = parse_cache_config(args.cache_config, args.response_cache_byte_size)
    except TritonError as exc:
        parser.error(exc.message)
    mode = ControlMode(args.model_control_mode)
    if "*" in args.load_models and len(args.load_models) > 1:
        parser.error("--load-model='*' cannot be combined with other model names")
    if args.load_models and mode is not ControlMode.EXPLICIT:
        parser.error("--load-model requires --model-control-mode=explicit")
    try:
        backend_config = parse_backend_config(args.backend_config)
    except ValueError as exc:
        parser.error(str(exc))
    # Flags for what trionserve does not have: refused here, or noted at start.
    args.compat_notes = compat_notes(parser, args)
    grpc = replace(_grpc_options(parser, args), reuse_port=reuse_port or args.reuse_grpc_port)
    if args.grpc_max_connection_age is not None:
        args.compat_notes.append(
            "--grpc-max-connection-age has no effect in trionserve: connections are "
            "not closed by age"
        )
    if args.grpc_infer_allocation_pool_size is not None:
        args.compat_notes.append(
            f"--grpc-infer-allocation-pool-size={args.grpc_infer_allocation_pool_size} has "
            "no effect in trionserve: gRPC responses are built for each call"
        )
    return ServerOptions(
        model_repositories=args.model_repositories,
        model_namespacing=args.model_namespacing,
        model_control_mode=mode,
        model_cache_dir=args.model_cache_dir,
        repository_poll_secs=args.repository_poll_secs,
        load_models=args.load_models,
        strict_model_config=args.strict_model_config,
        disable_auto_complete_config=args.disable_auto_complete_config,
        strict_readiness=args.strict_readiness,
        max_undelivered_response_bytes=args.max_undelivered_response_bytes,
        model_config_name=args.model_config_name,
        backend_config=backend_config,
        backend_directory=args.backend_directory,
        allow_http=args.allow_http,
        http_address=args.http_address,
        http_port=args.http_port,
        http=HttpOptions(
            max_input_size=args.http_max_input_size,
            max_connections=args.http_max_connections,
            header_timeout=args.http_header_timeout,
            keep_alive_timeout=args.http_keep_alive_timeout,
            reuse_port=reuse_port or args.reuse_http_port,
            header_forward_pattern=args.http_header_forward_pattern,
            restricted_apis=_restricted(
                parser, args.http_restricted_api, "--http-restricted-api", "api"
            ),
        ),
        allow_grpc=args.allow_grpc,
        grpc_address=args.grpc_address,
        grpc_port=args.grpc_port,
        grpc=grpc,
        allow_metrics=args.allow_metrics,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        metrics=_metrics_options(parser, args),
        openai_port=args.openai_port,
        openai_address=args.openai_address,
        openai=_openai_options(parser, args),
        trace=trace,
        model_load_thread_count=args.model_load_thread_count,
        rate_limit=RateLimitMode(args.rate_limit),
        rate_limit_resources=args.rate_limit_resources,
        allow_client_shm=args.allow_client_shm,
        response_cache_bytes=cache_bytes,
        exit_timeout_secs=args.exit_timeout_secs,
        exit_process=True,
        exit_on_error=args.exit_on_error,
        log_verbose=args.log_verbose,
        log_format="json" if args.log_format == "json" else "console",
        log_file=args.log_file,
        log_info=args.log_info,
        log_warning=args.log_warning,
        log_error=args.log_error,
        server_id=args.server_id,
    ), args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    options, args = _parse(argv)
    try:
        configure_logging(
            options.log_format,
            options.log_verbose,
            log_file=options.log_file,
            log_info=options.log_info,
            log_warning=options.log_warning,
            log_error=options.log_error,
        )
    except OSError as exc:
        print(
            f"error: --log-file: cannot open '{options.log_file}': {exc.strerror}", file=sys.stderr
        )
        return 1
    if args.worker_index is None:  # workers would repeat them
        for note in args.compat_notes:
            log.info(note)
    if args.workers > 1 and args.worker_index is None:
        return run_supervisor(options, args.workers, argv)
    try:
        server = Server(options)
        if args.worker_index is None:
            trio.run(server.serve)
        else:
            structlog.contextvars.bind_contextvars(worker=args.worker_index)
            trio.run(
                serve_worker,
                server,
                args.worker_index,
                args.worker_ready_fd,
                args.worker_supervisor_port,
            )
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:
        error = _triton_error(exc)
        if error is None:
            raise
        # One line; the traceback only when asked for (--log-verbose).
        if options.log_verbose:
            traceback.print_exception(exc)
        summary = error.summary if isinstance(error, StartupError) else error.message
        print(f"error: {summary}", file=sys.stderr)
        return 1
    # 1 when the drain at shutdown did not finish (as Triton's exit timeout).
    return server.exit_code


def _triton_error(exc: BaseException) -> TritonError | None:
    """The error that stopped the server, also from inside Trio's exception groups
    (a StartupError, a repository that cannot be read); None for anything else."""
    if isinstance(exc, TritonError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [_triton_error(inner) for inner in exc.exceptions]
        if len(found) == 1 and found[0] is not None:
            return found[0]
    return None


if __name__ == "__main__":
    sys.exit(main())
