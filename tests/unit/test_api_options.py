"""trionserve.api.Options: every field of Triton's tritonserver.Options, turned
into the command line's ServerOptions, or refused naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from trionserve import api
from trionserve.actors.rate_limiter import RateLimiterResource, RateLimitMode
from trionserve.actors.watcher import ControlMode

# The fields of Triton's Options (core python/tritonserver/_api/_server.py), in order.
TRITON_FIELDS = [
    "model_repository",
    "server_id",
    "model_control_mode",
    "startup_models",
    "strict_model_config",
    "rate_limiter_mode",
    "rate_limiter_resources",
    "pinned_memory_pool_size",
    "cuda_memory_pool_sizes",
    "cache_config",
    "cache_directory",
    "min_supported_compute_capability",
    "exit_on_error",
    "strict_readiness",
    "exit_timeout",
    "buffer_manager_thread_count",
    "model_load_thread_count",
    "model_load_retry_count",
    "model_namespacing",
    "enable_peer_access",
    "log_file",
    "log_info",
    "log_warn",
    "log_error",
    "log_format",
    "log_verbose",
    "metrics",
    "gpu_metrics",
    "cpu_metrics",
    "metrics_interval",
    "backend_directory",
    "repo_agent_directory",
    "model_load_device_limits",
    "backend_configuration",
    "host_policies",
    "metrics_configuration",
]


def test_every_triton_field_is_there_in_tritons_order():
    names = [f.name for f in dataclasses.fields(api.Options)]
    assert names[: len(TRITON_FIELDS)] == TRITON_FIELDS


def test_tritons_positional_and_keyword_construction():
    options = api.Options("models", "my-server", api.ModelControlMode.EXPLICIT, ["a"])
    settings = options.server_options()
    assert settings.model_repositories == ["models"]
    assert settings.server_id == "my-server"
    assert settings.model_control_mode is ControlMode.EXPLICIT
    assert settings.load_models == ["a"]
    # No frontend, no signal handling: the host program owns those.
    assert not (settings.allow_http or settings.allow_grpc or settings.allow_metrics)
    assert not settings.handle_signals


def test_enums_have_tritons_values():
    assert [(m.name, m.value) for m in api.ModelControlMode] == [
        ("NONE", 0),
        ("POLL", 1),
        ("EXPLICIT", 2),
    ]
    assert [(m.name, m.value) for m in api.RateLimitMode] == [("OFF", 0), ("EXEC_COUNT", 1)]
    assert [(m.name, m.value) for m in api.LogFormat] == [("DEFAULT", 0), ("ISO8601", 1)]
    assert [m.name for m in api.InstanceGroupKind] == ["AUTO", "CPU", "GPU", "MODEL"]


def test_log_levels_cascade_as_tritons():
    settings = api.Options("m", log_verbose=1).server_options()
    assert settings.log_info and settings.log_warning and settings.log_error
    settings = api.Options("m", log_warn=True).server_options()
    assert not settings.log_info and settings.log_warning and settings.log_error


def test_metrics_fields_reach_the_metrics_options():
    settings = api.Options(
        "m",
        cpu_metrics=False,
        metrics_interval=500,
        metrics_configuration={"": {"histogram_latencies": "true"}},
    ).server_options()
    assert not settings.metrics.allow_cpu_metrics
    assert settings.metrics.interval_ms == 500
    assert settings.metrics.histogram_latencies
    settings = api.Options("m", metrics=False).server_options()
    assert not settings.metrics.allow_cpu_metrics and not settings.metrics.allow_gpu_metrics


def test_rate_limiter_options_reach_the_server():
    settings = api.Options(
        "m",
        rate_limiter_mode=api.RateLimitMode.EXEC_COUNT,
        rate_limiter_resources=[
            api.RateLimiterResource("R1", 2, 0),
            api.RateLimiterResource("R2", 1, -1),
        ],
    ).server_options()
    assert settings.rate_limit is RateLimitMode.EXEC_COUNT
    assert settings.rate_limit_resources == [
        RateLimiterResource("R1", 2, 0),
        RateLimiterResource("R2", 1, -1),
    ]
    assert api.Options("m").server_options().rate_limit is RateLimitMode.OFF
    with pytest.raises(api.InvalidArgumentError, match="Options.rate_limiter_mode"):
        api.Options("m", rate_limiter_mode=7).server_options()
    with pytest.raises(api.InvalidArgumentError, match="Options.rate_limiter_resources"):
        api.Options(
            "m", rate_limiter_resources=[api.RateLimiterResource("", 2, 0)]
        ).server_options()


def test_model_namespacing_reaches_the_server():
    assert api.Options("m", model_namespacing=True).server_options().model_namespacing
    assert not api.Options("m").server_options().model_namespacing


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pinned_memory_pool_size", 1 << 20),
        ("cuda_memory_pool_sizes", {0: 1 << 20}),
        ("host_policies", {"gpu_0": {"numa-node": "0"}}),
        ("model_load_device_limits", [api.ModelLoadDeviceLimit(api.InstanceGroupKind.GPU, 0, 0.5)]),
        ("enable_peer_access", False),
    ],
)
def test_a_part_of_triton_this_server_lacks_is_accepted(field, value):
    api.Options("m", **{field: value}).server_options()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"server_id": 1}, TypeError, "Options.server_id"),
        ({"model_repository": 1}, TypeError, "Options.model_repository"),
        ({"log_verbose": True}, TypeError, "Options.log_verbose"),
        ({"model_repository": None}, api.InvalidArgumentError, "Model repository"),
        ({"model_control_mode": "sometimes"}, api.InvalidArgumentError, "model_control_mode"),
        ({"cache_config": {"redis": {}}}, api.InvalidArgumentError, "cache_config"),
        (
            {"metrics_configuration": {"": {"counter_latencies": "maybe"}}},
            api.InvalidArgumentError,
            "metrics_configuration",
        ),
    ],
)
def test_unusable_values_are_refused_at_start(kwargs, error, match):
    options = api.Options(**{"model_repository": "m", **kwargs})
    with pytest.raises(error, match=match):
        options.server_options()
