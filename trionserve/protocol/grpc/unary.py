"""The handler of a one-request, one-response gRPC method, and gRPC statuses of
TritonErrors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
from google.protobuf.message import Message

from trionserve.core.errors import Cancelled, TritonError, as_triton_error
from trionserve.observability.trace.frontend import FrontendStamps, valid_traceparent
from trionserve.protocol.grpc import codec as grpc_codec
from trionserve.protocol.grpc.call import GrpcCall, Method
from trionserve.protocol.grpc.status import GRPCError, Status

if TYPE_CHECKING:
    from trionserve.dataplane import DataPlane

__all__ = ["grpc_error", "unary_method"]

log = structlog.get_logger(__name__)


def grpc_error(error: TritonError) -> GRPCError:
    """A TritonError as a gRPC status: the Status names are the same."""
    return GRPCError(Status[error.status.name], error.message)


def unary_method(
    request_type: type[Message] | None,
    handle: Callable[..., Awaitable[Any]],
    traced: DataPlane | None = None,
) -> Method:
    """A method taking one request message (parsed as ``request_type``; None: the
    raw message) and answering ``await handle(request, call)``.

    ``traced`` (ModelInfer): while its tracing is on, the call takes Triton's
    GRPC_WAITREAD_START / GRPC_WAITREAD_END around the wait for its message and
    GRPC_SEND_START / GRPC_SEND_END around its answer's send, handed to ``handle``
    as ``call.stamps`` (:mod:`trionserve.observability.trace.frontend`).
    """

    async def handler(call: GrpcCall) -> None:
        stamps = None
        if traced is not None and traced.tracing.active:
            stamps = call.stamps = FrontendStamps(deferred=True)
            stamps.stamp("GRPC_WAITREAD_START")
            stamps.traceparent = valid_traceparent(dict(call.metadata).get("traceparent"))
        try:
            data = await call.receive()
            if data is None or await call.receive() is not None:
                raise GRPCError(
                    Status.INTERNAL, f"{call.method} expects exactly one request message"
                )
            if stamps is not None:
                stamps.stamp("GRPC_WAITREAD_END")
            try:
                request = (
                    data if request_type is None else grpc_codec.parse_message(request_type, data)
                )
                response = await handle(request, call)
            except TritonError as error:
                if (
                    stamps is not None
                    and stamps.trace is not None
                    and not isinstance(error, Cancelled)
                ):
                    # Triton answers a sampled request's error as any response
                    # (src/grpc/infer_handler.cc InferResponseComplete: GRPC_SEND_START
                    # before Finish, GRPC_SEND_END at COMPLETE); here its trailers are
                    # queued with h2 in the same step as the handler ends.
                    stamps.stamp("GRPC_SEND_START")
                    stamps.stamp("GRPC_SEND_END")
                raise grpc_error(error) from None
            except GRPCError:
                raise
            except Exception as exc:
                log.exception("grpc method failed", method=call.method)
                raise grpc_error(as_triton_error(exc, "internal error")) from None
            if isinstance(response, Message):
                response = response.SerializeToString()
            if stamps is not None:
                stamps.stamp("GRPC_SEND_START")
            await call.send(response)
            if stamps is not None:
                stamps.stamp("GRPC_SEND_END")
        finally:
            if stamps is not None:
                stamps.release()

    return Method(handler)
