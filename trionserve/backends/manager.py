"""A server's BackendManager: its ``--backend-config`` and ``--backend-directory``.

Triton's core gives each server one ``TritonBackendManager`` (core
``src/backend_manager.cc``) that holds the backends it loaded and the settings
each was configured with. Here each :class:`~trionserve.server.Server` creates one
and hands it to its ModelRegistry, which resolves every model's backend through
it; nothing a server is configured with lives in a module global, so two servers
in one process keep their own settings.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import structlog

from trionserve.backends import registry
from trionserve.backends.backend_config import BackendConfig
from trionserve.backends.base import Backend, ModelContext
from trionserve.backends.python import settings as python_settings
from trionserve.core.errors import InvalidArgument, Unavailable
from trionserve.observability.custom_metrics import CustomMetrics
from trionserve.observability.logging import verbose

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

log = structlog.get_logger(__name__)


# The global backend setting auto-complete reads (Triton's default: 4).
DEFAULT_MAX_BATCH_SIZE = "default-max-batch-size"


class BackendNotFound(InvalidArgument):
    """No backend of the name a config gives. Triton looks for it only when a
    version loads (core src/backend_model.cc:441, LocateBackendLibrary): the model
    is polled, and each version fails with this (see :class:`MissingBackend`)."""


class MissingBackend:
    """The backend of a model whose backend does not exist: it completes
    nothing, and every version's load fails with the reason, as in Triton."""

    def __init__(self, name: str, error: BackendNotFound) -> None:
        self.name = name
        self.error = error

    def default_model_filename(self) -> str:
        return ""

    def auto_complete_config(
        self, config: ModelConfig, model_path: Path, max_batch_size_set: bool
    ) -> None:
        return None

    def auto_complete_source(self, version_dir: Path, filename: str) -> Path:
        return version_dir / filename

    def configure(self, settings: Mapping[str, str]) -> None:
        return None

    def can_use_gpu(self) -> bool:
        return False

    def load(self, context: ModelContext) -> NoReturn:
        raise self.error


