"""What the server's process takes in memory, read from the system.

Used to charge a model what its load took (:mod:`trionserve.actors.residency`):
the resident set of the server's process and of its children (a Python model's
stub process is one) and each GPU's used memory through NVML. Every reading is
blocking and cheap (``/proc`` lives in memory); NVML is imported lazily and absent
without a GPU. Memory given back to the system is :mod:`trionserve.core.memory`'s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trionserve.actors.residency_budget import HOST, Charge
from trionserve.core.memory import release_free_memory

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


def settled_usage(gpus: GpuMemory | None) -> Charge:
    """What the server takes once a load's temporary buffers (a model file's parsed
    copy, say) are given back: what it keeps is what it is charged."""
    release_free_memory()
    return usage(gpus)


def delta(before: Charge | None, after: Charge) -> Charge:
    """What grew between two readings, by device."""
    before = before or {}
    return {d: size - before.get(d, 0) for d, size in after.items() if size > before.get(d, 0)}


def files_size(model_dir: Path) -> int:
    """Bytes of a model's files: the estimate of a first load without a declared size."""
    size = 0
    for path in model_dir.rglob("*"):
        try:
            if path.is_file():
                size += path.stat().st_size
        except OSError:
            continue
    return size
