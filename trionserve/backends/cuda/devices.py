"""GPU discovery, with every CUDA library imported lazily."""

from __future__ import annotations

import functools
import os
import sys

# Name prefixes of the device nodes a GPU is reached through on Linux: NVIDIA's
# driver (nvidiactl, nvidia0, ...), Jetson's (nvhost-*, nvmap), WSL's (dxg) and
# ROCm's (kfd, which torch.cuda reaches on AMD GPUs).
DRIVER_NODES = ("nvidia", "nvhost", "nvmap", "dxg", "kfd")
DEV = "/dev"


def no_gpu_driver() -> bool:
    """True on a Linux host with no GPU driver's device node: no CUDA library can
    see a device there, so none is imported to count them (importing torch takes
    seconds of CPU at every start-up of a CPU-only server)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        names = os.listdir(DEV)
    except OSError:
        return False
    return not any(name.startswith(DRIVER_NODES) for name in names)


@functools.cache
def gpu_count() -> int:
    """Number of visible CUDA devices; 0 when no CUDA library or device exists."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "" or no_gpu_driver():
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
