"""The backends this installation has: backend and platform names -> factories.

What is installed is code, the same for every server in the process (as the
backend libraries on Triton's disk); which of them a server uses, and with what
settings, is its :class:`~trionserve.backends.manager.BackendManager`'s, which also
holds the backends a server has besides these (an embedding program's, a test's):
nothing adds to this table at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trionserve.backends.base import Backend

# Makes one Backend, configured by the BackendManager that called it.
BackendFactory = Callable[[], Backend]


def _onnxruntime() -> Backend:
    from trionserve.backends.onnxruntime.backend import OnnxRuntimeBackend

    return OnnxRuntimeBackend()


def _pytorch() -> Backend:
    from trionserve.backends.pytorch.backend import PyTorchBackend

    return PyTorchBackend()


def _tensorrt() -> Backend:
    from trionserve.backends.tensorrt.backend import TensorRTBackend

    return TensorRTBackend()


def _python() -> Backend:
    from trionserve.backends.python.backend import PythonBackend

    return PythonBackend()


def _ensemble() -> Backend:
    from trionserve.backends.ensemble import EnsembleBackend

    return EnsembleBackend()


def _reference(module: str, cls: str) -> Callable[[], Backend]:
    """A factory for one of Triton's test backends (backends/reference/)."""

    def make() -> Backend:
        import importlib

        backend: Backend = getattr(
            importlib.import_module(f"trionserve.backends.reference.{module}"), cls
        )()
        return backend

    return make


# backend or platform name -> factory. Factories import their framework lazily, so
# a server without torch or tensorrt starts and reports those models UNAVAILABLE.
_FACTORIES: dict[str, BackendFactory] = {
    "onnxruntime": _onnxruntime,
    "onnxruntime_onnx": _onnxruntime,
    "pytorch": _pytorch,
    "pytorch_libtorch": _pytorch,
    "torch_aoti": _pytorch,
    "tensorrt": _tensorrt,
    "tensorrt_plan": _tensorrt,
    "python": _python,
    "ensemble": _ensemble,
    # Triton's test and example backends, by the names Triton's QA uses.
    "identity": _reference("identity", "IdentityBackend"),
    "repeat": _reference("decoupled", "RepeatBackend"),
    "square": _reference("decoupled", "SquareBackend"),
    "minimal": _reference("examples", "MinimalBackend"),
    "recommended": _reference("examples", "RecommendedBackend"),
    "sequence": _reference("sequence", "SequenceBackend"),
    "dyna_sequence": _reference("sequence", "DynaSequenceBackend"),
    "implicit_state": _reference("sequence", "ImplicitStateBackend"),
    "bls": _reference("bls", "BLSBackend"),
    "iterative_sequence": _reference("iterative", "IterativeSequenceBackend"),
}


def factory(name: str) -> BackendFactory | None:
    """The factory registered for a backend or platform name, if any."""
    return _FACTORIES.get(name)


# Where Python-based backends live: <directory>/<backend name>/model.py, as in
# Triton (whose default directory is kept, for images built for Triton). A
# server's BackendManager holds the directories it looks in.
DEFAULT_BACKEND_DIRECTORY = Path("/opt/tritonserver/backends")
