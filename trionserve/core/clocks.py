"""Trio's clock as the data plane reads it: whether Trio runs on a virtual
clock (``trio.testing.MockClock``: the simulations', the unit tests'), asked
without importing ``trio.testing``: that module imports pytest where pytest is
installed (a tenth of a second of CPU at every start-up of a server in a test
environment), and a MockClock can only exist once it has been imported; and
Trio's own clock as ``time.perf_counter()`` plus a constant."""

from __future__ import annotations

import sys
import time
from typing import Any

import trio

__all__ = ["clock_offset", "virtual_clock"]


def virtual_clock(clock: Any) -> bool:
    """True when ``clock`` is a ``trio.testing.MockClock``."""
    testing = sys.modules.get("trio.testing")
    return testing is not None and isinstance(clock, testing.MockClock)


def clock_offset() -> float | None:
    """Trio's clock less ``time.perf_counter()`` (on the Trio thread), where
    that is a constant: Trio's own clock (``perf_counter()`` plus an offset,
    as schedulers/timer.py relies on too), not a ``MockClock``'s virtual
    time (None). A reading on another thread (an instance's) then goes to
    Trio's clock with an addition, and one on the Trio thread costs no call
    of the clock's method (a submit's arrival time); read between two
    readings of ``perf_counter()``: within tens of ns."""
    clock = trio.lowlevel.current_clock()
    if virtual_clock(clock):
        return None
    before = time.perf_counter()
    now = clock.current_time()
    return now - (before + time.perf_counter()) / 2
