"""The handler of a one-request, one-response gRPC method, gRPC statuses of
TritonErrors, and Triton's gRPC debug delays."""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog
import trio
from google.protobuf.message import Message

from trionserve.core.errors import Cancelled, TritonError, as_triton_error
from trionserve.observability.logging import verbose
from trionserve.observability.trace.frontend import FrontendStamps
from trionserve.protocol.grpc import codec as grpc_codec
from trionserve.protocol.grpc import inline
from trionserve.protocol.grpc.call import GrpcCall, Method
from trionserve.protocol.grpc.parking import PARKED
from trionserve.protocol.grpc.status import GRPCError, Status

if TYPE_CHECKING:
    from trionserve.dataplane import DataPlane

__all__ = ["DebugDelays", "common_method", "grpc_error", "unary_method"]

log = structlog.get_logger(__name__)


def grpc_error(error: TritonError) -> GRPCError:
    """A TritonError as a gRPC status: the Status names are the same."""
    return GRPCError(Status[error.status.name], error.message)


@dataclass(frozen=True, slots=True)
class DebugDelays:
    """Triton's debugging delays of a ModelInfer call, in milliseconds, from the
    environment variables its gRPC frontend reads (server src/grpc/infer_handler.h
    ParseDebugVariable, in release builds too; its QA sets them to hold a call at
    a step while the client cancels it):

    - ``before_infer``: ``TRITONSERVER_DELAY_GRPC_PROCESS`` (infer_handler.cc:699,
      Process at START, before the request goes to the model) plus
      ``TRITONSERVER_DELAY_GRPC_PROCESS_ENTRY`` (taken once here: this stack has no
      completion-queue steps to enter);
    - ``before_answer``: ``TRITONSERVER_DELAY_RESPONSE_COMPLETE_EXEC`` (:1065) plus
      ``TRITONSERVER_DELAY_RESPONSE_COMPLETION`` (:1181), between the model's
      response and its send.

    And for the other methods (Triton's CommonHandler), ``common_answer``:
    ``TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC``, seconds before each answer is
    written (server src/grpc/grpc_server.cc:2398, read with ``atoi``; applied in
    CommonCallData::WriteResponse, :239).

    Triton's threads sleep; here the call's task waits, so a client that cancels
    meanwhile ends the call at once. Its other delays (``_GRPC_NOTIFICATION``,
    ``_GRPC_ENQUEUE``, ``_GRPC_RESPONSE``, ``_GRPC_COMPLETE``) hold the threads
    that hand its completion-queue events over, which this stack does not have."""

    before_infer: int = 0
    before_answer: int = 0
    common_answer: int = 0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> DebugDelays:
        def ms(name: str) -> int:
            text = environ.get(name)
            if text is None:
                return 0
            try:
                return int(text.strip())
            except ValueError:  # Triton's words (infer_handler.h ParseDebugVariable)
                log.error(
                    f"Unable to parse the debug variable {name}. Value provided: "
                    f"'{text}' is not a valid integer. Error: stoi"
                )
                return 0

        seconds = re.match(r"\s*[+-]?\d+", environ.get(RESPONSE_DELAY, ""))  # atoi
        return cls(
            ms("TRITONSERVER_DELAY_GRPC_PROCESS") + ms("TRITONSERVER_DELAY_GRPC_PROCESS_ENTRY"),
            ms("TRITONSERVER_DELAY_RESPONSE_COMPLETE_EXEC")
            + ms("TRITONSERVER_DELAY_RESPONSE_COMPLETION"),
            max(0, int(seconds.group())) if seconds else 0,
        )

    def infer(self) -> DebugDelays:
        """The delays of ModelInfer."""
        return replace(self, common_answer=0)

    def common(self) -> DebugDelays:
        """The delays of the other unary methods."""
        return DebugDelays(common_answer=self.common_answer)

    @staticmethod
    async def wait(ms: int, what: str) -> None:
        if ms > 0:
            log.info(f"Delaying {what} by {ms} ms...")
            await trio.sleep(ms / 1000)

    async def before_write(self) -> None:
        await self.wait(self.before_answer, "InferResponseComplete")
        if self.common_answer > 0:
            if verbose():
                log.debug(f"Delaying the write of the response by {self.common_answer} seconds")
            await trio.sleep(self.common_answer)


# Triton's CommonHandler delay (grpc_server.cc:2398), in seconds.
RESPONSE_DELAY = "TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC"


def common_method(delays: DebugDelays) -> Callable[..., Method]:
    """``unary_method`` for the methods other than ModelInfer, with their delay."""
    return partial(unary_method, delays=delays.common())


