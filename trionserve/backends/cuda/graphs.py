"""CUDA graphs (``optimization { cuda { graphs: true } }``): which graphs a config
asks for, and a captured graph. Shared by the PyTorch and TensorRT backends.

The fields are Triton's (``optimization.cuda.graphs``, ``graph_spec``,
``graph_lower_bound``), which its TensorRT backend reads (qa/L0_cuda_graph). The
two backends read ``graph_spec`` the same way; without it they differ:
:func:`cuda_graph_shapes` (PyTorch, which Triton does not capture for) covers every
batch size with powers of two, :func:`tensorrt_graph_shapes` captures the batch
sizes Triton's TensorRT backend does, each serving only its own size. A TorchScript
instance captures and replays them
(:meth:`trionserve.backends.pytorch.instance.TorchScriptInstance.capture_graphs`),
a TensorRT instance too
(:meth:`trionserve.backends.tensorrt.instance.TensorRTInstance.capture_graphs`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import structlog

from trionserve.core.errors import InvalidArgument

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelOptimizationPolicy

    GraphSpec: TypeAlias = ModelOptimizationPolicy.Cuda.GraphSpec

log = structlog.get_logger(__name__)

# "Within a process, only one capture may be underway at a time" (torch's CUDA
# graphs notes): instances of models loading side by side take turns capturing.
# The CUDA context is the process's, so this lock is too.
CAPTURE_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class GraphShape:
    """One CUDA graph to capture: it serves batches of ``lower``..``batch_size``
    (padded to ``batch_size``; 0 for a model without batching), with these
    per-item input shapes."""

    batch_size: int
    lower: int
    inputs: dict[str, tuple[int, ...]]


def _spec_inputs(entry: GraphSpec | GraphSpec.LowerBound) -> dict[str, tuple[int, ...]]:
    """A graph_spec's (or its lower bound's) ``input`` shapes, by input name."""
    return {name: tuple(shape.dim) for name, shape in entry.input.items()}


def cuda_graph_shapes(config: ModelConfig) -> list[GraphShape] | None:
    """The graphs ``optimization.cuda`` asks of a PyTorch model, smallest first;
    None: no graphs.

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
            given = _spec_inputs(spec)
            inputs = {}
            for name, dims in fixed.items():
                shape = given.get(name) or dims
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


def _default_tensorrt_batch_sizes(config: ModelConfig) -> list[int]:
    """The batch sizes Triton's TensorRT backend captures without graph_spec
    (tensorrt_backend src/instance_state.cc, InitializeGraphSpecs): 1 and the
    dynamic batcher's preferred sizes (or the oldest sequence batcher's), else
    1, 2, 3, 4, 6, 8, 12 and 16; and max_batch_size; none above it. 0 alone for a
    model without batching."""
    max_batch = config.max_batch_size
    if max_batch <= 0:
        return [0]
    sizes = {1}
    if config.HasField("dynamic_batching"):
        sizes.update(config.dynamic_batching.preferred_batch_size)
    elif config.HasField("sequence_batching") and config.sequence_batching.HasField("oldest"):
        sizes.update(config.sequence_batching.oldest.preferred_batch_size)
    else:
        sizes.update((1, 2, 3, 4, 6, 8, 12, 16))
    sizes.add(max_batch)
    return sorted(size for size in sizes if size <= max_batch)


def _check_tensorrt_spec(config: ModelConfig, spec: GraphSpec) -> None:
    """Triton's ValidateGraphSpec: a bad graph_spec fails the load."""
    model, max_batch = config.name, config.max_batch_size
    lower = spec.graph_lower_bound
    has_lower = spec.HasField("graph_lower_bound")
    lower_batch = lower.batch_size if has_lower else spec.batch_size
    where = f"model '{model}': optimization.cuda.graph_spec for batch size {spec.batch_size}"
    if max_batch <= 0:
        if spec.batch_size != 0 or lower_batch != 0:
            raise InvalidArgument(
                f"{where}: graph spec expects 'batch_size' to be 0 if 'max_batch_size' is 0"
            )
    elif not (1 <= spec.batch_size <= max_batch and 1 <= lower_batch <= max_batch):
        raise InvalidArgument(
            f"{where}: graph spec expects 'batch_size' (and graph_lower_bound's) to be "
            f">= 1 and <= {max_batch}"
        )
    if lower_batch > spec.batch_size:
        raise InvalidArgument(
            f"{where}: graph_lower_bound expects 'batch_size' <= {spec.batch_size}, "
            f"got {lower_batch}"
        )
    shapes = _spec_inputs(spec)
    lower_shapes = _spec_inputs(lower) if has_lower else shapes
    for name, dims in shapes.items():
        bound = lower_shapes.get(name)
        if bound is None:
            raise InvalidArgument(f"{where}: graph_lower_bound expects a shape for input '{name}'")
        if len(bound) != len(dims):
            raise InvalidArgument(
                f"{where}: graph_lower_bound expects input '{name}' to have {len(dims)} "
                f"dimensions, got {len(bound)}"
            )
        if any(d < 0 for d in (*dims, *bound)):
            raise InvalidArgument(f"{where}: input '{name}' needs dimensions >= 0")
        if any(b > d for b, d in zip(bound, dims, strict=True)):
            raise InvalidArgument(
                f"{where}: graph_lower_bound expects input '{name}' to have dimensions "
                f"<= {list(dims)}, got {list(bound)}"
            )


