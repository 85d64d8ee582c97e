"""CUDA graphs of the PyTorch backend (``optimization { cuda { graphs: true } }``):
which graphs a config asks for, and a captured graph.

The fields are Triton's (``optimization.cuda.graphs``, ``graph_spec``,
``graph_lower_bound``), which its TensorRT backend reads (qa/L0_cuda_graph). A
TorchScript instance captures and replays them
(:meth:`trionserve.backends.pytorch_instance.TorchScriptInstance.capture_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trionserve.core.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class GraphShape:
    """One CUDA graph to capture: it serves batches of ``lower``..``batch_size``
    (padded to ``batch_size``; 0 for a model without batching), with these
    per-item input shapes."""

    batch_size: int
    lower: int
    inputs: dict[str, tuple[int, ...]]


def cuda_graph_shapes(config) -> list[GraphShape] | None:
    """The graphs ``optimization.cuda`` asks for, smallest first; None: no graphs.

    With ``graph_spec``, one graph per entry: its ``batch_size``, serving batches
    down to ``graph_lower_bound.batch_size`` (Triton's TensorRT backend reads the
    same fields; qa/L0_cuda_graph), its ``input`` shapes where the config's dims
    are variable. Without, one graph per power of two up to ``max_batch_size`` and
    ``max_batch_size`` itself, each serving the batches above the one before it,
    which needs every input's dims fixed in the config.
    """
    cuda = config.optimization.cuda
    if not cuda.graphs:
        return None
    fixed = {
        i.name: tuple(i.reshape.shape if i.HasField("reshape") else i.dims) for i in config.input
    }
    if cuda.graph_spec:
        shapes = []
        for spec in cuda.graph_spec:
            inputs = {}
            for name, dims in fixed.items():
                given = spec.input.get(name)
                shape = tuple(given.dim) if given is not None and given.dim else dims
                if any(d < 0 for d in shape):
                    raise InvalidArgument(
                        f"model '{config.name}': optimization.cuda.graph_spec for batch size "
                        f"{spec.batch_size} needs the shape of input '{name}', whose dims "
                        f"{list(dims)} are variable"
                    )
                inputs[name] = shape
            lower = spec.batch_size
            if spec.HasField("graph_lower_bound") and spec.graph_lower_bound.batch_size:
                lower = min(spec.graph_lower_bound.batch_size, spec.batch_size)
            shapes.append(GraphShape(spec.batch_size, lower, inputs))
        return sorted(shapes, key=lambda g: g.batch_size)
    if any(d < 0 for dims in fixed.values() for d in dims):
        return []  # variable shapes and no graph_spec: nothing to capture
    if config.max_batch_size <= 0:
        return [GraphShape(0, 0, fixed)]
    sizes, size = [], 1
    while size < config.max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(config.max_batch_size)
    shapes, previous = [], 0
    for size in sizes:
        shapes.append(GraphShape(size, previous + 1, fixed))
        previous = size
    return shapes


@dataclass(slots=True)
class CapturedGraph:
    """A captured forward(): its shape, the graph, its static inputs and outputs
    (which the next replay overwrites: a batch's outputs are copied out, on the
    instance's stream, before it replays again). ``batch_major``: every output's
    first dimension is the batch, so a padded batch's rows can be sliced back."""

    shape: GraphShape
    graph: Any
    inputs: dict
    outputs: dict
    batch_major: bool = True
