"""Which backend serves a model, from its platform and backend fields."""

from __future__ import annotations

from trionserve.backends.base import Backend
from trionserve.core.errors import Unavailable

# platform or backend name -> factory; later backends register here.
_FACTORIES: dict[str, str] = {
    "onnxruntime_onnx": "onnxruntime",
    "onnxruntime": "onnxruntime",
}


def backend_for(config) -> Backend:
    """The backend for a normalised config, or Unavailable naming what is missing."""
    key = config.backend or config.platform
    kind = _FACTORIES.get(key)
    if kind == "onnxruntime":
        from trionserve.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend()
    raise Unavailable(
        f"model '{config.name}': backend '{config.backend}' / platform "
        f"'{config.platform}' is not supported by this server"
    )
