"""Reports that threads leave for the event loop's next sweep, instead of waking it.

An instance's thread that wrote a batch's answers itself (an HTTP/1.1 client on a
plain socket, see :mod:`trionserve.protocol.http.answer`) has nothing urgent left
for the event loop: the batch's report (its outcomes, statistics, in-flight counts)
can wait until the loop wakes for something else, typically the client's next
request, which saves the loop a wake-up from its sleep per request (about 0.2 ms of
cold caches at c=1 on a small machine; benchmarks/README.md, issue 39's fourth
round). Such a report goes into the run's :class:`Deferred`; the loop delivers
every one there when it sweeps: a connection woken by its client, a statistics or
metrics read, the HTTP server's 0.25 s tick (so a drain never waits on a client).

A thread appends its job before it writes any of the job's answers, so a consumer
that sees its answer written finds the job here; when an answer could not be
written whole (the socket full, the client gone, the answer declined), the thread
wakes the loop to sweep at once (``wake``).

A job appended ``idle`` holds back its instance: the executor offers it to its
scheduler again only as the job is delivered. A request submitted meanwhile
whose instance is not asking for work sweeps first (:func:`sweep_idle`), so it
does not wait for an unrelated sweep (a request from another client, the tick).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import trio


class Report(Protocol):
    def finished(self) -> None:
        """On the Trio thread: the work is done, deliver it."""


class Deferred:
    """The reports of one Trio run that threads left for the event loop's next
    :meth:`sweep` instead of waking it (see the module docstring)."""

    __slots__ = ("_jobs", "_token", "idle")

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._jobs: deque[Report] = deque()
        self._token = token
        # Set (after its append) by a job whose instance waits for its delivery
        # to take work again; cleared by the sweep before it delivers, so that
        # it is never clear while such a job waits (at worst set for none).
        self.idle = False

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def append(self, job: Report, idle: bool = False) -> None:
        """On a thread: ``job.finished()`` is called at the next sweep;
        ``idle``: its instance takes no work until then."""
        self._jobs.append(job)
        if idle:
            self.idle = True

    def wake(self) -> None:
        """On a thread: the loop sweeps now."""
        try:
            self._token.run_sync_soon(self.sweep)
        except trio.RunFinishedError:
            pass

    def sweep(self) -> None:
        """On the Trio thread: report every job deferred so far."""
        self.idle = False
        jobs = self._jobs
        while jobs:
            jobs.popleft().finished()


_DEFERRED: trio.lowlevel.RunVar[Deferred] = trio.lowlevel.RunVar("trionserve_deferred_jobs")
_NO_DEFERRED = Deferred(None)  # type: ignore[arg-type]  # never swept: always empty


def deferred_jobs() -> Deferred:
    """The current Trio run's deferred jobs (on the Trio thread)."""
    try:
        return _DEFERRED.get()
    except LookupError:
        deferred = Deferred(trio.lowlevel.current_trio_token())
        _DEFERRED.set(deferred)
        return deferred


def sweep_deferred() -> None:
    """Deliver the current run's deferred reports, if any (on the Trio thread;
    nothing outside a run): before anything that must see every answer written
    so far counted (a statistics or metrics read, a new request)."""
    try:
        deferred = _DEFERRED.get(_NO_DEFERRED)
    except RuntimeError:  # not in a Trio run
        return
    if deferred._jobs:
        deferred.sweep()


def sweep_idle() -> None:
    """Deliver the current run's deferred reports if one of them holds its
    instance back (on the Trio thread): before a request waits for an instance
    that is not asking for work."""
    deferred = _DEFERRED.get(_NO_DEFERRED)
    if deferred.idle:
        deferred.sweep()
