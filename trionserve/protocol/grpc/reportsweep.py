"""The gRPC server's tick for the reports that instances' threads leave for the
event loop (:mod:`trionserve.core.deferred`): a sweep every ``SWEEP_SECS`` while
no connection's read sweeps, put off by the reads that do.

A connection whose client sends its next call sweeps the run's reports as it
reads (``Connection._read``): the tick is only for the reports left when no call
comes (a call the thread answered ends, its in-flight count and statistics
settle, a drain does not wait for a client). A tick that woke on a steady stream
would find the reads had swept; and its wake is a timer's, a cancellation run on
cold code, about eight times a socket's wake on the loop
(``benchmarks.investigations.loop_steps``). So the reads put it off.
"""

from __future__ import annotations

import trio

from trionserve.core.deferred import sweep_deferred

__all__ = ["SWEEP_SECS", "ReportSweep"]

# How long a report waits at most, when no client's next call comes first (as
# the HTTP server's tick).
SWEEP_SECS = 0.25
# The reads that swept between two looks at the clock (a read of the clock per
# read costs more than the count): the tick is put off while calls come at
# least this many every half a tick, 32 a second.
LOOK_EVERY = 4


class ReportSweep:
    """One gRPC server's tick (:meth:`run`, a task of its nursery): the run's
    reports swept at most ``SWEEP_SECS`` after the last sweep that put it off.

    Guarantee: a report is delivered within ``SWEEP_SECS`` of the sweep before
    its deferral, by a read that sweeps or by the tick: the tick is put off only
    by a sweep (:meth:`swept`, called right after it), and only to
    ``SWEEP_SECS`` past it."""

    __slots__ = ("_scope", "_reads")

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None  # the tick's wait
        self._reads = LOOK_EVERY  # swept reads until the next look at the clock

    def swept(self) -> None:
        """A connection's read swept the run's reports just now: every
        ``LOOK_EVERY``-th such read, a tick due within half of ``SWEEP_SECS``
        is put off to ``SWEEP_SECS`` from now (its deadline moved at most twice
        a tick, not once a call)."""
        self._reads -= 1
        if self._reads:
            return
        self._reads = LOOK_EVERY
        scope = self._scope
        if scope is not None:
            now = trio.current_time()
            if scope.deadline - now < SWEEP_SECS / 2:
                scope.deadline = now + SWEEP_SECS

    async def run(self) -> None:
        """Sweep the reports whenever the tick's deadline passes."""
        while True:
            with trio.CancelScope(deadline=trio.current_time() + SWEEP_SECS) as scope:
                self._scope = scope
                try:
                    await trio.sleep_forever()
                finally:
                    self._scope = None
            sweep_deferred()
