"""What the server's process takes in memory, read from the system, and memory given back.

Used to charge a model what its load took (:mod:`trionserve.actors.residency`):
the resident set of the server's process and of its children (a Python model's
stub process is one), each GPU's used memory through NVML, and ``malloc_trim``
after an unload so that glibc returns the arenas it keeps (a model's weights are
freed, but the heap pages stay mapped until trimmed). Every reading is blocking
and cheap (``/proc`` lives in memory); NVML is imported lazily and absent without
a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from trionserve.actors.residency_budget import HOST, Charge

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss(pid: int | str) -> int:
    """Resident bytes of one process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def children(pid: int) -> list[int]:
    """The children of a process, from every thread's ``children`` list (Linux)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        found.extend(int(child) for child in text.split())
    return found


def process_tree_rss(pid: int | None = None) -> int:
    """Resident bytes of a process and all its descendants (this one by default);
    on a system without ``/proc``, the peak resident size of this process."""
    root = os.getpid() if pid is None else pid
    if not os.path.exists(f"/proc/{root}/statm"):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    seen: set[int] = set()
    stack = [root]
    used = 0
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        used += _rss(current)
        stack.extend(children(current))
    return used


def host_total() -> int | None:
    """The host's physical memory in bytes (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class GpuMemory:
    """Used and total memory of each GPU, through NVML (pynvml imported lazily).

    ``available`` is False where pynvml or a GPU is missing: nothing is charged on
    GPUs then, and a GPU budget is refused at start.
    """

    def __init__(self) -> None:
        self._nvml = None
        self._handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            self._nvml = pynvml
        except Exception:
            self._handles = []

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def count(self) -> int:
        return len(self._handles)

    def total(self, index: int) -> int | None:
        if self._nvml is None or not 0 <= index < len(self._handles):
            return None
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handles[index]).total)

    def used(self) -> Charge:
        """``gpu:<index>`` -> used bytes, for every GPU."""
        if self._nvml is None:
            return {}
        return {
            f"gpu:{i}": int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
            for i, handle in enumerate(self._handles)
        }

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


def usage(gpus: GpuMemory | None) -> Charge:
    """What the server takes now: ``host`` (its process tree's resident set) and
    each GPU's used memory."""
    reading: Charge = {HOST: process_tree_rss()}
    if gpus is not None:
        reading.update(gpus.used())
    return reading


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


# mallopt's parameter number for the mmap threshold (glibc's malloc.h: M_MMAP_THRESHOLD).
_M_MMAP_THRESHOLD = -3
# Blocks at least this large are mapped on their own and unmapped when freed.
MMAP_THRESHOLD = 1 << 20


@functools.cache
def fix_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Have glibc map every block of ``size`` bytes or more on its own (True if it
    could), for the whole process: once per process.

    glibc's threshold starts at 128 KiB and rises to the size of each mapped block
    freed (up to 32 MiB), so after the first unload a model's next tensors come
    from the heap arenas, where freed they stay: 12 load/unload cycles of a
    TorchScript model holding 20 MiB grew the server by 40 MiB, 0.2 MiB with the
    threshold fixed. Fixing it (which also stops its rising) makes every large
    tensor a mapping the system gets back when the model is unloaded; the price is
    a mapping and its page faults for each large request buffer, so only servers
    that load and unload models as they go (the residency flags) fix it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, size))


def trim_heap() -> bool:
    """Give the heap's free pages back to the system (glibc only); True if it did.

    glibc keeps freed memory in its arenas (one per thread that allocated: a
    model's load thread is one) until ``malloc_trim`` releases it, which is why an
    unloaded model can leave its size in the server's RSS.
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
