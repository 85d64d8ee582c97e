"""Memory given back to the system: the one place that calls glibc's
``malloc_trim``, for the server (after a burst of bytes held for clients, after a
gRPC connection that held many) and for Python stubs (after their backlog
drained). Imports nothing but ctypes, so a stub pays nothing for it. Also the
one place that settles the Python heap of the start-up (:func:`settle_heap`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
from typing import cast

__all__ = ["MMAP_THRESHOLD", "fix_mmap_threshold", "release_free_memory", "settle_heap"]

# mallopt's parameter number for the mmap threshold (glibc's malloc.h: M_MMAP_THRESHOLD).
_M_MMAP_THRESHOLD = -3
# Blocks at least this large are mapped on their own and unmapped when freed.
MMAP_THRESHOLD = 1 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return cast(Callable[[int], int], trim)


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
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, size))


def release_free_memory() -> None:
    """Give the pages malloc holds free back to the system (glibc's malloc_trim;
    nothing elsewhere). After a burst that held many buffers ends, its memory is
    free but stays in the process: megabyte buffers come from malloc's heap once
    its mmap threshold has risen, and the heap only shrinks from its top. Takes
    milliseconds on a large heap: call it in a worker thread."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def settle_heap(owned: bool) -> bool:
    """Once the start-up's models are loaded, in a process the server ``owns``
    (the command line's, not a server inside another program): move every object
    alive into the collector's permanent generation (``gc.freeze``), so that no
    later collection walks them again. True if it did.

    The start-up leaves a heap of about 200,000 objects (the frameworks, numpy,
    protobuf descriptors, Trio, the models), which every full collection walked:
    200-500 ms holding the GIL, once every 30-90 s under load, paid by whichever
    thread allocated at that moment (the event loop, an instance's thread), with
    every request in flight waiting (benchmarks/README.md, issue 39's sixth
    round). No collection first (it would cost every start about 0.1 s): what is
    frozen is never collected as a cycle, so start-up objects in cycles that are
    garbage already, or die later (a model loaded at start, then unloaded), keep
    their memory, once; objects freed by their reference counts are freed as
    before.
    """
    if not owned:
        return False
    gc.freeze()
    return True
