"""Parsed flags into ServerOptions: the checks that span several flags, and each
frontend's options built from its flags.

Triton's ``TritonParser::Parse`` (server/src/command_line_parser.cc) fills
``TritonServerParameters`` and checks them the same way (``CheckPortCollision``
and friends): a bad combination is one usage error naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from trionserve.actors.rate_limiter import RateLimitMode
from trionserve.actors.residency import ResidencyOptions
from trionserve.actors.watcher import ControlMode
from trionserve.backends.backend_config import parse_backend_config
from trionserve.cli.compat import compat_notes
from trionserve.cli.parser import build_parser
from trionserve.core.client_budget import default_limit
from trionserve.core.errors import TritonError
from trionserve.core.redis_cache import RedisSettings
from trionserve.core.response_cache import parse_cache_config, redis_settings
from trionserve.observability.metrics import MetricsOptions, parse_metrics_config
from trionserve.observability.trace.settings import TraceConfig, parse_trace_config
from trionserve.protocol.grpc.options import GrpcOptions, GrpcSsl
from trionserve.protocol.http.frontend import HttpOptions
from trionserve.protocol.http.sagemaker import SagemakerOptions
from trionserve.protocol.openai.chat import ChatTemplates
from trionserve.protocol.openai.frontend import OpenAIOptions, parse_restricted_apis
from trionserve.protocol.restricted import (
    GRPC_HEADER_PREFIX,
    RestrictedFeatures,
    parse_restricted_features,
)
from trionserve.server import ServerOptions
from trionserve.workers import worker_conflicts


def grpc_ssl(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GrpcSsl | None:
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


def sagemaker_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> SagemakerOptions | None:
    """--allow-sagemaker's port (None: not served), with --sagemaker-safe-port-range
    checked as Triton's CheckPortCollision does (command_line_parser.cc:990-1020):
    every other endpoint on the SageMaker address within the range."""
    if not args.allow_sagemaker:
        return None
    if args.workers > 1:
        parser.error("--allow-sagemaker cannot be combined with --workers yet")
    try:
        options = SagemakerOptions(
            port=args.sagemaker_port,
            multi_model=bool(args.sagemaker_multi_model_root),
            multi_model_root=os.path.abspath(args.sagemaker_multi_model_root or "."),
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.sagemaker_safe_port_range is not None:
        low, high = args.sagemaker_safe_port_range
        metrics_address = args.metrics_address or (
            args.http_address if args.allow_http else "0.0.0.0"
        )
        for name, address, port, allowed in (
            ("HTTP", args.http_address, args.http_port, args.allow_http),
            ("GRPC", args.grpc_address, args.grpc_port, args.allow_grpc),
            ("metrics", metrics_address, args.metrics_port, args.allow_metrics),
        ):
            if allowed and address == options.address and not low <= port <= high:
                parser.error(
                    f"The server cannot listen to {name} requests at port {port}, "
                    f"allowed port range is [{low}, {high}]"
                )
    return options


def openai_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> OpenAIOptions:
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


def metrics_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> MetricsOptions:
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


# The deprecated --trace-* flags and Triton's warning for each (server
# command_line_parser.cc, printed to stderr as it parses them).
_DEPRECATED_TRACE_FLAGS = (
    ("trace_file", "--trace-file", "--trace-config triton,file=<filepath>"),
    ("trace_level", "--trace-level", "--trace-config level=<OFF|TIMESTAMPS|TENSORS>"),
    ("trace_rate", "--trace-rate", "--trace-config rate=<rate value>"),
    ("trace_count", "--trace-count", "--trace-config count=<count value>"),
    (
        "trace_log_frequency",
        "--trace-log-frequency",
        "--trace-config triton,log-frequency=<log frequency value>",
    ),
)


def strict_model_config(args: argparse.Namespace) -> bool:
    """--strict-model-config, with Triton's warnings (server command_line_parser.cc
    1380-1384 and 1868-1876): the flag is deprecated, and
    --disable-auto-complete-config makes it true."""
    given = args.strict_model_config
    if given is not None:
        print(
            "Warning: '--strict-model-config' has been deprecated! Please use "
            "'--disable-auto-complete-config' instead.",
            file=sys.stderr,
        )
    if args.disable_auto_complete_config:
        if given is False:
            print(
                "Warning: Overriding deprecated '--strict-model-config' from False to True "
                "in favor of '--disable-auto-complete-config'!",
                file=sys.stderr,
            )
        return True
    return bool(given)


def trace_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TraceConfig:
    for attribute, flag, replacement in _DEPRECATED_TRACE_FLAGS:
        given = getattr(args, attribute)
        # One warning for each time the flag is given (--trace-level repeats).
        for _ in given if isinstance(given, list) else ([] if given is None else [given]):
            print(
                f"Warning: '{flag}' has been deprecated and will be removed in future "
                f"releases. Please use '{replacement} instead.",
                file=sys.stderr,
            )
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


def restricted_features(
    parser: argparse.ArgumentParser, settings: list[str], flag: str, kind: str, prefix: str = ""
) -> RestrictedFeatures:
    try:
        return parse_restricted_features(settings, flag, kind, prefix)
    except ValueError as exc:
        parser.error(str(exc))


def grpc_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GrpcOptions:
    if args.grpc_max_message_size >= 2**32:
        parser.error(
            "--grpc-max-message-size: expected less than 4 GiB (2**32), "
            f"got {args.grpc_max_message_size}"
        )
    return GrpcOptions(
        ssl=grpc_ssl(parser, args),
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
        restricted_protocols=restricted_features(
            parser,
            args.grpc_restricted_protocol,
            "--grpc-restricted-protocol",
            "protocol",
            GRPC_HEADER_PREFIX,
        ),
    )


def client_buffer_limit(args: argparse.Namespace) -> int | None:
    """--client-buffer-limit (None: the default, a quarter of the host's memory).
    With --workers N it is the whole server's: each worker process holds at most
    its Nth."""
    limit: int | None = args.client_buffer_limit
    if args.worker_index is not None and args.workers > 1:
        limit = (limit if limit is not None else default_limit()) // args.workers
    return limit


def options_from_args(argv: list[str] | None = None) -> ServerOptions:
    return parse_options(argv)[0]


def parse_options(argv: list[str] | None) -> tuple[ServerOptions, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    for problem in worker_conflicts(args):
        parser.error(problem)
    # Worker processes of --workers N share the HTTP and gRPC ports, and write
    # trace files of their own.
    reuse_port = args.worker_index is not None
    trace = trace_config(parser, args)
    if reuse_port and trace.file:
        trace = replace(trace, file=f"{trace.file}.worker{args.worker_index}")
    if not args.model_repositories:
        parser.error("--model-repository must be specified")
    try:
        cache_bytes = parse_cache_config(args.cache_config, args.response_cache_byte_size)
        redis = redis_settings(args.cache_config)
        redis_cache = RedisSettings.parse(redis) if redis is not None else None
    except TritonError as exc:
        parser.error(exc.message)
    mode = ControlMode(args.model_control_mode)
    if "*" in args.load_models and len(args.load_models) > 1:
        parser.error("--load-model='*' cannot be combined with other model names")
    if args.load_models and mode is not ControlMode.EXPLICIT:
        parser.error("--load-model requires --model-control-mode=explicit")
    if args.model_load_on_demand and mode is not ControlMode.EXPLICIT:
        parser.error("--model-load-on-demand=true requires --model-control-mode=explicit")
    try:
        backend_config = parse_backend_config(args.backend_config)
    except ValueError as exc:
        parser.error(str(exc))
    # Flags for what trionserve does not have: refused here, or noted at start.
    args.compat_notes = compat_notes(parser, args)
    grpc = replace(grpc_options(parser, args), reuse_port=reuse_port or args.reuse_grpc_port)
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
        strict_model_config=strict_model_config(args),
        disable_auto_complete_config=args.disable_auto_complete_config,
        strict_readiness=args.strict_readiness,
        max_undelivered_response_bytes=args.max_undelivered_response_bytes,
        client_buffer_limit=client_buffer_limit(args),
        client_buffer_stall_secs=args.client_buffer_stall_secs,
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
            restricted_apis=restricted_features(
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
        metrics=metrics_options(parser, args),
        openai_port=args.openai_port,
        openai_address=args.openai_address,
        openai=openai_options(parser, args),
        sagemaker=sagemaker_options(parser, args),
        trace=trace,
        model_load_thread_count=args.model_load_thread_count,
        residency=ResidencyOptions(
            load_on_demand=args.model_load_on_demand,
            memory_limits=args.model_memory_limit,
            idle_unload_secs=args.model_idle_unload_secs,
        ),
        rate_limit=RateLimitMode(args.rate_limit),
        rate_limit_resources=args.rate_limit_resources,
        allow_client_shm=args.allow_client_shm,
        response_cache_bytes=cache_bytes,
        redis_cache=redis_cache,
        exit_timeout_secs=args.exit_timeout_secs,
        exit_process=True,
        exit_on_error=args.exit_on_error,
        log_verbose=args.log_verbose,
        log_format=args.log_format,
        log_file=args.log_file,
        log_info=args.log_info,
        log_warning=args.log_warning,
        log_error=args.log_error,
        server_id=args.server_id,
    ), args
