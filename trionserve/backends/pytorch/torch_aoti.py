"""PyTorch 2 models: platform ``torch_aoti``, file ``model.pt2``.

Triton's PyTorch backend serves an AOTInductor package
(``torch._inductor.aoti_compile_and_package``) when the config says
``platform: "torch_aoti"`` (pytorch_backend src/libtorch.cc GetModelInfo;
src/pt2/model_state.hh: default file ``model.pt2``). The same file name may also
hold an ExportedProgram written by ``torch.export.save``, which is served here
too (Triton does not): the archive's contents say which it is.

Tensors are named after the program's call specification, as in Triton's README
("Model Configuration"): an input is ``INPUT__<i>`` (its position among the
flattened inputs) or its place in the call, ``ARGS[0]``, ``ARGS[2][key]``,
``KWARGS[name]``; an output is ``OUTPUT__<i>`` or ``RESULT``, ``RESULT[key]``,
``RESULT[1]``, ``RESULT[key][0]``. Leaves are ordered as torch's pytree flattens
them: tuples and lists by position, dicts in insertion order.
"""

from __future__ import annotations

import threading
import zipfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import structlog

from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.pytorch.device import instance_device, require_torch
from trionserve.backends.pytorch.instance import TorchScriptInstance
from trionserve.backends.pytorch.naming import TORCH_DTYPES, config_type_name, name_index
from trionserve.core import datatypes
from trionserve.core.errors import InvalidArgument

if TYPE_CHECKING:
    import torch
    from torch.utils._pytree import TreeSpec

    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.backends.pytorch.instance import TorchInput

log = structlog.get_logger(__name__)

INPUT_ROOTS = ("ARGS", "KWARGS")  # the call spec's inputs are the pair (args, kwargs)
OUTPUT_ROOT = "RESULT"
# torch.export.load sets a process-wide deserializer and fails when two threads
# load at once ("_CURRENT_DESERIALIZER is already set"): models and instances load
# in parallel, so loads take turns. It guards torch's global, not server state.
_LOAD_LOCK = threading.Lock()


# -- names (pure: unit-testable without torch) ------------------------------------------


def leaf_name(root: str, path: list[int | str]) -> str:
    """``ROOT[step][step]``: a leaf's name from its steps into the call's tree."""
    return root + "".join(f"[{step}]" for step in path)


def input_names(paths: list[list[int | str]]) -> list[str]:
    """Names of the flattened inputs; each path starts with 0 (args) or 1 (kwargs)."""
    return [leaf_name(INPUT_ROOTS[path[0]], path[1:]) for path in paths]  # type: ignore[index]


def output_names(paths: list[list[int | str]]) -> list[str]:
    return [leaf_name(OUTPUT_ROOT, path) for path in paths]


def bind_leaves(
    model: str, kind: str, config_names: list[str], leaves: list[str], everything: bool
) -> dict[str, int]:
    """Config tensor name -> position among the flattened leaves.

    A name is a leaf's own name or ``<NAME>__<i>``; ``everything``: the config must
    give every leaf (inputs: the program takes all of them).
    """
    if not config_names:
        raise InvalidArgument(
            f"model '{model}': list the model's {kind}s in config.pbtxt (no {kind} was given)"
        )
    positions = {}
    for name in config_names:
        index = name_index(name)
        if name in leaves:
            positions[name] = leaves.index(name)
        elif index is not None and index < len(leaves):
            positions[name] = index
        else:
            raise InvalidArgument(
                f"model '{model}': {kind} '{name}' is none of the model's {kind}s "
                f"{leaves} (or {kind.upper()}__<index>, 0..{len(leaves) - 1})"
            )
    taken: dict[int, str] = {}
    for name, position in positions.items():
        if position in taken:
            raise InvalidArgument(
                f"model '{model}': {kind}s '{taken[position]}' and '{name}' both name "
                f"{leaves[position]}"
            )
        taken[position] = name
    if everything and len(positions) != len(leaves):
        missing = [leaf for i, leaf in enumerate(leaves) if i not in taken]
        raise InvalidArgument(
            f"unable to load model '{model}', configuration expects {len(config_names)} "
            f"inputs, model provides {len(leaves)} (not configured: {missing})"
        )
    return positions


