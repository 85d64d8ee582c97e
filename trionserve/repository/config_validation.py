"""Model configuration checks: the rules a settled config must meet before it loads.

Triton's ``ValidateModelConfig`` and ``ValidateModelIOConfig`` with their helpers
(core ``src/model_config_utils.cc``): platform and backend, version policy, inputs
and outputs (dims, reshape, formats), batch inputs and outputs, instance groups,
dynamic and sequence batching, ensembles, metric controls. Reading, platform
inference and normalisation are in :mod:`trionserve.repository.config`. Errors are
Triton's, word for word where Triton has the check (model_config_utils.cc; each names
the model, e.g. ``model input 'INPUT0' must specify 'dims' for simple``), so that
what a Triton user greps for (qa/L0_model_config's expected messages) is there;
the checks Triton does not have name the model and the field in this server's words
(``model 'simple': ...``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn

from trionserve._generated import model_config_pb2 as mc
from trionserve.core.errors import InvalidArgument
from trionserve.repository.config import (
    ENSEMBLE_PLATFORM,
    WILDCARD_DIM,
    ModelConfig,
    check_platform_backend_pair,
)

# Raises InvalidArgument with the model's name before the message.
_Fail = Callable[[str], NoReturn]


def _triton(message: str) -> NoReturn:
    """Triton's message for a check it has, as it is (it names the model)."""
    raise InvalidArgument(message)


def validate_model_config(config: ModelConfig, *, io: bool = True) -> None:
    """Raise InvalidArgument naming the model and the field for the first problem found.

    Call after auto-complete and
    :func:`~trionserve.repository.config.normalize_model_config` (Triton validates
    inputs and outputs only once the backend has filled them in). ``io=False``
    leaves out the inputs and outputs, as Triton's poll of a model whose config
    the backend may still complete (core model_repository_manager.cc:
    ValidateModelConfig, and ValidateModelIOConfig only without autofill).
    """
    name = config.name
    if not name:
        raise InvalidArgument("model configuration must specify 'name'")
    prefix = f"model '{name}': "

    def fail(message: str) -> NoReturn:
        raise InvalidArgument(prefix + message)

    _validate_platform(config, fail)
    if config.max_batch_size < 0:
        _triton(f"'max_batch_size' must be non-negative value for {name}")
    _validate_version_policy(config, fail)
    groups: tuple[tuple[str, Sequence[mc.ModelInput | mc.ModelOutput]], ...] = (
        ("input", config.input),
        ("output", config.output),
    )
    for kind, tensors in groups if io else ():
        seen: set[str] = set()
        for tensor in tensors:
            _validate_io(kind, tensor, config)
            if tensor.name in seen:
                fail(f"{kind} '{tensor.name}' is declared more than once")
            seen.add(tensor.name)
    if io:
        _validate_batch_io(config, fail)
    _validate_instance_groups(config, fail)
    if config.HasField("dynamic_batching"):
        _validate_dynamic_batching(config, fail)
    if config.HasField("sequence_batching"):
        _validate_sequence_batching(config, fail)
    if config.HasField("ensemble_scheduling") or config.platform == ENSEMBLE_PLATFORM:
        _validate_ensemble(config, fail)
    if config.model_transaction_policy.decoupled and config.response_cache.enable:
        # core src/model_config_utils.cc ValidateModelConfig (DLIS-3916), its words.
        fail(
            f"Response Cache does not currently support model {config.name} with "
            "'decoupled' transaction policy. Please disable the response cache."
        )
    _validate_model_metrics(config, fail)


def _validate_model_metrics(config: ModelConfig, fail: _Fail) -> None:
    # core src/model_config_utils.cc ValidateModelMetrics (lines 455-485), its words
    # and order; Triton's messages do not name the model, ours put it first.
    for control in config.model_metrics.metric_control:
        if not control.HasField("metric_identifier"):
            fail("metric control must specify 'metric_identifier'")
        if not control.metric_identifier.family:
            fail("metric identifier must specify non-empty 'family'")
        if not control.HasField("histogram_options"):
            fail("metric control must specify 'histogram_options'")
        if not control.histogram_options.buckets:
            fail("histogram options must specify non-empty 'buckets'")


