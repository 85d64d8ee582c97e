"""A TorchScript module on one device, executing batches: staging inputs,
forward() (or a captured CUDA graph's replay), outputs back to the host.

Triton's pytorch backend ``ModelInstanceState`` (``src/libtorch.cc``: Execute,
SetInputTensors, ReadOutputTensors). Loading the module and choosing its device are
in :mod:`trionserve.backends.pytorch.backend`, the tensor matching in
:mod:`trionserve.backends.pytorch.naming`, the graphs' shapes in
:mod:`trionserve.backends.cuda.graphs`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import structlog

from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.batch_io import BatchTensors
from trionserve.backends.batch_tensors import (
    build_responses,
    gather_inputs,
    wanted_outputs,
)
from trionserve.backends.cuda.graphs import (
    CAPTURE_LOCK,
    CapturedGraph,
    GraphShape,
    captured_graph,
    log_capture_failure,
)
from trionserve.backends.cuda.pipeline import HostBuffers, pinned_bytes
from trionserve.backends.pytorch.naming import (
    TORCH_DTYPES,
    bind_inputs,
    bind_outputs,
    config_type_name,
)
from trionserve.backends.pytorch.parameters import TorchParameters
from trionserve.core import datatypes
from trionserve.core.errors import InternalError, InvalidArgument, TritonError
from trionserve.core.inference import InferenceRequest
from trionserve.observability.statistics import ComputeTimes

if TYPE_CHECKING:
    import torch

    # What forward() is given for one input: a tensor, or a List[str] (TYPE_STRING).
    TorchInput: TypeAlias = torch.Tensor | list[str]

log = structlog.get_logger(__name__)


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


class _Both:
    """Two context managers as one (entered in order, left in reverse)."""

    def __init__(
        self, first: AbstractContextManager[object], second: AbstractContextManager[object]
    ) -> None:
        self._first, self._second = first, second

    def __enter__(self) -> None:
        self._first.__enter__()
        self._second.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._second.__exit__(exc_type, exc, traceback)
        self._first.__exit__(exc_type, exc, traceback)


def _string_list(model: str, name: str, array: np.ndarray) -> list[str]:
    """A BYTES input as TorchScript's List[str], one string per element."""
    items = []
    for item in array.reshape(-1).tolist():
        if isinstance(item, str):
            items.append(item)
            continue
        try:
            items.append(bytes(item).decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"input '{name}' for model '{model}' holds a string that is not UTF-8; "
                "a TorchScript List[str] holds text"
            ) from None
    return items


def _bytes_array(items: Sequence[str | bytes]) -> np.ndarray:
    """A List[str] output as a BYTES array (one dimension, as Triton reads it)."""
    array = np.empty(len(items), dtype=object)
    array[:] = [item.encode("utf-8") if isinstance(item, str) else bytes(item) for item in items]
    return array


