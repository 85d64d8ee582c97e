"""The command line's parser: every tritonserver flag trionserve knows, by Triton's names.

Triton's ``TritonParser`` (server/src/command_line_parser.cc): the server,
repository, model-control, HTTP, rate-limiter, cache and logging flags here, the
gRPC, metrics, OpenAI and trace groups from :mod:`trionserve.cli.flag_groups`,
the worker flags from :mod:`trionserve.workers` and the flags trionserve accepts
without effect from :mod:`trionserve.cli.compat`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from trionserve import __version__
from trionserve.actors.rate_limiter import RateLimitMode
from trionserve.actors.watcher import ControlMode
from trionserve.cli.compat import add_compat_flags
from trionserve.cli.flag_groups import (
    add_grpc_flags,
    add_grpc_ssl_flags,
    add_metrics_flags,
    add_openai_flags,
    add_sagemaker_flags,
    add_trace_flags,
)
from trionserve.cli.values import (
    RESTRICTED_GROUPS,
    boolean,
    byte_size,
    config_name,
    header_pattern,
    http_max_input_size,
    int_at_least,
    int_bool,
    memory_limit,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    rate_limit_resource,
    repository_location,
)
from trionserve.core.client_budget import DEFAULT_STALL_SECS
from trionserve.core.inference import DEFAULT_UNDELIVERED_RESPONSE_BYTES
from trionserve.workers import add_worker_flags


class _Parser(argparse.ArgumentParser):
    """argparse with tritonserver's usage-error exit code (1, main.cc) and, instead
    of the whole usage, one error line and where the help is."""

    def error(self, message: str) -> NoReturn:
        # A check worded as tritonserver's ParseException ("Error: ...") is
        # printed as it prints one: the exception's text alone (main.cc:475-480).
        _, triton, words = message.partition(": Error: ")
        line = f"Error: {words}" if triton else f"{self.prog}: error: {message}"
        self.exit(1, f"{line}\nsee {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="trionserve",
        description="A Triton-compatible inference server on Trio.",
        # A flag may be shortened to any prefix that names one flag, as
        # tritonserver reads its flags with getopt_long (server
        # src/command_line_parser.cc): qa/L0_logging starts it with --log-warn.
        allow_abbrev=True,
    )
    p.add_argument("--version", action="version", version=f"trionserve {__version__}")
    add = p.add_argument
    add(
        "--model-repository",
        "--model-store",
        dest="model_repositories",
        action="append",
        type=repository_location,
        metavar="PATH",
        help="model repository: a directory, or s3://, gs://, as:// (repeatable)",
    )
    add(
        "--model-namespacing",
        type=boolean,
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
        type=non_negative_float,
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
        type=boolean,
        default=None,  # None: not given (its deprecation warning is for when it is)
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
        type=boolean,
        default=True,
        metavar="BOOL",
        help="ready only when every model is ready (default true); false: ready "
        "once the server started, whatever the models' state",
    )
    add(
        "--max-undelivered-response-bytes",
        type=int_at_least(1024 * 1024),
        default=DEFAULT_UNDELIVERED_RESPONSE_BYTES,
        metavar="BYTES",
        help="bytes of one request's responses the server holds before its client "
        "reads them (a decoupled model streaming to a client that stops "
        "reading); past it the request is cancelled with RESOURCE_EXHAUSTED "
        f"(default {DEFAULT_UNDELIVERED_RESPONSE_BYTES})",
    )
    add(
        "--client-buffer-limit",
        type=byte_size(1024 * 1024),
        default=None,
        metavar="BYTES",
        help="bytes the server holds for clients, every listener and connection "
        "together: request bodies, responses and stream chunks waiting for slow "
        "clients, decoupled models' backlogs; at it new requests are refused (HTTP 503, "
        "gRPC RESOURCE_EXHAUSTED) and streaming models wait; suffixes K, M, G, T "
        "(powers of 1024; default: a quarter of the host's memory)",
    )
    add(
        "--client-buffer-stall-secs",
        type=positive_float,
        default=DEFAULT_STALL_SECS,
        metavar="SECONDS",
        help="while --client-buffer-limit is reached, a client that has read nothing "
        "for this long has its stream cancelled, the one holding the most bytes "
        f"first (default {DEFAULT_STALL_SECS:g})",
    )
    add(
        "--model-config-name",
        type=config_name,
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
        type=boolean,
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
        type=port_number,
        default=8000,
        metavar="PORT",
        help="port of the HTTP/REST API; 0: any free port (default 8000)",
    )
    add(
        "--http-max-input-size",
        type=http_max_input_size,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="largest HTTP request body accepted, after decompression too; 413 beyond "
        "it (default 67108864: 64 MiB, as Triton)",
    )
    add(
        "--http-max-connections",
        type=positive_int,
        default=1024,
        metavar="N",
        help="HTTP connections served at once; more are answered 503 and closed (default 1024)",
    )
    add(
        "--http-header-timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="a connection must send a whole request head within this time of opening "
        "(or of a later request's first byte), and a request body must not pause for "
        "longer, else 408 and closed (default 30)",
    )
    add(
        "--http-keep-alive-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="an idle keep-alive connection is closed after this time; at "
        "--http-max-connections the longest idle ones are closed first to make room "
        "(default 60; not in Triton, whose HTTP server keeps idle connections open)",
    )
    add(
        "--reuse-http-port",
        type=boolean,
        default=False,
        metavar="BOOL",
        help="bind the HTTP port with SO_REUSEPORT (default false)",
    )
    add(
        "--http-header-forward-pattern",
        type=header_pattern,
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
        f"(repeatable, each API in one flag only); APIs: {RESTRICTED_GROUPS}",
    )
    add(
        "--allow-grpc",
        type=boolean,
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
        type=port_number,
        default=8001,
        metavar="PORT",
        help="port of the gRPC API; 0: any free port (default 8001)",
    )
    add(
        "--reuse-grpc-port",
        type=boolean,
        default=False,
        metavar="BOOL",
        help="bind the gRPC port with SO_REUSEPORT (default false)",
    )
    add_grpc_flags(add)
    add_grpc_ssl_flags(add)
    add_metrics_flags(add)
    add_sagemaker_flags(add)
    add_openai_flags(add)
    add_trace_flags(add)
    add(
        "--allow-client-shm",
        type=boolean,
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
        type=non_negative_int,
        default=None,
        metavar="BYTES",
        help="deprecated: --cache-config local,size=BYTES",
    )
    add(
        "--model-load-thread-count",
        type=positive_int,
        default=4,
        help="models loaded concurrently (default 4)",
    )
    add(
        "--model-load-on-demand",
        type=boolean,
        default=False,
        help="with --model-control-mode=explicit: an inference request for a model in "
        "the repository that is not loaded loads it, and waits for it within its own "
        "timeout (default false)",
    )
    add(
        "--model-memory-limit",
        type=memory_limit,
        action="append",
        default=[],
        metavar="host:BYTES|gpu:N:BYTES|gpu:N:FRACTION",
        help="a memory budget for loaded models, repeatable (e.g. host:8GiB, "
        "gpu:0:20GiB, gpu:0:0.8): a load that does not fit evicts idle models, least "
        "recently used first",
    )
    add(
        "--model-idle-unload-secs",
        type=non_negative_float,
        default=0.0,
        help="unload a model no request has used for this many seconds (default 0: never); "
        "models loaded at start-up or pinned stay",
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
        type=rate_limit_resource,
        metavar="<name>:<count>[:<device>]",
        help="copies of a rate-limiter resource (repeatable); without <device> on every "
        "device; default: the largest count any loaded instance needs",
    )
    add(
        "--exit-timeout-secs",
        type=non_negative_float,
        default=30.0,
        help="seconds to finish in-flight requests at shutdown (default 30)",
    )
    add(
        "--exit-on-error",
        type=boolean,
        default=True,
        metavar="BOOL",
        help="exit if a model fails to load at startup (default true)",
    )
    add(
        "--log-verbose",
        type=int_bool,
        default=0,
        metavar="LEVEL",
        help="verbose logging level; > 0 logs every request",
    )
    add(
        "--log-format",
        choices=["default", "ISO8601", "console", "json"],
        default="default",
        help="Triton's line formats default (the default) and ISO8601, or this "
        "server's structured console and json",
    )
    for level in ("info", "warning", "error"):
        add(
            f"--log-{level}",
            type=boolean,
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
    add_compat_flags(add, boolean)
    return p
