"""Microsecond wake-ups for the batchers, on the real clock.

Trio's own timers wake a task through the timeout of ``epoll_wait``, which counts
whole milliseconds: ``trio.sleep(100e-6)`` takes about 1.1 ms. A batching delay of
``max_queue_delay_microseconds: 100`` must take 100 µs, as in Triton (its batcher
waits on a ``std::condition_variable`` with a microsecond deadline). A
:class:`PreciseWakeup` arms a Linux ``timerfd`` (nanosecond resolution) at the
batcher's next deadline; its task waits for the descriptor to become readable,
which ends the ``epoll_wait`` at that instant, and wakes the batcher. Nothing spins:
an idle batcher has no timer armed.

The batcher still bounds its wait with ``trio.move_on_at``, at the deadline
:meth:`PreciseWakeup.arm` returns. With the ``timerfd`` armed that deadline is a
fallback, ``FALLBACK_SLACK`` later: at the very instant of the timer, Trio would
look at its own deadlines first (before it runs the timer's task) and cancel the
wait, and a cancellation (``Cancelled`` raised through the batcher's task and
caught) cost the event loop a tenth of its time with one request at a time in
flight (benchmarks/README.md, served_vs_direct).

On a virtual clock (``trio.testing.MockClock``: the simulations, the unit tests)
and where no ``timerfd`` exists, the wake-up does nothing and the batcher's own
``trio.move_on_at`` at the deadline itself is the only timer, so virtual time
stays exact and a seed replays a run. An early or spurious wake-up is harmless:
the batcher looks at the clock again and goes back to waiting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import trio

from trionserve.core.clocks import virtual_clock

_CLOCK_MONOTONIC = 1
# How much later than the timerfd Trio's own deadline for the same wait falls.
FALLBACK_SLACK = 0.05
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


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
        ctypes.POINTER(_Itimerspec),
        ctypes.POINTER(_Itimerspec),
    ]
    settime.restype = ctypes.c_int
    return create, settime


_TIMERFD = _load_timerfd()


class PreciseWakeup:
    """Calls ``wake`` when Trio's clock reaches the deadline last armed.

    ``run`` is the timer's task, a child of the batcher's nursery; ``arm`` is a
    plain call on the Trio thread. Both do nothing on a virtual clock.
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._fd = -1
        # Whether this wake-up runs (its ``timerfd`` is open): not on a virtual
        # clock, nor where there is none, nor before ``run`` or after it. (An
        # attribute: read on every request's way.)
        self.live = False
        self._armed = math.inf
        self._spec = _Itimerspec()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if _TIMERFD is None or virtual_clock(trio.lowlevel.current_clock()):
            task_status.started()
            return
        fd = _TIMERFD[0](_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            task_status.started()
            return
        self._fd = fd
        self.live = True
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(fd)
                try:
                    os.read(fd, 8)  # the expiration count; reading rearms readiness
                except BlockingIOError:
                    continue  # disarmed or rearmed between the wake-up and the read
                self._armed = math.inf
                self._wake()
        finally:
            self._fd = -1
            self.live = False
            trio.lowlevel.notify_closing(fd)
            os.close(fd)

    def arm(self, deadline: float) -> float:
        """Wake at ``deadline`` (Trio's clock); ``math.inf`` disarms. Returns the
        deadline for the caller's own ``trio.move_on_at`` around its wait:
        ``deadline`` itself where this wake-up does nothing, else a fallback
        ``FALLBACK_SLACK`` later."""
        if self._fd < 0:
            return deadline
        if deadline == self._armed:
            return deadline + FALLBACK_SLACK
        self._armed = deadline
        if deadline == math.inf:
            seconds, nanoseconds = 0, 0  # an all-zero it_value disarms the timer
        else:
            # At least 1 ns: zero would disarm the timer instead of firing it.
            delay_ns = max(math.ceil((deadline - trio.current_time()) * 1e9), 1)
            seconds, nanoseconds = divmod(delay_ns, 1_000_000_000)
        spec = self._spec
        spec.it_value.tv_sec = seconds
        spec.it_value.tv_nsec = nanoseconds
        assert _TIMERFD is not None  # the descriptor exists
        if _TIMERFD[1](self._fd, 0, ctypes.byref(spec), None) != 0:
            error = ctypes.get_errno() or errno.EINVAL
            raise OSError(error, f"timerfd_settime: {os.strerror(error)}")
        return deadline + FALLBACK_SLACK
