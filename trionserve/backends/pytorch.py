"""PyTorch backend: platform ``pytorch_libtorch`` / backend ``pytorch`` (TorchScript);
platform ``torch_aoti`` (PyTorch 2 ``model.pt2``) is in :mod:`.pytorch2`.

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
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.backends.batch_tensors import (
    HostBuffers,
    build_responses,
    gather_inputs,
    wanted_outputs,
)
from trionserve.core import datatypes
from trionserve.core.errors import InternalError, InvalidArgument, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest
from trionserve.observability.statistics import ComputeTimes

if TYPE_CHECKING:
    from trionserve.backends.pytorch2 import Pt2Model

log = structlog.get_logger(__name__)

# Config data types the backend can carry, as torch dtype attribute names. Like
# Triton's, it has no unsigned types above 8 bits; BYTES would need List[str].
_TORCH_DTYPES = {
    "TYPE_BOOL": "bool",
    "TYPE_UINT8": "uint8",
    "TYPE_INT8": "int8",
    "TYPE_INT16": "int16",
    "TYPE_INT32": "int32",
    "TYPE_INT64": "int64",
    "TYPE_FP16": "float16",
    "TYPE_FP32": "float32",
    "TYPE_FP64": "float64",
    "TYPE_BF16": "bfloat16",
}
_INDEX_DELIMITER = "__"
# Triton's platform for PyTorch 2 (AOTInductor) models; see pytorch2.py.
PT2_PLATFORM = "torch_aoti"


def _import_torch():
    import torch

    return torch


def _torch():
    """torch, or Unavailable naming the missing package (torch is an optional extra)."""
    try:
        return _import_torch()
    except ImportError as exc:
        raise Unavailable(
            f"the PyTorch backend needs torch, which is not installed "
            f"(install the 'torch' extra): {exc}"
        ) from None


# -- Triton's naming conventions (pure: unit-testable without torch) ------------------


def name_index(name: str) -> int | None:
    """The index of a ``<name>__<index>`` tensor name, else None (Triton's rule:
    everything after the first ``__`` must be digits)."""
    head, sep, tail = name.partition(_INDEX_DELIMITER)
    if not sep or not tail.isdigit():
        return None
    return int(tail)


@dataclass(frozen=True, slots=True)
class InputBinding:
    """How config inputs become forward() arguments."""

    as_dict: bool  # forward takes one Dict[str, Tensor] holding every input
    positions: dict[str, int]  # config input name -> argument position


def bind_inputs(
    model: str, config_inputs: list[str], arguments: list[tuple[str, str]]
) -> InputBinding:
    """Match config inputs to forward's ``(name, type kind)`` arguments (self excluded)."""
    if not config_inputs:
        raise InvalidArgument(
            f"model '{model}': the PyTorch backend cannot read a TorchScript model's "
            "inputs; list them in config.pbtxt (no input was given)"
        )
    if len(arguments) == 1 and arguments[0][1] == "DictType":
        return InputBinding(True, {name: i for i, name in enumerate(config_inputs)})
    for arg_name, kind in arguments:
        if kind != "TensorType":
            raise InvalidArgument(
                f"model '{model}': forward() argument '{arg_name}' is a {kind}; the "
                "PyTorch backend supports Tensor arguments or a single "
                "Dict(str, Tensor) argument"
            )
    if len(arguments) != len(config_inputs):
        raise InvalidArgument(
            f"unable to load model '{model}', configuration expects "
            f"{len(config_inputs)} inputs, model provides {len(arguments)}"
        )
    names = [a for a, _ in arguments]
    if all(name in names for name in config_inputs):
        return InputBinding(False, {name: names.index(name) for name in config_inputs})
    indices = [i for i in map(name_index, config_inputs) if i is not None]
    if len(indices) == len(config_inputs):
        if sorted(indices) != list(range(len(arguments))):
            raise InvalidArgument(
                f"model '{model}': input indices {sorted(indices)} do not match "
                f"forward()'s {len(arguments)} arguments"
            )
        return InputBinding(False, dict(zip(config_inputs, indices)))
    return InputBinding(False, {name: i for i, name in enumerate(config_inputs)})


