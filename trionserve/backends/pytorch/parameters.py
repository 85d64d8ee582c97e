"""The pytorch backend's model-config ``parameters``, read and applied as Triton's
libtorch backend reads and applies them.

Triton 2.51's ``src/libtorch.cc`` (pytorch_backend r24.10; the same code is in
``src/pt/model_state.cc`` since): ``ModelState::ParseParameters`` reads, when the
model loads,

- ``DISABLE_OPTIMIZED_EXECUTION``, ``ENABLE_CACHE_CLEANING``, ``INFERENCE_MODE``,
  ``DISABLE_CUDNN``, each logged ("Optimized execution is enabled for model
  instance 'm'", ...) whether given or not;
- ``ENABLE_TENSOR_FUSER``, ``ENABLE_WEIGHT_SHARING``, ``ENABLE_JIT_PROFILING``,
  ``ENABLE_JIT_EXECUTOR``, logged and applied only when given (torch's own
  settings stay otherwise);
- ``INTRA_OP_THREAD_COUNT``, ``INTER_OP_THREAD_COUNT``: a count above 0 sets
  torch's thread pools, process-wide and once per process (``std::call_once``
  since pytorch_backend #159: the interop pool cannot be resized once used).

A boolean is backend_common's ``ParseBoolValue`` (``true``/``on``/``1``,
``false``/``off``/``0``, any case; anything else fails the load with "failed to
convert 'maybe' to boolean"), a count its ``ParseIntValue`` (``std::stoi``: a
leading integer, "failed to convert 'x' to integral number" otherwise). Triton's
message does not say which parameter; ours adds it after Triton's words.

``ModelInstanceState::Execute`` then sets, before every forward: optimized
execution (thread-local; here a context around the call), inference mode, cuDNN
(``setUserEnabledCuDNN``, process-wide, always: a model without
``DISABLE_CUDNN`` turns it back on), and the JIT profiling mode, the profiling
executor and the tensor-expression fuser when the model names them (process-wide
too, never restored: a model that does not name them runs with what the last one
set, as in Triton). ``ENABLE_CACHE_CLEANING`` empties the CUDA caching
allocator after each execute (``ClearCache``).

ENABLE_NVFUSER was dropped from the backend after 23.12 (torch no longer has
nvFuser) and ``NUM_THREADS`` / ``NUM_INTEROP_THREADS`` are the Python-based
PyTorch runtime's (``src/model.py``), not the TorchScript backend's: Triton 2.51
ignores all three for a TorchScript model, and so does this backend.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from trionserve.core.errors import InvalidArgument

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

log = structlog.get_logger(__name__)

_TRUE = ("true", "on", "1")
_FALSE = ("false", "off", "0")
# std::stoi: leading whitespace, a sign, digits; what follows is ignored.
_LEADING_INT = re.compile(r"\s*([+-]?\d+)")
_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class TorchParameters:
    """A TorchScript model's settings (Triton's ModelState fields and defaults);
    None: not given, torch's own setting stays."""

    optimized_execution: bool = True
    inference_mode: bool = True
    cudnn: bool = True
    cache_cleaning: bool = False
    weight_sharing: bool | None = None  # None: not given, off
    tensor_fuser: bool | None = None
    jit_profiling: bool | None = None
    jit_executor: bool | None = None
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None

    @classmethod
    def from_config(cls, config: ModelConfig, model: str) -> TorchParameters:
        """The settings in ``config.parameters``; InvalidArgument for a value
        Triton cannot parse (the load fails, as ParseParameters fails it)."""

        def flag(key: str) -> bool | None:
            if key not in config.parameters:
                return None
            value = config.parameters[key].string_value
            if value.lower() in _TRUE:
                return True
            if value.lower() in _FALSE:
                return False
            raise InvalidArgument(
                f"failed to convert '{value}' to boolean (parameter '{key}' of model '{model}')"
            )

        def count(key: str) -> int | None:
            if key not in config.parameters:
                return None
            value = config.parameters[key].string_value
            found = _LEADING_INT.match(value)
            if found is None or abs(int(found.group(1))) > _INT_MAX:
                # (std::stoi's out_of_range is not caught in Triton: it ends the
                # server; here it fails the load like any other bad count.)
                raise InvalidArgument(
                    f"failed to convert '{value}' to integral number "
                    f"(parameter '{key}' of model '{model}')"
                )
            return int(found.group(1))

        def given(value: bool | None, default: bool) -> bool:
            return default if value is None else value

        disable_optimized = flag("DISABLE_OPTIMIZED_EXECUTION")
        disable_cudnn = flag("DISABLE_CUDNN")
        return cls(
            optimized_execution=not given(disable_optimized, False),
            inference_mode=given(flag("INFERENCE_MODE"), True),
            cudnn=not given(disable_cudnn, False),
            cache_cleaning=given(flag("ENABLE_CACHE_CLEANING"), False),
            weight_sharing=flag("ENABLE_WEIGHT_SHARING"),
            tensor_fuser=flag("ENABLE_TENSOR_FUSER"),
            jit_profiling=flag("ENABLE_JIT_PROFILING"),
            jit_executor=flag("ENABLE_JIT_EXECUTOR"),
            intra_op_threads=count("INTRA_OP_THREAD_COUNT"),
            inter_op_threads=count("INTER_OP_THREAD_COUNT"),
        )

    def announce(self, model: str) -> None:
        """Triton's log lines for these settings, in its order and words
        (ParseParameters; "model instance" is Triton's wording for the model)."""

        def state(on: bool) -> str:
            return "enabled" if on else "disabled"

        where = f" for model instance '{model}'"
        log.info(f"Optimized execution is {state(self.optimized_execution)}{where}")
        log.info(f"Cache Cleaning is {state(self.cache_cleaning)}{where}")
        log.info(f"Inference Mode is {state(self.inference_mode)}{where}")
        log.info(f"cuDNN is {state(self.cudnn)}{where}")
        for line, value in (
            ("Tensor fuser", self.tensor_fuser),
            ("Weight sharing", self.weight_sharing),
            ("Jit profiling", self.jit_profiling),
            ("Jit executor", self.jit_executor),
        ):
            if value is not None:
                log.info(f"{line} is {state(value)}{where}")

    def set_process_flags(self, torch: Any, jit: bool) -> None:
        """What Triton's Execute sets before a forward, process-wide: cuDNN always;
        with ``jit`` (TorchScript), the JIT's profiling mode, executor and
        tensor-expression fuser where the model names them."""
        torch._C._set_cudnn_enabled(self.cudnn)
        if not jit:
            return
        if self.jit_profiling is not None:
            torch._C._jit_set_profiling_mode(self.jit_profiling)
        if self.jit_executor is not None:
            torch._C._jit_set_profiling_executor(self.jit_executor)
        if self.tensor_fuser is not None:
            torch._C._jit_set_texpr_fuser_enabled(self.tensor_fuser)


# Thread pools are set once per process (pytorch_backend's pytorch_intraop_threads_flag
# and pytorch_interop_threads_flag, std::call_once).
_THREADS_LOCK = threading.Lock()
_threads_set: set[str] = set()


def set_thread_counts(torch: Any, parameters: TorchParameters, model: str) -> None:
    """INTRA_OP_THREAD_COUNT / INTER_OP_THREAD_COUNT above 0: torch's intra-op and
    inter-op pools, the first model that sets each wins for the process; each
    model that names one logs the count torch then has."""
    where = f" for model instance '{model}'"
    intra, inter = parameters.intra_op_threads, parameters.inter_op_threads
    with _THREADS_LOCK:
        if intra is not None and intra > 0:
            if "intra" not in _threads_set:
                _threads_set.add("intra")
                torch.set_num_threads(intra)
            log.info(f"Intra op thread count is set to {torch.get_num_threads()}{where}")
        if inter is not None and inter > 0:
            if "inter" not in _threads_set:
                _threads_set.add("inter")
                try:
                    torch.set_num_interop_threads(inter)
                except RuntimeError:
                    pass  # already used or set in this process; Triton ignores it too
            log.info(f"Inter op thread count is set to {torch.get_num_interop_threads()}{where}")