def _validate_platform(config: ModelConfig, fail: _Fail) -> None:
    # model_config_utils.cc ValidateModelConfig, in its order.
    name, platform, backend = config.name, config.platform, config.backend
    if platform == ENSEMBLE_PLATFORM:
        if backend:
            _triton(
                f"Ensemble model '{name}' must have platform type '{platform}' and empty "
                "backend type"
            )
        return
    if not backend:
        if not platform:
            _triton(f"must specify 'platform' or 'backend' for '{name}'")
        _triton(f"unexpected platform type '{platform}' for {name}")
    check_platform_backend_pair(config.name, platform, backend)


def _validate_version_policy(config: ModelConfig, fail: _Fail) -> None:
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "latest" and policy.latest.num_versions < 1:
        fail("version_policy.latest.num_versions must be >= 1")
    if which == "specific":
        if not policy.specific.versions:
            fail("version_policy.specific.versions must not be empty")
        for version in policy.specific.versions:
            if version < 1:
                fail(f"version_policy.specific.versions must be positive, got {version}")


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _element_count(shape: Sequence[int]) -> int:
    # As Triton's GetElementCount: -1 with any wildcard, 0 for an empty shape.
    if not shape:
        return 0
    count = 1
    for dim in shape:
        if dim == WILDCARD_DIM:
            return WILDCARD_DIM
        count *= dim
    return count


def _trunk_counts(shape: Sequence[int]) -> list[int]:
    # Element counts of the runs of fixed dims between wildcards: [2,4,-1,6] -> [8, 6].
    counts, current = [], 1
    for dim in shape:
        if dim == WILDCARD_DIM:
            counts.append(current)
            current = 1
        else:
            current *= dim
    counts.append(current)
    return counts


def _validate_io(kind: str, io: mc.ModelInput | mc.ModelOutput, config: ModelConfig) -> None:
    """Triton's ValidateIOShape, ValidateModelInput / ValidateModelOutput and
    ValidateNonLinearFormatIO (model_config_utils.cc:296, 1820, 1865, 428), their
    words with " for <model>" as ValidateModelIOConfig adds it."""
    suffix = f" for {config.name}"
    if not io.name:
        _triton(f"model {kind} must specify 'name'{suffix}")
    where = f"model {kind} '{io.name}'"
    if io.data_type == mc.TYPE_INVALID:
        _triton(f"{where} must specify 'data_type'{suffix}")
    if not io.dims:
        _triton(
            f"{where} must specify 'dims'{suffix} "
            "(dims: [ 1 ] with reshape: { shape: [ ] } for a scalar)"
        )
    if io.HasField("reshape") and not io.reshape.shape and config.max_batch_size == 0:
        _triton(
            f"{where} cannot have empty reshape for non-batching model as scalar tensors "
            f"are not supported{suffix}"
        )
    variable = f"{WILDCARD_DIM} to indicate a variable-size dimension{suffix}"
    if any(d < 1 and d != WILDCARD_DIM for d in io.dims):
        _triton(f"{where} dimension must be integer >= 1, or {variable}")
    if io.HasField("reshape"):
        shape = io.reshape.shape
        if any(d < 1 and d != WILDCARD_DIM for d in shape):
            _triton(f"{where} reshape dimensions must be integer >= 1, or {variable}")
        dims_count, reshape_count = _element_count(io.dims), _element_count(shape)
        different = f"{where} has different size for dims and reshape{suffix}"
        if dims_count != reshape_count and (reshape_count != 0 or dims_count != 1):
            _triton(different)
        if dims_count == WILDCARD_DIM:
            dims_trunks, reshape_trunks = _trunk_counts(io.dims), _trunk_counts(shape)
            if len(dims_trunks) != len(reshape_trunks):
                _triton(
                    f"{where} has different number of variable-size dimensions for dims "
                    f"and reshape{suffix}"
                )
            if dims_trunks != reshape_trunks:
                _triton(different)
    is_tensorrt = config.platform == "tensorrt_plan"
    if (
        isinstance(io, mc.ModelInput)
        and io.format != mc.ModelInput.FORMAT_NONE
        and len(io.dims) != 3
    ):
        _triton(f"model input NHWC/NCHW require 3 dims{suffix}")
    if io.is_shape_tensor and not is_tensorrt:
        _triton(f"shape tensors are only supported for TensorRT platform{suffix}")
    if io.is_non_linear_format_io:
        if not is_tensorrt:
            _triton(f"Non-linear IO format is only supported for the TensorRT platform{suffix}")
        if len(io.dims) != 3:
            _triton(f"Non-linear IO format {kind} requires 3 dims{suffix}")