# -- loading ------------------------------------------------------------------------


@dataclass(slots=True)
class Program:
    """A loaded PyTorch 2 program: called as ``call(*args, **kwargs)``."""

    kind: str  # "AOTInductor package" or "ExportedProgram"
    call: Any
    in_spec: Any
    out_spec: Any


def archive_kind(model: str, path: Path) -> str:
    """Which kind of PyTorch 2 archive ``path`` is, from its entries."""
    where = f"{path.parent.name}/{path.name}"
    if not zipfile.is_zipfile(path):
        raise InvalidArgument(
            f"failed to load PyTorch 2 model '{model}' from {where}: not a PyTorch 2 "
            "archive (a zip written by torch.export.save or "
            "torch._inductor.aoti_compile_and_package)"
        )
    with zipfile.ZipFile(path) as archive:
        entries = archive.namelist()
    if any("data/aotinductor/" in entry for entry in entries):
        return "AOTInductor package"
    if any(entry.endswith("models/model.json") for entry in entries):
        return "ExportedProgram"
    raise InvalidArgument(
        f"failed to load PyTorch 2 model '{model}' from {where}: the archive holds "
        "neither an AOTInductor package nor an ExportedProgram (a TorchScript file "
        "is served with platform 'pytorch_libtorch' from model.pt)"
    )


def load_program(model: str, path: Path, device: torch.device | None) -> Program:
    """Load ``path`` for ``device`` (None: where it was saved)."""
    require_torch()  # torch missing: Unavailable, saying so
    kind = archive_kind(model, path)
    try:
        with _LOAD_LOCK:
            return _load(kind, path, device)
    except Exception as exc:  # torch raises RuntimeError and friends
        raise InvalidArgument(
            f"failed to load PyTorch 2 model '{model}' ({kind}) from "
            f"{path.parent.name}/{path.name}: {exc}"
        ) from None


def _load(kind: str, path: Path, device: torch.device | None) -> Program:
    import torch._inductor
    import torch.export.passes
    import torch.utils._pytree as pytree

    if kind == "AOTInductor package":
        index = device.index if device is not None and device.type == "cuda" else -1
        compiled = torch._inductor.aoti_load_package(str(path), device_index=index)
        in_spec, out_spec = map(pytree.treespec_loads, compiled.loader.get_call_spec())
        return Program(kind, compiled, in_spec, out_spec)
    program = torch.export.load(str(path))
    if device is not None:
        program = torch.export.passes.move_to_device_pass(program, device)
    spec = program.call_spec
    return Program(kind, program.module(), spec.in_spec, spec.out_spec)


def leaf_paths(model: str, spec: TreeSpec) -> list[list[int | str]]:
    """Each leaf's steps into the tree ``spec`` describes (tuple/list index, dict key)."""
    import torch.utils._pytree as pytree

    tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    paths = []
    for keys, _ in pytree.tree_flatten_with_path(tree)[0]:
        path: list[int | str] = []
        for key in keys:
            if isinstance(key, pytree.SequenceKey):
                path.append(key.idx)
            elif isinstance(key, pytree.MappingKey):
                path.append(str(key.key))
            else:
                raise InvalidArgument(
                    f"model '{model}': its call takes or returns a {type(key).__name__} "
                    "step; only tuples, lists, dicts and Tensors are supported"
                )
        paths.append(path)
    return paths


