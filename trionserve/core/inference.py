"""Inference requests, responses and tensors, as every layer sees them.

Frontends decode wire messages into an :class:`InferenceRequest`; the runtime answers
each request exactly once through :meth:`InferenceRequest.respond` or
:meth:`InferenceRequest.fail`; the frontend awaits :meth:`InferenceRequest.wait` and
encodes the :class:`InferenceResponse`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import trio

from trionserve.core.errors import InternalError, ResourceExhausted, TritonError

if TYPE_CHECKING:
    from trionserve.core.client_budget import ClientBudget

# --max-undelivered-response-bytes: what one request's responses may hold in the
# server before its consumer (the client's connection) takes them.
DEFAULT_UNDELIVERED_RESPONSE_BYTES = 64 * 1024 * 1024


def response_nbytes(response: InferenceResponse) -> int:
    """The bytes a response's output tensors hold (BYTES elements: their lengths)."""
    total = 0
    for tensor in response.outputs:
        data = tensor.data
        if data.dtype.kind != "O":
            total += data.nbytes
        else:
            total += sum(
                len(item) if isinstance(item, (bytes, bytearray, str)) else 8
                for item in data.reshape(-1).tolist()
            )
    return total


class ThreadAnswer(Protocol):
    """Where a request's one response may be written by the thread that computed
    it, without the event loop (an HTTP/1.1 connection's, see
    :mod:`trionserve.protocol.http.answer`; a unary gRPC call's,
    :mod:`trionserve.protocol.grpc.answer`). ``armed`` and ``write`` are read and
    called on that thread: ``write`` answers the client, or declines (False: the
    event loop answers as usual, once the executor's report reaches it).
    ``wait`` is the consumer's wait for the outcome (on the Trio thread) while
    the answer is armed, and ``finalized`` is called on the Trio thread when the
    request's final outcome is delivered: it writes the answer there, still
    armed, or ends that wait."""

    @property
    def armed(self) -> bool: ...

    def write(self, request: InferenceRequest, response: InferenceResponse) -> bool: ...

    def wait(self) -> Awaitable[None]: ...

    def finalized(self) -> None: ...


@dataclass(slots=True)
class Tensor:
    """A named tensor: its wire datatype and a numpy array with its shape and data."""

    name: str
    datatype: str
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for, with its per-output parameters."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    id: str = ""
    outputs: list[Tensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)


