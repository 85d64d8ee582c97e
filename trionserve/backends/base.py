"""The interface between the runtime and a model framework.

A :class:`Backend` knows one kind of model file. The registry asks it to auto-complete
a configuration and to load a version directory into a :class:`LoadedModel`; the
loaded model creates one :class:`BackendInstance` per configured instance. Every
method here is blocking and is called from a worker thread, never on the Trio loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trionserve.core.errors import TritonError
from trionserve.core.types import InferenceRequest, InferenceResponse

if TYPE_CHECKING:
    from trionserve.repository.model_config_pb2 import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What a backend needs to load one version of one model."""

    name: str
    version: int
    config: "ModelConfig"
    model_dir: Path  # <repository>/<model>
    version_dir: Path  # <repository>/<model>/<version>

    @property
    def repository(self) -> Path:
        return self.model_dir.parent


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One model instance: Triton's name for it, its kind and its device."""

    name: str  # e.g. "simple_0_0"
    group: str  # e.g. "simple_0"
    kind: str  # "KIND_CPU", "KIND_GPU", "KIND_MODEL"
    device_id: int  # GPU index for KIND_GPU; 0 otherwise


ExecuteResult = list["InferenceResponse | TritonError"]


class BackendInstance(Protocol):
    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        """Run one batch; return one response or error per request, in order."""

    def close(self) -> None:
        """Release the instance's resources."""


class LoadedModel(Protocol):
    def create_instance(self, spec: InstanceSpec) -> BackendInstance: ...

    def unload(self) -> None: ...


class Backend(Protocol):
    name: str

    def default_model_filename(self) -> str: ...

    def auto_complete_config(
        self, config: "ModelConfig", model_path: Path, max_batch_size_set: bool
    ) -> None:
        """Fill inputs, outputs and max_batch_size that the model file can tell.

        ``max_batch_size_set`` says whether config.pbtxt named max_batch_size (proto3
        cannot tell an explicit 0 from an absent field).
        """

    def load(self, context: ModelContext) -> LoadedModel: ...
