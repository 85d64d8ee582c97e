"""The options table tritonserver logs once its models have loaded (core
src/tritonserver.cc:2499-2598, TRITONSERVER_ServerNew: ``Option | Value``), with
this server's values, for the people and tools that read Triton's start-up log.

The rows are Triton's, in its order; those about memory pools Triton keeps and
this server does not (``pinned_memory_pool_byte_size``,
``cuda_memory_pool_byte_size{N}``) are left out rather than reported with a
value nothing uses. Booleans are ``0`` / ``1`` and the exit timeout whole
seconds, as ``std::to_string`` writes them.
"""

from __future__ import annotations

from typing import Any

from trionserve import __version__
from trionserve.dataplane import EXTENSIONS

# Triton's names (tritonserver.cc ModelControlMode, RateLimitModeToString).
_CONTROL_MODES = {"none": "MODE_NONE", "poll": "MODE_POLL", "explicit": "MODE_EXPLICIT"}
_RATE_LIMITS = {"off": "OFF", "execution_count": "EXEC_COUNT"}


def options_rows(options: Any) -> list[dict[str, str]]:
    """The table's rows, ``{"Option": ..., "Value": ...}``, for a
    :class:`~trionserve.server.ServerOptions` (not imported: the server imports
    this module)."""
    rows = [
        ("server_id", options.server_id),
        ("server_version", __version__),
        ("server_extensions", " ".join(EXTENSIONS)),
    ]
    rows += [
        (f"model_repository_path[{index}]", str(path))
        for index, path in enumerate(options.model_repositories)
    ]
    rows.append(("model_control_mode", _CONTROL_MODES[options.model_control_mode.value]))
    rows += [(f"startup_models_{index}", name) for index, name in enumerate(options.load_models)]
    cache = options.response_cache_bytes > 0 or options.redis_cache is not None
    rows += [
        ("strict_model_config", str(int(not options.autocomplete))),
        ("model_config_name", options.model_config_name or ""),
        ("rate_limit", _RATE_LIMITS[options.rate_limit.value]),
        ("min_supported_compute_capability", "6.0"),
        ("strict_readiness", str(int(options.strict_readiness))),
        ("exit_timeout", str(int(options.exit_timeout_secs))),
        ("cache_enabled", str(int(cache))),
    ]
    return [{"Option": option, "Value": value} for option, value in rows]
