"""Which backend serves a model, from its platform and backend fields."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trionserve.backends.base import Backend
from trionserve.core.errors import Unavailable


def _onnxruntime() -> Backend:
    from trionserve.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend()


def _pytorch() -> Backend:
    from trionserve.backends.pytorch import PyTorchBackend

    return PyTorchBackend()


def _tensorrt() -> Backend:
    from trionserve.backends.tensorrt import TensorRTBackend

    return TensorRTBackend()


def _python() -> Backend:
    from trionserve.backends.python.backend import PythonBackend

    return PythonBackend()


def _ensemble() -> Backend:
    from trionserve.backends.ensemble import EnsembleBackend

    return EnsembleBackend()


# backend or platform name -> factory. Factories import their framework lazily, so
# a server without torch or tensorrt starts and reports those models UNAVAILABLE.
_FACTORIES: dict[str, Callable[[], Backend]] = {
    "onnxruntime": _onnxruntime,
    "onnxruntime_onnx": _onnxruntime,
    "pytorch": _pytorch,
    "pytorch_libtorch": _pytorch,
    "tensorrt": _tensorrt,
    "tensorrt_plan": _tensorrt,
    "python": _python,
    "ensemble": _ensemble,
}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make ``backend: "<name>"`` (or ``platform``) load through ``factory``."""
    _FACTORIES[name] = factory


# Where Python-based backends live: <directory>/<backend name>/model.py, as in
# Triton (whose default directory is kept, for images built for Triton).
DEFAULT_BACKEND_DIRECTORY = Path("/opt/tritonserver/backends")
_backend_directories: list[Path] = [DEFAULT_BACKEND_DIRECTORY]


def set_backend_directories(directories: list[Path]) -> None:
    """Look for Python-based backends in ``directories`` (``--backend-directory``)."""
    _backend_directories[:] = [Path(d) for d in directories]


def python_based_backend(name: str) -> Path | None:
    """``<backend directory>/<name>/model.py`` of a Python-based backend, if any."""
    if not name or "/" in name or name.startswith("."):
        return None
    for directory in _backend_directories:
        model_file = directory / name / "model.py"
        if model_file.is_file():
            return model_file
    return None


def backend_for(config) -> Backend:
    """The backend for a normalised config, or Unavailable naming what is missing."""
    for key in (config.backend, config.platform):
        factory = _FACTORIES.get(key) if key else None
        if factory is not None:
            return factory()
    model_file = python_based_backend(config.backend)
    if model_file is not None:
        from trionserve.backends.python.backend import PythonBackend

        return PythonBackend(model_file)
    searched = ", ".join(
        str(d / (config.backend or "<backend>") / "model.py") for d in _backend_directories
    )
    raise Unavailable(
        f"model '{config.name}': backend '{config.backend}' / platform "
        f"'{config.platform}' is not supported by this server (nor is there a "
        f"Python-based backend at {searched or 'no backend directory'})"
    )
