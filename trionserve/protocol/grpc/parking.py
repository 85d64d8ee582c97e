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
  (:mod:`~trionserve.protocol.grpc.answer`) *parks* once its request is queued
  (:meth:`ParkedCalls.park`: no deadline, not reset, no outcome yet): its
  handler returns :data:`PARKED` at once and leaves a
  :class:`Parked`, how the call goes on; no task and no coroutine wait for it.
  The outcome carries it on (the ``Parked`` is the request's ``on_final``
  callback): delivered by the reader's sweep (at c=1 the client's next call), a
  call the thread answered ends right there, with no coroutine at all
  (``ParkedInfer.__call__``: the data plane's ``answered``, then
  ``Connection._ended``); else (:meth:`ParkedCalls._carry`), and for any other
  outcome,
  :meth:`Parked.rest` (the handler's remainder) runs as a call does, in the
  reader's task after the read or in a task of its own; so does a call the
  client resets (its scope cancelled: the request is cancelled as in any
  call's task) and every waiting call when the reader ends (the connection's
  end: they run under its cancellation, as the calls' tasks do).

A call carried on goes the way it would have gone awaited: exactly one
outcome, the same status and trailers, its cancellation and the server's cut
at the exit timeout (``Connection._run_call``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from trionserve.core.inference import InferenceRequest
    from trionserve.protocol.grpc.call import GrpcCall

__all__ = ["PARKED", "PARKED_KINDS", "Handler", "Parked", "ParkedCalls"]

Handler = Callable[["GrpcCall"], Awaitable[object]]

# What a handler (and ModelInfer's ``handle``) returns for a call it parked:
# the call is not over (Connection._run_call leaves it as it is).
PARKED: list = []


# Parked and its subclasses: ``type(entry) in PARKED_KINDS`` tells a carried-on
# entry of ``_starting`` from a handler without an isinstance call.
PARKED_KINDS: set[type] = set()


class Parked:
    """How a parked call goes on once its request has its outcome (a base:
    ModelInfer's is ``parkedinfer.ParkedInfer``), and the request's ``on_final``
    callback (:meth:`__call__`)."""

    __slots__ = ()

    def __call__(self) -> None:
        """On the Trio thread: the request has its outcome. The call leaves
        ``_parked`` (none: it went on in a task already) and ends here if
        :meth:`ended` says so, else goes on as :meth:`ParkedCalls._carry`
        says."""
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        PARKED_KINDS.add(cls)

    def ended(self) -> bool:
        """In the reader, after the read (``_start_calls``), a call carried
        on: end it there if it needs no wait and no write of its own: True;
        False leaves everything to :meth:`rest`. (ModelInfer's ends such a
        call in :meth:`__call__` already.)"""
        return False

    async def rest(self, call: GrpcCall) -> object:
        """The handler's remainder, awaited as a handler is (its status and
        trailers, cancellation, the exit timeout's cut: ``Connection._run_call``)."""
        raise NotImplementedError


PARKED_KINDS.add(Parked)


class ParkedCalls:
    """The connection's calls waiting in no task (a base of
    :class:`~trionserve.protocol.grpc.connection.Connection`, which sets the
    attributes below)."""

    _awaiting: dict[int, tuple[GrpcCall, Handler]]  # by stream id
    _parked: dict[GrpcCall, Parked]
    _starting: list[tuple[GrpcCall, Handler | Parked]]
    _inline: GrpcCall | None
    _sweeping: bool  # the reader's sweep (Connection._sweep) runs
    _swept: int  # the parked calls it carried on so far (_carry)
    _nursery: trio.Nursery | None

    def _spawn(self, call: GrpcCall, handler: Handler) -> None:
        raise NotImplementedError

    def park(self, call: GrpcCall, request: InferenceRequest, parked: Parked) -> bool:
        """Whether ``call``, running in the reader's task with its answer armed
        (answer.py), parks until ``request``, queued, has its outcome: no
        deadline, not reset, no outcome yet; the outcome carries it on as
        ``parked`` says (``Parked.__call__``, the request's ``on_final``: no
        object made per call)."""
        if (
            self._inline is not call
            or call.deadline is not None
            or call.state.reset
            or request.done
        ):
            return False
        self._parked[call] = parked
        request.on_final(parked)
        return True

    def _carry(self, call: GrpcCall, parked: Parked) -> None:
        """A parked call's request has its outcome (``Parked.__call__``, the
        call out of ``_parked``) and the call goes on: after the read when the
        reader's sweep delivered it (before the read's new calls, in the order
        delivered), else in a task of its own."""
        if self._sweeping:
            self._starting.insert(self._swept, (call, parked))
            self._swept += 1
        else:
            self._spawn(call, parked.rest)

    def _release(self, call: GrpcCall) -> None:
        """The call's request is whole, refused or reset: an awaiting call
        starts after the read; a parked one reset goes on in a task of its
        own, its scope cancelled."""
        entry = self._awaiting.pop(call.stream_id, None)
        if entry is not None:
            self._starting.append(entry)
        elif call.state.reset and (parked := self._parked.pop(call, None)) is not None:
            self._spawn(call, parked.rest)

    def _let_go_waiting(self) -> None:
        """Nothing reads on (the reader ended): every call waiting in no task
        gets one, as the calls in tasks of their own go on; so does every call
        left to start after a read (a closing connection's reads start none:
        a parked call its sweep carried on would end never, its request never
        counted out)."""
        starting, self._starting = self._starting, []
        for call, handler in starting:
            self._go_on(call, handler)
        awaiting, self._awaiting = self._awaiting, {}
        for call, handler in awaiting.values():
            self._spawn(call, handler)
        parked, self._parked = self._parked, {}
        for call, carried in parked.items():
            self._spawn(call, carried.rest)

    def _go_on(self, call: GrpcCall, handler: Handler | Parked) -> None:
        """A call of ``_starting`` not run in the reader: a task of its own,
        started (a handler) or carrying it on (a parked call's rest)."""
        self._spawn(call, handler.rest if isinstance(handler, Parked) else handler)