def _validate_batch_io(config: ModelConfig, fail: _Fail) -> None:
    # Triton's ValidateBatchIO (model_config_utils.cc:1341) and its words.
    suffix = f" for {config.name}"
    inputs = {io.name for io in config.input}
    outputs = {io.name for io in config.output}
    for batch_input in config.batch_input:
        kind = mc.BatchInput.Kind.Name(batch_input.kind)
        if len(batch_input.source_input) != 1:
            count = len(batch_input.source_input)
            _triton(f"batch input kind '{kind}' expects 1 source input, got {count}{suffix}")
        if batch_input.data_type not in (mc.TYPE_INT32, mc.TYPE_FP32):
            _triton(f"batch input data type must be TYPE_INT32 or TYPE_FP32{suffix}")
        for source in batch_input.source_input:
            if source not in inputs:
                _triton(f"unknown source input name '{source}'{suffix}")
    for batch_output in config.batch_output:
        kind = mc.BatchOutput.Kind.Name(batch_output.kind)
        if len(batch_output.source_input) != 1:
            count = len(batch_output.source_input)
            _triton(f"batch output kind '{kind}' expects 1 source input, got {count}{suffix}")
        for source in batch_output.source_input:
            if source not in inputs:
                _triton(f"unknown source input name '{source}'{suffix}")
        targets: set[str] = set()
        for target in batch_output.target_name:
            if target not in outputs:
                _triton(f"unknown target output name '{target}'{suffix}")
            if target in targets:
                _triton(f"target output name '{target}' can only be specified once{suffix}")
            targets.add(target)


def _validate_instance_groups(config: ModelConfig, fail: _Fail) -> None:
    Kind = mc.ModelInstanceGroup.Kind
    for index, group in enumerate(config.instance_group):
        where = f"instance_group '{group.name}'" if group.name else f"instance_group {index}"
        if group.count < 0:
            fail(f"{where}: count must be >= 1 (0 or unset means the default), got {group.count}")
        if group.kind not in Kind.values():
            fail(f"{where}: unknown kind {group.kind}")
        # Triton's ValidateInstanceGroup (model_config_utils.cc:1703), its words.
        named = f"instance group {group.name or f'{config.name}_{index}'} of model {config.name}"
        if group.kind in (Kind.Value("KIND_CPU"), Kind.Value("KIND_MODEL")) and group.gpus:
            _triton(f"{named} has kind {Kind.Name(group.kind)} but specifies one or more GPUs")
        for gpu in group.gpus:
            if gpu < 0:  # never a device (the GPUs themselves are checked when it loads)
                _triton(
                    f"{named} specifies invalid or unsupported gpu id {gpu}. GPUs with at "
                    "least the minimum required CUDA compute compatibility of 6.000000 are: "
                )
        if group.profile:
            on = f"{named} and platform {config.platform}"
            if config.platform != "tensorrt_plan":
                _triton(f"{on}specifies profile field which is only supported for TensorRT models")
            for profile in group.profile:
                if not profile.isdigit():
                    _triton(
                        f"{on} specifies invalid profile {profile}. The field should contain "
                        "the string representation of a non-negative integer."
                    )


