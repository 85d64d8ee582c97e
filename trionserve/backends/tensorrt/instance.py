"""One TensorRT engine on one GPU: an execution context and a CUDA stream, batches
bound by tensor name and run with ``execute_async_v3``, CUDA graphs captured at load
and replayed per batch (Triton's tensorrt backend's ``ModelInstanceState``,
src/instance_state.cc)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.batch_io import BatchTensors
from trionserve.backends.batch_tensors import build_responses, gather_inputs, wanted_outputs
from trionserve.backends.cuda.graphs import (
    CAPTURE_LOCK,
    CapturedGraph,
    GraphShape,
    captured_graph,
    log_capture_failure,
)
from trionserve.backends.cuda.pipeline import HostBuffers
from trionserve.backends.tensorrt.engine import EngineTensor, engine_tensors, type_name
from trionserve.core import datatypes
from trionserve.core.errors import InternalError, InvalidArgument, TritonError
from trionserve.core.inference import InferenceRequest
from trionserve.observability.statistics import ComputeTimes

if TYPE_CHECKING:
    from tensorrt import ICudaEngine

    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.backends.cuda.buffers import DeviceBuffers

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _TrtBatch:
    """One batch between ``stage``, ``launch`` and ``finish``."""

    started: int
    staged: int = 0
    launched: int = 0
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    size: int = 0
    graph: CapturedGraph | None = None
    outputs: dict[str, Any] = field(default_factory=dict)
    error: TritonError | None = None


class TensorRTInstance:
    """One engine, execution context and CUDA stream on one GPU.

    Its batches run in three steps (``stage``, ``launch``, ``finish``: a
    :class:`~trionserve.backends.cuda.pipeline.StagedBackendInstance` that
    ``overlaps``), whose times are Triton's compute_input, compute_infer and
    compute_output: the next batch's inputs are gathered while the device computes.

    A batch that a captured CUDA graph serves is copied into the graph's static
    inputs and the graph replayed; any other runs ``execute_async_v3`` with buffers
    of its own shapes."""

    def __init__(
        self,
        context: ModelContext,
        spec: InstanceSpec,
        buffers: DeviceBuffers,
        engine: ICudaEngine,
    ) -> None:
        config = context.config
        self.spec = spec
        self.model_name = context.name
        self.model_version = str(context.version)
        self._buffers = buffers
        self._engine = engine
        # Ragged inputs concatenated flat, batch_input tensors bound with the inputs
        # and batch_output ones scattered back (tensorrt_backend, through the
        # backend library's BackendInputCollector / BackendOutputResponder).
        self._ragged = frozenset(i.name for i in config.input if i.allow_ragged_batch)
        self._batch_tensors = BatchTensors(context.name, config)
        tensors = engine_tensors(engine)
        self._check(config, tensors)
        self._inputs = [t.name for t in tensors if t.is_input]
        self._outputs = [t.name for t in tensors if not t.is_input]
        # Host dtypes of every engine tensor (BF16 travels as uint16 bits, same size).
        self._dtypes = {t.name: datatypes.BY_CONFIG[t.data_type].numpy for t in tensors}
        self._output_datatypes = {
            o.name: datatypes.BY_CONFIG[type_name(o.data_type)].wire for o in config.output
        }
        self._input_reshape = {
            i.name: tuple(i.reshape.shape) for i in config.input if i.HasField("reshape")
        }
        self._output_reshape = {
            o.name: tuple(o.dims) for o in config.output if o.HasField("reshape")
        }
        self._batched = config.max_batch_size > 0
        skip = 1 if self._batched else 0
        # Per-item shapes at profile 0's "opt" point: the graphs Triton captures
        # where graph_spec names no input shapes (SetCudaGraphShape).
        self.opt_shapes = {
            t.name: tuple((t.opt_shape or t.shape)[skip:]) for t in tensors if t.is_input
        }
        self._context = engine.create_execution_context()
        self._stream, self._stream_handle = buffers.stream()
        self._graphs: list[CapturedGraph] = []  # smallest batch size first
        # The GPU pipeline (trionserve.backends.cuda.pipeline): launch returns
        # before the device is done, so the next batch is gathered meanwhile, into
        # the other of two reusable host buffers.
        self.overlaps = True
        self.compute_times: ComputeTimes | None = None
        self._host_buffers = (HostBuffers(), HostBuffers())
        self._slot = 0
        self._held: dict[str, Any] = {}

    def _check(self, config: ModelConfig, tensors: list[EngineTensor]) -> None:
        model = self.model_name
        by_name = {t.name: t for t in tensors}
        for kind, entries, is_input in (
            ("input", config.input, True),
            ("output", config.output, False),
        ):
            for entry in entries:
                t = by_name.get(entry.name)
                if t is None or t.is_input != is_input:
                    names = sorted(x.name for x in tensors if x.is_input == is_input)
                    raise InvalidArgument(
                        f"model '{model}': {kind} '{entry.name}' is not an {kind} of "
                        f"the TensorRT engine; its {kind}s are {names}"
                    )
                expected = type_name(entry.data_type)
                if t.data_type != expected:
                    raise InvalidArgument(
                        f"model '{model}': {kind} '{entry.name}' is {expected} in the "
                        f"config but {t.data_type or 'unsupported'} in the engine"
                    )
        for t in tensors:
            if not t.data_type:
                raise InvalidArgument(
                    f"model '{model}': tensor '{t.name}' of the TensorRT engine has a "
                    "datatype that Triton's protocol cannot carry"
                )
            if t.is_shape_tensor:
                raise InvalidArgument(
                    f"model '{model}': tensor '{t.name}' is a shape tensor, which this "
                    "TensorRT backend does not support"
                )
            configured = {i.name for i in config.input}.union(self._batch_tensors.input_names)
            if t.is_input and t.name not in configured:
                raise InvalidArgument(
                    f"model '{model}': the engine's input '{t.name}' is missing from the config"
                )

    def execute(self, requests: list[InferenceRequest]) -> list:
        """One batch start to end (warmup, and callers that run one batch)."""
        return self.finish(requests, self.launch(requests, self.stage(requests)))

    # -- a batch in three steps (the GPU pipeline: trionserve.backends.cuda.pipeline) ----

    def stage(self, requests: list[InferenceRequest]) -> _TrtBatch:
        """Gather the batch's inputs on the host, into the reusable buffers of its
        slot (two slots: the batch before this one may still be computing), and
        pick the captured graph that serves it, if any. Nothing touches the
        device or the execution context, which the batch before may be using."""
        batch = _TrtBatch(time.perf_counter_ns())
        try:
            buffers = self._host_buffers[self._slot]
            self._slot ^= 1
            arrays = gather_inputs(requests, self._input_reshape, self._ragged, buffers=buffers)
            if self._batch_tensors.inputs:
                arrays.update(self._batch_tensors.input_tensors(requests))
            batch.arrays = {
                name: np.ascontiguousarray(array, dtype=self._dtypes[name])
                if name in self._dtypes
                else array
                for name, array in arrays.items()
            }
            batch.names = wanted_outputs(requests, list(self._output_datatypes))
            batch.size = sum(r.batch_size for r in requests) if self._batched else 0
            batch.graph = self._graph_for(batch.size, batch.arrays) if self._graphs else None
        except TritonError as error:
            batch.error = error
        except Exception as exc:
            batch.error = self._failure(exc)
        batch.staged = time.perf_counter_ns()
        return batch

    def launch(self, requests: list[InferenceRequest], batch: _TrtBatch) -> _TrtBatch:
        """Bind and copy the inputs and start the engine (or replay the batch's
        graph) on the instance's stream, without waiting for it: the next batch is
        staged on the host while the device computes this one. The stream orders
        this batch's copies and kernels after the batch before it."""
        batch.launched = time.perf_counter_ns()
        if batch.error is not None:
            return batch
        try:
            with self._buffers.device(self.spec.device_id):
                if batch.graph is not None:
                    batch.outputs = self._replay(batch.graph, batch.arrays, batch.size, batch.names)
                else:
                    batch.outputs = self._run(batch.arrays, batch.names)
        except TritonError as error:
            batch.error = error
        except Exception as exc:
            batch.error = self._failure(exc)
        batch.arrays = {}
        return batch

    def finish(self, requests: list[InferenceRequest], batch: _TrtBatch) -> list:
        """Wait for the stream, copy the wanted outputs back and build one response
        per request; ``compute_times`` for the batch (compute_infer from the launch
        to the outputs on the host, as Triton's tensorrt backend counts it)."""
        self.compute_times = None
        if batch.error is not None:
            return [batch.error] * len(requests)
        try:
            with self._buffers.device(self.spec.device_id):
                stream = self._stream
                outputs = {
                    name: self._buffers.to_host(device, stream)
                    for name, device in batch.outputs.items()
                }
                self._buffers.synchronize(stream)
        except TritonError as error:
            return [error] * len(requests)
        except Exception as exc:
            return [self._failure(exc)] * len(requests)
        finally:
            batch.outputs = {}
        inferred = time.perf_counter_ns()
        try:
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
        self.compute_times = ComputeTimes(
            batch.staged - batch.started,
            inferred - batch.launched,
            time.perf_counter_ns() - inferred,
        )
        return responses

    def _failure(self, exc: Exception) -> InternalError:
        # CUDA and TensorRT raise their own types
        return InternalError(f"TensorRT execute failure for model '{self.model_name}': {exc}")

    def _run(self, arrays: dict[str, np.ndarray], names: list[str]) -> dict[str, Any]:
        """Enqueue the batch on the stream; the wanted outputs' device buffers."""
        context, buffers, stream = self._context, self._buffers, self._stream
        held = {}  # device buffers, kept alive until the stream has finished with them
        for name in self._inputs:
            if name not in arrays:
                raise InvalidArgument(
                    f"model '{self.model_name}' needs input '{name}': the TensorRT "
                    "engine has no optional inputs"
                )
            array = arrays[name]
            if not context.set_input_shape(name, array.shape):
                raise InvalidArgument(
                    f"input '{name}' of model '{self.model_name}' has shape "
                    f"{list(array.shape)}, outside the TensorRT engine's optimization "
                    "profile"
                )
            held[name], address = buffers.to_device(array, stream)
            context.set_tensor_address(name, address)
        for name in self._outputs:
            shape = tuple(int(d) for d in context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise InternalError(
                    f"output '{name}' of model '{self.model_name}' has a data-dependent "
                    f"shape {list(shape)}, which this TensorRT backend does not support"
                )
            held[name], address = buffers.empty(shape, self._dtypes[name])
            context.set_tensor_address(name, address)
        self._enqueue()
        # The inputs' device buffers stay alive until the stream is done with them:
        # they are held by the execution context's bindings until the next batch
        # binds its own, and by ``held`` through the outputs' batch.
        self._held = held
        return {name: held[name] for name in names}

    def _enqueue(self) -> None:
        if not self._context.execute_async_v3(self._stream_handle):
            raise InternalError(
                f"TensorRT execute failure for model '{self.model_name}': "
                "execute_async_v3 returned false"
            )

    # -- CUDA graphs ---------------------------------------------------------------------

    def capture_graphs(self, shapes: list[GraphShape]) -> None:
        """Capture ``execute_async_v3`` as a CUDA graph per shape, on the
        instance's stream (Triton's BuildCudaGraph). Each graph has static device
        inputs and outputs at its shapes, bound to the execution context before
        the capture: a replay reads and writes those addresses. A graph that
        cannot be captured is logged and its batches run without one, as in
        Triton. A graph whose outputs are not batch-major serves only batches of
        exactly its size (padding would change them, slicing would cut the wrong
        dimension). Captures run one at a time in the process, in thread-local
        mode (Triton's cudaStreamCaptureModeThreadLocal)."""
        captured = []
        with CAPTURE_LOCK, self._buffers.device(self.spec.device_id):
            for shape in shapes:
                try:
                    captured.append(self._capture(shape))
                except Exception as exc:
                    log_capture_failure(shape, exc, model=self.model_name, instance=self.spec.name)
        self._graphs = sorted(captured, key=lambda g: g.shape.batch_size)

    def _capture(self, shape: GraphShape) -> CapturedGraph:
        context, buffers, stream = self._context, self._buffers, self._stream
        missing = [name for name in self._inputs if name not in shape.inputs]
        if missing:
            raise InvalidArgument(
                f"optimization.cuda.graph_spec for batch size {shape.batch_size} gives "
                f"no shape for input(s) {missing}"
            )
        batch = (shape.batch_size,) if self._batched else ()
        inputs, outputs = {}, {}
        for name in self._inputs:
            full = batch + shape.inputs[name]
            if not context.set_input_shape(name, full):
                raise InvalidArgument(
                    f"input '{name}' shape {list(full)} is outside the TensorRT "
                    "engine's optimization profile"
                )
            inputs[name], address = buffers.empty(full, self._dtypes[name])
            context.set_tensor_address(name, address)
        for name in self._outputs:
            dims = tuple(int(d) for d in context.get_tensor_shape(name))
            if any(d < 0 for d in dims):
                raise InternalError(f"output '{name}' has a data-dependent shape {list(dims)}")
            outputs[name], address = buffers.empty(dims, self._dtypes[name])
            context.set_tensor_address(name, address)
        # TensorRT defers work that depends on new input shapes to the next
        # enqueue, which a capture must not record: run once first (TensorRT's
        # developer guide, "CUDA Graphs"; Triton's BuildCudaGraph enqueues too).
        self._enqueue()
        buffers.synchronize(stream)
        graph = buffers.capture(stream, self._enqueue)
        return captured_graph(
            shape,
            graph,
            inputs,
            outputs,
            self._batched,
            model=self.model_name,
            instance=self.spec.name,
        )

    def _graph_for(self, size: int, arrays: dict[str, np.ndarray]) -> CapturedGraph | None:
        """The smallest captured graph that serves a batch of ``size`` with these
        inputs' shapes, if any (Triton's FindClosestCudaGraph: its batch size or
        between its lower bound and it; here the per-item shapes must be the
        graph's)."""
        if any(name not in arrays for name in self._inputs):
            return None  # the plain path says which input is missing
        skip = 1 if self._batched else 0
        for captured in self._graphs:
            shape = captured.shape
            if self._batched and not shape.lower <= size <= shape.batch_size:
                continue
            if all(
                arrays[name].shape[skip:] == shape.inputs[name]
                and (not self._batched or arrays[name].shape[0] == size)
                for name in self._inputs
            ):
                return captured
        return None

    def _replay(
        self, captured: CapturedGraph, arrays: dict[str, np.ndarray], size: int, names: list[str]
    ) -> dict[str, Any]:
        """Copy the batch into the graph's leading rows and replay it; this batch's rows of
        the outputs (device views, read back by ``finish``). Rows past the batch keep an
        earlier batch's data (Triton's graphs do not clear them either); a batch-major
        model's rows do not depend on each other."""
        buffers, stream = self._buffers, self._stream
        for name in self._inputs:
            array = arrays[name]
            static = captured.inputs[name]
            buffers.upload(static[:size] if self._batched else static, array, stream)
        buffers.launch(captured.graph, stream)
        padded = self._batched and size != captured.shape.batch_size
        return {
            name: captured.outputs[name][:size] if padded else captured.outputs[name]
            for name in names
        }

    def close(self) -> None:
        """Release the graphs and their buffers, then the context and engine,
        once the instance's stream is done with them."""
        if self._graphs:
            self._buffers.synchronize(self._stream)
        self._graphs = []
        self._held = {}
        self._context = None
        self._engine = None
