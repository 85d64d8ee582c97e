"""Which backend serves a model, from its platform and backend fields."""

from __future__ import annotations

from collections.abc import Callable

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


def backend_for(config) -> Backend:
    """The backend for a normalised config, or Unavailable naming what is missing."""
    for key in (config.backend, config.platform):
        factory = _FACTORIES.get(key) if key else None
        if factory is not None:
            return factory()
    raise Unavailable(
        f"model '{config.name}': backend '{config.backend}' / platform "
        f"'{config.platform}' is not supported by this server"
    )
