"""A connection's buffer and the flow-control window it gives back, sans-I/O.

A connection holds at most ``limit`` bytes for its calls, all streams together
(``--grpc-max-connection-buffer``): request messages not taken yet (whole or
partial), messages its handlers took and have not answered, and responses
waiting for the client's flow-control window. :class:`ConnectionBuffer` keeps
that count and decides, for every DATA frame received and every byte taken,
answered or sent, which HTTP/2 window to give back now and which to hold back.
It returns those decisions as :class:`Window` values; the Trio loop
(:mod:`~trionserve.protocol.grpc.connection`) applies them to h2. Tested with
numbers alone (tests/unit/test_grpc_state.py).

The rules:

- A call's stream window is held back while it has more than ``window`` bytes
  of messages its handler has not taken.
- Past the limit the client gets no more window (connection window included), so
  it sends nothing more. Only the oldest unfinished message may go on, so that it
  completes and no call waits on another: when nothing held drains by itself (no
  work taken and unanswered, no response waiting), the connection window is given
  back for it, and the stream windows of the others stay held.
- Within those bounds, an unfinished message's window comes back with its end,
  stream and connection in one (not once per read): the bytes not acknowledged
  yet, all calls together, stay below a quarter of the connection's window, so
  the client can always send on to the next acknowledgement; a refused or ended
  call's are given back.
- A handler takes a message only while the work not answered and the responses
  waiting leave room for it (one is always taken when the connection holds
  neither: :meth:`ConnectionBuffer.has_room`).

What the buffer holds also counts in the server's budget of bytes held for
clients (``budget``, :mod:`~trionserve.core.client_budget`), changed as its
count changes (per frame or message, never per byte); :meth:`ConnectionBuffer.let_go`
releases whatever is left when the connection ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from trionserve.core.client_budget import ClientBudget

__all__ = ["Account", "ConnectionBuffer", "Window"]


@dataclass(frozen=True, slots=True)
class Window:
    """Flow-control window to give back to the client."""

    stream_id: int
    ack: int = 0  # received bytes acknowledged: the stream's and the connection's window
    stream: int = 0  # the stream's window only
    connection: int = 0  # the connection's window only


class Account:
    """One call's bytes in its connection's buffer."""

    __slots__ = (
        "stream_id",
        "queued",
        "partial",
        "working",
        "taken",
        "deferred_ack",
        "deferred_stream",
        "unacked",
    )

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.queued = 0  # whole messages not taken yet
        self.partial = 0  # of an unfinished message, prefix included
        self.working = 0  # of messages taken and not answered yet
        self.taken: deque[int] = deque()  # their sizes, oldest first
        self.deferred_ack = 0  # received bytes whose stream and connection window is held back
        self.deferred_stream = 0  # received bytes whose stream window only is held back
        self.unacked = 0  # of its unfinished message, received bytes acknowledged later


class ConnectionBuffer:
    """The bytes one connection holds for its calls; see the module's rules."""

    __slots__ = (
        "limit",
        "window",
        "held",
        "unsent",
        "working",
        "peak",
        "budget",
        "unacked",
        "_ack_at",
        "_accounts",
        "_held_back",
    )

    def __init__(self, limit: int, window: int, budget: ClientBudget | None = None) -> None:
        self.limit = limit
        self.budget = budget
        self.window = window  # a stream's receive window
        self.held = 0
        self.unsent = 0  # of those, responses waiting for the client's window
        self.working = 0  # and messages handlers took and have not answered
        self.peak = 0  # the most held at once
        # Received bytes of unfinished messages, all calls together, whose window
        # is given back with their message's end (or once they reach _ack_at):
        # a message's window in one WINDOW_UPDATE instead of one per read.
        self.unacked = 0
        self._ack_at = max(1, min(window, limit) // 4)  # below the connection's window
        self._accounts: dict[int, Account] = {}
        self._held_back: dict[Account, None] = {}  # insertion-ordered

    def open(self, stream_id: int, spare: Account | None = None) -> Account:
        """A new call's account; ``spare``: an ended call's, re-armed (its counts
        zeroed by ``close``) instead of a new one made."""
        if spare is None:
            account = Account(stream_id)
        else:
            account = spare
            account.stream_id = stream_id
            account.deferred_ack = account.deferred_stream = 0
        self._accounts[stream_id] = account
        return account

    def received(self, account: Account, flow: int, partial: int, sizes: list[int]) -> list[Window]:
        """A DATA frame of ``flow`` flow-controlled bytes came for the call: its
        reader now holds ``partial`` bytes of an unfinished message and completed
        messages of ``sizes``. The windows to give back."""
        added = partial - account.partial + sum(sizes)
        account.partial = partial
        account.queued += sum(sizes)
        windows = self.hold(added)
        if account.unacked and (account.queued > self.window or self.held > self.limit):
            flow += account.unacked  # (held back with this frame's)
            self.unacked -= account.unacked
            account.unacked = 0
        if account.queued > self.window:
            account.deferred_ack += flow
            self._held_back[account] = None
        elif self.held > self.limit and (self.working or self.unsent or not self._leads(account)):
            if flow:
                if self.working or self.unsent:
                    # Work in hand drains by itself: the client gets no more
                    # window, not even for the oldest unfinished message.
                    account.deferred_ack += flow
                else:  # only messages: the oldest must be able to complete
                    account.deferred_stream += flow
                    windows.append(Window(account.stream_id, connection=flow))
                self._held_back[account] = None
        elif flow:
            if partial and not sizes and self.unacked + flow < self._ack_at:
                account.unacked += flow  # with the message's end
                self.unacked += flow
                return windows
            if account.unacked:
                flow += account.unacked
                self.unacked -= account.unacked
                account.unacked = 0
            windows.append(Window(account.stream_id, ack=flow))
        return windows

    def whole(self, account: Account, length: int) -> bool:
        """A new call's message of ``length`` bytes came whole, with its stream's
        end: counted as ``received`` counts it (its DATA frames' ``length + 5``
        flow-controlled bytes) when it gives their window back at once and
        nothing else (True: the caller acknowledges them, as ``Window(stream_id,
        ack=length + 5)``): nothing held back, the message within the stream's
        window and the connection's limit. False: nothing counted
        (``received``'s)."""
        held = self.held + length
        if self._held_back or length > self.window or held > self.limit:
            return False
        account.queued = length
        # (hold(length) written out: with nothing held back it gives no window)
        self.held = held
        if held > self.peak:
            self.peak = held
        if length and self.budget is not None:
            self.budget.reserve(length)
        return True

    def refused(self, account: Account) -> list[Window]:
        """A message of the call was refused: what it queued is dropped."""
        dropped = account.queued + account.partial
        account.queued = account.partial = 0
        windows = self.hold(-dropped)
        if account.unacked:
            windows.append(Window(account.stream_id, ack=account.unacked))
            self.unacked -= account.unacked
            account.unacked = 0
        return windows

    def taken(self, account: Account, size: int) -> list[Window]:
        """The handler took a message: it stays held, as work not answered."""
        account.queued -= size
        account.working += size
        account.taken.append(size)
        self.working += size
        # Held the same: only windows held back for the call's queue may go now.
        return self.hold(0) if self._held_back else []

    def take(self, account: Account, size: int) -> list[Window] | None:
        """:meth:`has_room` and :meth:`taken` in one step, their rules as they
        are there (a unary call's one message, taken without waiting): None,
        and nothing taken, when there is no room for it."""
        in_hand = self.working + self.unsent
        if in_hand and in_hand + size > self.limit:
            return None
        account.queued -= size
        account.working += size
        account.taken.append(size)
        self.working += size
        return self.hold(0) if self._held_back else []

    def answered(self, account: Account) -> list[Window]:
        """The oldest message the handler took is answered."""
        if not account.taken:
            return []
        return self._release(account, account.taken.popleft())

    def answered_all(self, account: Account) -> list[Window]:
        """A unary call's answer: its request's bytes are now its response's."""
        if not account.taken:
            return []
        account.taken.clear()
        return self._release(account, account.working)

    def _release(self, account: Account, size: int) -> list[Window]:
        account.working -= size
        self.working -= size
        return self.hold(-size)

    def sending(self, size: int) -> list[Window]:
        """``size`` more bytes of responses wait to be sent (negative: fewer)."""
        self.unsent += size
        return self.hold(size)

    def has_room(self, size: int) -> bool:
        """Whether a message of ``size`` bytes may be taken now: it fits beside the
        work not answered and the responses waiting, or there are neither."""
        in_hand = self.working + self.unsent
        return not in_hand or in_hand + size <= self.limit

    def close(self, account: Account) -> list[Window]:
        """The call ended: everything it held is let go."""
        self._accounts.pop(account.stream_id, None)
        held_back = self._held_back
        if held_back:
            held_back.pop(account, None)
        account.taken.clear()
        working = account.working
        self.working -= working
        left = account.queued + account.partial + working
        account.queued = account.partial = account.working = 0
        windows: list[Window] = []
        if left:
            if held_back:
                windows = self.hold(-left)
            else:  # (hold(-left) written out: with nothing held back it gives no window)
                self.held -= left
                if self.budget is not None:
                    self.budget.release(left)
        if account.unacked:  # the stream is over: only the connection's window matters
            windows.append(Window(account.stream_id, connection=account.unacked))
            self.unacked -= account.unacked
            account.unacked = 0
        return windows

    def let_go(self) -> None:
        """The connection ended: whatever it still counts in the budget is released."""
        budget, held = self.budget, self.held
        if budget is not None and held > 0:
            budget.release(held)
        self.held = 0

    def _leads(self, account: Account) -> bool:
        """Whether ``account`` has the oldest unfinished message of the connection."""
        if not account.partial:
            return False
        return all(
            other.stream_id >= account.stream_id
            for other in self._accounts.values()
            if other.partial
        )

    def hold(self, size: int) -> list[Window]:
        """Count ``size`` more bytes held (negative: fewer); below the limit again,
        the windows held back are given back."""
        self.held += size
        if self.held > self.peak:
            self.peak = self.held
        budget = self.budget
        if budget is not None and size:
            if size > 0:
                budget.reserve(size)
            else:
                budget.release(-size)
        over = self.held > self.limit
        if not self._held_back or (size > 0 and over):
            return []
        window = self.window
        released: list[Account]
        if over and (self.working or self.unsent):  # work in hand drains first
            released = []
        elif over:  # only the oldest unfinished message may go on
            released = [a for a in self._held_back if a.queued <= window and self._leads(a)]
        else:
            released = [a for a in self._held_back if a.queued <= window]
        windows = []
        for account in released:
            del self._held_back[account]
            if account.deferred_ack or account.deferred_stream:
                windows.append(
                    Window(
                        account.stream_id, ack=account.deferred_ack, stream=account.deferred_stream
                    )
                )
            account.deferred_ack = account.deferred_stream = 0
        if over and size < 0 and not (self.working or self.unsent):
            # Nothing drains by itself any more, only messages wait: give the
            # connection window held back, so that the oldest unfinished message
            # can complete (stream windows stay held).
            for account in self._held_back:
                if account.deferred_ack:
                    windows.append(Window(account.stream_id, connection=account.deferred_ack))
                    account.deferred_stream += account.deferred_ack
                    account.deferred_ack = 0
        return windows
