"""Linux's ``timerfd`` through libc (Python 3.11's ``os`` has none): a timer
that is a file descriptor, readable (its expiration count) once it fires, set
to a nanosecond, relative or absolute on ``CLOCK_MONOTONIC`` (the clock
``time.perf_counter()`` and Trio's clock read). The batchers' microsecond
wake-ups (schedulers/timer.py) and the instance thread's doorbell
(backends/instance_thread.py) use it."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

__all__ = ["CLOCK_MONOTONIC", "TFD_TIMER_ABSTIME", "TIMERFD", "Itimerspec", "Timespec"]

CLOCK_MONOTONIC = 1
TFD_TIMER_ABSTIME = 1  # timerfd_settime's flag: it_value is a time on the clock


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", Timespec), ("it_value", Timespec)]


def _load_timerfd() -> tuple[Any, Any] | None:
    """libc's timerfd_create and timerfd_settime, or None where there are none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes = [ctypes.c_int, ctypes.c_int]
    create.restype = ctypes.c_int
    settime.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(Itimerspec),
        ctypes.POINTER(Itimerspec),
    ]
    settime.restype = ctypes.c_int
    return create, settime


# (timerfd_create, timerfd_settime), or None where there is no timerfd.
TIMERFD = _load_timerfd()