class TorchScriptInstance:
    """One TorchScript module on one device; executes one batch at a time.

    Its batches run in three steps (``stage``, ``launch``, ``finish``: a
    :class:`~trionserve.backends.cuda.pipeline.StagedBackendInstance`) whose times are
    Triton's compute_input, compute_infer and compute_output.
    """

    def __init__(
        self,
        context: ModelContext,
        spec: InstanceSpec,
        torch: ModuleType,
        module: torch.jit.ScriptModule,
        device: torch.device | None,
    ) -> None:
        config = context.config
        self.spec = spec
        self.model_name = context.name
        self.model_version = str(context.version)
        self._torch = torch
        # None once closed (a torch.jit.ScriptModule, or torch_aoti's program call).
        self._module: Any = module
        # KIND_MODEL: inputs start on the CPU and the module moves them itself.
        self._device = device if device is not None else torch.device("cpu")
        self._bf16_inputs = {
            i.name for i in config.input if config_type_name(i.data_type) == "TYPE_BF16"
        }
        self._input_types = {i.name: config_type_name(i.data_type) for i in config.input}
        self._output_types = {o.name: config_type_name(o.data_type) for o in config.output}
        # Implicit state outputs are produced for the sequence batcher, which keeps
        # them (and drops those the client did not ask for).
        for state in config.sequence_batching.state:
            self._input_types.setdefault(state.input_name, config_type_name(state.data_type))
            self._output_types.setdefault(state.output_name, config_type_name(state.data_type))
        # BYTES inputs and outputs are List[str] in TorchScript (Triton's
        # SetStringInputTensor / SetStringOutputBuffer).
        self._string_inputs = {n for n, t in self._input_types.items() if t == "TYPE_STRING"}
        self._output_datatypes = {
            name: datatypes.BY_CONFIG[t].wire for name, t in self._output_types.items()
        }
        self._input_reshape = {
            i.name: tuple(i.reshape.shape) for i in config.input if i.HasField("reshape")
        }
        self._output_reshape = {
            o.name: tuple(o.dims) for o in config.output if o.HasField("reshape")
        }
        self._ragged = frozenset(i.name for i in config.input if i.allow_ragged_batch)
        # batch_input tensors given to forward() with the inputs, batch_output ones
        # scattered back (pytorch_backend src/pt/model_instance_state.cc
        # SetInputTensors / ReadOutputTensors).
        self._batch_tensors = BatchTensors(context.name, config)
        self._bind(context, module)
        self._batched = config.max_batch_size > 0
        # The model's parameters (checked when it loaded: TorchScriptModel).
        self._parameters = TorchParameters.from_config(config, context.name)
        self._inference_mode = self._parameters.inference_mode
        self._optimized = self._parameters.optimized_execution
        # Set after each batch; the executor reads it for the statistics.
        self.compute_times: ComputeTimes | None = None
        # On a GPU: the instance's own streams, one computing and one copying
        # inputs in, and pinned host buffers to stage inputs in: the next batch
        # is gathered and copied while the device computes the current one.
        on_gpu = self._device.type == "cuda"
        # Triton's ClearCache: the CUDA caching allocator emptied after each
        # execute (ENABLE_CACHE_CLEANING) and when the instance closes, for a GPU
        # instance or a KIND_MODEL one on a host with GPUs.
        self._uses_cuda = on_gpu or (spec.kind == "KIND_MODEL" and bool(torch.cuda.is_available()))
        self._stream = torch.cuda.Stream(self._device) if on_gpu else None
        self._copy_stream = torch.cuda.Stream(self._device) if on_gpu else None
        self.overlaps = on_gpu
        allocate = pinned_bytes(torch) if self._stream is not None else None
        self._buffers = (
            (HostBuffers(allocate), HostBuffers(allocate))
            if allocate is not None
            else (HostBuffers(), HostBuffers())
        )
        self._slot = 0
        # Per slot, the event recorded after the last copy that read its pinned
        # buffers: they are written again only once that copy is done. Stream
        # order does not say so: the copy runs on the copy stream, and a batch
        # whose forward() failed was never waited for on the host.
        self._slot_copied: list[Any] = [None, None]
        self._graphs: list[CapturedGraph] = []  # smallest batch size first

    def _bind(self, context: ModelContext, module: torch.jit.ScriptModule) -> None:
        """Match the config's inputs and outputs to forward()'s arguments and result."""
        # A scripted method carries its TorchScript schema (torch types forward as a
        # plain callable).
        forward: Any = module.forward
        arguments = [
            (a.name, a.type.kind())
            for a in forward.schema.arguments
            if a.type.kind() != "ClassType"  # self
        ]
        config = context.config
        batching = config.sequence_batching
        self._inputs = bind_inputs(
            context.name,
            [i.name for i in config.input],
            arguments,
            controls=[c.name for c in batching.control_input],
            states=[s.input_name for s in batching.state],
            batch_inputs=self._batch_tensors.input_names,
        )
        self._outputs = bind_outputs(
            context.name, [o.name for o in config.output], [s.output_name for s in batching.state]
        )

    def _execution(self) -> AbstractContextManager[object]:
        """The context forward() runs in: TorchScript's optimized execution flag
        (thread-local), after the process-wide flags Triton's Execute sets before
        each forward (cuDNN; the JIT's where the model names them)."""
        self._parameters.set_process_flags(self._torch, jit=True)
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
            slot = self._slot
            previous = self._slot_copied[slot]
            if previous is not None:
                # The slot's pinned buffers are still read by that copy until it is done.
                self._slot_copied[slot] = None
                previous.synchronize()
            arrays = gather_inputs(
                requests,
                self._input_reshape,
                self._ragged,
                buffers=self._buffers[slot],
                always_copy=self._stream is not None,
            )
            if self._batch_tensors.inputs:
                arrays.update(self._batch_tensors.input_tensors(requests))
            batch.names = wanted_outputs(requests, list(self._output_datatypes))
            with self._on_device(self._copy_stream):
                try:
                    batch.tensors = {name: self._to_tensor(name, a) for name, a in arrays.items()}
                finally:  # also after a failed copy: the ones before it were enqueued
                    if self._copy_stream is not None:
                        copied = self._torch.cuda.Event()
                        copied.record(self._copy_stream)
                        batch.copied = self._slot_copied[slot] = copied
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
                        if not isinstance(tensor, list):  # List[str] stays on the host
                            tensor.record_stream(self._stream)
                size = sum(r.batch_size for r in requests) if self._batched else 0
                captured = (
                    self._graph_for(size, batch.tensors)
                    if self._graphs and not self._string_inputs
                    else None
                )
                if captured is not None:
                    outputs = self._replay(captured, batch.tensors, size)
                    batch.outputs = {name: outputs[name] for name in batch.names}
                else:
                    result = self._forward(batch.tensors)
                    batch.outputs = {name: self._output(name, result) for name in batch.names}
                if self._stream is not None:
                    batch.outputs = {
                        name: tensor
                        if isinstance(tensor, np.ndarray)
                        else tensor.to("cpu", non_blocking=True)
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
        for the batch (compute_infer runs from forward() to the outputs on the host).
        ENABLE_CACHE_CLEANING empties the CUDA cache after each batch, as Triton's
        TRITONBACKEND_ModelInstanceExecute does after every execute."""
        try:
            return self._finish(requests, batch)
        finally:
            if self._parameters.cache_cleaning and self._uses_cuda:
                self._torch.cuda.empty_cache()

    def _finish(self, requests: list[InferenceRequest], batch: _TorchBatch) -> list:
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
            responses = build_responses(
                requests,
                self.model_name,
                self.model_version,
                outputs,
                self._output_datatypes,
                self._output_reshape,
                self._batch_tensors,
            )
        except TritonError as error:
            return [error] * len(requests)
        except Exception as exc:
            return [self._failure(exc)] * len(requests)
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
        the host, say) is logged and its batches run without one. A graph whose
        outputs are not batch-major (their first dimension is not the graph's
        batch size) serves only batches of exactly its size: padding would change
        such outputs and slicing would cut the wrong dimension.

        Captures run one at a time in the process, in "thread_local" mode: the
        other instances' threads keep serving meanwhile, and their CUDA calls
        (a pinned buffer allocated, an event waited for) neither fail nor break
        this capture, which "global" mode makes them do.
        """
        with CAPTURE_LOCK:
            self._capture_graphs(shapes)

    def _capture_graphs(self, shapes: list[GraphShape]) -> None:
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
                    with torch.cuda.graph(
                        graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                    ):
                        result = self._forward(inputs)
                    outputs = {name: self._output(name, result) for name in self._outputs}
            except Exception as exc:
                log_capture_failure(shape, exc, model=self.model_name, instance=self.spec.name)
                continue
            captured.append(
                captured_graph(
                    shape,
                    graph,
                    inputs,
                    outputs,
                    self._batched,
                    model=self.model_name,
                    instance=self.spec.name,
                )
            )
        self._graphs = sorted(captured, key=lambda g: g.shape.batch_size)

    def _graph_for(self, size: int, tensors: dict) -> CapturedGraph | None:
        """The smallest captured graph that serves a batch of ``size`` with these
        inputs' shapes, if any."""
        skip = 1 if self._batched else 0
        for captured in self._graphs:
            shape = captured.shape
            if not (shape.lower <= size <= shape.batch_size or shape.batch_size == 0):
                continue
            if tensors.keys() != captured.inputs.keys():
                continue  # an input the graph reads would keep an earlier batch's data
            if all(tuple(t.shape[skip:]) == shape.inputs.get(n) for n, t in tensors.items()):
                return captured
        return None

    def _replay(self, captured: CapturedGraph, tensors: dict, size: int) -> dict:
        """Copy the batch into the graph's inputs, replay it, and the outputs of
        this batch (views of the graph's static outputs, sliced to ``size``)."""
        for name, tensor in tensors.items():
            static = captured.inputs[name]
            (static[:size] if self._batched else static).copy_(tensor, non_blocking=True)
        captured.graph.replay()
        if not self._batched or not captured.batch_major:
            return dict(captured.outputs)  # only ever replayed for its own batch size
        return {name: output[:size] for name, output in captured.outputs.items()}

    def _input_dtype(self, name: str) -> torch.dtype:
        torch = self._torch
        config_type = self._input_types[name]
        return getattr(torch, TORCH_DTYPES[config_type])

    def _failure(self, exc: Exception) -> InternalError:
        return InternalError(f"PyTorch execute failure for model '{self.model_name}': {exc}")

    def _on_device(self, stream: torch.cuda.Stream | None = None) -> AbstractContextManager[object]:
        """New tensors a model creates on "cuda" land on this instance's GPU, and
        its work goes to the instance's own stream (``stream``: another of its own)."""
        if self._stream is None:
            return nullcontext()
        torch = self._torch
        return _Both(torch.cuda.device(self._device), torch.cuda.stream(stream or self._stream))

    def _forward(self, tensors: dict[str, TorchInput]) -> object:
        if self._inputs.as_dict:
            return self._module(tensors)
        missing = [name for name in self._inputs.positions if name not in tensors]
        if missing:
            raise InvalidArgument(
                f"model '{self.model_name}' needs input(s) {missing}: every forward() "
                "argument must be given"
            )
        args: list[TorchInput | None] = [None] * len(self._inputs.positions)
        for name, position in self._inputs.positions.items():
            args[position] = tensors[name]
        return self._module(*args)

    def _to_tensor(self, name: str, array: np.ndarray) -> TorchInput:
        torch = self._torch
        if name in self._string_inputs:
            return _string_list(self.model_name, name, array)
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

    def _output(self, name: str, result: object) -> torch.Tensor | np.ndarray:
        """The output tensor ``name`` of forward()'s result, its type checked."""
        tensor = self._select(name, result)
        torch = self._torch
        expected = self._output_types[name]
        if expected == "TYPE_STRING":
            if not isinstance(tensor, (list, tuple)) or not all(
                isinstance(item, (str, bytes)) for item in tensor
            ):
                raise InternalError(
                    f"output '{name}' of model '{self.model_name}' is TYPE_STRING: "
                    f"forward() must return a List[str] for it, got {type(tensor).__name__}"
                )
            return _bytes_array(tensor)
        if not isinstance(tensor, torch.Tensor):
            raise InternalError(
                f"output '{name}' of model '{self.model_name}' is a "
                f"{type(tensor).__name__}, not a Tensor"
            )
        if tensor.dtype != getattr(torch, TORCH_DTYPES[expected]):
            raise InternalError(
                f"configuration expects datatype {expected} for output '{name}' of "
                f"model '{self.model_name}', model provides {tensor.dtype}"
            )
        return tensor.detach()

    def _to_numpy(self, tensor: torch.Tensor | np.ndarray) -> np.ndarray:
        torch = self._torch
        if isinstance(tensor, np.ndarray):  # a BYTES output, already on the host
            return tensor
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

    def _select(self, name: str, result: object) -> object:
        if isinstance(result, dict):
            if name not in result:
                raise InternalError(
                    f"model '{self.model_name}' returned a dict without output "
                    f"'{name}'; it has {sorted(result)}"
                )
            return result[name]
        if isinstance(result, self._torch.Tensor) or (
            isinstance(result, list) and result and all(isinstance(i, str) for i in result)
        ):
            # One output: a Tensor, or a List[str] (a BYTES output, Triton's
            # ReadOutputTensors reads a list result as one string output).
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
            if name in self._batch_tensors.outputs:
                continue  # scattered by its source input's shapes, not by rows
            if array.ndim == 0 or array.shape[0] != total:
                raise InternalError(
                    f"output '{name}' of model '{self.model_name}' has shape "
                    f"{list(array.shape)}; a batch of {total} needs {total} rows"
                )

    def close(self) -> None:
        """Release the module, and on a GPU the graphs (their memory pool), their
        static tensors and the pinned buffers, once the instance's streams are
        done with them, rather than whenever the instance object is collected."""
        if self._stream is not None and self._copy_stream is not None:
            self._copy_stream.synchronize()
            self._stream.synchronize()
        self._module = None
        self._graphs = []
        self._buffers = (HostBuffers(), HostBuffers())
        self._slot_copied = [None, None]
        if self._uses_cuda:  # Triton's ~ModelInstanceState: ClearCache, always
            self._torch.cuda.empty_cache()