def sequence_tensors(config: ModelConfig) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The config types of ``sequence_batching``'s control inputs, implicit-state
    inputs and implicit-state outputs, by tensor name."""
    controls: dict[str, str] = {}
    for control_input in config.sequence_batching.control_input:
        for control in control_input.control:
            if control.int32_false_true:
                controls[control_input.name] = "TYPE_INT32"
            elif control.fp32_false_true:
                controls[control_input.name] = "TYPE_FP32"
            elif control.bool_false_true:
                controls[control_input.name] = "TYPE_BOOL"
            else:  # CONTROL_SEQUENCE_CORRID
                controls[control_input.name] = config_type_name(control.data_type)
    states = config.sequence_batching.state
    state_inputs = {s.input_name: config_type_name(s.data_type) for s in states}
    state_outputs = {s.output_name: config_type_name(s.data_type) for s in states}
    return controls, state_inputs, state_outputs


def check_sequence_types(model: str, config: ModelConfig) -> None:
    """Refuse sequence controls or state of a type a torch tensor cannot carry."""
    for group in sequence_tensors(config):
        for name, type_name in group.items():
            if type_name not in TORCH_DTYPES:
                raise InvalidArgument(
                    f"model '{model}': sequence_batching tensor '{name}' is {type_name}; "
                    "the PyTorch backend does not support it"
                )


# -- the model and its instances ------------------------------------------------------


class Pt2Model:
    """A ``model.pt2`` and its config; each instance loads its own program."""

    def __init__(self, context: ModelContext, path: Path) -> None:
        self.context = context
        self.path = path

    def create_instance(self, spec: InstanceSpec) -> Pt2Instance:
        torch = require_torch()
        device = instance_device(spec, self.context.name)
        program = load_program(self.context.name, self.path, device)
        log.info(
            "loaded PyTorch 2 model",
            model=self.context.name,
            instance=spec.name,
            kind=program.kind,
        )
        return Pt2Instance(self.context, spec, torch, program, device)

    def unload(self) -> None:
        pass


class Pt2Instance(TorchScriptInstance):
    """One PyTorch 2 program on one device, run in the TorchScript instance's
    stage/launch/finish steps (reusable buffers, streams, CUDA graphs); only how
    tensors meet the call differs."""

    def __init__(
        self,
        context: ModelContext,
        spec: InstanceSpec,
        torch: ModuleType,
        program: Program,
        device: torch.device | None,
    ) -> None:
        self._program = program
        super().__init__(context, spec, torch, program.call, device)

    def _bind(self, context: ModelContext, module: torch.jit.ScriptModule) -> None:
        """Match the config's tensors, with the sequence batcher's control and
        implicit-state tensors (Triton's pt2 ModelInstanceState counts them among
        the model's inputs), to the program's call specification."""
        program = self._program
        controls, state_inputs, state_outputs = sequence_tensors(context.config)
        for name, type_name in {**controls, **state_inputs}.items():
            self._input_types.setdefault(name, type_name)
        for name, type_name in state_outputs.items():
            if name not in self._output_types:
                self._output_types[name] = type_name
                self._output_datatypes[name] = datatypes.BY_CONFIG[type_name].wire
        inputs = input_names(leaf_paths(context.name, program.in_spec))
        outputs = output_names(leaf_paths(context.name, program.out_spec))
        # Batch inputs are program inputs too, named like the others (Triton's pt2
        # instance leaves their mapping disabled, "TODO: FIXME" in
        # src/pt2/model_instance_state.cc; its TorchScript one maps them).
        self._input_positions = bind_leaves(
            context.name,
            "input",
            list(self._input_types) + self._batch_tensors.input_names,
            inputs,
            everything=True,
        )
        self._outputs = bind_leaves(
            context.name, "output", list(self._output_types), outputs, everything=False
        )

    def _execution(self) -> AbstractContextManager[object]:
        # cuDNN as for TorchScript; optimized execution and the JIT's flags are
        # TorchScript's.
        self._parameters.set_process_flags(self._torch, jit=False)
        return nullcontext()

    def _forward(self, tensors: dict[str, TorchInput]) -> object:
        import torch.utils._pytree as pytree

        missing = [name for name in self._input_positions if name not in tensors]
        if missing:
            raise InvalidArgument(
                f"model '{self.model_name}' needs input(s) {missing}: the program takes every input"
            )
        leaves: list[Any] = [None] * len(self._input_positions)
        for name, position in self._input_positions.items():
            leaves[position] = tensors[name]
        args, kwargs = pytree.tree_unflatten(leaves, self._program.in_spec)
        return self._program.call(*args, **kwargs)

    def _select(self, name: str, result: object) -> object:
        import torch.utils._pytree as pytree

        leaves = pytree.tree_leaves(result)
        return leaves[self._outputs[name]]

    def close(self) -> None:
        self._program = None  # type: ignore[assignment]
        self._module = None