def unary_method(
    request_type: type[Message] | None,
    handle: Callable[..., Awaitable[Any]],
    traced: DataPlane | None = None,
    delays: DebugDelays | None = None,
    now: Callable[[Any, GrpcCall], Any] | None = None,
) -> Method:
    """A method taking one request message (parsed as ``request_type``; None: the
    raw message) and answering ``await handle(request, call)``.

    ``traced`` (ModelInfer): while its tracing is on, the call takes Triton's
    GRPC_WAITREAD_START / GRPC_WAITREAD_END around the wait for its message and
    GRPC_SEND_START / GRPC_SEND_END around its answer's send, handed to ``handle``
    as ``call.stamps`` (:mod:`trionserve.observability.trace.frontend`).
    ``delays``: Triton's debugging delays (:class:`DebugDelays`).
    ``now`` (ModelInfer's, with ``traced``): ``handle``'s first step as plain calls
    (PARKED, or what to await for the rest), taken in place of the handler's first
    step for an untraced call taken whole (:func:`_direct`).
    """
    delays = delays or DebugDelays()

    async def handler(call: GrpcCall) -> object:
        stamps = None
        if traced is not None and traced.tracing.active:
            stamps = call.stamps = FrontendStamps(deferred=True)
            stamps.stamp("GRPC_WAITREAD_START")
            metadata = dict(call.metadata)
            stamps.take_context(metadata.get("traceparent"), metadata.get("tracestate"))
        try:
            # (the request whole: its message taken without a receive, no second
            # receive to find it is the only one)
            data = call.take_whole()
            if data is None:
                data = await call.receive()
                state = call.state
                # (no second receive when it would return None: the request is whole)
                if data is None or (
                    (call.messages or not state.client_done or state.reset or call.error)
                    and await call.receive() is not None
                ):
                    raise GRPCError(
                        Status.INTERNAL, f"{call.method} expects exactly one request message"
                    )
            if stamps is not None:
                stamps.stamp("GRPC_WAITREAD_END")
            try:
                request = (
                    data if request_type is None else grpc_codec.parse_message(request_type, data)
                )
                if delays.before_infer:  # (no coroutine per call without delays)
                    await delays.wait(delays.before_infer, "the Process execution")
                response = await handle(request, call)
                if response is PARKED:  # the call goes on without this coroutine
                    return PARKED
                if delays.before_answer or delays.common_answer:
                    await delays.before_write()
            except Exception as exc:
                raise _status(call, exc, stamps) from None
            message = _message(response)
            if stamps is not None:
                stamps.stamp("GRPC_SEND_START")
            await call.send(message)
            if stamps is not None:
                stamps.stamp("GRPC_SEND_END")
            return None
        finally:
            if stamps is not None:
                stamps.release()

    if traced is not None and now is not None:
        handler.direct = partial(_direct, handler, now, traced, delays)  # type: ignore[attr-defined]
    return Method(handler)


def _direct(
    handler: Callable[[GrpcCall], Awaitable[object]],
    now: Callable[[Any, GrpcCall], Any],
    traced: DataPlane,
    delays: DebugDelays,
    call: GrpcCall,
) -> object:
    """ModelInfer's handler's first step as ``now``'s plain calls, not a coroutine stepped
    (a level fewer, run to its return on the loop's cold caches): PARKED, or the coroutine
    to step for the rest (:func:`_answer`). An untraced call taken whole with no debug delay
    before it; any other is the handler's (``handler(call)``)."""
    if traced.tracing.active or delays.before_infer:
        return handler(call)
    data = call.take_whole()
    if data is None:
        return handler(call)
    try:
        rest = now(data, call)
    except BaseException as exc:
        return _answer(call, inline.Failed(exc), delays)
    return PARKED if rest is PARKED else _answer(call, rest, delays)


async def _answer(call: GrpcCall, rest: Awaitable[object], delays: DebugDelays) -> object:
    """The handler's rest after ``_direct``'s step, as the handler's own ends an untraced
    call: ``rest`` awaited, its errors as statuses, its answer sent."""
    try:
        response = await rest
        if response is PARKED:
            return PARKED
        if delays.before_answer or delays.common_answer:
            await delays.before_write()
    except Exception as exc:
        raise _status(call, exc, None) from None
    await call.send(_message(response))
    return None


def _status(call: GrpcCall, error: Exception, stamps: FrontendStamps | None) -> GRPCError:
    """The status a unary call whose handling raised ``error`` ends with: a GRPCError's
    own, a TritonError's (a sampled request's stamped as sent: ``stamps``), else INTERNAL
    (logged). Called where it is caught."""
    if isinstance(error, GRPCError):
        return error
    if isinstance(error, TritonError):
        if stamps is not None and stamps.trace is not None and not isinstance(error, Cancelled):
            # Triton answers a sampled request's error as any response
            # (src/grpc/infer_handler.cc InferResponseComplete: GRPC_SEND_START
            # before Finish, GRPC_SEND_END at COMPLETE); here its trailers are
            # queued with h2 in the same step as the handler ends.
            stamps.stamp("GRPC_SEND_START")
            stamps.stamp("GRPC_SEND_END")
        return grpc_error(error)
    log.exception("grpc method failed", method=call.method)
    return grpc_error(as_triton_error(error, "internal error"))


def _message(response: Any) -> Any:
    """A handler's answer as ``GrpcCall.send`` takes it (a protobuf message serialized;
    ModelInfer's chunks as they are)."""
    if type(response) is not list and isinstance(response, Message):
        return response.SerializeToString()
    return response