class BackendManager:
    """Owns one server's backends: ``config`` (``--backend-config``, as given), the
    checked settings each backend is configured with, the directories
    Python-based backends are looked for in, the backends it has besides the
    installed ones (``backends``: backend or platform name -> factory, looked up
    first; an embedding program's or a test's), and ``custom_metrics``, where its
    models define their metric families. Its settings are immutable once made.

    Raises InvalidArgument naming the flag for a bad ``python`` setting; logs one
    line for each setting that has no effect here (as a Triton backend ignores
    keys it does not read).
    """

    def __init__(
        self,
        config: BackendConfig | None = None,
        directories: list[Path] | None = None,
        backends: Mapping[str, registry.BackendFactory] | None = None,
        *,
        autocomplete: bool = True,
    ) -> None:
        self.autocomplete = autocomplete
        self._announced: set[str] = set()  # backends whose configuration was logged
        self._loaded: dict[str, str] = {}  # backend name -> the file that implements it
        self.config: BackendConfig = {
            backend: dict(values) for backend, values in (config or {}).items()
        }
        self.directories: tuple[Path, ...] = tuple(
            Path(d) for d in (directories or [registry.DEFAULT_BACKEND_DIRECTORY])
        )
        self._factories = dict(backends or {})
        self.custom_metrics = CustomMetrics()
        python = self.config.get("python", {})
        python_defaults, ignored = python_settings.check_backend_defaults(python)
        # backend name -> the checked settings its backends are configured with
        self._settings: dict[str, dict[str, str]] = {"python": python_defaults}
        for key in ignored:
            _no_effect("python", key, python[key])
        for backend, values in self.config.items():
            if backend != "python":
                for key, value in values.items():
                    if key == DEFAULT_MAX_BATCH_SIZE and backend in ("", "onnxruntime"):
                        continue  # read by the onnxruntime backend's auto-complete
                    _no_effect(backend, key, value)
        # A bad default-max-batch-size fails start-up, as it fails Triton's
        # onnxruntime backend when it loads (ParseIntValue).
        for name in ("", "onnxruntime"):
            given = self.config.get(name, {}).get(DEFAULT_MAX_BATCH_SIZE)
            if given is not None and not _is_int(given):
                raise InvalidArgument(
                    f"--backend-config {name + ',' if name else ''}"
                    f"{DEFAULT_MAX_BATCH_SIZE}={given}: expected an integer"
                )

    def python_based_backend(self, name: str) -> Path | None:
        """``<backend directory>/<name>/model.py`` of a Python-based backend, if any."""
        if not name or "/" in name or name.startswith("."):
            return None
        for directory in self.directories:
            model_file = directory / name / "model.py"
            if model_file.is_file():
                return model_file
        return None

    def backend_for(self, config: ModelConfig) -> Backend:
        """The backend for a normalised config, configured with this server's
        settings, or Unavailable naming what is missing."""
        if config.runtime:
            self._check_runtime(config)
        for key in (config.backend, config.platform):
            factory = (self._factories.get(key) or registry.factory(key)) if key else None
            if factory is not None:
                return self._configured(factory())
        model_file = self.python_based_backend(config.backend)
        if model_file is not None:
            from trionserve.backends.python.backend import PythonBackend

            return self._configured(PythonBackend(model_file), model_file)
        searched = ", ".join(
            str(d / (config.backend or "<backend>") / "model.py") for d in self.directories
        )
        if config.backend:
            raise BackendNotFound(
                f"unable to find backend library for backend '{config.backend}', try "
                "specifying runtime on the model configuration. (this server serves no "
                f"backend '{config.backend}', and there is no Python-based backend at "
                f"{searched or 'no backend directory'})"
            )
        raise Unavailable(
            f"model '{config.name}': backend '{config.backend}' / platform "
            f"'{config.platform}' is not supported by this server (nor is there a "
            f"Python-based backend at {searched or 'no backend directory'})"
        )

    def _check_runtime(self, config: ModelConfig) -> None:
        """A config's ``runtime`` names the backend's library in Triton: here it
        may name the one this server serves the backend with (``libtriton_<backend>.so``)
        or ``model.py`` (a Python-based backend); any other is refused as Triton
        refuses a library it cannot find, or one outside the backend's directory
        (core src/backend_model.cc:369, :383 GetBackendLibraryProperties)."""
        runtime, name = config.runtime, config.name
        if runtime in (f"libtriton_{config.backend}.so", "model.py"):
            return
        base = self.directories[0] / config.backend
        if os.path.isabs(runtime) or ".." in Path(runtime).parts:
            raise InvalidArgument(
                f"backend library name '{runtime}' escapes backend directory '{base}', for "
                f"model '{name}', check model config runtime field"
            )
        raise InvalidArgument(
            f"unable to find backend library '{runtime}' for model '{name}', searched: "
            f"'{base}' (this server serves backend '{config.backend}' itself: leave runtime "
            f"empty or name libtriton_{config.backend}.so)"
        )

    def settings_for(self, backend: str) -> Mapping[str, str]:
        """The checked settings a backend of this name is configured with.

        Every backend but ``python`` gets Triton's resolution (core
        backend_model.cc ResolveBackendConfigs, SetBackendConfigDefaults): the
        settings given without a backend name, overridden by its own, and
        ``default-max-batch-size`` 4 unless one of them set it, each logged at
        verbose level 1 as Triton logs it for each model it creates.
        """
        if backend in self._settings:
            return self._settings[backend]
        resolved = dict(self.config.get("", {}))
        resolved.update(self.config.get(backend, {}))
        value = resolved.get(DEFAULT_MAX_BATCH_SIZE)
        if value is not None:
            vlog(f"Found overwritten default setting: {DEFAULT_MAX_BATCH_SIZE},{value}")
        else:
            value = resolved[DEFAULT_MAX_BATCH_SIZE] = "4"
            vlog(f"Adding default backend config setting: {DEFAULT_MAX_BATCH_SIZE},{value}")
        return resolved

    def _configured(self, backend: Backend, path: Path | None = None) -> Backend:
        if backend.name not in self._loaded:
            self._loaded[backend.name] = str(path or inspect.getfile(type(backend)))
        if backend.name in _ANNOUNCING and backend.name not in self._announced:
            self._announced.add(backend.name)
            if backend.name == "onnxruntime":  # onnxruntime.cc:2917, as it first loads
                log.info("TRITONBACKEND_Initialize: onnxruntime")
            log.info("backend configuration:\n" + self.backend_configuration(backend.name))
        backend.configure(self.settings_for(backend.name))
        return backend

    def backend_rows(self) -> list[dict[str, str]]:
        """The start-up table of the backends the models loaded so far use, as
        Triton's server logs it (core src/server.cc:642-667,
        PrintBackendAndModelSummary, from backend_manager.cc:405 BackendState):
        each backend's name, where it comes from (Triton: its shared library;
        here the module that implements it, or a Python-based backend's
        ``model.py``) and the configuration JSON it was given."""
        return [
            {"Backend": name, "Path": path, "Config": self.backend_configuration(name)}
            for name, path in sorted(self._loaded.items())
        ]

    def backend_configuration(self, backend: str) -> str:
        """The JSON of the settings Triton's core gives a backend when it first
        loads (TRITONBACKEND_BackendConfig), which its onnxruntime and python
        backends log as ``backend configuration:`` (onnxruntime_backend
        src/onnxruntime.cc:2963, python_backend src/python_be.cc:2261): under
        ``cmdline``, the core's three global settings (core src/tritonserver.cc:2465
        auto-complete-config, min-compute-capability, backend-directory), those
        given without a backend name, then the backend's own, in key order
        (backend_model.cc ResolveBackendConfigs, a std::map), and last
        ``default-max-batch-size`` 4 unless one set it (SetBackendConfigDefaults);
        as TRITONSERVER_MessageSerializeToJson writes it, compact."""
        resolved = {
            "auto-complete-config": "true" if self.autocomplete else "false",
            # std::to_string(TRITON_MIN_COMPUTE_CAPABILITY), Triton's default 6.0
            "min-compute-capability": "6.000000",
            "backend-directory": str(self.directories[0]),
            **self.config.get("", {}),
            **self.config.get(backend, {}),
        }
        cmdline = dict(sorted(resolved.items()))
        cmdline.setdefault(DEFAULT_MAX_BATCH_SIZE, "4")
        return json.dumps({"cmdline": cmdline}, separators=(",", ":"))


# The backends of Triton's that log their configuration when they first load.
_ANNOUNCING = ("onnxruntime", "python")


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def vlog(message: str) -> None:
    """A Triton LOG_VERBOSE(1) line."""
    if verbose():
        log.debug(message)


def _no_effect(backend: str, key: str, value: str) -> None:
    flag = f"--backend-config={backend + ',' if backend else ''}{key}={value}"
    log.info(f"{flag} has no effect in trionserve", flag="--backend-config")