def _validate_dynamic_batching(config: ModelConfig, fail: _Fail) -> None:
    # Triton's ValidateModelConfig (model_config_utils.cc:1485-1556), its words.
    batching, suffix = config.dynamic_batching, f" for {config.name}"
    for size in batching.preferred_batch_size:
        if size <= 0:
            _triton(f"dynamic batching preferred size must be positive{suffix}")
        if size > config.max_batch_size:
            _triton(f"dynamic batching preferred size must be <= max batch size{suffix}")
    levels = batching.priority_levels
    if levels:
        if not 1 <= batching.default_priority_level <= levels:
            _triton(f"default priority level must be in range [1, {levels}]{suffix}")
        for level in batching.priority_queue_policy:
            if not 1 <= level <= levels:
                _triton(
                    f"priority queue policy must have priority level in range [1, {levels}]{suffix}"
                )
    if batching.preserve_ordering:
        if levels > 1:
            _triton(f"Only one priority level is allowed when 'preserve_ordering' is true{suffix}")
        policies = [batching.default_queue_policy, *batching.priority_queue_policy.values()]
        for policy in policies:
            delays = policy.timeout_action == mc.ModelQueuePolicy.DELAY
            if policy.default_timeout_microseconds and delays:
                _triton(
                    "Queue policy can not have DELAY as timeout action when "
                    f"'preserve_ordering' is true{suffix}"
                )


_BOOL_CONTROLS = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY")
_CORRID_TYPES = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING)


def _validate_sequence_batching(config: ModelConfig, fail: _Fail) -> None:
    batching = config.sequence_batching
    Kind = mc.ModelSequenceBatching.Control.Kind
    if config.response_cache.enable:
        # core src/model_config_utils.cc ValidateModelConfig (DLIS-4034), its words.
        fail(
            f"Response Cache does not currently support model {config.name} with "
            "sequence batching scheduler. Please disable the response cache."
        )

    # Triton's Get{Boolean,Typed}SequenceControlProperties and ValidateModelConfig
    # (model_config_utils.cc:510, 665, 1576-1640), their words.
    suffix = f" for {config.name}"
    tensors: set[str] = set()
    seen_kinds: set[str] = set()
    for control_input in batching.control_input:
        if not control_input.name:
            _triton(f"sequence batching control tensor must have a name{suffix}")
        if control_input.name in tensors:
            _triton(
                f"sequence batching control tensor '{control_input.name}' is specified for "
                f"multiple control kinds{suffix}"
            )
        tensors.add(control_input.name)
        for control in control_input.control:
            kind = Kind.Name(control.kind)
            if kind in seen_kinds:
                _triton(f"sequence batching specifies multiple {kind} tensors{suffix}")
            seen_kinds.add(kind)
            given = [
                field
                for field in ("int32_false_true", "fp32_false_true", "bool_false_true")
                if len(getattr(control, field))
            ]
            fields = "'int32_false_true', 'fp32_false_true'"
            if kind in _BOOL_CONTROLS:
                if not given:
                    _triton(
                        f"sequence batching must specify either {fields} or 'bool_false_true' "
                        f"for {kind}{suffix}"
                    )
                if len(given) > 1:
                    _triton(
                        f"sequence batching specifies more than one from {fields} and "
                        f"'bool_false_true' for {kind}{suffix}"
                    )
                if len(getattr(control, given[0])) != 2:
                    _triton(
                        f"sequence batching control '{given[0]}' must have exactly 2 entries "
                        f"for {kind}{suffix}"
                    )
            else:
                if given:
                    _triton(
                        f"sequence batching must not specify either {fields} or "
                        f"'bool_false_true' for {kind}{suffix}"
                    )
                if control.data_type not in _CORRID_TYPES:
                    _triton(
                        f"unexpected data type for control {kind}{suffix}. Allowed data types "
                        "are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"
                    )

    if batching.HasField("oldest"):
        for size in batching.oldest.preferred_batch_size:
            if size <= 0:
                _triton(f"sequence batching preferred batch size must be positive{suffix}")
            if size > config.max_batch_size:
                _triton(f"sequence batching preferred batch size must be <= max batch size{suffix}")
    if batching.HasField("direct"):
        utilization = batching.direct.minimum_slot_utilization
        if not 0.0 <= utilization <= 1.0:
            _triton(
                f"sequence batching minimum slot utilization must be in range (0.0, 1.0]{suffix}"
            )

    for index, state in enumerate(batching.state):
        where = f"sequence_batching.state {index}"
        if not state.input_name or not state.output_name:
            fail(f"{where}: input_name and output_name must be set")
        where = f"sequence_batching.state '{state.input_name}'"
        if state.data_type == mc.TYPE_INVALID:
            fail(f"{where}: data_type must be set")
        if any(d < 1 and d != WILDCARD_DIM for d in state.dims):
            fail(f"{where}: dims must be integers >= 1, or -1, got {_shape_text(state.dims)}")
        for initial in state.initial_state:
            if initial.WhichOneof("state_data") is None:
                fail(f"{where}: initial_state '{initial.name}' must set zero_data or data_file")
            if any(d < 1 for d in initial.dims):
                fail(
                    f"{where}: initial_state '{initial.name}' dims must be integers >= 1, "
                    f"got {_shape_text(initial.dims)}"
                )


