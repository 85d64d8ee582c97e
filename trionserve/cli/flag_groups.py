"""tritonserver's flags, by group: gRPC, gRPC SSL, metrics, SageMaker, OpenAI, trace.

Triton's ``TritonParser`` (server/src/command_line_parser.cc) declares these in
groups of its own; :func:`trionserve.cli.parser.build_parser` adds each group
here to the one parser.
"""

from __future__ import annotations

from pathlib import Path

from trionserve.cli.values import (
    RESTRICTED_GROUPS,
    AddFlag,
    boolean,
    compression_level,
    header_pattern,
    int_at_least,
    non_negative_float,
    non_negative_int,
    port_number,
    port_range,
    positive_float,
    positive_int,
)


def add_grpc_flags(add: AddFlag) -> None:
    """tritonserver's gRPC tuning flags (see GrpcOptions for what each one does)."""
    add(
        "--grpc-max-message-size",
        type=int_at_least(1024),
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="largest request message, after decompression; larger "
        "ones get RESOURCE_EXHAUSTED (default 67108864, as --http-max-input-size)",
    )
    add(
        "--grpc-max-concurrent-streams",
        type=positive_int,
        default=1024,
        metavar="N",
        help="calls one connection may have open at once; clients queue the rest (default 1024)",
    )
    add(
        "--grpc-max-connection-buffer",
        type=int_at_least(1024 * 1024),
        default=256 * 1024 * 1024,
        metavar="BYTES",
        help="bytes one connection may hold, all its streams together, for requests not "
        "yet taken, requests taken and not answered, and responses the client has not "
        "read; past it no request is taken and the client is held back by flow control "
        "(default 268435456)",
    )
    add(
        "--grpc-max-connections",
        type=positive_int,
        default=1024,
        metavar="N",
        help="connections served at once; past it a new one is closed (default 1024)",
    )
    add(
        "--grpc-first-call-timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection that starts no call within SECONDS of opening (default 30)",
    )
    add(
        "--grpc-idle-timeout",
        type=positive_float,
        default=300.0,
        metavar="SECONDS",
        help="close (GOAWAY) a connection that has had no call in flight for SECONDS; at "
        "--grpc-max-connections the longest idle one is closed to make room (default 300; "
        "not in Triton, whose gRPC server keeps idle connections open)",
    )
    add(
        "--grpc-header-forward-pattern",
        type=header_pattern,
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
        f"protocols: {RESTRICTED_GROUPS}",
    )
    add(
        "--grpc-infer-allocation-pool-size",
        type=non_negative_int,
        metavar="N",
        help="accepted, no effect: responses are built for each call",
    )
    add(
        "--grpc-infer-response-compression-level",
        default="none",
        choices=["none", "low", "med", "high"],
        type=compression_level,
        help="gzip level for responses to clients that accept it (default none)",
    )
    add(
        "--grpc-keepalive-time",
        type=non_negative_int,
        default=7_200_000,
        metavar="MS",
        help="ping a client after MS milliseconds (default 7200000)",
    )
    add(
        "--grpc-keepalive-timeout",
        type=non_negative_int,
        default=20_000,
        metavar="MS",
        help="close a connection whose ping is not answered in MS ms (default 20000)",
    )
    add(
        "--grpc-keepalive-permit-without-calls",
        type=boolean,
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
            type=non_negative_int,
            default=default,
            metavar="N",
            help="client ping policy: accepted, not policed",
        )


def add_grpc_ssl_flags(add: AddFlag) -> None:
    """tritonserver's gRPC TLS and connection-age flags."""
    add(
        "--grpc-use-ssl",
        type=boolean,
        default=False,
        metavar="BOOL",
        help="serve gRPC over TLS with --grpc-server-cert and --grpc-server-key (PEM files)",
    )
    add(
        "--grpc-use-ssl-mutual",
        type=boolean,
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
        type=non_negative_int,
        metavar="MS",
        help="accepted, no effect: connections are not closed by age",
    )
    add(
        "--grpc-max-connection-age-grace",
        type=non_negative_int,
        metavar="MS",
        help="accepted, no effect (see --grpc-max-connection-age)",
    )


def add_metrics_flags(add: AddFlag) -> None:
    """tritonserver's metrics flags."""
    add(
        "--allow-metrics",
        type=boolean,
        default=True,
        metavar="BOOL",
        help="serve Prometheus metrics at /metrics on the metrics port (default true)",
    )
    add(
        "--allow-gpu-metrics",
        type=boolean,
        default=True,
        metavar="BOOL",
        help="report each GPU's utilization, memory, power and energy (nv_gpu_*, "
        "nv_energy_consumption) through NVML, where nvidia-ml-py (the cuda12 or cuda13 "
        "extra) is installed and a "
        "GPU is visible (default true)",
    )
    add(
        "--allow-cpu-metrics",
        type=boolean,
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
        type=port_number,
        default=8002,
        metavar="PORT",
        help="port of Prometheus /metrics; 0: any free port (default 8002)",
    )
    add(
        "--metrics-interval-ms",
        type=non_negative_float,
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


def add_sagemaker_flags(add: AddFlag) -> None:
    """SageMaker's port (Triton's command_line_parser.cc:670-686, "Sagemaker" group)."""
    add(
        "--allow-sagemaker",
        type=boolean,
        default=False,
        metavar="BOOL",
        help="serve Amazon SageMaker's endpoints (GET /ping, POST /invocations on "
        "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME) on --sagemaker-port (default false)",
    )
    add(
        "--sagemaker-port",
        type=port_number,
        default=8080,
        metavar="PORT",
        help="port of the SageMaker endpoints, on 0.0.0.0 (default 8080)",
    )
    add(
        "--sagemaker-safe-port-range",
        type=port_range,
        default=None,
        metavar="LOW-HIGH",
        help="with --allow-sagemaker: every other endpoint's port on the same address "
        "must lie in [LOW, HIGH]",
    )
    add(
        "--sagemaker-multi-model-root",
        default="/opt/ml/models",
        metavar="DIR",
        help="with --allow-sagemaker: the multi-model endpoint (POST /models) loads "
        "only <DIR>/<hash>/model[/<subdir>] directories that resolve inside DIR "
        "(default /opt/ml/models, SageMaker's); empty: the endpoint is off",
    )


def add_openai_flags(add: AddFlag) -> None:
    """The OpenAI-compatible API's flags (Triton's python/openai/openai_frontend/main.py)."""
    add(
        "--openai-port",
        type=port_number,
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
        type=positive_int,
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


def add_trace_flags(add: AddFlag) -> None:
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
