"""ONNX Runtime execution providers for an instance, from the model config.

Follows Triton's onnxruntime backend: KIND_GPU instances get the CUDA execution
provider on their device, preceded by the TensorRT execution provider when
``optimization { execution_accelerators { gpu_execution_accelerator [ { name:
"tensorrt" ... } ] } }`` asks for it; ``name: "cuda"`` parameters (and the older
model ``parameters`` cudnn_conv_algo_search, gpu_mem_limit, arena_extend_strategy,
do_copy_in_default_stream) tune the CUDA provider; ``cpu_execution_accelerator
[ { name: "openvino" } ]`` adds OpenVINO for every instance. The CPU provider always
comes last. Pure: the available providers are passed in.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from trionserve.backends.base import InstanceSpec
from trionserve.core.errors import InvalidArgument, Unavailable

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelParameter

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"

# Triton's TensorRT accelerator parameters -> (TensorRT EP option, value kind).
_TRT_OPTIONS = {
    "max_workspace_size_bytes": ("trt_max_workspace_size", "int"),
    "trt_max_partition_iterations": ("trt_max_partition_iterations", "int"),
    "trt_min_subgraph_size": ("trt_min_subgraph_size", "int"),
    "int8_calibration_table_name": ("trt_int8_calibration_table_name", "str"),
    "int8_use_native_calibration_table": ("trt_int8_use_native_calibration_table", "bool"),
    "trt_dla_enable": ("trt_dla_enable", "bool"),
    "trt_dla_core": ("trt_dla_core", "int"),
    "trt_engine_cache_enable": ("trt_engine_cache_enable", "bool"),
    "trt_engine_cache_path": ("trt_engine_cache_path", "str"),
    "trt_engine_cache_prefix": ("trt_engine_cache_prefix", "str"),
    "trt_dump_subgraphs": ("trt_dump_subgraphs", "bool"),
    "trt_force_sequential_engine_build": ("trt_force_sequential_engine_build", "bool"),
    "trt_context_memory_sharing_enable": ("trt_context_memory_sharing_enable", "bool"),
    "trt_layer_norm_fp32_fallback": ("trt_layer_norm_fp32_fallback", "bool"),
    "trt_timing_cache_enable": ("trt_timing_cache_enable", "bool"),
    "trt_timing_cache_path": ("trt_timing_cache_path", "str"),
    "trt_force_timing_cache": ("trt_force_timing_cache", "bool"),
    "trt_detailed_build_log": ("trt_detailed_build_log", "bool"),
    "trt_build_heuristics_enable": ("trt_build_heuristics_enable", "bool"),
    "trt_sparsity_enable": ("trt_sparsity_enable", "bool"),
    "trt_builder_optimization_level": ("trt_builder_optimization_level", "int"),
    "trt_auxiliary_streams": ("trt_auxiliary_streams", "int"),
    "trt_tactic_sources": ("trt_tactic_sources", "str"),
    "trt_extra_plugin_lib_paths": ("trt_extra_plugin_lib_paths", "str"),
    "trt_profile_min_shapes": ("trt_profile_min_shapes", "str"),
    "trt_profile_max_shapes": ("trt_profile_max_shapes", "str"),
    "trt_profile_opt_shapes": ("trt_profile_opt_shapes", "str"),
    "trt_cuda_graph_enable": ("trt_cuda_graph_enable", "bool"),
    "trt_dump_ep_context_model": ("trt_dump_ep_context_model", "bool"),
    "trt_ep_context_file_path": ("trt_ep_context_file_path", "str"),
    "trt_ep_context_embed_mode": ("trt_ep_context_embed_mode", "int"),
}
_PRECISION_MODES = {
    "FP32": None,
    "FP16": "trt_fp16_enable",
    "BF16": "trt_bf16_enable",
    "INT8": "trt_int8_enable",
}
_CUDA_BOOL_OPTIONS = ("do_copy_in_default_stream", "use_ep_level_unified_stream")
# Older model ``parameters`` for the CUDA provider: integer codes -> option values.
_LEGACY_CUDA_CODES = {
    "cudnn_conv_algo_search": ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"),
    "arena_extend_strategy": ("kNextPowerOfTwo", "kSameAsRequested"),
}
_LEGACY_CUDA_STRINGS = ("gpu_mem_limit", "do_copy_in_default_stream")


# An InferenceSession provider: its name, or its name and options.
Provider = str | tuple[str, dict[str, str]]


def _value(model: str, where: str, key: str, value: str, kind: str) -> str:
    """Validate a parameter value; booleans become "1"/"0" for onnxruntime."""
    text = value.strip()
    if kind == "bool":
        lowered = text.lower()
        if lowered in ("1", "true"):
            return "1"
        if lowered in ("0", "false"):
            return "0"
    elif kind == "int":
        try:
            int(text)
            return text
        except ValueError:
            pass
    else:
        return value
    raise InvalidArgument(
        f"model '{model}': {where} parameter '{key}' must be "
        f"{'a boolean (1, 0, true, false)' if kind == 'bool' else 'an integer'}, "
        f"got '{value}'"
    )


def _tensorrt_options(model: str, parameters: Mapping[str, str], device_id: int) -> dict[str, str]:
    where = "TensorRT execution accelerator"
    options: dict[str, str] = {}
    for key, value in sorted(parameters.items()):
        if key == "precision_mode":
            if value not in _PRECISION_MODES:
                raise InvalidArgument(
                    f"model '{model}': unsupported precision mode '{value}' is "
                    f"requested; expected one of {list(_PRECISION_MODES)}"
                )
            flag = _PRECISION_MODES[value]
            if flag:
                options[flag] = "1"
            continue
        if key not in _TRT_OPTIONS:
            raise InvalidArgument(
                f"model '{model}': unknown parameter '{key}' is provided for {where}"
            )
        option, kind = _TRT_OPTIONS[key]
        if value:
            options[option] = _value(model, where, key, value, kind)
    options["device_id"] = str(device_id)
    return options


def _legacy_cuda_options(model: str, parameters: Mapping[str, ModelParameter]) -> dict[str, str]:
    options: dict[str, str] = {}
    for key, names in _LEGACY_CUDA_CODES.items():
        if key in parameters:
            text = parameters[key].string_value.strip()
            if not text.isdigit() or int(text) >= len(names):
                raise InvalidArgument(
                    f"model '{model}': unsupported {key} value '{text}' is requested"
                )
            options[key] = names[int(text)]
    for key in _LEGACY_CUDA_STRINGS:
        if key in parameters:
            options[key] = parameters[key].string_value.strip()
    return options


def execution_providers(
    config: ModelConfig, spec: InstanceSpec, available: Collection[str]
) -> list[Provider]:
    """The ``providers`` argument of ``InferenceSession`` for one instance."""
    model = config.name
    accelerators = config.optimization.execution_accelerators
    providers: list[Provider] = []
    if spec.kind == "KIND_GPU":
        if CUDA not in available:
            raise Unavailable(
                f"instance '{spec.name}' of model '{model}' is KIND_GPU but "
                "onnxruntime has no CUDA execution provider (install onnxruntime-gpu in "
                "place of onnxruntime, on a host with a GPU)"
            )
        cuda_options = _legacy_cuda_options(model, config.parameters)
        for accelerator in accelerators.gpu_execution_accelerator:
            if accelerator.name == "tensorrt":
                if TENSORRT not in available:
                    raise Unavailable(
                        f"model '{model}' asks for the 'tensorrt' GPU execution "
                        "accelerator but onnxruntime has no TensorRT execution "
                        "provider (onnxruntime-gpu with the TensorRT libraries)"
                    )
                options = _tensorrt_options(model, accelerator.parameters, spec.device_id)
                providers.append((TENSORRT, options))
            elif accelerator.name == "cuda":
                for key, value in sorted(accelerator.parameters.items()):
                    if key in _CUDA_BOOL_OPTIONS:
                        value = _value(model, "CUDA execution accelerator", key, value, "bool")
                    if value:
                        cuda_options[key] = value
            else:
                raise InvalidArgument(
                    f"model '{model}': unknown Execution Accelerator "
                    f"'{accelerator.name}' is requested; gpu_execution_accelerator "
                    "accepts 'tensorrt' and 'cuda'"
                )
        cuda_options["device_id"] = str(spec.device_id)
        providers.append((CUDA, cuda_options))
    for accelerator in accelerators.cpu_execution_accelerator:
        if accelerator.name != "openvino":
            raise InvalidArgument(
                f"model '{model}': unknown Execution Accelerator '{accelerator.name}' "
                "is requested; cpu_execution_accelerator accepts 'openvino'"
            )
        if OPENVINO not in available:
            raise Unavailable(
                f"model '{model}' asks for the 'openvino' CPU execution accelerator "
                "but onnxruntime has no OpenVINO execution provider (install "
                "onnxruntime-openvino in place of onnxruntime)"
            )
        providers.append((OPENVINO, {"device_type": "CPU"}))
    providers.append(CPU)
    return providers