class InferenceRequest:
    """One inference request and the place its responses are delivered.

    The request is created by a frontend on the Trio thread and answered on the Trio
    thread (backends in worker threads or stub processes hand their results to the
    executor, which answers). A request ends with exactly one final outcome:
    ``respond`` (one response, final), ``fail`` (an error, final), or for decoupled
    models any number of ``send(response, final=False)`` followed by a final
    ``send``. Anything delivered after the final outcome is ignored and reported by
    the ``False`` return value, so a racing cancellation never produces two answers.

    Consumers use ``wait`` (exactly one response expected) or ``stream`` (every
    response, for decoupled models and gRPC streams).

    Responses delivered and not yet consumed are bounded by bytes: when a response
    would take them past ``undelivered_limit`` (the first pending response is
    always taken, however large), the request fails at once with
    :class:`ResourceExhausted` naming the bytes held and the flag, and is flagged
    cancelled so that its model stops; what the model sends after that is
    ignored. A consumer that never reads (a client that stops reading a decoupled
    model's stream) thus holds at most ``undelivered_limit`` plus one response.
    ``undelivered_peak`` is the most bytes the request ever held undelivered (a
    lone final response, which can pass no bound, is not counted).

    The same bytes are counted in the server's ``budget``
    (:class:`~trionserve.core.client_budget.ClientBudget`, set at admission),
    reserved as a response is held and released as it is taken; while it holds
    any, the request is one of the budget's holders, which the memory-pressure
    policy may ``evict``: its responses are dropped and it fails with
    RESOURCE_EXHAUSTED. ``discard`` lets go of what nobody will take any more.
    """

    # Whether the request counts in the model's statistics (a sequence batcher's
    # null filler request does not: schedulers/sequence_controls.NullRequest).
    collect_stats: ClassVar[bool] = True

    __slots__ = (
        "model_name",
        "model_version",
        "model_namespace",
        "id",
        "inputs",
        "requested_outputs",
        "parameters",
        "priority",
        "timeout_us",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "batch_size",
        "arrival_time",
        "rescheduled",
        "trace",
        "trace_context",
        "_cancelled",
        "_on_cancel",
        "_responses",
        "done",
        "_empty_final",
        "_error",
        "_wakeup",
        "_undelivered",
        "undelivered_limit",
        "undelivered_peak",
        "budget",
        "last_read",
        "_in_hand",
        "answer",
        "_on_final",
        "queued",
        "shape_key",
    )

    def __init__(
        self,
        model_name: str,
        model_version: int | None = None,
        *,
        id: str = "",
        inputs: dict[str, Tensor] | None = None,
        requested_outputs: list[RequestedOutput] | None = None,
        parameters: dict[str, Any] | None = None,
        priority: int = 0,
        timeout_us: int = 0,
        sequence_id: int | str = 0,
        sequence_start: bool = False,
        sequence_end: bool = False,
        model_namespace: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.model_version = model_version
        # The namespace that names the model exactly (an ensemble step's, with
        # --model-namespacing); None: the name is resolved by the registry.
        self.model_namespace = model_namespace
        self.id = id
        self.inputs: dict[str, Tensor] = inputs if inputs is not None else {}
        # None means "every output of the model".
        self.requested_outputs = requested_outputs
        self.parameters: dict[str, Any] = parameters if parameters is not None else {}
        self.priority = priority
        self.timeout_us = timeout_us
        self.sequence_id = sequence_id
        self.sequence_start = sequence_start
        self.sequence_end = sequence_end
        # Filled in by validation: 0 for models without a batch dimension.
        self.batch_size = 0
        self.arrival_time = 0.0
        # Set by a backend whose model released the request with
        # TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: its scheduler queues it again
        # (an iterative sequence, core sequence_batch_scheduler/sequence_utils.cc).
        self.rescheduled = False
        # The request's trace while it is traced (set by the data plane), and what
        # its trace hangs from: the trace of the request that made it (an ensemble
        # step's), whose child trace it then gets whatever the sampling (core
        # SpawnChildTrace), or its frontend's timestamps (HTTP_RECV_START ...),
        # which go with its trace if it is sampled.
        self.trace: object | None = None
        self.trace_context: object | None = None
        # Set when the client went away; schedulers drop cancelled requests.
        self._cancelled = False
        self._on_cancel: Callable[[], None] | None = None
        # Responses delivered and not yet consumed. Its length is bounded by what
        # the model produces for one request; the consumer drains it as it goes.
        self._responses: deque[tuple[InferenceResponse, int]] = deque()
        # Bytes of the responses in ``_responses``, their bound and their peak.
        self._undelivered = 0
        self.undelivered_limit = DEFAULT_UNDELIVERED_RESPONSE_BYTES
        self.undelivered_peak = 0
        # The server's budget of bytes held for clients (None: not counted), and
        # when the consumer last took a response (for its pressure policy).
        self.budget: ClientBudget | None = None
        self.last_read = 0.0
        # The counted bytes of the response a stream consumer took last: still in
        # its hands (being encoded and written) until it asks for the next one.
        self._in_hand = 0
        # True once the final outcome was delivered (read anywhere, set here only).
        self.done = False
        # The final outcome came as a flag after the last response, not with it.
        self._empty_final = False
        self._error: TritonError | None = None
        # What a consumer waiting for a response waits on: made by its first wait
        # (most outcomes come before one, or during the HTTP answer's wait).
        self._wakeup: trio.Event | None = None
        # Set by a frontend whose client's answer the instance's thread may write
        # (see ThreadAnswer); told of the final outcome, and waited on, by ``wait``.
        self.answer: ThreadAnswer | None = None
        # Called once with the final outcome (see on_final).
        self._on_final: Callable[[], None] | None = None
        # Set by the data plane: what its caller waits on until the model holds
        # the request (an ensemble's next step run, a stream's next request). A
        # batch run in the submitting task sets it as the run begins (``held``,
        # InstanceExecutor._run_direct_awaited), not once the model has answered.
        self.queued: trio.Event | None = None
        # Set by a frontend that decoded the request from a form it keeps (the HTTP
        # codec's plan of a repeated header): requests with the same key have the
        # same inputs' names, types and shapes and the same requested outputs, so
        # validation against a model is done once per key (core/validation.py).
        self.shape_key: object | None = None

    @property
    def cancelled(self) -> bool:
        """True once the client went away (or the caller cancelled the request)."""
        return self._cancelled

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        if value and not self._cancelled:
            self._cancelled = True
            callback, self._on_cancel = self._on_cancel, None
            if callback is not None:
                callback()
        else:
            self._cancelled = bool(value)

    def on_cancel(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (on the Trio thread, once) when the request is
        cancelled: at once if it already is. A backend uses it to tell the model
        without waiting; ``None`` removes it."""
        if callback is not None and self._cancelled:
            callback()
            return
        self._on_cancel = callback

    def held(self) -> None:
        """The model holds the request now (it is running it): its caller's
        ``queued`` wait ends, as it would once the request was queued."""
        if self.queued is not None:
            self.queued.set()

    def on_final(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (on the Trio thread, once) when the request gets its
        final outcome: at once if it has it; ``None`` removes it. The data plane
        uses it to end the trace of a request its caller gave up on while the
        model still runs it; a caller that began a request (``DataPlane.begin``)
        to be carried on by its outcome."""
        if callback is not None and self.done:
            callback()
        else:
            self._on_final = callback

    def _finalized(self) -> None:
        callback, self._on_final = self._on_final, None
        if callback is not None:
            callback()

    @property
    def lone_response(self) -> InferenceResponse | None:
        """The request's one response, when its final outcome is that response
        alone and nobody took it yet; None otherwise (an error, none, several)."""
        if self.done and self._error is None and len(self._responses) == 1:
            return self._responses[0][0]
        return None

    @property
    def ready(self) -> bool:
        """True when :meth:`stream` has its next pair (a response, the end or the
        error) now, without waiting: a consumer may take it to write several
        responses at once."""
        return bool(self._responses) or self.done

    def send(self, response: InferenceResponse | None, *, final: bool) -> bool:
        """Deliver a response (or, with ``final``, possibly none: just the end)."""
        if self.done:
            return False
        if response is not None:
            held = self._undelivered
            # A final response with nothing before it held can pass no bound and
            # nothing follows it: not counted (the one-response path pays nothing).
            size = response_nbytes(response) if held or not final else 0
            if held and held + size > self.undelivered_limit:
                return self._overflow(size)
            budget = self.budget
            if size and budget is not None:
                if not held:
                    self.last_read = trio.current_time()
                    budget.hold(self)
                budget.reserve(size)
            held += size
            self._undelivered = held
            self.undelivered_peak = max(self.undelivered_peak, held)
            self._responses.append((response, size))
        elif final:
            self._empty_final = True
        self.done = final
        if self._wakeup is not None:
            self._wakeup.set()
        if final:
            if self.answer is not None:
                self.answer.finalized()
            if self._on_final is not None:
                self._finalized()
        return True

    def _overflow(self, size: int) -> bool:
        """A response that would pass the bound: fail the request and stop its model."""
        self.fail(
            ResourceExhausted(
                f"request '{self.id}' for model '{self.model_name}': its responses not "
                f"yet delivered to the client hold {self._undelivered} bytes and the next "
                f"one {size} bytes, past the limit of {self.undelivered_limit} bytes "
                "(--max-undelivered-response-bytes); the client is not reading its "
                "responses fast enough, so the request was cancelled"
            )
        )
        self.cancelled = True
        return False

    @property
    def held_bytes(self) -> int:
        """The bytes of the responses delivered and not consumed yet."""
        return self._undelivered

    def _let_go(self) -> None:
        """Drop the responses not consumed (nobody will take them) and release
        their bytes."""
        held, self._undelivered = self._undelivered, 0
        self._responses.clear()
        budget = self.budget
        if budget is not None and held:
            budget.release(held)
            budget.let_go(self)

    def discard(self) -> None:
        """The consumer is done with the request: what it did not take is dropped,
        and what it took is no longer counted."""
        if self._in_hand:
            self._put_down()
        if self._responses:
            self._let_go()

    def _put_down(self) -> None:
        """The stream consumer is done with the response it took last."""
        in_hand, self._in_hand = self._in_hand, 0
        if self.budget is not None:
            self.budget.release(in_hand)

    def evict(self, message: str) -> None:
        """The budget's pressure policy gave up on this request's client (see
        :mod:`~trionserve.core.client_budget`): its responses not consumed are
        dropped, it fails with RESOURCE_EXHAUSTED (even when the model had
        finished), and its model is told to stop."""
        self._let_go()
        self._error = ResourceExhausted(
            f"request '{self.id}' for model '{self.model_name}': {message}; the "
            "request was cancelled"
        )
        self.done = True
        self._empty_final = False
        if self._wakeup is not None:
            self._wakeup.set()
        if self.answer is not None:
            self.answer.finalized()
        if self._on_final is not None:
            self._finalized()
        self.cancelled = True

    def respond(self, response: InferenceResponse) -> bool:
        """Deliver the one final response of a non-decoupled request."""
        if self.done:
            return False
        if self._undelivered:
            # This class's send (a subclass that tracks deliveries sees one: this).
            return InferenceRequest.send(self, response, final=True)
        # send() with nothing held: a lone final response is not counted.
        self._responses.append((response, 0))
        self.done = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self.answer is not None:
            self.answer.finalized()
        callback = self._on_final
        if callback is not None:  # (_finalized, written out: a parked gRPC call's)
            self._on_final = None
            callback()
        return True

    def fail(self, error: TritonError) -> bool:
        """Deliver the final error; responses already sent stay delivered."""
        if self.done:
            return False
        self._error = error
        self.done = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self.answer is not None:
            self.answer.finalized()
        if self._on_final is not None:
            self._finalized()
        return True

    async def wait(self) -> InferenceResponse:
        """Wait for the outcome of a request that has exactly one response."""
        if self.answer is not None and not self.done:
            await self.answer.wait()
        while not self.done:
            wakeup = self._wakeup
            if wakeup is None or wakeup.is_set():  # (set by a response before this wait)
                wakeup = self._wakeup = trio.Event()
            await wakeup.wait()
        return self.result()

    def result(self) -> InferenceResponse:
        """The outcome of a request that has exactly one response, once final
        (``done``): the response, taken, or the error raised."""
        if self._error is not None:
            raise self._error
        if len(self._responses) != 1:
            raise InternalError(
                f"model '{self.model_name}' produced {len(self._responses)} responses "
                "for a request that expects exactly one"
            )
        response, size = self._responses.popleft()
        if size:
            self._taken(size)
        return response

    async def stream(self) -> AsyncIterator[tuple[InferenceResponse | None, bool]]:
        """Yield ``(response, final)`` pairs until the final one; raise a final error.

        A final pair carries ``None`` exactly when the model ended the request
        without a last response (decoupled models' final flag sent on its own):
        the pairs are what the model sent, whatever the timing of its sends.
        """
        while True:
            if self._in_hand:
                self._put_down()  # the consumer asks for the next: done with it
            while not self._responses and not self.done:
                wakeup = self._wakeup
                if wakeup is None:
                    wakeup = self._wakeup = trio.Event()
                await wakeup.wait()
                self._wakeup = None
            if self._responses:
                response, size = self._responses.popleft()
                if size:
                    # Still counted in the budget while the consumer holds it.
                    self._in_hand = size
                    held = self._undelivered = self._undelivered - size
                    budget = self.budget
                    if budget is not None:
                        if held:
                            self.last_read = trio.current_time()
                        else:
                            budget.let_go(self)
                last = (
                    self.done
                    and not self._responses
                    and self._error is None
                    and not self._empty_final
                )
                yield response, last
                if last:
                    return
                continue
            if self._error is not None:
                raise self._error
            yield None, True
            return

    def _taken(self, size: int) -> None:
        """The consumer took a response of ``size`` counted bytes."""
        held = self._undelivered = self._undelivered - size
        budget = self.budget
        if budget is not None:
            budget.release(size)
            if held:
                self.last_read = trio.current_time()
            else:
                budget.let_go(self)

    def __repr__(self) -> str:
        return (
            f"InferenceRequest({self.model_name!r}, version={self.model_version}, "
            f"id={self.id!r}, inputs={list(self.inputs)})"
        )
