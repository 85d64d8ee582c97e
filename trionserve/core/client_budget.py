"""One server-wide budget of bytes held for clients (``--client-buffer-limit``).

Every listener bounds what one connection or one request may hold (the HTTP body
limit, ``--grpc-max-connection-buffer``, ``--max-undelivered-response-bytes``);
:class:`ClientBudget` bounds their sum. What is counted, each where its buffer is
made and let go (per buffer, never per byte copied):

- request bodies being received and held while their request runs (HTTP bodies of
  declared length, gRPC messages in a connection's buffer);
- responses a request holds that its client has not taken yet (a decoupled
  model's backlog, in :class:`~trionserve.core.inference.InferenceRequest`), which
  is also what a Python model's stub holds for them in shared memory;
- response bodies and stream chunks waiting for a slow client (HTTP), responses
  waiting for a gRPC client's window.

What happens as it fills (docs/limits.md, "One budget for the whole server"):

- A new request is refused at once when the bytes it brings would take the
  budget past its limit: :meth:`admit` raises :class:`ResourceExhausted` (HTTP
  503, gRPC RESOURCE_EXHAUSTED) naming the budget and the flag. Requests that
  bring nothing (health, metadata, statistics, reading a stream already open)
  go on.
- Producers wait: at seven eighths of the limit (``high``) the budget is *full*
  for producers and stays so until it drains to three quarters (``low``). A
  decoupled model's response sender waits for room then, in its own thread (an
  in-process model's) or in its stub process (told through ``subscribe``); a
  model that runs on the event loop is never made to wait (its responses are
  counted). The eighth kept free is for new requests, so that a well-behaved
  client is still served while slow ones hold the rest.
- The memory-pressure policy (:meth:`run`): while the budget is full, a holder
  (a request holding responses) whose client has taken nothing for
  ``stall_secs`` (``--client-buffer-stall-secs``) is evicted, the one holding the
  most bytes first: its responses are dropped, it fails with RESOURCE_EXHAUSTED
  naming the flag and is cancelled (its model's ``is_cancelled()`` turns true),
  and its frontend ends the client's stream.

Memory given back: glibc keeps what a burst freed in its heaps (its mmap threshold
rises as large buffers are freed, so later ones come from the heap), and the
process would stay at its peak. Once the bytes held have fallen by
``TRIM_BYTES`` from their most since the last time, :meth:`run` calls glibc's
``malloc_trim`` (:func:`release_free_memory`, in a worker thread; nothing where the C
library has none), at most once a second.

The budget lives on the Trio thread (``reserve``, ``release`` and ``admit`` are
called there); ``full`` and :meth:`wait_for_room_blocking` may be used from any
thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog
import trio

from trionserve.core.errors import ResourceExhausted
from trionserve.core.memory import release_free_memory

log = structlog.get_logger(__name__)

__all__ = ["DEFAULT_STALL_SECS", "ClientBudget", "Holder", "default_limit"]

# --client-buffer-stall-secs: how long a client may take nothing while the budget
# is full before its stream, if it holds the most, is cancelled.
DEFAULT_STALL_SECS = 10.0
# Memory is given back to the system once the bytes held fell by this much.
TRIM_BYTES = 32 * 1024 * 1024
TRIM_INTERVAL_SECS = 1.0


def default_limit() -> int:
    """A quarter of the memory this process may use: the host's, or the cgroup's
    limit where one is set (a container's memory is its host's for it)."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        text = "max"
    if text.isdigit():
        memory = min(memory, int(text))
    return memory // 4


class Holder(Protocol):
    """Something holding bytes for one client, which the pressure policy may evict."""

    @property
    def held_bytes(self) -> int: ...

    # trio.current_time() when its client last took something (or it began holding).
    last_read: float

    def evict(self, message: str) -> None: ...


