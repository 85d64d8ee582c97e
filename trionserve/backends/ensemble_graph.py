"""An ensemble checked against its composing models' configs, as Triton's core does.

Triton checks an ensemble once its composing models are loaded and their configs
completed (core src/ensemble_scheduler/ensemble_utils.cc, ``ValidateEnsembleConfig``
called from model_repository_manager.cc ``CheckNode``): each ensemble tensor
becomes a node holding the data type and shape of the first model it is inferred
from, and every later use must agree with it; then a walk from the ensemble's
inputs labels each tensor with the decoupled step it descends from, and a step
whose inputs descend from different decoupled steps is refused. The errors here
are Triton's words, in Triton's order, so a user (and Triton's QA) reads the
same message as from Triton.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trionserve.core.errors import InvalidArgument

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelEnsembling


@dataclass(eq=False)
class _Node:
    """Triton's ``TensorNode`` (ensemble_utils.cc:44): an ensemble tensor, the
    model it was first inferred from, and its place in the graph."""

    model: str
    datatype: int = 0
    dims: tuple[int, ...] = ()
    full_dims: tuple[int, ...] = ()
    decoupled: bool = False
    label: int = 0
    visited: bool = False
    prev: list[_Node] = field(default_factory=list)
    next: list[_Node] = field(default_factory=list)
    # The symbolic node shared by the outputs of one step (one label for them all).
    sibling: _Node | None = None


def _tensor(model: str, batching: bool, datatype: int, dims: Sequence[int]) -> _Node:
    dims = tuple(dims)
    return _Node(model, datatype, dims, ((-1,) if batching else ()) + dims)


def _fits(a: Sequence[int], b: Sequence[int]) -> bool:
    """common/src/model_config.cc ``CompareDimsWithWildcard``."""
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _fmt(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


def _consistent(first: _Node, later: _Node, where: str) -> None:
    """ensemble_utils.cc:88 ``ValidateTensorConsistency``: same data type, and the
    same dims or the same full shape (a tensor between a batching and a
    non-batching model), -1 matching anything."""
    if first.datatype != later.datatype:
        raise InvalidArgument(
            f"{where}inconsistent data type: {_type_name(first.datatype)} is inferred from "
            f"model {first.model} while {_type_name(later.datatype)} is inferred from model "
            f"{later.model}"
        )
    if not _fits(first.dims, later.dims) and not _fits(first.full_dims, later.full_dims):
        raise InvalidArgument(
            f"{where}inconsistent shape: {_fmt(first.full_dims)} is inferred from model "
            f"{first.model} while {_fmt(later.full_dims)} is inferred from model {later.model}"
        )


def _merge(ensemble: str, tensors: dict[str, _Node], tensor: str, node: _Node) -> _Node:
    """The tensor's node: ``node`` if the tensor is new, else the first one,
    which ``node`` must agree with."""
    first = tensors.setdefault(tensor, node)
    if first is not node:
        _consistent(first, node, f"in ensemble {ensemble}, ensemble tensor {tensor}: ")
    return first


def _map_step(
    ensemble: str,
    step_id: str,
    step: ModelEnsembling.Step,
    config: ModelConfig,
    tensors: dict[str, _Node],
) -> None:
    """ensemble_utils.cc:123 ``ValidateTensorMapping`` for one step."""
    batching = config.max_batch_size > 0
    inputs = {i.name: i for i in config.input}
    for model_input, tensor in step.input_map.items():
        if model_input not in inputs:
            raise InvalidArgument(
                f"in ensemble {ensemble}, ensemble tensor {tensor} is mapping to non-existing "
                f"input {model_input} in model {step_id} (its inputs: {sorted(inputs)})"
            )
    for spec in config.input:
        source = step.input_map.get(spec.name)
        if source is None:
            if spec.optional:
                continue
            raise InvalidArgument(
                f"in ensemble {ensemble}, input {spec.name} in model {step_id} is not mapped "
                "to any ensemble tensors"
            )
        _merge(ensemble, tensors, source, _tensor(step_id, batching, spec.data_type, spec.dims))
    outputs = {o.name: o for o in config.output}
    for model_output, tensor in step.output_map.items():
        if model_output not in outputs:
            raise InvalidArgument(
                f"in ensemble {ensemble}, ensemble tensor {tensor} is mapped from non-existing "
                f"output {model_output} in model {step.model_name} (its outputs: "
                f"{sorted(outputs)})"
            )
    sibling = _Node(step_id)
    for model_output, tensor in step.output_map.items():
        out = outputs[model_output]
        node = _tensor(step_id, batching, out.data_type, out.dims)
        _merge(ensemble, tensors, tensor, node).sibling = sibling
    decoupled = bool(config.model_transaction_policy.decoupled)
    for tensor in step.output_map.values():
        node = tensors[tensor]
        node.decoupled = decoupled
        for source in step.input_map.values():
            node.prev.append(tensors[source])
            tensors[source].next.append(node)


def validate_ensemble(config: ModelConfig, step_configs: Sequence[ModelConfig]) -> bool:
    """Check ``config``'s steps against their models' completed configs (one per
    step, in step order); raise Triton's error, or return whether a decoupled
    step feeds the ensemble's outputs (Triton then makes the ensemble decoupled).

    ensemble_utils.cc:246 ``ValidateEnsembleConfig``.
    """
    name = config.name
    batching = config.max_batch_size > 0
    tensors: dict[str, _Node] = {}
    for spec in config.input:
        dims = spec.reshape.shape if spec.HasField("reshape") else spec.dims
        tensors[spec.name] = _tensor(name, batching, spec.data_type, dims)
    sink = _Node(name)
    for out in config.output:
        dims = out.reshape.shape if out.HasField("reshape") else out.dims
        # An output named like an input is that input's node (Triton's emplace).
        node = tensors.setdefault(out.name, _tensor(name, batching, out.data_type, dims))
        sink.prev.append(node)
        node.next.append(sink)

    for step, model in zip(config.ensemble_scheduling.step, step_configs):
        step_id = (
            f"{step.model_namespace}::{step.model_name}"
            if step.model_namespace
            else (step.model_name)
        )
        # A batching ensemble may hold non-batching models (their full shapes
        # must agree), not models that batch less (ensemble_utils.cc:293).
        if 0 < model.max_batch_size < config.max_batch_size:
            raise InvalidArgument(
                f"ensemble {name} allows maximum batch size {config.max_batch_size}, but it "
                f"contains model {step.model_name} which only allows maximum batch size to "
                f"be {model.max_batch_size}"
            )
        _map_step(name, step_id, step, model, tensors)
    return _label_decoupled(name, config, tensors)


def _label_decoupled(name: str, config: ModelConfig, tensors: dict[str, _Node]) -> bool:
    """ensemble_utils.cc:308-365: walk from the inputs; each tensor takes the
    label of the decoupled step it descends from (a new label per decoupled
    step, shared by a step's outputs), and the tensors a step reads must all
    carry one label."""
    labels = 0
    queue: deque[_Node] = deque()
    for spec in config.input:
        tensors[spec.name].visited = True
        queue.append(tensors[spec.name])
    while queue:
        current = queue.popleft()
        for node in current.next:
            if node.visited or not all(p.visited for p in node.prev):
                continue
            label = node.prev[0].label
            if any(p.label != label for p in node.prev):
                raise InvalidArgument(
                    f"in ensemble {name}, step of model '{node.model}' receives inputs "
                    "originated from different decoupled models"
                )
            if node.sibling is not None and node.sibling.visited:
                node.label = node.sibling.label
            else:
                if node.decoupled:
                    labels += 1
                node.label = labels if node.decoupled else label
                if node.sibling is not None:
                    node.sibling.label = node.label
                    node.sibling.visited = True
            node.visited = True
            queue.append(node)
    return labels != 0
