"""The dynamic batcher's batch held by an idle instance's thread for its batching
delay (issue 39's ninth round): given to the thread at once, which sleeps out the
rest of the delay itself, so the event loop does not wake at the delay's end;
requests that come meanwhile join it by the rules the batcher would apply at the
delay's end. :class:`HeldBatches` is that part of
:class:`~trionserve.schedulers.dynamic_batch.DynamicBatchScheduler`, whose state it
shares."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trionserve.core.inference import InferenceRequest
from trionserve.schedulers.batch_queue import Entry, OpenBatch

if TYPE_CHECKING:
    from trionserve.schedulers.batcher_outlet import BatcherOutlet
    from trionserve.schedulers.timer import PreciseWakeup


class HeldBatches:
    """The held batch's part of the dynamic batcher (see the module docstring)."""

    # The batcher's state this part reads and writes (set by its __init__).
    _open: OpenBatch | None
    _opened: OpenBatch | None  # the one OpenBatch, re-armed for each batch held
    _holds: bool
    _closed: bool
    _timer: PreciseWakeup | None
    _preserve_ordering: bool
    _next_ticket: int
    _check_shapes: bool
    _preferred: frozenset[int]
    _max_preferred: int

    if TYPE_CHECKING:

        def _ticket(self) -> int | None: ...
        def _shape_key(self, request: InferenceRequest) -> tuple: ...
        def _take(self, entries: list[Entry]) -> list[InferenceRequest]: ...
        def _signal_space(self) -> None: ...

    def _hold_in_thread(self, outlet: BatcherOutlet, entries: list[Entry], go_at: float) -> bool:
        """Give a batch that waits for the delay (until ``go_at``) to the idle
        instance's thread now, which sleeps out the rest of the delay itself:
        no pass of the event loop at the delay's end (issue 39's ninth round).
        Requests that come meanwhile join it (:meth:`_join`) by the rules
        :meth:`_form` would apply at the delay's end, so the batch and its
        start are those Triton's batcher forms (core
        src/dynamic_batch_scheduler.cc, GetDynamicBatch), its queue time
        including the delay. Only on the real clock, one batch held at a
        time, where ``_holds`` says nothing else could differ; False: the
        batch waits here as before."""
        requests = [entry.request for entry in entries]
        if not self._hold_with(outlet, requests, sum(entry.size for entry in entries), go_at):
            return False
        self._take(entries)
        self._signal_space()
        return True

    def _hold_with(
        self, outlet: BatcherOutlet, requests: list[InferenceRequest], size: int, go_at: float
    ) -> bool:
        """:meth:`_hold_in_thread` for ``requests`` (of total batch size ``size``)."""
        delayed = outlet._delayed
        timer = self._timer  # (_timed, written out: once per request at c=1)
        if delayed is None or not self._holds or self._open or self._closed:
            return False
        if timer is None or not timer.live:
            return False
        ticket = self._ticket() if self._preserve_ordering else None
        outlet._tickets.append(ticket)
        held = delayed(requests, go_at)
        if held is None:
            outlet._tickets.pop()
            if ticket is not None:
                self._next_ticket -= 1
            return False
        key = self._shape_key(requests[0]) if self._check_shapes else None
        opened = self._opened
        if opened is None:
            opened = self._opened = OpenBatch(held, outlet, size, key)
        else:  # (re-armed: nothing refers to the last one once ``_open`` let it go)
            opened.batch, opened.outlet, opened.size, opened.key = held, outlet, size, key
        self._open = opened
        return True

    def _join(self, request: InferenceRequest) -> bool:
        """Add a submitted request to the batch held for its delay where the
        batch formed at the delay's end would take it (:meth:`_form`: it fits
        and its shapes match); reaching a preferred size or the largest starts
        the batch now. False: the request is queued as usual; one that would
        take the batch past the largest preferred size or the maximum, or
        whose shapes differ, starts the batch now without it (:meth:`_form`
        sends it at once then)."""
        held = self._open
        assert held is not None
        size = held.size + (request.batch_size or 1)
        if size > self._max_preferred or (
            self._check_shapes and self._shape_key(request) != held.key
        ):
            self._release_held()
            return False
        if not held.batch.join(request):
            self._open = None  # its thread started it: this goes to the next batch
            return False
        held.size = size
        if size in self._preferred or size >= self._max_preferred:
            self._release_held()
        return True

    def _release_held(self) -> None:
        """The batch held for its delay starts now (if it has not)."""
        held, self._open = self._open, None
        if held is not None:
            held.batch.release()
