"""PyTorch backend: platform ``pytorch_libtorch`` / backend ``pytorch`` (TorchScript);
platform ``torch_aoti`` (PyTorch 2 ``model.pt2``) is in :mod:`.torch_aoti`.

One ``torch.jit.load``-ed module per instance, on the CPU or on ``cuda:<device_id>``
for KIND_GPU instances. Tensors are matched to ``forward()`` the way Triton's
pytorch backend matches them:

- inputs: a forward taking a single ``Dict[str, Tensor]`` gets every input in one
  dict keyed by config name; otherwise, when every config input name is a forward
  argument name, by that name; else, when every name is ``<name>__<index>``
  (``INPUT__0``), by that index; else in config order. The config lists exactly
  as many inputs as forward takes.
- outputs: a returned Tensor is output 0, a returned tuple is indexed by
  ``<name>__<index>`` (``OUTPUT__0``) when every output follows that convention,
  else by config order; a returned ``Dict[str, Tensor]`` is read by config name
  (Triton rejects dict outputs from TorchScript; they are accepted here).

TorchScript carries no reliable tensor metadata, so like Triton this backend does not
auto-complete: config.pbtxt lists every input and output. torch is optional; without
it a pytorch model is UNAVAILABLE with a reason that says so.

This module loads a model and places its instances (Triton's ModelState and
instance creation in ``src/libtorch.cc``); the matching rules are in
:mod:`.naming`, the CUDA graphs' shapes in :mod:`trionserve.backends.cuda.graphs`, a
loaded module's batch execution in :mod:`.instance`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from trionserve._generated.model_config_pb2 import ModelTensorReshape
from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.backends.cuda.graphs import cuda_graph_shapes
from trionserve.backends.pytorch.device import instance_device, require_torch
from trionserve.backends.pytorch.instance import TorchScriptInstance
from trionserve.backends.pytorch.naming import bind_outputs, check_data_types
from trionserve.backends.pytorch.parameters import TorchParameters, set_thread_counts
from trionserve.core.errors import InvalidArgument, Unavailable

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelSequenceBatching
    from trionserve.backends.pytorch.torch_aoti import Pt2Model

log = structlog.get_logger(__name__)

# Triton's platform for PyTorch 2 (AOTInductor) models; see torch_aoti.py.
PT2_PLATFORM = "torch_aoti"


# -- the backend ------------------------------------------------------------------------


class PyTorchBackend(Backend):
    name = "pytorch"

    def default_model_filename(self) -> str:
        return "model.pt"

    def can_use_gpu(self) -> bool:
        """Only a CUDA build of torch that sees a device (no torch: no GPU; loading
        the model then says torch is missing)."""
        try:
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())

    def auto_complete_config(
        self, config: ModelConfig, model_path: Path, max_batch_size_set: bool
    ) -> None:
        """Nothing to fill: TorchScript does not record its tensors (as in Triton)."""
        if not config.input or not config.output:
            log.warning(
                "skipping model configuration auto-complete: not supported for the pytorch backend",
                model=config.name,
            )

    def load(self, context: ModelContext) -> TorchScriptModel | Pt2Model:
        require_torch()  # a server without torch reports the model UNAVAILABLE, with why
        config = context.config
        filename = config.default_model_filename or self.default_model_filename()
        path = context.version_dir / filename
        if not path.is_file():
            raise Unavailable(
                f"model file '{filename}' not found in version {context.version} "
                f"of model '{context.name}' ({context.version_dir.name}/)"
            )
        torchscript = config.platform != PT2_PLATFORM
        batching = config.max_batch_size > 0
        for kind, entries in (("input", config.input), ("output", config.output)):
            check_data_types(context.name, kind, entries, strings=torchscript, batching=batching)
        if torchscript:
            check_data_types(
                context.name,
                "input state",
                [_StateEntry(s.input_name, s) for s in config.sequence_batching.state],
                strings=True,
            )
        # A value Triton cannot parse fails the load (its ModelState::Create).
        parameters = TorchParameters.from_config(config, context.name)
        if config.platform == PT2_PLATFORM:
            from trionserve.backends.pytorch.torch_aoti import (
                Pt2Model,
                archive_kind,
                check_sequence_types,
            )

            for kind, entries in (("input", config.input), ("output", config.output)):
                if not entries:
                    raise InvalidArgument(
                        f"model '{context.name}': list the model's {kind}s in "
                        f"config.pbtxt (no {kind} was given)"
                    )
            check_sequence_types(context.name, config)
            archive_kind(context.name, path)  # a file that is no PyTorch 2 archive fails here
            return Pt2Model(context, path)
        if config.input:
            # Without inputs the instance reports first, in the backend's order: its
            # bind_inputs counts forward()'s arguments against none (pytorch_backend
            # src/pt/model_instance_state.cc ValidateInputs, then ValidateOutputs).
            bind_outputs(
                context.name,
                [o.name for o in config.output],
                [s.output_name for s in config.sequence_batching.state],
            )
        parameters.announce(context.name)
        set_thread_counts(require_torch(), parameters, context.name)
        return TorchScriptModel(context, path, parameters)


class _StateEntry:
    """A ``sequence_batching.state`` entry read as a tensor entry (name, type, dims)."""

    def __init__(self, name: str, state: ModelSequenceBatching.State) -> None:
        self.name = name
        self.data_type = state.data_type
        self.dims = list(state.dims)
        self.reshape = ModelTensorReshape()  # none: a state has no reshape

    def HasField(self, field: str) -> bool:  # noqa: N802 (protobuf's name)
        return False


class TorchScriptModel:
    """A TorchScript file and its config; each instance loads its own module, or
    with ENABLE_WEIGHT_SHARING the instances on one device share one (Triton's
    ModelState::LoadModel keeps one module per device, keyed by whether it is a
    GPU and its index: a KIND_MODEL instance shares the CPU's)."""

    def __init__(self, context: ModelContext, path: Path, parameters: TorchParameters) -> None:
        self.context = context
        self.path = path
        self.parameters = parameters
        self._shared: dict[tuple[bool, int], Any] = {}
        self._lock = threading.Lock()

    def _load(self, torch: Any, device: Any) -> Any:
        try:
            module = torch.jit.load(str(self.path), map_location=device)
        except Exception as exc:  # torch raises RuntimeError and friends
            raise InvalidArgument(
                f"failed to load TorchScript model '{self.context.name}' from "
                f"{self.context.version_dir.name}/{self.path.name}: {exc}"
            ) from None
        return module.eval()

    def module_for(self, torch: Any, device: Any) -> Any:
        """The module an instance runs: its own, or the device's shared one."""
        if not self.parameters.weight_sharing:
            return self._load(torch, device)
        on_gpu = device is not None and device.type == "cuda"
        key = (on_gpu, device.index if on_gpu else -1)
        with self._lock:  # one load per device, however many instances start at once
            if key in self._shared:
                log.info(f"Reusing TorchScript model for instance '{self.context.name}'")
                return self._shared[key]
            module = self._shared[key] = self._load(torch, device)
            return module

    def create_instance(self, spec: InstanceSpec) -> TorchScriptInstance:
        torch = require_torch()
        device = instance_device(spec, self.context.name)
        module = self.module_for(torch, device)
        instance = TorchScriptInstance(self.context, spec, torch, module, device)
        shapes = cuda_graph_shapes(self.context.config)
        if shapes is not None:
            if instance.on_gpu:
                instance.capture_graphs(shapes)
            else:
                log.info(
                    "optimization.cuda.graphs ignored: the instance does not run on a GPU",
                    model=self.context.name,
                    instance=spec.name,
                )
        return instance

    def unload(self) -> None:
        with self._lock:
            self._shared.clear()
