"""Running a coroutine in the calling task until it would wait.

A unary gRPC call whose request came whole is usually answered without waiting:
the data plane runs a small batch inline and the answer is written at once (as
an HTTP connection's task answers its requests, one task step per request).
Given a task of its own, each such call cost a task spawn and a pass of Trio's
run loop more than the same call over HTTP. :func:`step` runs the call's
coroutine in the connection's reader task instead, up to its first wait: most
calls end there. One that would wait has already told Trio's primitives that
*this* task waits (an Event, a ParkingLot, a socket), so it cannot move to
another task: the reader task stays with the call (:class:`Resume`, awaited as
its next step, carries the coroutine on under Trio as if awaited from the
start) and another task takes over the reading.

Trio steps a task's coroutine with ``send`` only, the value an ``Outcome`` that
the waiting primitive unwraps (trio/_core/_run.py ``unrolled_run``, the
"We used to unwrap the Outcome object here" note), so a coroutine stepped here
and carried on by :class:`Resume` sees exactly what it would see awaited.

(A call that waits for its request's outcome in no task does not stop its
coroutine: its handler returns, and the outcome carries the call on,
:mod:`~trionserve.protocol.grpc.parking`.)
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from functools import partial
from typing import Any, final

__all__ = ["READY", "Failed", "Resume", "step"]


def step(coroutine: Coroutine[Any, Any, None]) -> Resume | None:
    """Run ``coroutine`` until it ends (None) or would wait: then the
    :class:`Resume` that the calling task must await next, before any checkpoint
    of its own, to carry it on. Exceptions the coroutine raises propagate."""
    try:
        message = coroutine.send(None)
    except StopIteration:
        return None
    return Resume(coroutine, message)


class _Ready:
    """What awaits nothing: its await returns None at once (an empty tuple's
    iterator, no Python frame), for a function that returns an awaitable
    instead of being a coroutine (``answer.CallAnswer.wait``)."""

    __slots__ = ()

    __await__ = staticmethod(partial(iter, ()))


READY = _Ready()


@final
class Resume:
    """A coroutine stopped at its first wait, carried on when awaited: what it
    yielded is passed up to Trio and what Trio sends back is passed down, until
    it returns. Closed with its awaiter."""

    __slots__ = ("_coroutine", "_message")

    def __init__(self, coroutine: Coroutine[Any, Any, None], message: object) -> None:
        self._coroutine = coroutine
        self._message = message

    def __await__(self) -> Generator[Any, Any, object]:
        coroutine, message = self._coroutine, self._message
        try:
            while True:
                try:
                    sent = yield message
                except GeneratorExit:
                    raise
                except BaseException as exc:  # thrown in (Trio sends, but to be whole)
                    try:
                        message = coroutine.throw(exc)
                    except StopIteration as stop:
                        return stop.value
                    continue
                try:
                    message = coroutine.send(sent)
                except StopIteration as stop:  # (what it returned: a handler's PARKED)
                    return stop.value
        finally:
            coroutine.close()  # a no-op once it returned


@final
class Failed:
    """A coroutine that raised ``error`` at its first step, taken by the
    caller: awaited, it raises ``error`` at once, as the coroutine would have."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __await__(self) -> Generator[Any, Any, object]:
        raise self._error
        yield  # (a generator that never yields)
