"""What one ModelStreamInfer call keeps in order and in bounds: its requests in
flight (:class:`StreamBudget`) and the order of its answers (:class:`Turn`)."""

from __future__ import annotations

import trio

__all__ = ["STREAM_PENDING_LIMIT", "StreamBudget", "Turn"]

# Requests of one ModelStreamInfer call being served at once; beyond it the stream
# is not read (and HTTP/2 flow control holds the client back).
STREAM_PENDING_LIMIT = 1024


class StreamBudget:
    """The requests one ModelStreamInfer call serves at once, bounded by count and
    by bytes.

    Requests are admitted before their responses exist, and a response waits for
    its client's flow-control window, so a stream's memory is about its requests in
    flight times the size of a request and its response. ``acquire`` admits a
    request while fewer than ``count_limit`` are in flight and ``in flight x
    (largest request + largest response)`` seen on the stream so far stays within
    ``byte_limit``; one request is always admitted, however large.
    """

    __slots__ = ("_count_limit", "_byte_limit", "in_flight", "request", "response", "_changed")

    def __init__(self, count_limit: int, byte_limit: int) -> None:
        self._count_limit = count_limit
        self._byte_limit = byte_limit
        self.in_flight = 0
        self.request = 0  # the largest request seen, in bytes
        self.response = 0  # the largest response seen, in bytes
        self._changed = trio.Event()

    def observe(self, size: int) -> None:
        """A response of ``size`` bytes is on its way to the client."""
        if size > self.response:
            self.response = size

    def _full(self) -> bool:
        n = self.in_flight
        if n == 0:
            return False
        return n >= self._count_limit or (n + 1) * (self.request + self.response) > self._byte_limit

    async def acquire(self, size: int) -> None:
        """Wait until a request of ``size`` bytes may be served, and count it."""
        if size > self.request:
            self.request = size
        while self._full():
            await self._changed.wait()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._changed.set()
        self._changed = trio.Event()


class Turn:
    """A stream request's place in the order of the stream's answers: ``wait``
    until the requests before it were answered (when ``ordered``), ``done`` once
    it was answered or ended without an answer."""

    __slots__ = ("_before", "written", "ordered")

    def __init__(self, before: trio.Event | None) -> None:
        self._before = before
        self.written = trio.Event()
        self.ordered = True  # until its model is known to be decoupled

    async def wait(self) -> None:
        if self.ordered and self._before is not None:
            await self._before.wait()

    async def done(self) -> None:
        """The next request's turn comes after this one's and the ones before it
        (a request that ended first waits for them, so no answer overtakes)."""
        if self._before is not None:
            await self._before.wait()
        self.written.set()