def bind_outputs(model: str, config_outputs: list[str]) -> dict[str, int]:
    """Config output name -> position in the returned tuple."""
    if not config_outputs:
        raise InvalidArgument(
            f"model '{model}': the PyTorch backend cannot read a TorchScript model's "
            "outputs; list them in config.pbtxt (no output was given)"
        )
    indices = [i for i in map(name_index, config_outputs) if i is not None]
    if len(indices) == len(config_outputs):
        return dict(zip(config_outputs, indices))
    return {name: i for i, name in enumerate(config_outputs)}


def _type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


def _check_data_types(model: str, kind: str, entries) -> None:
    for entry in entries:
        type_name = _type_name(entry.data_type)
        if type_name == "TYPE_STRING":
            raise InvalidArgument(
                f"model '{model}': {kind} '{entry.name}' is TYPE_STRING; the PyTorch "
                "backend does not support BYTES tensors"
            )
        if type_name not in _TORCH_DTYPES:
            raise InvalidArgument(
                f"unsupported datatype {type_name} for {kind} '{entry.name}' for model '{model}'"
            )


# -- CUDA graphs (optimization { cuda { graphs: true } }) ---------------------------------


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

    def auto_complete_config(self, config, model_path: Path, max_batch_size_set: bool) -> None:
        """Nothing to fill: TorchScript does not record its tensors (as in Triton)."""
        if not config.input or not config.output:
            log.warning(
                "skipping model configuration auto-complete: not supported for the pytorch backend",
                model=config.name,
            )

    def load(self, context: ModelContext) -> TorchScriptModel | Pt2Model:
        _torch()  # a server without torch reports the model UNAVAILABLE, with why
        config = context.config
        filename = config.default_model_filename or self.default_model_filename()
        path = context.version_dir / filename
        if not path.is_file():
            raise Unavailable(
                f"model file '{filename}' not found in version {context.version} "
                f"of model '{context.name}' ({context.version_dir.name}/)"
            )
        _check_data_types(context.name, "input", config.input)
        _check_data_types(context.name, "output", config.output)
        if config.platform == PT2_PLATFORM:
            from trionserve.backends.pytorch2 import Pt2Model, archive_kind, check_sequence_types

            for kind, entries in (("input", config.input), ("output", config.output)):
                if not entries:
                    raise InvalidArgument(
                        f"model '{context.name}': list the model's {kind}s in "
                        f"config.pbtxt (no {kind} was given)"
                    )
            check_sequence_types(context.name, config)
            archive_kind(context.name, path)  # a file that is no PyTorch 2 archive fails here
            return Pt2Model(context, path)
        if not config.input:
            bind_inputs(context.name, [], [])  # raises: the config must list inputs
        bind_outputs(context.name, [o.name for o in config.output])
        return TorchScriptModel(context, path)


def _parameter(config, key: str, default: bool) -> bool:
    if key not in config.parameters:
        return default
    return config.parameters[key].string_value.strip().lower() in ("1", "true", "yes", "on")


def instance_device(spec: InstanceSpec, model_name: str) -> Any:
    """The torch device an instance of ``spec`` runs on; None for KIND_MODEL (the
    model keeps the devices it was saved with)."""
    torch = _torch()
    if spec.kind == "KIND_GPU":
        if not torch.cuda.is_available():
            raise Unavailable(
                f"instance '{spec.name}' of model '{model_name}' is KIND_GPU "
                "but this torch cannot use CUDA (a CPU-only build of torch?)"
            )
        return torch.device("cuda", spec.device_id)
    if spec.kind == "KIND_MODEL":
        return None
    return torch.device("cpu")


