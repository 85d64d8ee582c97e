"""The Python backend's settings: ``--backend-config=python,<key>=<value>`` defaults,
overridden by a model's config.pbtxt ``parameters``.

Triton takes the shared-memory sizes and the stub timeout as ``--backend-config=
python,<key>=<value>`` for the whole server; here those are the server-wide
defaults (checked by :func:`check_backend_defaults`, held by the server's
``BackendManager`` and handed to each PythonBackend it makes) and the same keys may also be model
parameters, which win, next to the model's own (``FORCE_CPU_ONLY_INPUT_TENSORS``,
``EXECUTION_ENV_PATH``):

- ``shm-default-byte-size`` (1 MiB), ``shm-growth-byte-size`` (1 MiB): each
  direction's shared-memory arena, per instance;
- ``stub-timeout-seconds`` (30): how long a stub may take to answer
  auto-complete, and to finalize;
- ``initialize-timeout-seconds`` (600): how long a stub may take to start and
  run ``initialize``;
- ``execute-timeout-seconds`` (0, no limit): an ``execute`` running longer is
  treated as a hang: the stub is killed, its requests fail, and it restarts;
- ``stub-max-restarts`` (5): consecutive failures (crash, hang, failed restart)
  tolerated before the model becomes UNAVAILABLE;
- ``EXECUTION_ENV_PATH``: the model's own Python environment (see
  :mod:`.environment`);
- ``EXECUTION_MODE``: ``stub`` (the default: a stub process per instance, as
  Triton) or ``in_process`` (model.py runs on threads of the server, see
  :mod:`.inprocess`); a model parameter only;
- ``INPROCESS_EXECUTE_ON``: where an in-process model's ``execute`` runs:
  ``instance_thread`` (the default: the instance's own thread) or
  ``event_loop`` (the server's event-loop thread while its executes stay cheap,
  see :mod:`.inprocess`); a model parameter only, with EXECUTION_MODE
  ``in_process``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trionserve.backends.python.environment import ExecutionEnvironment, resolve
from trionserve.core.errors import InvalidArgument

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

_MIB = 1 << 20

# key -> (default, type, minimum): the settings --backend-config may also set.
_NUMBERS = {
    "shm-default-byte-size": (_MIB, int, 4096),
    "shm-growth-byte-size": (_MIB, int, 4096),
    "stub-timeout-seconds": (30.0, float, 1),
    "initialize-timeout-seconds": (600.0, float, 1),
    "execute-timeout-seconds": (0.0, float, 0),
    "stub-max-restarts": (5, int, 0),
}
# EXECUTION_MODE values: a stub process per instance (Triton's way), or the server's
# own threads.
STUB, IN_PROCESS = "stub", "in_process"
EXECUTION_MODES = (STUB, IN_PROCESS)
# INPROCESS_EXECUTE_ON values: the instance's own thread, or the event loop's.
INSTANCE_THREAD, EVENT_LOOP = "instance_thread", "event_loop"
EXECUTE_ON = (INSTANCE_THREAD, EVENT_LOOP)
# Triton's Python backend settings that configure what this one does not have
# (its message queue, shared-memory region names, its own thread pool).
NO_EFFECT_KEYS = ("shm-message-queue-size", "shm-region-prefix-name", "thread-pool-size")


def _number(key: str, text: str, where: str) -> int | float:
    _default, kind, minimum = _NUMBERS[key]
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise InvalidArgument(f"{where} must be a number >= {minimum}, got '{text}'")
    return value


def check_backend_defaults(settings: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Check ``--backend-config=python,...`` settings, every model's defaults.

    Returns the settings this backend reads, checked (InvalidArgument naming the
    flag for a bad value), and the keys that have no effect here, known
    (:data:`NO_EFFECT_KEYS`) or not, for the caller to report.
    """
    defaults: dict[str, str] = {}
    ignored: list[str] = []
    for key, text in settings.items():
        if key in _NUMBERS:
            _number(key, text, f"--backend-config=python,{key}")
            defaults[key] = text
        else:
            ignored.append(key)
    return defaults, ignored


