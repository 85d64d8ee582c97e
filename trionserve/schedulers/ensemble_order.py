"""The order in which an ensemble hands on its steps' responses.

Each step run of an ensemble request is a task of its own (see
:class:`~trionserve.schedulers.ensemble.EnsembleRun`) that takes its step's
responses and passes them on: into the steps that read them, or out as the
ensemble's answer. Two runs whose responses arrive in the same turn of the event
loop wake together, and Trio runs a batch of woken tasks in an order of its own
choosing, so without more a stream's later value could overtake an earlier one
(a decoupled step's three values squared by the next step and answered 4, 16, 9).

Triton hands a step's responses on in the order its models sent them: each
response's callback runs the ensemble's next steps where it was sent (core
src/ensemble_scheduler/ensemble_scheduler.cc, ``ResponseComplete`` ->
``ProcessAndSetResponses`` -> ``ScheduleSteps``), on the thread of the model that
sent it, so one step's responses keep their order and another step's do not wait
for them. Here a :class:`StepRequest` notes each response (and a final flag sent
alone) in its step's :class:`ResponseOrder` at the moment its model sends it, and
a run passes a response on only when it is its step's oldest not passed on yet (a
decoupled step's values waiting for the next step's ``max_inflight_requests``
slot hold back no answer of that next step). A run's slot of
``max_inflight_requests`` is given back when its model sends the final response,
not when that response was passed on, so a response waiting for its turn never
holds back the one before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse


class ResponseOrder:
    """The step requests of one ensemble request, once for each response their
    models sent and nobody passed on yet, the oldest first."""

    __slots__ = ("_sent", "_moved")

    def __init__(self) -> None:
        self._sent: deque[InferenceRequest] = deque()
        self._moved = trio.Event()  # set (and replaced) when the oldest is passed on

    def sent(self, request: InferenceRequest) -> None:
        self._sent.append(request)

    async def turn(self, request: InferenceRequest) -> None:
        """Wait until ``request``'s next response is the oldest not passed on (at
        once for a response that was never noted: a cached one)."""
        sent = self._sent
        while sent and sent[0] is not request and request in sent:
            await self._moved.wait()

    def passed_on(self, request: InferenceRequest) -> None:
        """``request``'s oldest response was passed on (or dropped)."""
        sent = self._sent
        if sent and sent[0] is request:
            sent.popleft()
            self._wake()

    def forget(self, request: InferenceRequest) -> None:
        """``request``'s run ended: responses of it that were never passed on (its
        consumer failed or was cancelled) no longer hold back the others."""
        sent = self._sent
        if request not in sent:
            return
        front = sent[0]
        kept = [r for r in sent if r is not request]
        sent.clear()
        sent.extend(kept)
        if front is request:
            self._wake()

    def _wake(self) -> None:
        self._moved.set()
        self._moved = trio.Event()


class StepRequest(InferenceRequest):
    """An ensemble step's request: notes each response in its ensemble request's
    :class:`ResponseOrder` as its model sends it, and calls ``on_end`` (once) when
    it has its final outcome."""

    __slots__ = ("order", "on_end")

    def __init__(self, *args: Any, order: ResponseOrder, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.order = order
        self.on_end: Callable[[], None] | None = None

    def send(self, response: InferenceResponse | None, *, final: bool) -> bool:
        accepted = super().send(response, final=final)
        if accepted:
            if response is not None or final:  # something for the stream to yield
                self.order.sent(self)
            if final:
                self.ended()
        return accepted

    def respond(self, response: InferenceResponse) -> bool:
        accepted = super().respond(response)
        if accepted:
            self.order.sent(self)
            self.ended()
        return accepted

    def fail(self, error: TritonError) -> bool:
        accepted = super().fail(error)
        if accepted:
            self.ended()
        return accepted

    def evict(self, message: str) -> None:
        super().evict(message)
        self.ended()

    def ended(self) -> None:
        """Call ``on_end`` if it was not called yet (the run's end calls it too,
        for a request that never had its final outcome)."""
        callback, self.on_end = self.on_end, None
        if callback is not None:
            callback()