class TorchScriptModel:
    """A TorchScript file and its config; each instance loads its own module."""

    def __init__(self, context: ModelContext, path: Path) -> None:
        self.context = context
        self.path = path

    def create_instance(self, spec: InstanceSpec) -> TorchScriptInstance:
        torch = _torch()
        device = instance_device(spec, self.context.name)
        try:
            module = torch.jit.load(str(self.path), map_location=device)
        except Exception as exc:  # torch raises RuntimeError and friends
            raise InvalidArgument(
                f"failed to load TorchScript model '{self.context.name}' from "
                f"{self.context.version_dir.name}/{self.path.name}: {exc}"
            ) from None
        module.eval()
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
        pass


class _TorchBatch:
    """One batch between the steps of :class:`TorchScriptInstance`."""

    __slots__ = (
        "names",
        "tensors",
        "outputs",
        "copied",
        "done",
        "error",
        "started",
        "staged",
        "launched",
    )

    def __init__(self, started: int) -> None:
        self.names: list[str] = []
        self.tensors: dict = {}
        self.outputs: dict = {}
        self.copied: Any = None  # a CUDA event recorded after the inputs' copy in
        self.done: Any = None  # a CUDA event recorded after the outputs' copy to the host
        self.error: TritonError | None = None
        self.started = self.staged = self.launched = started


@dataclass(slots=True)
class _CapturedGraph:
    """A captured forward(): its shape, the graph, its static inputs and outputs."""

    shape: GraphShape
    graph: Any
    inputs: dict
    outputs: dict


class _Both:
    """Two context managers as one (entered in order, left in reverse)."""

    def __init__(self, first, second) -> None:
        self._first, self._second = first, second

    def __enter__(self) -> None:
        self._first.__enter__()
        self._second.__enter__()

    def __exit__(self, *exc) -> None:
        self._second.__exit__(*exc)
        self._first.__exit__(*exc)


def _pinned_bytes(torch):
    """An allocator of pinned host byte buffers (kept alive by their numpy views)."""

    def allocate(nbytes: int) -> np.ndarray:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    return allocate