@dataclass(frozen=True, slots=True)
class StubSettings:
    shm_default_byte_size: int = _MIB
    shm_growth_byte_size: int = _MIB
    stub_timeout: float = 30.0
    initialize_timeout: float = 600.0
    execute_timeout: float = 0.0
    max_restarts: int = 5
    # EXECUTION_ENV_PATH as written; ``environment`` once resolved for a model.
    execution_env: str = ""
    environment: ExecutionEnvironment | None = None
    execution_mode: str = STUB
    execute_on: str = INSTANCE_THREAD

    @classmethod
    def from_config(cls, config: ModelConfig, defaults: Mapping[str, str]) -> StubSettings:
        """The settings of one model, its parameters over the server's checked
        ``defaults``; raises naming the model and the parameter."""
        name = config.name
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        force_cpu = parameters.get("FORCE_CPU_ONLY_INPUT_TENSORS", "yes").lower()
        if force_cpu not in ("yes", "no", "true", "false", "1", "0", "on", "off"):
            raise InvalidArgument(
                f"model '{name}': parameter FORCE_CPU_ONLY_INPUT_TENSORS must be 'yes' "
                f"or 'no', got '{parameters['FORCE_CPU_ONLY_INPUT_TENSORS']}'"
            )

        mode = parameters.get("EXECUTION_MODE", "") or STUB
        if mode not in EXECUTION_MODES:
            raise InvalidArgument(
                f"model '{name}': parameter EXECUTION_MODE must be 'stub' or 'in_process', "
                f"got '{mode}'"
            )
        if mode == IN_PROCESS and parameters.get("EXECUTION_ENV_PATH"):
            raise InvalidArgument(
                f"model '{name}': parameter EXECUTION_ENV_PATH cannot be used with "
                "EXECUTION_MODE 'in_process': an in-process model runs in the server's own "
                "Python; use EXECUTION_MODE 'stub' for a model with its own environment"
            )
        execute_on = parameters.get("INPROCESS_EXECUTE_ON", "") or INSTANCE_THREAD
        if execute_on not in EXECUTE_ON:
            raise InvalidArgument(
                f"model '{name}': parameter INPROCESS_EXECUTE_ON must be 'instance_thread' "
                f"or 'event_loop', got '{execute_on}'"
            )
        if execute_on != INSTANCE_THREAD and mode != IN_PROCESS:
            raise InvalidArgument(
                f"model '{name}': parameter INPROCESS_EXECUTE_ON '{execute_on}' needs "
                f"EXECUTION_MODE 'in_process', got '{mode}': a stub's execute runs in its "
                "own process"
            )

        def number(key: str) -> Any:
            text = parameters.get(key)
            if text:
                return _number(key, text, f"model '{name}': parameter '{key}'")
            text = defaults.get(key)  # checked when it was set
            return _NUMBERS[key][1](text) if text else _NUMBERS[key][0]

        return cls(
            shm_default_byte_size=number("shm-default-byte-size"),
            shm_growth_byte_size=number("shm-growth-byte-size"),
            stub_timeout=number("stub-timeout-seconds"),
            initialize_timeout=number("initialize-timeout-seconds"),
            execute_timeout=number("execute-timeout-seconds"),
            max_restarts=number("stub-max-restarts"),
            execution_env=parameters.get("EXECUTION_ENV_PATH", ""),
            execution_mode=mode,
            execute_on=execute_on,
        )


def settings_for(config: ModelConfig, model_dir: Path, defaults: Mapping[str, str]) -> StubSettings:
    """A model's settings with its EXECUTION_ENV_PATH resolved (blocking: an
    archive is unpacked the first time)."""
    settings = StubSettings.from_config(config, defaults)
    if not settings.execution_env:
        return settings
    environment = resolve(settings.execution_env, model_dir, config.name)
    return replace(settings, environment=environment)
