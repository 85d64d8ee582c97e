"""Model configuration: read config.pbtxt, settle platform/backend, normalise, JSON.

The rules and defaults mirror Triton's ``model_config_utils.cc`` (GetModelConfig,
GetNormalizedModelConfig, NormalizeModelConfig, ModelConfigToJson); the checks a
settled config must pass are in :mod:`trionserve.repository.config_validation`.
Error messages name the model and the field. Every function here is blocking or
pure: the registry calls them in a worker thread, in the order read ->
infer_platform -> (auto-complete) -> normalize -> validate, like Triton.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pyjson5
from google.protobuf import json_format, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from trionserve._generated import model_config_pb2 as mc
from trionserve.core.errors import InvalidArgument, Unavailable
from trionserve.repository.versions import list_versions

if TYPE_CHECKING:
    # What a generated message's DESCRIPTOR is typed as: the pure-Python descriptor or
    # upb's (the one the protobuf runtime serves).
    from google._upb._message import Descriptor as UpbDescriptor
    from google._upb._message import FieldDescriptor as UpbFieldDescriptor

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
# (file name, platform, backend, whether it must be a directory: None when either)
_ModelFile = tuple[str, str, str, bool | None]
_MODEL_FILES: tuple[_ModelFile, ...] = (
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
    model_dir: Path,
    override_json: str | None = None,
    config_name: str | None = None,
    *,
    check_name: bool = True,
) -> tuple[ModelConfig, bool]:
    """Parse the model's config file (see :func:`config_file`), or ``override_json``
    when given.

    ``override_json`` is the JSON config of Triton's load API; it replaces the file.
    A missing config.pbtxt gives an empty config (auto-complete may fill it). The
    name defaults to the directory name and must equal it when given (unless not
    ``check_name``: the caller checks it, in Triton's order). Returns the
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
    elif check_name and config.name != dir_name:
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
            # Python's parser quotes the line before some messages; C++'s does not.
            lines = text.splitlines()
            echo = f"'{lines[line - 1]}': " if 0 < line <= len(lines) else ""
            _protobuf_error_line(f"{line}:{column}: {detail.removeprefix(echo)}")
            raise InvalidArgument(f"{context}: line {line}, column {column}: {detail}") from None
        _protobuf_error_line(detail)
        raise InvalidArgument(f"{context}: {detail}") from None


def _protobuf_error_line(detail: str) -> None:
    """The line protobuf's C++ text parser writes to stderr on a parse error.

    Triton reads config.pbtxt with ``TextFormat::ParseFromString`` (core
    src/filesystem/api.cc:599, ReadTextProto), whose default error collector logs
    the parser's own words through protobuf's logger, outside Triton's and so not
    escaped (protobuf src/google/protobuf/text_format.cc:337, as Triton 2.51 prints
    it: ``[libprotobuf ERROR .../text_format.cc:337] Error parsing text-format
    inference.ModelConfig: 6:24: ...``); Triton's own line then says only "failed
    to read text proto from <path>". Scripts grep the parser's words with their
    quotes (qa/L0_simple_ensemble: ``Expected integer, got: "invalid_value"``),
    which the escaped records of Triton's log format would not match.
    """
    stream = sys.stderr
    if stream is None:  # no stderr at all (a detached interpreter)
        return
    stream.write(
        "[libprotobuf ERROR google/protobuf/text_format.cc:337] Error parsing "
        f"text-format {ModelConfig.DESCRIPTOR.full_name}: {detail}\n"
    )
    stream.flush()


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
        obj = _legacy_json(override_json)
        if obj is None:
            raise InvalidArgument(f"{context}: {exc}") from None
    config = _config_from_dict(obj, context)
    return config, ("max_batch_size" in obj or "maxBatchSize" in obj)


def _legacy_json(text: str) -> object | None:
    """An override that is not strict JSON, read as Triton reads every override.

    Triton parses it with protobuf's ``JsonStringToMessage`` (core
    model_config_utils.cc JsonToModelConfig), whose lexer keeps protobuf's legacy
    syntax on: object keys may be bare words and strings single-quoted (protobuf
    json/internal/lexer.cc ParseBareWord, ParseUtf8). Triton's own QA writes such
    overrides (qa/L0_iterative_sequence test_backlog_fill: ``direct: {...}``).
    JSON5 is a superset of that syntax; None when the text is not JSON5 either.
    """
    try:
        return pyjson5.decode(text)
    except (pyjson5.Json5Exception, ValueError):
        return None


def model_config_from_json(obj: dict) -> ModelConfig:
    """A ModelConfig from its JSON form (what :func:`model_config_to_json` returns)."""
    return _config_from_dict(obj, "invalid model configuration")


def _config_from_dict(obj: object, context: str) -> ModelConfig:
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
            raise InvalidArgument(  # Triton's words (model_config_utils.cc:1458)
                f"Ensemble model '{name}' must have platform type '{platform}' and empty "
                "backend type"
            )
        return

    if not platform and not backend:
        found = _identify_model_file(config, Path(model_dir))
        if found is not None:
            _, platform, backend, _ = found
        elif not config.default_model_filename and "." in name:
            # Triton's custom-backend autofill: 'model.<backend_name>' names the
            # backend (core src/model_config_utils.cc AutoCompleteBackendFields,
            # lines 1282-1306).
            backend = name.split(".", 1)[1]
            platform = _BACKEND_PLATFORM.get(backend, "")
            config.default_model_filename = f"model.{backend}"
        elif config.default_model_filename:
            _triton_no_platform(name)
        else:
            # Triton's words first (model_config_utils.cc:1295), then what was looked for.
            raise InvalidArgument(
                f"Invalid model name: Could not determine backend for model '{name}' with "
                "no backend in model configuration. Expected model name of the form "
                f"'model.<backend_name>'. (platform and backend are not set in "
                f"{CONFIG_FILENAME} and no known model file (model.onnx, model.pt, "
                "model.plan, model.py, model.savedmodel, model.graphdef) was found in its "
                "version directories)"
            )
    elif not backend:
        # Triton's AutoCompleteBackendFields: the platform, else default_model_filename
        # names the backend (model_config_utils.cc:1158); then ValidateModelConfig
        # refuses an unknown platform in its words (:1448, :1470).
        backend = _PLATFORM_BACKEND.get(platform, "") or next(
            (entry[2] for entry in _MODEL_FILES if entry[0] == config.default_model_filename), ""
        )
        if not backend:
            raise InvalidArgument(
                f"unexpected platform type '{platform}' for {name} (expected one of "
                f"{sorted(_PLATFORM_BACKEND) + [ENSEMBLE_PLATFORM]}, or set 'backend')"
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

    check_platform_backend_pair(name, platform, backend)
    # Triton names a TorchScript model's file only when its config gives the
    # backend and no platform (core model_config_utils.cc:1245-1253); a platform
    # given or found from model.pt leaves it empty, as the config it reports
    # shows (the backend reads model.pt either way).
    unnamed_torchscript = platform == "pytorch_libtorch" and not (
        config.backend and not config.platform
    )
    config.platform, config.backend = platform, backend
    if not config.default_model_filename and not unnamed_torchscript:
        config.default_model_filename = _default_model_filename(platform, backend)


def _triton_no_platform(name: str) -> NoReturn:
    # model_config_utils.cc ValidateModelConfig: neither platform nor backend.
    raise InvalidArgument(f"must specify 'platform' or 'backend' for '{name}'")


def check_platform_backend_pair(name: str, platform: str, backend: str) -> None:
    # A backend Triton knows must match its platform; custom backends take any.
    known = set(_PLATFORM_BACKEND.values())
    if backend in known and _PLATFORM_BACKEND.get(platform) != backend:
        # Triton's words (model_config_utils.cc ValidateModelConfig).
        raise InvalidArgument(
            f"unexpected 'platform' and 'backend' pair, got:{platform}, {backend}"
        )


def _default_model_filename(platform: str, backend: str) -> str:
    for filename, file_platform, file_backend, _ in _MODEL_FILES:
        if file_backend == backend and (file_platform == platform or not file_platform):
            return filename
    return ""


def _identify_model_file(config: ModelConfig, model_dir: Path) -> _ModelFile | None:
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

    Each message's fields come in the proto's order, as protobuf's C++ printer
    writes them (Triton's ModelConfigToJson, core model_config_utils.cc); Python's
    puts the fields left at their default after the others, so that a policy
    with ``timeout_action: REJECT`` printed it last (qa/L0_config_json greps
    ``{"timeout_action":"REJECT","default_timeout_microseconds":...}``).
    """
    obj = json_format.MessageToDict(
        config,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    _int64_to_numbers(config.DESCRIPTOR, obj)
    return obj


def _int64_to_numbers(descriptor: Descriptor | UpbDescriptor, obj: dict[str, Any]) -> None:
    """64-bit integers as numbers, and the fields in the proto's order."""
    printed = dict(obj)
    obj.clear()
    for field in descriptor.fields:
        if field.name not in printed:
            continue
        obj[field.name] = value = printed[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                value[key] = _convert(value_field, item)
        elif field.is_repeated:
            obj[field.name] = [_convert(field, item) for item in value]
        else:
            obj[field.name] = _convert(field, value)


def _convert(field: FieldDescriptor | UpbFieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:  # FieldDescriptor.TYPE_MESSAGE
        _int64_to_numbers(field.message_type, value)
        return value
    if field.type in _INT64_TYPES:
        return int(value)
    return value