def _validate_ensemble(config: ModelConfig, fail: _Fail) -> None:
    # Triton's ValidateEnsembleSchedulingConfig and ValidateModelConfig
    # (model_config_utils.cc:113, 1665), their words where Triton has the check.
    name = config.name
    if config.platform != ENSEMBLE_PLATFORM:
        _triton(
            f"ensemble scheduling cannot be set for model '{name}' whose platform is not ensemble"
        )
    if not config.HasField("ensemble_scheduling"):
        _triton(f"ensemble scheduling must be set for ensemble {name} whose platform is ensemble")
    if config.instance_group:
        _triton(f"instance group should not be specified for ensemble '{name}'")
    if config.HasField("optimization"):
        _triton(f"optimization should not be specified for ensemble '{name}'")
    if config.model_warmup:
        _triton(f"model_warmup can not be specified for ensemble '{name}'")
    steps = config.ensemble_scheduling.step
    if not steps:
        _triton(f"must specify 'step' for ensemble '{name}'")

    inputs = [io.name for io in config.input]
    writer: dict[str, int] = {}  # ensemble tensor -> index of the step that writes it
    readers: dict[str, list[int]] = {}
    for index, step in enumerate(steps):
        where = f"ensemble_scheduling step {index} (model '{step.model_name}')"
        for field in ("model_name", "input_map", "output_map"):
            if not getattr(step, field):
                _triton(f"must specify '{field}' in step {index} of ensemble '{name}'")
        for tensor in step.output_map.values():
            if tensor in writer:
                _triton(
                    f"ensemble tensor '{tensor}' can appear in an output map only once for "
                    f"ensemble '{name}' step {index}"
                )
            if tensor in inputs:
                fail(f"{where}: writes ensemble input '{tensor}'")
            writer[tensor] = index
        for tensor in step.input_map.values():
            readers.setdefault(tensor, []).append(index)
    # Data flow, Triton's readiness walk: a step runs once every tensor it reads
    # exists; a tensor read but never written, or written in a cycle, never does.
    ready = set(inputs)
    pending = set(range(len(steps)))
    progress = True
    while progress:
        progress = False
        for index in sorted(pending):
            if all(t in ready for t in steps[index].input_map.values()):
                ready.update(steps[index].output_map.values())
                pending.discard(index)
                progress = True
    for tensor in inputs:
        if tensor not in readers:  # Triton's words, its stray quote too
            _triton(f"ensemble input '{tensor}' for ensemble {name}' is not used")
    outputs = {io.name for io in config.output}
    for tensor in sorted(outputs):
        if tensor not in writer and tensor not in readers:
            _triton(f"ensemble output '{tensor}' for ensemble {name}' is not used")
        if tensor not in ready:
            message = f"output '{tensor}' for ensemble '{name}' is not written"
            cut = _not_connected(tensor, steps, writer, ready)
            if cut != tensor:
                message += f": at least one of its depending tensors, '{cut}', is not connected"
            _triton(message)
    for tensor in sorted(set(writer) | set(readers)):
        if tensor not in outputs and (tensor not in ready or tensor not in readers):
            _triton(f"ensemble tensor '{tensor}' is unused in ensemble '{name}'")


def _not_connected(
    tensor: str, steps: Sequence[mc.ModelEnsembling.Step], writer: dict[str, int], ready: set[str]
) -> str:
    """The last tensor not ready on the way back from ``tensor`` (Triton's walk over
    prev_nodes in ValidateEnsembleSchedulingConfig, model_config_utils.cc:246)."""
    seen: set[str] = set()
    last = tensor
    while last in writer:
        step = steps[writer[last]]
        behind = [t for t in step.input_map.values() if t not in ready and t not in seen]
        if not behind:
            break
        last = behind[0]
        seen.add(last)
    return last