def tensorrt_graph_shapes(
    config: ModelConfig, opt_shapes: dict[str, tuple[int, ...]]
) -> list[GraphShape] | None:
    """The graphs ``optimization.cuda`` asks of a TensorRT model, smallest first;
    None: no graphs. ``opt_shapes``: each engine input's per-item shape at its
    optimization profile's "opt" point (without the batch dimension when the model
    batches), which Triton's TensorRT backend captures where graph_spec names no
    input shapes (SetCudaGraphShape).

    Without graph_spec, the batch sizes of :func:`_default_tensorrt_batch_sizes`,
    each serving only batches of its size (Triton's default specs set the lower
    bound to the batch size). With graph_spec, one graph per entry, serving its
    ``batch_size`` down to ``graph_lower_bound.batch_size`` (padded); its ``input``
    shapes, or where it names none the "opt" shapes. A spec that names some
    inputs but not every engine input is kept with those only (its capture fails
    and is logged, as Triton's does). The lower bound's input shapes are checked
    as Triton checks them; a batch must have the graph's per-item shapes (see
    docs/backends.md for why this differs from Triton).
    """
    cuda = config.optimization.cuda
    if not cuda.graphs:
        return None
    if not cuda.graph_spec:
        return [
            GraphShape(size, size, dict(opt_shapes))
            for size in _default_tensorrt_batch_sizes(config)
        ]
    shapes = []
    for spec in cuda.graph_spec:
        _check_tensorrt_spec(config, spec)
        given = _spec_inputs(spec)
        lower = spec.graph_lower_bound.batch_size if spec.HasField("graph_lower_bound") else 0
        shapes.append(
            GraphShape(spec.batch_size, lower or spec.batch_size, given or dict(opt_shapes))
        )
    return sorted(shapes, key=lambda g: g.batch_size)


@dataclass(slots=True)
class CapturedGraph:
    """A captured graph: its shape, the graph, its static inputs and outputs
    (which the next replay overwrites: a batch's outputs are copied out, on the
    instance's stream, before it replays again). ``batch_major``: every output's
    first dimension is the batch, so a padded batch's rows can be sliced back."""

    shape: GraphShape
    graph: Any
    inputs: dict
    outputs: dict
    batch_major: bool = True


def captured_graph(
    shape: GraphShape,
    graph: Any,
    inputs: dict,
    outputs: dict,
    batched: bool,
    **where: str,
) -> CapturedGraph:
    """A graph as captured, logged with ``where`` (model, instance). One whose
    outputs are not batch-major (their first dimension is not the graph's batch
    size) serves only batches of exactly its size: padding would change such
    outputs and slicing would cut the wrong dimension."""
    batch_major = not batched or all(
        len(output.shape) > 0 and output.shape[0] == shape.batch_size for output in outputs.values()
    )
    if not batch_major:
        shape = GraphShape(shape.batch_size, shape.batch_size, shape.inputs)
    log.info(
        "captured CUDA graph",
        **where,
        batch_size=shape.batch_size,
        serves=f"{shape.lower}..{shape.batch_size}",
        **({} if batch_major else {"why": "outputs are not batch-major: no padding"}),
    )
    return CapturedGraph(shape, graph, inputs, outputs, batch_major)


def log_capture_failure(shape: GraphShape, exc: Exception, **where: str) -> None:
    """A graph that could not be captured: its batches run without one."""
    log.warning(
        "CUDA graph capture failed; batches of this size run without a graph",
        **where,
        batch_size=shape.batch_size,
        error=f"{type(exc).__name__}: {exc}",
    )