class ClientBudget:
    """The bytes held for clients, all listeners together; see the module docstring."""

    def __init__(self, limit: int | None = None, stall_secs: float = DEFAULT_STALL_SECS) -> None:
        self.limit = default_limit() if limit is None else limit
        self.stall_secs = stall_secs
        # Producers wait from ``high`` until the bytes drain to ``low``.
        self.high = self.limit - self.limit // 8
        self.low = self.limit - self.limit // 4
        self.held = 0
        self.peak = 0
        self.trims = 0  # times memory was given back
        # The most held since memory was last given back.
        self._burst = 0
        self.refused = 0  # new requests refused at the limit
        self.evicted = 0  # streams cancelled by the pressure policy
        self.full = False
        # Set while not full, for producers waiting in threads.
        self._room = threading.Event()
        self._room.set()
        # Set while full, for the pressure policy's task.
        self._pressure = trio.Event()
        self._listeners: list[Callable[[bool], None]] = []
        self._holders: dict[Holder, None] = {}

    # -- counting (the Trio thread) ---------------------------------------------------

    def reserve(self, size: int) -> None:
        """``size`` bytes more are held: made already, so never refused."""
        held = self.held = self.held + size
        if held > self._burst:
            self._burst = held
            if held > self.peak:
                self.peak = held
        if held >= self.high and not self.full:
            self._set_full(True)

    def release(self, size: int) -> None:
        """``size`` bytes held are let go."""
        held = self.held = self.held - size
        if self.full and held <= self.low:
            self._set_full(False)

    def admit(self, what: str, size: int = 0) -> None:
        """Refuse (raise ResourceExhausted) a new request, ``what``, whose ``size``
        bytes would take the budget past its limit."""
        if self.held + max(size, 1) > self.limit:
            self.refused += 1
            raise ResourceExhausted(self.refusal(what, size))

    def has_room(self, size: int) -> bool:
        return self.held + max(size, 1) <= self.limit

    def refusal(self, what: str, size: int = 0) -> str:
        brings = f" and this one {size} bytes" if size else ""
        return (
            f"{what} refused: the server holds {self.held} bytes for clients that "
            f"have not read them yet{brings}, at its budget of {self.limit} bytes "
            "(--client-buffer-limit); try again later"
        )

    def _set_full(self, full: bool) -> None:
        self.full = full
        if full:
            self._room.clear()
            self._pressure.set()
        else:
            self._room.set()
            self._pressure = trio.Event()
        for listener in list(self._listeners):
            listener(full)

    # -- producers ----------------------------------------------------------------------

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(full)`` (on the Trio thread) each time the budget turns
        full for producers or has room again; at once if it is full now."""
        self._listeners.append(listener)
        if self.full:
            listener(True)

    def unsubscribe(self, listener: Callable[[bool], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def wait_for_room_blocking(self, cancelled: Callable[[], bool], poll: float = 0.05) -> None:
        """In a producer's thread (never the event loop's): wait until the budget
        has room for producers again or ``cancelled()`` says to stop."""
        while not self._room.wait(poll):
            if cancelled():
                return

    # -- the memory-pressure policy --------------------------------------------------

    def hold(self, holder: Holder) -> None:
        """``holder`` holds bytes for a client (its ``last_read`` set)."""
        self._holders[holder] = None

    def let_go(self, holder: Holder) -> None:
        self._holders.pop(holder, None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The pressure policy, and memory given back after a burst."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._give_back)
            nursery.start_soon(self._pressure_policy)
            task_status.started()

    async def _give_back(self) -> None:
        while True:
            await trio.sleep(TRIM_INTERVAL_SECS)
            if self._burst - self.held >= TRIM_BYTES:
                self._burst = self.held
                self.trims += 1
                await trio.to_thread.run_sync(release_free_memory)

    async def _pressure_policy(self) -> None:
        """While full, evict stalled holders, the largest first."""
        while True:
            if not self.full:
                await self._pressure.wait()
                continue
            holder, wait = self._stalled(trio.current_time())
            if holder is None:
                # Not less than a hundredth of a second: a clock's rounding must
                # not make this a busy loop.
                await trio.sleep(max(wait, 0.01))
                continue
            self.evicted += 1
            self._holders.pop(holder, None)
            reason = (
                f"its client took none of the {holder.held_bytes} bytes held for it "
                f"for {self.stall_secs:g} s (--client-buffer-stall-secs) while the "
                f"server's budget of bytes held for clients was full ({self.held} of "
                f"{self.limit} bytes, --client-buffer-limit), and it held the most"
            )
            log.warning("a client's stream cancelled under memory pressure", reason=reason)
            holder.evict(reason)
            await trio.lowlevel.checkpoint()

    def _stalled(self, now: float) -> tuple[Holder | None, float]:
        """The stalled holder holding the most, or None and how long until the
        next one could be."""
        stall = self.stall_secs
        best: Holder | None = None
        most = 0
        wait = stall
        for holder in list(self._holders):
            held = holder.held_bytes
            if held <= 0:
                self._holders.pop(holder, None)
                continue
            idle = now - holder.last_read
            if idle >= stall:
                if held > most:
                    best, most = holder, held
            else:
                wait = min(wait, stall - idle)
        return best, wait
