"""Model configuration: read config.pbtxt, settle platform/backend, validate, normalise.

The rules and defaults mirror Triton's ``model_config_utils.cc``; error messages
name the model and the field, e.g. ``model 'simple': input 'INPUT0': dims must not
be empty``. Every function here is blocking or pure: the registry calls them in a
worker thread, in the order read -> infer_platform -> (auto-complete) ->
normalize -> validate, like Triton.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor

from trionserve._generated import model_config_pb2 as mc
from trionserve.core.errors import InvalidArgument, Unavailable
from trionserve.repository.versions import list_versions

ModelConfig = mc.ModelConfig

CONFIG_FILENAME = "config.pbtxt"
# --model-config-name NAME reads <model>/configs/NAME.pbtxt where it exists.
CUSTOM_CONFIGS_DIR = "configs"
ENSEMBLE_PLATFORM = "ensemble"

# Platform -> the backend that serves it (Triton's GetBackendTypeFromPlatform).
_PLATFORM_BACKEND = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "libtorch": "pytorch",
    "torch_aoti": "pytorch",
    "tensorrt_plan": "tensorrt",
    "tensorflow_savedmodel": "tensorflow",
    "tensorflow_graphdef": "tensorflow",
}
# Backends whose platform is fixed; tensorflow has two platforms and is settled by
# the model file, python and custom backends have none.
_BACKEND_PLATFORM = {
    "onnxruntime": "onnxruntime_onnx",
    "pytorch": "pytorch_libtorch",
    "tensorrt": "tensorrt_plan",
}
# Model files Triton recognises in a version directory, in the order it checks them:
# (file name, platform, backend, must be a directory: True / a file: False / either: None)
_MODEL_FILES = (
    ("model.savedmodel", "tensorflow_savedmodel", "tensorflow", True),
    ("model.graphdef", "tensorflow_graphdef", "tensorflow", False),
    ("model.plan", "tensorrt_plan", "tensorrt", False),
    ("model.onnx", "onnxruntime_onnx", "onnxruntime", None),
    ("model.xml", "", "openvino", None),
    ("model.pt", "pytorch_libtorch", "pytorch", False),
    ("model.pt2", "torch_aoti", "pytorch", False),
    ("model.py", "", "python", None),
)
_SUFFIX_MODEL_FILE = {Path(f[0]).suffix: f for f in _MODEL_FILES}

# Backends whose KIND_CPU groups default to two instances (Triton's SetDefaultInstanceCount).
_TWO_CPU_INSTANCES = ("onnxruntime", "tensorflow")
SEQUENCE_IDLE_DEFAULT_MICROSECONDS = 1_000_000
WILDCARD_DIM = -1


# -- reading ------------------------------------------------------------------------


def config_file(model_dir: Path, config_name: str | None = None) -> str:
    """The model's config file, relative to its directory: Triton's rule for
    ``--model-config-name NAME`` is ``configs/NAME.pbtxt`` when that file exists,
    else ``config.pbtxt``."""
    if config_name:
        custom = f"{CUSTOM_CONFIGS_DIR}/{config_name}.pbtxt"
        if (Path(model_dir) / custom).is_file():
            return custom
    return CONFIG_FILENAME


def read_model_config(
    model_dir: Path, override_json: str | None = None, config_name: str | None = None
) -> tuple[ModelConfig, bool]:
    """Parse the model's config file (see :func:`config_file`), or ``override_json``
    when given.

    ``override_json`` is the JSON config of Triton's load API; it replaces the file.
    A missing config.pbtxt gives an empty config (auto-complete may fill it). The
    name defaults to the directory name and must equal it when given. Returns the
    config and whether ``max_batch_size`` appeared in the source (proto3 cannot tell
    an explicit 0 from an absent field).
    """
    model_dir = Path(model_dir)
    dir_name = model_dir.name
    if override_json is not None:
        source = "the config override"
        config, max_batch_size_set = _parse_override(override_json, dir_name)
    else:
        source = config_file(model_dir, config_name)
        path = model_dir / source
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return ModelConfig(name=dir_name), False
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise InvalidArgument(
                f"model '{dir_name}': cannot read {dir_name}/{source}: {reason}"
            ) from None
        context = f"model '{dir_name}': failed to parse {dir_name}/{source}"
        config = _parse_text(text, context)
        max_batch_size_set = _text_names_max_batch_size(text)

    if not config.name:
        config.name = dir_name
    elif config.name != dir_name:
        raise InvalidArgument(
            f"model name '{config.name}' in {source} does not match the directory name '{dir_name}'"
        )
    return config, max_batch_size_set


def _parse_text(text: str, context: str) -> ModelConfig:
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        line, column = exc.GetLine(), exc.GetColumn()
        detail = str(exc)
        detail = _cpp_wording(detail)
        if line is not None:
            # str(exc) starts with "line:column : "; say it in words instead.
            detail = detail.split(" : ", 1)[-1]
            raise InvalidArgument(f"{context}: line {line}, column {column}: {detail}") from None
        raise InvalidArgument(f"{context}: {detail}") from None


def _cpp_wording(detail: str) -> str:
    """protobuf's C++ words for an integer the Python parser refuses, as Triton
    (which reads config.pbtxt with the C++ parser) reports it: 'Expected integer,
    got: "x"', 'Expected integer, got: -' (a negative unsigned value) and
    'Integer out of range (N)'."""
    match = re.search(r"Couldn't parse integer: (.*)$", detail)
    if match is not None:
        return f"{detail[: match.start()]}Expected integer, got: {match.group(1)}"
    match = re.search(r"Value out of range: (-?)(\d+)$", detail)
    if match is not None:
        words = (
            "Expected integer, got: -" if match.group(1) else f"Integer out of range ({match[2]})"
        )
        return detail[: match.start()] + words
    return detail


def _text_names_max_batch_size(text: str) -> bool:
    """Whether a top-level ``max_batch_size`` field appears (comments and strings skipped)."""
    tokens = text_format.Tokenizer(text.splitlines())
    depth = 0
    while not tokens.AtEnd():
        token = tokens.token
        if token in ("{", "<", "["):
            depth += 1
        elif token in ("}", ">", "]"):
            depth -= 1
        elif depth == 0 and token == "max_batch_size":
            return True
        tokens.NextToken()
    return False


def _parse_override(override_json: str, dir_name: str) -> tuple[ModelConfig, bool]:
    context = f"failed to load '{dir_name}': invalid config override"
    try:
        obj = json.loads(override_json)
    except ValueError as exc:
        raise InvalidArgument(f"{context}: {exc}") from None
    config = _config_from_dict(obj, context)
    return config, ("max_batch_size" in obj or "maxBatchSize" in obj)


def model_config_from_json(obj: dict) -> ModelConfig:
    """A ModelConfig from its JSON form (what :func:`model_config_to_json` returns)."""
    return _config_from_dict(obj, "invalid model configuration")


def _config_from_dict(obj, context: str) -> ModelConfig:
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{context}: expected a JSON object, got {type(obj).__name__}")
    try:
        return json_format.ParseDict(obj, ModelConfig())
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"{context}: {exc}") from None


# -- platform and backend --------------------------------------------------------------


def infer_platform(config: ModelConfig, model_dir: Path) -> None:
    """Settle ``platform``, ``backend`` and ``default_model_filename`` like Triton.

    Each known platform implies its backend and the reverse (onnxruntime_onnx <->
    onnxruntime, pytorch_libtorch <-> pytorch, tensorrt_plan <-> tensorrt,
    tensorflow_savedmodel / tensorflow_graphdef <-> tensorflow); python and custom
    backends have no platform; the ensemble platform has no backend. With neither
    set, ``default_model_filename`` or the model file in a version directory
    (model.onnx, model.pt, model.plan, model.py, model.savedmodel, ...) decides.
    """
    name = config.name
    platform, backend = config.platform, config.backend

    if platform == ENSEMBLE_PLATFORM:
        if backend:
            raise InvalidArgument(
                f"model '{name}': an ensemble (platform 'ensemble') must have an empty "
                f"backend, got backend '{backend}'"
            )
        return

    if not platform and not backend:
        found = _identify_model_file(config, Path(model_dir))
        if found is None:
            raise InvalidArgument(
                f"model '{name}': platform or backend must be set in {CONFIG_FILENAME}: "
                "no known model file (model.onnx, model.pt, model.plan, model.py, "
                "model.savedmodel, model.graphdef) was found in its version directories"
            )
        _, platform, backend, _ = found
    elif not backend:
        backend = _PLATFORM_BACKEND.get(platform, "")
        if not backend:
            raise InvalidArgument(
                f"model '{name}': unknown platform '{platform}'; expected one of "
                f"{sorted(_PLATFORM_BACKEND) + [ENSEMBLE_PLATFORM]}, or set 'backend'"
            )
    elif not platform:
        if backend == "tensorflow":
            found = _identify_model_file(config, Path(model_dir))
            if found is None or found[2] != "tensorflow":
                raise InvalidArgument(
                    f"model '{name}': backend 'tensorflow' needs platform "
                    "'tensorflow_savedmodel' or 'tensorflow_graphdef'"
                )
            platform = found[1]
        else:
            platform = _BACKEND_PLATFORM.get(backend, "")

    _check_platform_backend_pair(name, platform, backend)
    config.platform, config.backend = platform, backend
    if not config.default_model_filename:
        config.default_model_filename = _default_model_filename(platform, backend)


def _check_platform_backend_pair(name: str, platform: str, backend: str) -> None:
    # A backend Triton knows must match its platform; custom backends take any.
    known = set(_PLATFORM_BACKEND.values())
    if backend in known and _PLATFORM_BACKEND.get(platform) != backend:
        raise InvalidArgument(
            f"model '{name}': unexpected 'platform' and 'backend' pair: platform "
            f"'{platform}' is not served by backend '{backend}'"
        )


def _default_model_filename(platform: str, backend: str) -> str:
    for filename, file_platform, file_backend, _ in _MODEL_FILES:
        if file_backend == backend and (file_platform == platform or not file_platform):
            return filename
    return ""


def _identify_model_file(config: ModelConfig, model_dir: Path):
    """The _MODEL_FILES entry that default_model_filename or a version directory names."""
    if config.default_model_filename:
        return _SUFFIX_MODEL_FILE.get(Path(config.default_model_filename).suffix)
    try:
        versions = list_versions(model_dir)
    except Unavailable:
        return None
    for version in versions:
        version_dir = model_dir / str(version)
        for entry in _MODEL_FILES:
            path = version_dir / entry[0]
            must_be_dir = entry[3]
            if path.exists() and (must_be_dir is None or path.is_dir() == must_be_dir):
                return entry
    return None


# -- validation ---------------------------------------------------------------------


def validate_model_config(config: ModelConfig) -> None:
    """Raise InvalidArgument naming the model and the field for the first problem found.

    Call after auto-complete and :func:`normalize_model_config` (Triton validates
    inputs and outputs only once the backend has filled them in).
    """
    name = config.name
    if not name:
        raise InvalidArgument("model configuration must specify 'name'")
    prefix = f"model '{name}': "

    def fail(message: str):
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
        fail(
            "response_cache cannot be enabled for a model with a decoupled model_transaction_policy"
        )
    for index, control in enumerate(config.model_metrics.metric_control):
        where = f"model_metrics.metric_control {index}"
        if not control.metric_identifier.family:
            fail(f"{where}: metric_identifier.family must not be empty")
        if not control.histogram_options.buckets:
            fail(f"{where}: histogram_options.buckets must not be empty")


def _validate_platform(config: ModelConfig, fail) -> None:
    platform, backend = config.platform, config.backend
    if not platform and not backend:
        fail("platform or backend must be set")
    if platform == ENSEMBLE_PLATFORM:
        if backend:
            fail(f"an ensemble (platform 'ensemble') must have an empty backend, got '{backend}'")
        return
    if not backend:
        fail(f"unexpected platform '{platform}' with no backend")
    _check_platform_backend_pair(config.name, platform, backend)


def _validate_version_policy(config: ModelConfig, fail) -> None:
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


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _element_count(shape) -> int:
    # As Triton's GetElementCount: -1 with any wildcard, 0 for an empty shape.
    if not shape:
        return 0
    count = 1
    for dim in shape:
        if dim == WILDCARD_DIM:
            return WILDCARD_DIM
        count *= dim
    return count


def _trunk_counts(shape) -> list[int]:
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


def _validate_io(kind: str, index: int, io, config: ModelConfig, fail) -> None:
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
    if kind == "input" and io.format != mc.ModelInput.FORMAT_NONE and len(io.dims) != 3:
        format_name = mc.ModelInput.Format.Name(io.format)
        fail(f"{where}: format {format_name} requires 3 dims, got {_shape_text(io.dims)}")
    if io.is_shape_tensor and not is_tensorrt:
        fail(f"{where}: is_shape_tensor is only supported for platform 'tensorrt_plan'")
    if io.is_non_linear_format_io:
        if not is_tensorrt:
            fail(f"{where}: is_non_linear_format_io is only supported for platform 'tensorrt_plan'")
        if len(io.dims) != 3:
            fail(f"{where}: is_non_linear_format_io requires 3 dims, got {_shape_text(io.dims)}")


def _validate_batch_io(config: ModelConfig, fail) -> None:
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


def _validate_instance_groups(config: ModelConfig, fail) -> None:
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


def _validate_dynamic_batching(config: ModelConfig, fail) -> None:
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


def _validate_sequence_batching(config: ModelConfig, fail) -> None:
    batching = config.sequence_batching
    Kind = mc.ModelSequenceBatching.Control.Kind
    if config.response_cache.enable:
        fail("response_cache cannot be enabled for a model with sequence_batching")

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


def _validate_ensemble(config: ModelConfig, fail) -> None:
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


# -- normalisation ------------------------------------------------------------------


def normalize_model_config(config: ModelConfig) -> None:
    """Fill in Triton's defaults (NormalizeModelConfig and NormalizeInstanceGroup).

    - version_policy: latest { num_versions: 1 } when unset;
    - dynamic_batching / sequence_batching.oldest: preferred_batch_size
      [max_batch_size] when empty and max_batch_size > 0;
    - sequence_batching.max_sequence_idle_microseconds: 1000000 when 0;
    - non-ensembles: input/output pinned memory enabled when unset; one instance
      group ``{name: <model>, kind: KIND_AUTO}`` when there is none; each group
      without a name gets ``<model>_<index>``; count 0 (unset) becomes the
      default, 1 (2 for KIND_CPU groups of onnxruntime and tensorflow models, as
      in Triton); a negative count is left for validation to reject.
      KIND_AUTO is resolved where the host's GPUs are known, not here.
    """
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1

    if config.HasField("dynamic_batching"):
        preferred = config.dynamic_batching.preferred_batch_size
        if not preferred and config.max_batch_size > 0:
            preferred.append(config.max_batch_size)

    if config.HasField("sequence_batching"):
        batching = config.sequence_batching
        if batching.max_sequence_idle_microseconds == 0:
            batching.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_MICROSECONDS
        if batching.HasField("oldest"):
            preferred = batching.oldest.preferred_batch_size
            if not preferred and config.max_batch_size > 0:
                preferred.append(config.max_batch_size)

    if config.HasField("ensemble_scheduling") or config.platform == ENSEMBLE_PLATFORM:
        return

    optimization = config.optimization
    if not optimization.HasField("input_pinned_memory"):
        optimization.input_pinned_memory.enable = True
    if not optimization.HasField("output_pinned_memory"):
        optimization.output_pinned_memory.enable = True

    if not config.instance_group:
        config.instance_group.add(name=config.name)
    cpu = mc.ModelInstanceGroup.Kind.Value("KIND_CPU")
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}"
        if group.count == 0:  # negative counts are left for validation to reject
            two = group.kind == cpu and config.backend in _TWO_CPU_INSTANCES
            group.count = 2 if two else 1


# -- JSON ---------------------------------------------------------------------------

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def model_config_to_json(config: ModelConfig) -> dict:
    """The JSON that Triton's ``GET /v2/models/{name}/config`` returns.

    Field names as in the proto, fields without presence printed with their
    defaults, and 64-bit integers as JSON numbers (proto3 JSON renders them as
    strings; Triton turns them back into numbers). Map keys stay strings.
    """
    obj = json_format.MessageToDict(
        config,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    _int64_to_numbers(config.DESCRIPTOR, obj)
    return obj


def _int64_to_numbers(descriptor, obj: dict) -> None:
    for field in descriptor.fields:
        if field.name not in obj:
            continue
        value = obj[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                value[key] = _convert(value_field, item)
        elif _is_repeated(field):
            obj[field.name] = [_convert(field, item) for item in value]
        else:
            obj[field.name] = _convert(field, value)


def _is_repeated(field) -> bool:
    # ``label`` is deprecated in newer protobuf releases in favour of ``is_repeated``.
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated() if callable(is_repeated) else is_repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _convert(field, value):
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        _int64_to_numbers(field.message_type, value)
        return value
    if field.type in _INT64_TYPES:
        return int(value)
    return value
