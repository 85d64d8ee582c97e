"""Scaffolding for in-process test backends: an instance factory becomes a Backend.

Test backends differ only in what their instances do in ``execute``; loading and
instance creation are the same, so they live here once. A test gives its backends
to the servers it makes (``Server(options, backends=...)``, through their
BackendManager): nothing is registered process-wide.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.backends.batch_tensors import build_responses, gather_inputs
from trionserve.backends.registry import BackendFactory

MODEL_FILE = "model.txt"


class _Model:
    def __init__(self, context: ModelContext, make_instance) -> None:
        self.context = context
        self._make_instance = make_instance

    def create_instance(self, spec: InstanceSpec):
        return self._make_instance(self.context, spec)

    def unload(self) -> None:
        pass


class InstanceBackend(Backend):
    """A Backend whose instances come from ``make_instance(context, spec)``."""

    def __init__(self, name: str, make_instance) -> None:
        self.name = name
        self._make_instance = make_instance

    def default_model_filename(self) -> str:
        return MODEL_FILE

    def auto_complete_config(self, config, model_path: Path, max_batch_size_set: bool) -> None:
        pass

    def load(self, context: ModelContext) -> _Model:
        return _Model(context, self._make_instance)


def instance_backend(
    name: str, make_instance: Callable[[ModelContext, InstanceSpec], object]
) -> dict[str, BackendFactory]:
    """``backend: "<name>"`` for a server's ``backends``: an InstanceBackend."""
    return {name: lambda: InstanceBackend(name, make_instance)}


def echo_responses(requests, model_name: str, model_version: str) -> list:
    """Responses whose FP32 OUTPUT0 is each request's INPUT0."""
    outputs = {"OUTPUT0": gather_inputs(requests)["INPUT0"]}
    return build_responses(requests, model_name, model_version, outputs, {"OUTPUT0": "FP32"})
