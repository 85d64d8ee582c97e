"""Model configuration checks: the rules a settled config must meet before it loads.

Triton's ``ValidateModelConfig`` and ``ValidateModelIOConfig`` with their helpers
(core ``src/model_config_utils.cc``): platform and backend, version policy, inputs
and outputs (dims, reshape, formats), batch inputs and outputs, instance groups,
dynamic and sequence batching, ensembles, metric controls. Reading, platform
inference and normalisation are in :mod:`trionserve.repository.config`. Errors name
the model and the field, e.g. ``model 'simple': input 'INPUT0': dims must not be
empty``.
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


def validate_model_config(config: ModelConfig) -> None:
    """Raise InvalidArgument naming the model and the field for the first problem found.

    Call after auto-complete and
    :func:`~trionserve.repository.config.normalize_model_config` (Triton validates
    inputs and outputs only once the backend has filled them in).
    """
    name = config.name
    if not name:
        raise InvalidArgument("model configuration must specify 'name'")
    prefix = f"model '{name}': "

    def fail(message: str) -> NoReturn:
        raise InvalidArgument(prefix + message)

    _validate_platform(config, fail)
    if config.max_batch_size < 0:
        fail(f"max_batch_size must be >= 0, got {config.max_batch_size}")
    _validate_version_policy(config, fail)
    groups: tuple[tuple[str, Sequence[mc.ModelInput | mc.ModelOutput]], ...] = (
        ("input", config.input),
        ("output", config.output),
    )
    for kind, tensors in groups:
        seen: set[str] = set()
        for index, io in enumerate(tensors):
            _validate_io(kind, index, io, config, fail)
            if io.name in seen:
                fail(f"{kind} '{io.name}' is declared more than once")
            seen.add(io.name)
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
    for index, control in enumerate(config.model_metrics.metric_control):
        where = f"model_metrics.metric_control {index}"
        if not control.metric_identifier.family:
            fail(f"{where}: metric_identifier.family must not be empty")
        if not control.histogram_options.buckets:
            fail(f"{where}: histogram_options.buckets must not be empty")


def _validate_platform(config: ModelConfig, fail: _Fail) -> None:
    platform, backend = config.platform, config.backend
    if not platform and not backend:
        fail("platform or backend must be set")
    if platform == ENSEMBLE_PLATFORM:
        if backend:
            fail(f"an ensemble (platform 'ensemble') must have an empty backend, got '{backend}'")
        return
    if not backend:
        fail(f"unexpected platform '{platform}' with no backend")
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


def _validate_io(
    kind: str, index: int, io: mc.ModelInput | mc.ModelOutput, config: ModelConfig, fail: _Fail
) -> None:
    if not io.name:
        fail(f"{kind} {index}: name must not be empty")
    where = f"{kind} '{io.name}'"
    if io.data_type == mc.TYPE_INVALID:
        fail(f"{where}: data_type must be set")
    if not io.dims:
        fail(
            f"{where}: dims must not be empty "
            "(use dims: [ 1 ] with reshape: { shape: [ ] } for a scalar)"
        )
    if any(d < 1 and d != WILDCARD_DIM for d in io.dims):
        fail(
            f"{where}: dims must be integers >= 1, or -1 for a variable-size dimension, "
            f"got {_shape_text(io.dims)}"
        )
    if io.HasField("reshape"):
        shape = io.reshape.shape
        if not shape and config.max_batch_size == 0:
            fail(
                f"{where}: reshape must not be empty for a model with max_batch_size 0, "
                "as scalar tensors are not supported"
            )
        if any(d < 1 and d != WILDCARD_DIM for d in shape):
            fail(
                f"{where}: reshape.shape must be integers >= 1, or -1 for a variable-size "
                f"dimension, got {_shape_text(shape)}"
            )
        dims_count, reshape_count = _element_count(io.dims), _element_count(shape)
        mismatch = f"{where}: dims {_shape_text(io.dims)} and reshape {_shape_text(shape)}"
        if dims_count != reshape_count and (reshape_count != 0 or dims_count != 1):
            fail(f"{mismatch} have different element counts")
        if dims_count == WILDCARD_DIM:
            dims_trunks, reshape_trunks = _trunk_counts(io.dims), _trunk_counts(shape)
            if len(dims_trunks) != len(reshape_trunks):
                fail(f"{mismatch} have different numbers of variable-size dimensions")
            if dims_trunks != reshape_trunks:
                fail(f"{mismatch} have different element counts")
    is_tensorrt = config.platform == "tensorrt_plan"
    if (
        isinstance(io, mc.ModelInput)
        and io.format != mc.ModelInput.FORMAT_NONE
        and len(io.dims) != 3
    ):
        format_name = mc.ModelInput.Format.Name(io.format)
        fail(f"{where}: format {format_name} requires 3 dims, got {_shape_text(io.dims)}")
    if io.is_shape_tensor and not is_tensorrt:
        fail(f"{where}: is_shape_tensor is only supported for platform 'tensorrt_plan'")
    if io.is_non_linear_format_io:
        if not is_tensorrt:
            fail(f"{where}: is_non_linear_format_io is only supported for platform 'tensorrt_plan'")
        if len(io.dims) != 3:
            fail(f"{where}: is_non_linear_format_io requires 3 dims, got {_shape_text(io.dims)}")


def _validate_batch_io(config: ModelConfig, fail: _Fail) -> None:
    inputs = {io.name for io in config.input}
    outputs = {io.name for io in config.output}
    for index, batch_input in enumerate(config.batch_input):
        where = f"batch_input {index}"
        kind = mc.BatchInput.Kind.Name(batch_input.kind)
        if len(batch_input.source_input) != 1:
            count = len(batch_input.source_input)
            fail(f"{where}: kind {kind} expects 1 source_input, got {count}")
        if batch_input.data_type not in (mc.TYPE_INT32, mc.TYPE_FP32):
            fail(f"{where}: data_type must be TYPE_INT32 or TYPE_FP32")
        for source in batch_input.source_input:
            if source not in inputs:
                fail(f"{where}: unknown source_input '{source}'")
    for index, batch_output in enumerate(config.batch_output):
        where = f"batch_output {index}"
        if len(batch_output.source_input) != 1:
            fail(f"{where}: expects 1 source_input, got {len(batch_output.source_input)}")
        for source in batch_output.source_input:
            if source not in inputs:
                fail(f"{where}: unknown source_input '{source}'")
        targets: set[str] = set()
        for target in batch_output.target_name:
            if target not in outputs:
                fail(f"{where}: unknown target_name '{target}'")
            if target in targets:
                fail(f"{where}: target_name '{target}' can only be given once")
            targets.add(target)


def _validate_instance_groups(config: ModelConfig, fail: _Fail) -> None:
    Kind = mc.ModelInstanceGroup.Kind
    for index, group in enumerate(config.instance_group):
        where = f"instance_group '{group.name}'" if group.name else f"instance_group {index}"
        if group.count < 0:
            fail(f"{where}: count must be >= 1 (0 or unset means the default), got {group.count}")
        if group.kind not in Kind.values():
            fail(f"{where}: unknown kind {group.kind}")
        if group.kind in (Kind.Value("KIND_CPU"), Kind.Value("KIND_MODEL")) and group.gpus:
            fail(f"{where}: kind {Kind.Name(group.kind)} must not list gpus")
        if any(gpu < 0 for gpu in group.gpus):
            fail(f"{where}: gpus must be non-negative device ids, got {list(group.gpus)}")
        if group.profile:
            if config.platform != "tensorrt_plan":
                fail(f"{where}: profile is only supported for platform 'tensorrt_plan'")
            for profile in group.profile:
                if not profile.isdigit():
                    fail(f"{where}: profile must be a non-negative integer, got '{profile}'")


def _validate_dynamic_batching(config: ModelConfig, fail: _Fail) -> None:
    batching = config.dynamic_batching
    for size in batching.preferred_batch_size:
        if size <= 0:
            fail(f"dynamic_batching.preferred_batch_size must be positive, got {size}")
        if size > config.max_batch_size:
            fail(
                f"dynamic_batching.preferred_batch_size {size} exceeds max_batch_size "
                f"{config.max_batch_size}"
            )
    levels = batching.priority_levels
    if levels:
        if not 1 <= batching.default_priority_level <= levels:
            fail(
                f"dynamic_batching.default_priority_level must be in [1, {levels}] "
                f"when priority_levels is {levels}, got {batching.default_priority_level}"
            )
        for level in batching.priority_queue_policy:
            if not 1 <= level <= levels:
                fail(
                    f"dynamic_batching.priority_queue_policy level {level} is outside [1, {levels}]"
                )
    if batching.preserve_ordering:
        if levels > 1:
            fail(
                "dynamic_batching: only one priority level is allowed when "
                "preserve_ordering is true"
            )
        policies = [batching.default_queue_policy, *batching.priority_queue_policy.values()]
        for policy in policies:
            delays = policy.timeout_action == mc.ModelQueuePolicy.DELAY
            if policy.default_timeout_microseconds and delays:
                fail(
                    "dynamic_batching: a queue policy cannot use timeout_action DELAY "
                    "when preserve_ordering is true"
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

    tensors: set[str] = set()
    seen_kinds: set[str] = set()
    for control_input in batching.control_input:
        if not control_input.name:
            fail("sequence_batching.control_input must have a name")
        if control_input.name in tensors:
            fail(f"sequence_batching.control_input '{control_input.name}' is given more than once")
        tensors.add(control_input.name)
        for control in control_input.control:
            kind = Kind.Name(control.kind)
            where = f"sequence_batching.control_input '{control_input.name}' ({kind})"
            if kind in seen_kinds:
                fail(f"sequence_batching specifies more than one {kind} control")
            seen_kinds.add(kind)
            given = [
                field
                for field in ("int32_false_true", "fp32_false_true", "bool_false_true")
                if len(getattr(control, field))
            ]
            if kind in _BOOL_CONTROLS:
                if not given:
                    fail(
                        f"{where}: must set one of int32_false_true, fp32_false_true "
                        "or bool_false_true"
                    )
                if len(given) > 1:
                    fail(f"{where}: must set only one of {', '.join(given)}")
                if len(getattr(control, given[0])) != 2:
                    fail(f"{where}: {given[0]} must have exactly 2 entries")
            else:
                if given:
                    fail(f"{where}: must not set {given[0]}")
                if control.data_type not in _CORRID_TYPES:
                    fail(
                        f"{where}: data_type must be TYPE_UINT64, TYPE_INT64, TYPE_UINT32, "
                        f"TYPE_INT32 or TYPE_STRING, got {mc.DataType.Name(control.data_type)}"
                    )

    if batching.HasField("oldest"):
        for size in batching.oldest.preferred_batch_size:
            if size <= 0:
                fail(f"sequence_batching.oldest.preferred_batch_size must be positive, got {size}")
            if size > config.max_batch_size:
                fail(
                    f"sequence_batching.oldest.preferred_batch_size {size} exceeds "
                    f"max_batch_size {config.max_batch_size}"
                )
    if batching.HasField("direct"):
        utilization = batching.direct.minimum_slot_utilization
        if not 0.0 <= utilization <= 1.0:
            fail(
                "sequence_batching.direct.minimum_slot_utilization must be in [0, 1], "
                f"got {utilization}"
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
    if config.platform != ENSEMBLE_PLATFORM:
        fail(f"ensemble_scheduling is set but platform is '{config.platform}', not 'ensemble'")
    if not config.HasField("ensemble_scheduling"):
        fail("platform 'ensemble' requires ensemble_scheduling")
    if config.instance_group:
        fail("instance_group must not be set for an ensemble")
    if config.HasField("optimization"):
        fail("optimization must not be set for an ensemble")
    if config.model_warmup:
        fail("model_warmup must not be set for an ensemble")
    steps = config.ensemble_scheduling.step
    if not steps:
        fail("ensemble_scheduling must have at least one step")

    inputs = [io.name for io in config.input]
    writer: dict[str, int] = {}  # ensemble tensor -> index of the step that writes it
    readers: dict[str, list[int]] = {}
    for index, step in enumerate(steps):
        where = f"ensemble_scheduling step {index}"
        if not step.model_name:
            fail(f"{where}: model_name must be set")
        where = f"{where} (model '{step.model_name}')"
        if not step.input_map:
            fail(f"{where}: input_map must not be empty")
        if not step.output_map:
            fail(f"{where}: output_map must not be empty")
        for tensor in step.output_map.values():
            if tensor in writer:
                fail(
                    f"{where}: ensemble tensor '{tensor}' is already written by step "
                    f"{writer[tensor]}"
                )
            if tensor in inputs:
                fail(f"{where}: writes ensemble input '{tensor}'")
            writer[tensor] = index
        for tensor in step.input_map.values():
            readers.setdefault(tensor, []).append(index)
    for tensor, steps_reading in readers.items():
        if tensor not in writer and tensor not in inputs:
            fail(
                f"ensemble_scheduling step {steps_reading[0]} reads ensemble tensor "
                f"'{tensor}', which is neither an ensemble input nor written by any step"
            )

    # Data flow: a step can run once every tensor it reads exists.
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
    for name in inputs:
        if name not in readers:
            fail(f"ensemble input '{name}' is not used by any step")
    outputs = {io.name for io in config.output}
    for name in sorted(outputs):
        if name not in writer:
            fail(f"ensemble output '{name}' is not written by any step")
    if pending:
        index = min(pending)
        fail(
            f"ensemble_scheduling step {index} (model '{steps[index].model_name}') can "
            "never run: its inputs depend on a cycle"
        )
    for tensor in writer:
        if tensor not in outputs and tensor not in readers:
            fail(f"ensemble tensor '{tensor}' is written by step {writer[tensor]} but never used")