class TorchScriptInstance:
    """One TorchScript module on one device; executes one batch at a time.

    Its batches run in three steps (``stage``, ``launch``, ``finish``: a
    :class:`~trionserve.backends.base.StagedBackendInstance`) whose times are
    Triton's compute_input, compute_infer and compute_output.
    """

    def __init__(self, context: ModelContext, spec: InstanceSpec, torch, module, device):
        config = context.config
        self.spec = spec
        self.model_name = context.name
        self.model_version = str(context.version)
        self._torch = torch
        self._module = module
        # KIND_MODEL: inputs start on the CPU and the module moves them itself.
        self._device = device if device is not None else torch.device("cpu")
        self._bf16_inputs = {i.name for i in config.input if _type_name(i.data_type) == "TYPE_BF16"}
        self._input_types = {i.name: _type_name(i.data_type) for i in config.input}
        self._output_types = {o.name: _type_name(o.data_type) for o in config.output}
        self._output_datatypes = {
            name: datatypes.BY_CONFIG[t].wire for name, t in self._output_types.items()
        }
        self._input_reshape = {
            i.name: tuple(i.reshape.shape) for i in config.input if i.HasField("reshape")
        }
        self._output_reshape = {
            o.name: tuple(o.dims) for o in config.output if o.HasField("reshape")
        }
        self._bind(context, module)
        self._batched = config.max_batch_size > 0
        self._inference_mode = _parameter(config, "INFERENCE_MODE", True)
        self._optimized = not _parameter(config, "DISABLE_OPTIMIZED_EXECUTION", False)
        # Set after each batch; the executor reads it for the statistics.
        self.compute_times: ComputeTimes | None = None
        # On a GPU: the instance's own streams, one computing and one copying
        # inputs in, and pinned host buffers to stage inputs in: the next batch
        # is gathered and copied while the device computes the current one.
        on_gpu = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if on_gpu else None
        self._copy_stream = torch.cuda.Stream(self._device) if on_gpu else None
        self.overlaps = on_gpu
        allocate = _pinned_bytes(torch) if self._stream is not None else None
        self._buffers = (
            (HostBuffers(allocate), HostBuffers(allocate))
            if allocate is not None
            else (HostBuffers(), HostBuffers())
        )
        self._slot = 0
        self._graphs: list[_CapturedGraph] = []  # smallest batch size first

    def _bind(self, context: ModelContext, module) -> None:
        """Match the config's inputs and outputs to forward()'s arguments and result."""
        arguments = [
            (a.name, a.type.kind())
            for a in module.forward.schema.arguments
            if a.type.kind() != "ClassType"  # self
        ]
        config = context.config
        self._inputs = bind_inputs(context.name, [i.name for i in config.input], arguments)
        self._outputs = bind_outputs(context.name, [o.name for o in config.output])

    def _execution(self):
        """The context forward() runs in (TorchScript's optimized execution flag)."""
        return self._torch.jit.optimized_execution(self._optimized)

    def execute(self, requests: list[InferenceRequest]) -> list:
        """Run one batch (the three steps below in a row)."""
        return self.finish(requests, self.launch(requests, self.stage(requests)))

    def stage(self, requests: list[InferenceRequest]) -> _TorchBatch:
        """The batch's input tensors on the instance's device.

        On a GPU, the inputs are gathered into this batch's pinned host buffers and
        copied to the device on the instance's copy stream, without waiting (the
        compute stream waits for that copy in ``launch``), so the copy overlaps
        the batch computing before it. On the
        CPU a batch of several requests is gathered into reusable host buffers; a
        single request's writable array is shared with torch as it is.
        """
        started = time.perf_counter_ns()
        batch = _TorchBatch(started)
        try:
            self._slot ^= 1
            arrays = gather_inputs(
                requests,
                self._input_reshape,
                buffers=self._buffers[self._slot],
                always_copy=self._stream is not None,
            )
            batch.names = wanted_outputs(requests, list(self._output_datatypes))
            with self._on_device(self._copy_stream):
                batch.tensors = {name: self._to_tensor(name, a) for name, a in arrays.items()}
                if self._copy_stream is not None:
                    copied = self._torch.cuda.Event()
                    copied.record(self._copy_stream)
                    batch.copied = copied
        except TritonError as error:
            batch.error = error
        except Exception as exc:  # torch raises its own exception types
            batch.error = self._failure(exc)
        batch.staged = time.perf_counter_ns()
        return batch

    def launch(self, requests: list[InferenceRequest], batch: _TorchBatch) -> _TorchBatch:
        """Run forward(); on a GPU, start the outputs' copy back to pinned host
        memory and return without waiting for the device."""
        batch.launched = time.perf_counter_ns()
        if batch.error is not None:
            return batch
        torch = self._torch
        grad_mode = torch.inference_mode() if self._inference_mode else torch.no_grad()
        try:
            with grad_mode, self._on_device(), self._execution():
                if batch.copied is not None:
                    # The compute stream waits for the inputs' copy; the inputs,
                    # allocated on the copy stream, are in use on this one too.
                    assert self._stream is not None
                    self._stream.wait_event(batch.copied)
                    for tensor in batch.tensors.values():
                        tensor.record_stream(self._stream)
                size = sum(r.batch_size for r in requests) if self._batched else 0
                captured = self._graph_for(size, batch.tensors) if self._graphs else None
                if captured is not None:
                    outputs = self._replay(captured, batch.tensors, size)
                    batch.outputs = {name: outputs[name] for name in batch.names}
                else:
                    result = self._forward(batch.tensors)
                    batch.outputs = {name: self._output(name, result) for name in batch.names}
                if self._stream is not None:
                    batch.outputs = {
                        name: tensor.to("cpu", non_blocking=True)
                        for name, tensor in batch.outputs.items()
                    }
                    done = torch.cuda.Event()
                    done.record(self._stream)
                    batch.done = done
        except TritonError as error:
            batch.error = error
        except Exception as exc:
            batch.error = self._failure(exc)
        batch.tensors = {}
        return batch

    def finish(self, requests: list[InferenceRequest], batch: _TorchBatch) -> list:
        """Wait for the device, then one response per request; ``compute_times``
        for the batch (compute_infer runs from forward() to the outputs on the host)."""
        self.compute_times = None
        try:
            if batch.done is not None:
                batch.done.synchronize()
            inferred = time.perf_counter_ns()
            if batch.error is not None:
                return [batch.error] * len(requests)
            outputs = {name: self._to_numpy(tensor) for name, tensor in batch.outputs.items()}
            if self._batched and len(requests) > 1:
                self._check_batch(outputs, sum(r.batch_size for r in requests))
        except TritonError as error:
            return [error] * len(requests)
        except Exception as exc:
            return [self._failure(exc)] * len(requests)
        responses = build_responses(
            requests,
            self.model_name,
            self.model_version,
            outputs,
            self._output_datatypes,
            self._output_reshape,
        )
        self.compute_times = ComputeTimes(
            batch.staged - batch.started,
            inferred - batch.launched,
            time.perf_counter_ns() - inferred,
        )
        return responses

    @property
    def on_gpu(self) -> bool:
        return self._stream is not None

    def capture_graphs(self, shapes: list[GraphShape]) -> None:
        """Capture forward() as a CUDA graph per shape, on the instance's stream.

        Each graph has static input tensors that a batch is copied into (padded
        to the graph's batch size) before a replay, and static outputs that are
        sliced back to the batch. The graphs share one memory pool, captured
        largest first. A graph that cannot be captured (a model that syncs with
        the host, say) is logged and its batches run without one.
        """
        torch = self._torch
        stream = self._stream
        assert stream is not None  # a GPU instance
        pool = torch.cuda.graph_pool_handle()
        grad_mode = torch.inference_mode() if self._inference_mode else torch.no_grad()
        captured = []
        for shape in sorted(shapes, key=lambda g: g.batch_size, reverse=True):
            try:
                with grad_mode, self._on_device(), self._execution():
                    inputs = {
                        name: torch.zeros(
                            ((shape.batch_size,) if self._batched else ()) + dims,
                            dtype=self._input_dtype(name),
                            device=self._device,
                        )
                        for name, dims in shape.inputs.items()
                    }
                    for _ in range(3):  # warm up on the stream before capturing
                        self._forward(inputs)
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        result = self._forward(inputs)
                    outputs = {name: self._output(name, result) for name in self._outputs}
            except Exception as exc:
                log.warning(
                    "CUDA graph capture failed; batches of this size run without a graph",
                    model=self.model_name,
                    instance=self.spec.name,
                    batch_size=shape.batch_size,
                    error=f"{type(exc).__name__}: {exc}",
                )
                continue
            captured.append(_CapturedGraph(shape, graph, inputs, outputs))
            log.info(
                "captured CUDA graph",
                model=self.model_name,
                instance=self.spec.name,
                batch_size=shape.batch_size,
                serves=f"{shape.lower}..{shape.batch_size}",
            )
        self._graphs = sorted(captured, key=lambda g: g.shape.batch_size)

    def _graph_for(self, size: int, tensors: dict) -> _CapturedGraph | None:
        """The smallest captured graph that serves a batch of ``size`` with these
        inputs' shapes, if any."""
        skip = 1 if self._batched else 0
        for captured in self._graphs:
            shape = captured.shape
            if not (shape.lower <= size <= shape.batch_size or shape.batch_size == 0):
                continue
            if all(tuple(t.shape[skip:]) == shape.inputs.get(n) for n, t in tensors.items()):
                return captured
        return None

    def _replay(self, captured: _CapturedGraph, tensors: dict, size: int) -> dict:
        """Copy the batch into the graph's inputs, replay it, and the outputs of
        this batch (views of the graph's static outputs, sliced to ``size``)."""
        for name, tensor in tensors.items():
            static = captured.inputs[name]
            (static[:size] if self._batched else static).copy_(tensor, non_blocking=True)
        captured.graph.replay()
        if not self._batched:
            return dict(captured.outputs)
        return {name: output[:size] for name, output in captured.outputs.items()}

    def _input_dtype(self, name: str):
        torch = self._torch
        config_type = self._input_types[name]
        return getattr(torch, _TORCH_DTYPES[config_type])

    def _failure(self, exc: Exception) -> InternalError:
        return InternalError(f"PyTorch execute failure for model '{self.model_name}': {exc}")

    def _on_device(self, stream=None):
        """New tensors a model creates on "cuda" land on this instance's GPU, and
        its work goes to the instance's own stream (``stream``: another of its own)."""
        if self._stream is None:
            return nullcontext()
        torch = self._torch
        return _Both(torch.cuda.device(self._device), torch.cuda.stream(stream or self._stream))

    def _forward(self, tensors: dict):
        if self._inputs.as_dict:
            return self._module(tensors)
        missing = [name for name in self._inputs.positions if name not in tensors]
        if missing:
            raise InvalidArgument(
                f"model '{self.model_name}' needs input(s) {missing}: every forward() "
                "argument must be given"
            )
        args = [None] * len(self._inputs.positions)
        for name, position in self._inputs.positions.items():
            args[position] = tensors[name]
        return self._module(*args)

    def _to_tensor(self, name: str, array: np.ndarray):
        torch = self._torch
        # torch has no read-only tensors, and a model may write its inputs in place:
        # a single request's array viewing an immutable request body (read-only) is
        # copied; writable ones (gathered batches, shared memory) are shared.
        if not array.flags.writeable or any(s < 0 for s in array.strides):
            array = np.array(array)
        tensor = torch.from_numpy(array)
        if name in self._bf16_inputs:  # BF16 travels as uint16 bits
            tensor = tensor.view(torch.bfloat16)
        if self._device.type != "cpu":
            tensor = tensor.to(self._device, non_blocking=True)
        return tensor

    def _output(self, name: str, result):
        """The output tensor ``name`` of forward()'s result, its type checked."""
        tensor = self._select(name, result)
        torch = self._torch
        if not isinstance(tensor, torch.Tensor):
            raise InternalError(
                f"output '{name}' of model '{self.model_name}' is a "
                f"{type(tensor).__name__}, not a Tensor"
            )
        expected = self._output_types[name]
        if tensor.dtype != getattr(torch, _TORCH_DTYPES[expected]):
            raise InternalError(
                f"configuration expects datatype {expected} for output '{name}' of "
                f"model '{self.model_name}', model provides {tensor.dtype}"
            )
        return tensor.detach()

    def _to_numpy(self, tensor) -> np.ndarray:
        torch = self._torch
        # On the CPU .numpy() shares the tensor's memory: no copy, unless it is an
        # input's (a model that returns an input), whose buffer the next batches reuse.
        tensor = tensor.cpu()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: keep the bits
            array = tensor.view(torch.int16).numpy().view(np.uint16)
        else:
            array = tensor.numpy()
        if self._buffers[0].holds(array) or self._buffers[1].holds(array):
            array = array.copy()
        return array

    def _select(self, name: str, result):
        if isinstance(result, dict):
            if name not in result:
                raise InternalError(
                    f"model '{self.model_name}' returned a dict without output "
                    f"'{name}'; it has {sorted(result)}"
                )
            return result[name]
        if isinstance(result, self._torch.Tensor):
            result = (result,)
        if not isinstance(result, (tuple, list)):
            raise InternalError(
                f"model '{self.model_name}' returned a {type(result).__name__}; "
                "expected a Tensor, a tuple of Tensors or a Dict[str, Tensor]"
            )
        position = self._outputs[name]
        if position >= len(result):
            raise InternalError(
                f"model '{self.model_name}' returned {len(result)} output(s); output "
                f"'{name}' is at index {position}"
            )
        return result[position]

    def _check_batch(self, outputs: dict[str, np.ndarray], total: int) -> None:
        for name, array in outputs.items():
            if array.ndim == 0 or array.shape[0] != total:
                raise InternalError(
                    f"output '{name}' of model '{self.model_name}' has shape "
                    f"{list(array.shape)}; a batch of {total} needs {total} rows"
                )

    def close(self) -> None:
        self._module = None
