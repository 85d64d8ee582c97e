"""Calls that wait in no task: a unary call whose request is not whole yet, and
one parked while its request runs. A part of
:class:`~trionserve.protocol.grpc.connection.Connection`, apart for its size.

At c=1 a large ModelInfer call used to cost the loop a task of its own (its
request came in several reads: spawned on its HEADERS), that task's wake-ups
for its message and for its outcome, and a pass of Trio's run loop each
(benchmarks/README.md, issue 39's tenth round). Now:

- A unary call without a deadline whose request is not whole in the read that
  brings its HEADERS *awaits* it (``_awaiting``): it starts in the reader's
  task after the read that makes it whole, refuses it or resets it
  (:meth:`ParkedCalls._release`), as a call whose request came whole does
  (``Connection._start_calls``).
- A call run there whose answer is armed for the instance's thread
  (:mod:`~trionserve.protocol.grpc.answer`) *parks* where it would wait for its
  outcome (``CallAnswer.wait``: :data:`~trionserve.protocol.grpc.inline.PARK`,
  allowed by :meth:`ParkedCalls.park`: no deadline, not reset): no task waits
  for it. The outcome carries it on (``request.on_final``,
  :meth:`ParkedCalls._unpark`): in the reader's task after the read whose sweep
  delivered it (at c=1 the client's next call: the call ends there, its answer
  taken, with no task and no pass of its own), else in a task of its own
  (:meth:`ParkedCalls._carry_on`), as does a call the client resets (its scope
  cancelled: the request is cancelled as in any call's task) and every waiting
  call when the reader ends (the connection's end: they run under its
  cancellation, as the calls' tasks do).

A call carried on goes the way it would have gone awaited: exactly one
outcome, the same status and trailers, its cancellation and the server's cut
at the exit timeout (``Connection._run_call``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

import trio

from trionserve.protocol.grpc import inline

if TYPE_CHECKING:
    from trionserve.core.inference import InferenceRequest
    from trionserve.protocol.grpc.call import GrpcCall

__all__ = ["Handler", "ParkedCalls"]

Handler = Callable[["GrpcCall"], Awaitable[None]]


class ParkedCalls:
    """The connection's calls waiting in no task (a base of
    :class:`~trionserve.protocol.grpc.connection.Connection`, which sets the
    attributes below)."""

    _awaiting: dict[int, tuple[GrpcCall, Handler]]  # by stream id
    _parked: dict[GrpcCall, inline.Resume]
    _starting: list[tuple[GrpcCall, Handler | inline.Resume]]
    _inline: GrpcCall | None
    _sweeping: bool  # the reader's sweep (Connection._sweep) runs
    _nursery: trio.Nursery | None

    def _spawn(self, call: GrpcCall, handler: Handler) -> None:
        raise NotImplementedError

    def park(self, call: GrpcCall, request: InferenceRequest) -> bool:
        """Whether ``call``, running in the reader's task with its answer armed,
        may park until ``request`` has its outcome (answer.py's
        ``CallAnswer.wait``): no deadline, not reset; the outcome carries it on
        (_unpark)."""
        if self._inline is not call or call.deadline is not None or call.state.reset:
            return False
        request.on_final(partial(self._unpark, call))  # (no frame of its own, as a lambda has)
        return True

    def _unpark(self, call: GrpcCall) -> None:
        """A parked call's request has its outcome: carried on after the read
        when the reader's sweep delivered it, else in a task of its own."""
        resume = self._parked.pop(call, None)
        if resume is None:  # (gone on in a task already)
            return
        if self._sweeping:
            self._starting.append((call, resume))
        else:
            self._adopt(call, resume)

    def _release(self, call: GrpcCall) -> None:
        """The call's request is whole, refused or reset: an awaiting call
        starts after the read; a parked one reset goes on in a task of its
        own, its scope cancelled."""
        entry = self._awaiting.pop(call.stream_id, None)
        if entry is not None:
            self._starting.append(entry)
        elif call.state.reset and (resume := self._parked.pop(call, None)) is not None:
            self._adopt(call, resume)

    def _let_go_waiting(self) -> None:
        """Nothing reads on (the reader ended): every call waiting in no task
        gets one, as the calls in tasks of their own go on."""
        awaiting, self._awaiting = self._awaiting, {}
        for call, handler in awaiting.values():
            self._spawn(call, handler)
        parked, self._parked = self._parked, {}
        for call, resume in parked.items():
            self._adopt(call, resume)

    def _go_on(self, call: GrpcCall, handler: Handler | inline.Resume) -> None:
        """A call of ``_starting`` not run in the reader: a task of its own,
        started (a handler) or carrying it on (a parked call's Resume)."""
        if isinstance(handler, inline.Resume):
            self._adopt(call, handler)
        else:
            self._spawn(call, handler)

    def _adopt(self, call: GrpcCall, resume: inline.Resume) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._carry_on, call, resume)

    @staticmethod
    async def _carry_on(call: GrpcCall, resume: inline.Resume) -> None:
        """A parked call goes on in this task, in a scope of its own (cancelled
        at once if the client reset the stream), as a call run in the reader's
        task that would wait takes that task's (Connection._run_call)."""
        with trio.CancelScope() as scope:
            call.scope = scope
            if call.state.reset:
                scope.cancel()
            if resume.proceed() is not None:
                await resume
