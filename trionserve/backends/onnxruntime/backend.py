"""ONNX Runtime backend: platform ``onnxruntime_onnx`` / backend ``onnxruntime``.

One ``InferenceSession`` per instance. KIND_GPU instances use the CUDA execution
provider on their GPU when onnxruntime-gpu is installed and a GPU is visible
(otherwise loading such an instance fails with a reason that says so), with the
TensorRT provider in front when the config's ``optimization`` asks for it; see
:mod:`trionserve.backends.onnxruntime.providers`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import structlog

from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.backends.batch_io import BatchTensors
from trionserve.backends.batch_tensors import (
    build_responses,
    gather_inputs,
    wanted_outputs,
)
from trionserve.backends.cuda.pipeline import HostBuffers
from trionserve.backends.onnxruntime.providers import CUDA, TENSORRT, execution_providers
from trionserve.backends.onnxruntime.session_run import SessionRun
from trionserve.backends.onnxruntime.validation import validate_session
from trionserve.core import datatypes
from trionserve.core.errors import InternalError, InvalidArgument, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.observability.logging import verbose
from trionserve.observability.statistics import ComputeTimes

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
    from onnxruntime import InferenceSession, NodeArg

    from trionserve._generated.model_config_pb2 import (
        DataType,
        ModelConfig,
        ModelInput,
        ModelOutput,
    )

log = structlog.get_logger(__name__)

# ONNX tensor element types (onnxruntime's type strings) -> Triton config datatypes.
_ORT_TYPES = {
    "tensor(bool)": "TYPE_BOOL",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
    "tensor(bfloat16)": "TYPE_BF16",
}


# A CPU batch whose last execution took at most this long runs inline on the
# event loop instead of paying a worker-thread hop that costs more than it does.
INLINE_BUDGET_NS = 150_000

# Triton's default when auto-complete finds a model that can batch.
DEFAULT_MAX_BATCH_SIZE = 4

# ONNX Runtime session config keys a model config may set as parameters, and the
# value each has when it does not. ONNX Runtime's own default is "1": an idle pool
# thread spins on a core between (and within) runs. In a server those cores are the
# ones its event loop, its frontends and other instances need: on 2 cores the
# spinning doubled the CPU per inference of the small CNN and halved its served
# rate at c=1 (benchmarks/README.md, served_vs_direct), so threads that wait here
# sleep. Triton's backend leaves ONNX Runtime's default (src/onnxruntime.cc,
# ModelState::CreateSession sets no spinning entry); set "1" to get it back.
SESSION_CONFIG_DEFAULTS = {
    "session.intra_op.allow_spinning": "0",
    "session.inter_op.allow_spinning": "0",
}


def _ort() -> ModuleType:
    import onnxruntime

    return onnxruntime


def _dims(shape: Sequence[int | str | None]) -> list[int]:
    """ONNX shapes use strings or None for symbolic dimensions; Triton uses -1."""
    return [d if isinstance(d, int) and d >= 0 else -1 for d in shape]


def _config_parameter(config: ModelConfig, key: str) -> str | None:
    if key in config.parameters:
        return config.parameters[key].string_value
    return None


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self) -> None:
        self._default_max_batch_size = DEFAULT_MAX_BATCH_SIZE

    def configure(self, settings: Mapping[str, str]) -> None:
        """``default-max-batch-size`` (global or ``onnxruntime,``), what
        auto-complete gives a model that can batch (onnxruntime.cc
        TRITONBACKEND_Initialize reads it from the backend config's cmdline)."""
        value = settings.get("default-max-batch-size")
        if value is not None:
            self._default_max_batch_size = int(value)

    def default_model_filename(self) -> str:
        return "model.onnx"

    def can_use_gpu(self) -> bool:
        """Only an onnxruntime build with a CUDA or TensorRT provider (onnxruntime-gpu)."""
        import onnxruntime as ort

        return bool({CUDA, TENSORRT} & set(ort.get_available_providers()))

    def auto_complete_config(
        self, config: ModelConfig, model_path: Path, max_batch_size_set: bool
    ) -> None:
        """Fill max_batch_size, inputs and outputs from the ONNX graph.

        Only what config.pbtxt leaves out is filled: a config that lists inputs
        and outputs is left as it is (Triton's backend skips it); one that lists
        only inputs keeps them, with missing dims or data types taken from the
        model. Like Triton, a
        model whose every tensor has a variable leading dimension gets
        max_batch_size ``default-max-batch-size`` (4 unless ``--backend-config``
        sets it; a negative value is 0) unless the config set max_batch_size
        itself, and such a model batching more than one request at a time gets a
        dynamic batcher unless the config names a scheduler (onnxruntime.cc
        ModelState::AutoCompleteMaxBatch).
        """
        if (config.input or config.batch_input) and config.output:
            # onnxruntime_backend src/onnxruntime.cc:995-1022 AutoCompleteConfig:
            # not even the batch size or a dynamic batcher, in its words at info.
            log.info(
                f"skipping model configuration auto-complete for '{config.name}': "
                "inputs and outputs already specified"
            )
            return
        session = _ort().InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        graph_inputs = session.get_inputs()
        graph_outputs = session.get_outputs()
        # A leading symbolic dimension on every tensor means the model batches.
        can_batch = all(
            len(t.shape) > 0 and _dims(t.shape)[0] == -1 for t in (*graph_inputs, *graph_outputs)
        )
        declared: list[ModelInput | ModelOutput] = [*config.input, *config.output]
        has_dims = any(e.dims for e in declared)
        if not max_batch_size_set and can_batch and not has_dims:
            config.max_batch_size = max(self._default_max_batch_size, 0)
        if not can_batch and config.max_batch_size != 0:
            # onnxruntime_backend src/onnxruntime.cc AutoCompleteMaxBatch:1167, its words.
            raise InvalidArgument(
                f"autofill failed for model '{config.name}': model does not support "
                "batching while non-zero max_batch_size is specified"
            )
        scheduled = config.HasField("dynamic_batching") or config.HasField("sequence_batching")
        if can_batch and config.max_batch_size > 1 and not scheduled:
            config.dynamic_batching.SetInParent()
        skip = 1 if config.max_batch_size > 0 else 0
        self._complete_tensors(config.input, graph_inputs, skip)
        self._complete_tensors(config.output, graph_outputs, skip)

    @staticmethod
    def _complete_tensors(
        entries: RepeatedCompositeFieldContainer[ModelInput]
        | RepeatedCompositeFieldContainer[ModelOutput],
        graph_tensors: Sequence[NodeArg],
        skip: int,
    ) -> None:
        known = {e.name: e for e in entries}
        for t in graph_tensors:
            entry = known.get(t.name)
            if entry is None:
                if known:
                    continue  # the config chose its own subset of tensors
                entry = entries.add()
                entry.name = t.name
            if entry.data_type == 0 and t.type in _ORT_TYPES:
                entry.data_type = _config_data_type(_ORT_TYPES[t.type])
            if not entry.dims and not entry.HasField("reshape"):
                dims = _dims(t.shape)[skip:]
                entry.dims.extend(dims if dims else [1])

    def load(self, context: ModelContext) -> OnnxModel:
        filename = context.config.default_model_filename or self.default_model_filename()
        path = context.version_dir / filename
        if not path.exists():
            raise Unavailable(
                f"model file '{filename}' not found in version {context.version} "
                f"of model '{context.name}' ({context.version_dir.name}/)"
            )
        # Triton's onnxruntime backend announces each model and instance it sets
        # up and tears down at info (src/onnxruntime.cc:3028, :3093, :3145, :3069),
        # lines a Triton user's log watching reads; written here at the same steps.
        log.info(f"TRITONBACKEND_ModelInitialize: {context.name} (version {context.version})")
        return OnnxModel(context, path)


def _config_data_type(name: str) -> DataType:
    from trionserve._generated.model_config_pb2 import DataType

    # The protobuf stubs type EnumTypeWrapper.Value as int; it is a DataType value.
    return DataType.Value(name)  # type: ignore[return-value]


class OnnxModel:
    """A loaded ONNX model: the file and config that every instance shares."""

    def __init__(self, context: ModelContext, path: Path) -> None:
        self.context = context
        self.path = path

    def create_instance(self, spec: InstanceSpec) -> OnnxInstance:
        # TRITONSERVER_InstanceGroupKindString: "CPU", "GPU", "MODEL"
        kind = spec.kind.removeprefix("KIND_")
        log.info(
            f"TRITONBACKEND_ModelInstanceInitialize: {spec.name} ({kind} device {spec.device_id})"
        )
        ort = _ort()
        config = self.context.config
        options = ort.SessionOptions()
        intra = _config_parameter(config, "intra_op_thread_count")
        inter = _config_parameter(config, "inter_op_thread_count")
        if intra:
            options.intra_op_num_threads = int(intra)
        if inter:
            options.inter_op_num_threads = int(inter)
        for key, default in SESSION_CONFIG_DEFAULTS.items():
            value = _config_parameter(config, key)
            if value not in (None, "0", "1"):
                raise InvalidArgument(
                    f"model '{self.context.name}' parameter '{key}' must be \"0\" or \"1\", "
                    f'got "{value}"'
                )
            options.add_session_config_entry(key, value or default)
        providers = execution_providers(config, spec, ort.get_available_providers())
        session = ort.InferenceSession(str(self.path), options, providers=providers)
        validate_session(config, self.context.name, session)
        return OnnxInstance(self.context, spec, session)

    def unload(self) -> None:
        log.info("TRITONBACKEND_ModelFinalize: delete model state")


class OnnxInstance:
    """One InferenceSession; executes one batch at a time (its executor guarantees it).

    A batch runs in one call (``run`` returns when it is done: there is nothing to
    overlap, so the instance is not staged in steps): its inputs gathered into the
    instance's reusable host buffers (none for a batch of one: onnxruntime reads a
    read-only request body as it is), the session run, the outputs sliced back to
    each request; the three times are Triton's compute_input, compute_infer and
    compute_output.
    """

    def __init__(
        self, context: ModelContext, spec: InstanceSpec, session: InferenceSession
    ) -> None:
        config = context.config
        self.spec = spec
        self.model_name = context.name
        self.model_version = str(context.version)
        self._session = session
        self._run = SessionRun(session)
        self._string_inputs = {i.name for i in session.get_inputs() if i.type == "tensor(string)"}
        graph_outputs = {o.name for o in session.get_outputs()}
        self._output_datatypes = {
            o.name: datatypes.BY_CONFIG[_data_type_name(o.data_type)].wire for o in config.output
        }
        # Implicit state outputs (sequence_batching.state) are produced for the
        # sequence batcher, which keeps them, whether or not the config lists them.
        for state in config.sequence_batching.state:
            self._output_datatypes.setdefault(
                state.output_name, datatypes.BY_CONFIG[_data_type_name(state.data_type)].wire
            )
        missing = [name for name in self._output_datatypes if name not in graph_outputs]
        if missing:
            raise InvalidArgument(
                f"model '{context.name}' config lists output(s) {missing} that the ONNX "
                f"graph does not produce; it produces {sorted(graph_outputs)}"
            )
        self._outputs = list(self._output_datatypes)
        # (name, wire datatype) of each output, in the model's order.
        self._typed_outputs = list(self._output_datatypes.items())
        self._input_reshape = {
            i.name: tuple(i.reshape.shape) for i in config.input if i.HasField("reshape")
        }
        self._output_reshape = {
            o.name: tuple(o.dims) for o in config.output if o.HasField("reshape")
        }
        self._ragged = frozenset(i.name for i in config.input if i.allow_ragged_batch)
        # batch_input tensors fed with the inputs, batch_output ones scattered back
        # (onnxruntime.cc SetInputTensors / ReadOutputTensors).
        self._batch_tensors = BatchTensors(context.name, config)
        # Set after each execute; the executor reads it for the statistics.
        self.compute_times: ComputeTimes | None = None
        # CPU sessions may run tiny batches on the event loop (see InstanceExecutor);
        # GPU sessions always go to a worker thread.
        on_cpu = session.get_providers()[:1] == ["CPUExecutionProvider"]
        self.inline_budget_ns = INLINE_BUDGET_NS if on_cpu else 0
        # Where a batch of several requests is gathered; reused by the next batch,
        # which starts after this one's outputs are out of it (see execute).
        self._buffers = HostBuffers()
        # Inputs fed as they come and outputs answered as they are (no strings,
        # reshapes, ragged inputs or batch tensors): a lone request's tensors go
        # to the session and back without the batch's gather and split.
        self._plain = not (
            self._string_inputs
            or self._input_reshape
            or self._output_reshape
            or self._ragged
            or self._batch_tensors
        )

    def execute(self, requests: list[InferenceRequest]) -> list:
        """One response or error per request; ``compute_times`` for the batch. A
        request with a string input that is not UTF-8 is refused on its own (see
        :meth:`_non_text_input`); the others run."""
        started = time.perf_counter_ns()
        self.compute_times = None
        if verbose():  # onnxruntime.cc:3178 ModelInstanceExecute, at verbose 1
            log.debug(
                f"model {self.model_name}, instance {self.spec.name}, "
                f"executing {len(requests)} requests"
            )
        if self._plain and len(requests) == 1 and requests[0].requested_outputs is None:
            return self._lone(requests[0], started)
        refused: list[TritonError | None] | None = None
        kept = requests
        if self._string_inputs:
            refused = [self._non_text_input(request) for request in requests]
            if any(refused):
                kept = [request for request, error in zip(requests, refused) if error is None]
        outputs: dict[str, np.ndarray] = {}
        staged = inferred = started
        if kept:
            try:
                names, feeds = self._feeds(kept)
            except TritonError as error:
                return [error] * len(requests)
            staged = time.perf_counter_ns()
            try:
                results = self._run(names, feeds)
            except Exception as exc:  # onnxruntime raises its own exception types
                return [self._failure(exc)] * len(requests)
            del feeds
            inferred = time.perf_counter_ns()
            gathered = len(kept) > 1
            for name, array in zip(names, results):
                # An output must outlive the input buffer the next batches reuse.
                if gathered and self._buffers.holds(array):
                    array = array.copy()
                outputs[name] = array
        try:
            responses = build_responses(
                kept,
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
            staged - started, inferred - staged, time.perf_counter_ns() - inferred
        )
        if refused is None or kept is requests:
            return responses
        answers = iter(responses)
        return [next(answers) if error is None else error for error in refused]

    def _feeds(self, requests: list[InferenceRequest]) -> tuple[list[str], dict[str, np.ndarray]]:
        """The outputs the batch asks for and the session's inputs: the requests'
        tensors gathered (into the host buffers for several), strings as text, the
        batch inputs added."""
        if self._plain and len(requests) == 1:
            feeds = {name: tensor.data for name, tensor in requests[0].inputs.items()}
            return wanted_outputs(requests, self._outputs), feeds
        feeds = gather_inputs(requests, self._input_reshape, self._ragged, buffers=self._buffers)
        if self._string_inputs:
            for name in self._string_inputs.intersection(feeds):
                feeds[name] = _to_str_array(feeds[name])
        if self._batch_tensors.inputs:
            feeds.update(self._batch_tensors.input_tensors(requests))
        return wanted_outputs(requests, self._outputs), feeds

    def _lone(self, request: InferenceRequest, started: int) -> list:
        """``execute`` for a plain model's lone request that asks for every
        output: its tensors fed as they are, its response built straight from
        the session's results, in the model's order (no batch gathered or split,
        no dictionary of outputs: the Python right after the model's run runs
        with its caches evicted, ~1 µs a step; issue 39's eleventh round)."""
        feeds = {name: tensor.data for name, tensor in request.inputs.items()}
        staged = time.perf_counter_ns()
        try:
            results = self._run(self._outputs, feeds)
        except Exception as exc:  # onnxruntime raises its own exception types
            return [self._failure(exc)]
        inferred = time.perf_counter_ns()
        tensors = [Tensor(*output, array) for output, array in zip(self._typed_outputs, results)]
        response = InferenceResponse(self.model_name, self.model_version, request.id, tensors)
        self.compute_times = ComputeTimes(
            staged - started, inferred - staged, time.perf_counter_ns() - inferred
        )
        return [response]

    def _failure(self, exc: Exception) -> InternalError:
        return InternalError(f"onnxruntime execute failure for model '{self.model_name}': {exc}")

    def _non_text_input(self, request: InferenceRequest) -> TritonError | None:
        """Why ``request`` cannot run, if a string input holds bytes that are not UTF-8.

        onnxruntime's Python API takes string tensors as Python ``str`` (a ``bytes``
        element would be passed as its repr, a fixed-width bytes array is cut at
        the first NUL) and returns them decoded as UTF-8, so other bytes cannot
        pass through unchanged: such a request is refused rather than altered.
        """
        for name in self._string_inputs:
            tensor = request.inputs.get(name)
            if tensor is None:
                continue
            for index, value in enumerate(tensor.data.reshape(-1)):
                if not isinstance(value, bytes):
                    continue
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return InvalidArgument(
                        f"input '{name}' for model '{self.model_name}' is not valid UTF-8 "
                        f"(element {index}, byte {exc.start}): the ONNX Runtime backend "
                        "passes BYTES tensors to the model as text, and would alter these bytes"
                    )
        return None

    def close(self) -> None:
        if self._session is not None:
            log.info("TRITONBACKEND_ModelInstanceFinalize: delete instance state")
        self._session = None


def _data_type_name(value: int) -> str:
    from trionserve._generated.model_config_pb2 import DataType

    return DataType.Name(value)


def _to_str_array(array: np.ndarray) -> np.ndarray:
    """onnxruntime string tensors want str elements; our BYTES tensors hold bytes
    (checked to be UTF-8 before: :meth:`OnnxInstance._non_text_input`)."""
    flat = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    return np.array(flat, dtype=object).reshape(array.shape)
