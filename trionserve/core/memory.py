"""Memory given back to the system: the one place that calls glibc's
``malloc_trim``, for the server (after a burst of bytes held for clients, after a
gRPC connection that held many) and for Python stubs (after their backlog
drained). Imports nothing but ctypes, so a stub pays nothing for it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import cast

__all__ = ["release_free_memory"]


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


def release_free_memory() -> None:
    """Give the pages malloc holds free back to the system (glibc's malloc_trim;
    nothing elsewhere). After a burst that held many buffers ends, its memory is
    free but stays in the process: megabyte buffers come from malloc's heap once
    its mmap threshold has risen, and the heap only shrinks from its top. Takes
    milliseconds on a large heap: call it in a worker thread."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
