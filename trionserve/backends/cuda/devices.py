"""GPU discovery, with every CUDA library imported lazily."""

from __future__ import annotations

import functools
import os


@functools.cache
def gpu_count() -> int:
    """Number of visible CUDA devices; 0 when no CUDA library or device exists."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except Exception:
        pass
    return 0
