"""The gRPC service's inference methods: ModelInfer (a unary call, its request
decoded from the last one's form where it repeats, its answer written by the
instance's thread where nothing else comes between) and ModelStreamInfer (a
stream's requests served concurrently, answered in turn). A part of
:class:`~trionserve.protocol.grpc.service.GrpcService`, apart for its size.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
import trio

from trionserve._generated import grpc_service_pb2 as pb
from trionserve.core.errors import TritonError, as_triton_error
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.core.parameters import check_forwarded_header
from trionserve.core.shared_memory import RequestRegions
from trionserve.dataplane import DataPlane
from trionserve.lifecycle import Lifecycle
from trionserve.observability.logging import SETTINGS as LOG_SETTINGS
from trionserve.observability.logging import log_infer_failed
from trionserve.observability.logging import verbose as verbose_logging
from trionserve.observability.trace.frontend import FrontendStamps, now_ns
from trionserve.protocol.grpc import answer as grpc_answer
from trionserve.protocol.grpc import codec as grpc_codec
from trionserve.protocol.grpc import framing as grpc_framing
from trionserve.protocol.grpc import infercache as grpc_infercache
from trionserve.protocol.grpc import laterread as grpc_laterread
from trionserve.protocol.grpc.call import GrpcCall
from trionserve.protocol.grpc.options import GrpcOptions
from trionserve.protocol.grpc.parkedinfer import ParkedInfer
from trionserve.protocol.grpc.parking import PARKED
from trionserve.protocol.grpc.status import GRPCError, Status
from trionserve.protocol.grpc.streams import STREAM_PENDING_LIMIT, StreamBudget, Turn
from trionserve.protocol.grpc.unary import DebugDelays, grpc_error

if TYPE_CHECKING:
    from trionserve.protocol.later import LaterBody

__all__ = ["InferMethods"]

log = structlog.get_logger(__name__)


class InferMethods:
    """ModelInfer and ModelStreamInfer (a base of
    :class:`~trionserve.protocol.grpc.service.GrpcService`, which sets the
    attributes below)."""

    dataplane: DataPlane
    options: GrpcOptions
    verbose: bool
    delays: DebugDelays
    _forward: re.Pattern[str] | None
    _first_response: bool

    async def model_infer(self, data: grpc_framing.Message, call: GrpcCall) -> object:
        """ModelInfer (the handler's way, :func:`~.unary.unary_method`): its answer's chunks,
        ANSWERED (written by the instance's thread) or PARKED (its outcome carries the call
        on: parking.py)."""
        rest = self.model_infer_now(data, call)
        return PARKED if rest is PARKED else await rest

    def model_infer_now(
        self,
        data: grpc_framing.Message,
        call: GrpcCall,
        decoded: tuple[InferenceRequest, LaterBody | None, RequestRegions | None] | None = None,
    ) -> Any:
        """ModelInfer's first step as plain calls (``unary._direct`` takes it in place of a
        coroutine stepped to its first wait): PARKED, or the awaitable that takes the rest
        of the way (to the answer's chunks, ANSWERED or PARKED), awaited at once.
        ``decoded``: the request protobuf decoded (:meth:`_decoded_infer`), the rest of its
        message left in the socket and the regions it holds."""
        if decoded is None:
            # The common request (infercache): it names no shared memory, so no
            # regions are held for it; any other goes through protobuf (codec).
            # (its last raw contents may still be in the socket: grpc/laterread.py)
            request, later = grpc_laterread.decoded(call, data)
            if request is None:
                return self._decoded_infer(data, call, later)
            shared_memory = None
        else:
            request, later, shared_memory = decoded
        dataplane = self.dataplane
        if self._forward is not None:
            self._forward_headers(call, request)
        if dataplane.tracing.active:  # GRPC_WAITREAD_START ... (unary.unary_method)
            request.trace_context = getattr(call, "stamps", None)
        if self.verbose or LOG_SETTINGS.log_verbose_level > 0:  # (verbose_logging())
            if later is not None:
                later.now()
            return self._logged_infer(request, shared_memory)
        answer = grpc_answer.arm(call, request, ParkedInfer) if self._answerable(request) else None
        if later is not None:  # read by the instance's thread, or now
            grpc_laterread.place(later, answer, dataplane, request)
        if answer is None:
            return self._infer(request, shared_memory)
        try:
            begun = dataplane.begin_now(request, "ModelInfer RPC")
            if isinstance(begun, Lifecycle) and self._parked(begun, answer, call, shared_memory):
                return PARKED
        except BaseException:
            answer.take()  # (failed after the thread's answer: the client has it)
            raise
        return self._answered_infer(begun, answer, request, call, shared_memory)

    async def _decoded_infer(
        self, data: grpc_framing.Message, call: GrpcCall, later: LaterBody | None
    ) -> object:
        """ModelInfer for a request infercache does not take: decoded by protobuf, the
        regions its shared memory names held until it is answered."""
        shared_memory = self.dataplane.request_regions()
        try:
            message, raws = grpc_codec.parse_infer_request(data)
            try:
                request = grpc_codec.decode_infer_request(message, shared_memory, raws)
            except TritonError as error:  # Triton's Execute logs it (infer_handler.cc:987)
                log_infer_failed(message.id, error.message)
                raise
            rest = self.model_infer_now(data, call, (request, later, shared_memory))
            return PARKED if rest is PARKED else await rest
        finally:
            if shared_memory is not None:
                shared_memory.release()

    def _parked(
        self,
        run: Lifecycle,
        answer: ParkedInfer,
        call: GrpcCall,
        shared_memory: RequestRegions | None,
    ) -> bool:
        """Whether the call parks until ``run``'s outcome carries it on (parking.py), its
        answer (armed, not written yet: else swept as it waits) its Parked."""
        answer.dataplane, answer.run = self.dataplane, run
        return (
            answer.state == grpc_answer.ARMED
            and shared_memory is None
            and call.connection.park(call, run.request, answer)
        )

    async def _answered_infer(
        self,
        begun: Lifecycle | Awaitable[Lifecycle | InferenceResponse],
        answer: ParkedInfer,
        request: InferenceRequest,
        call: GrpcCall,
        shared_memory: RequestRegions | None,
    ) -> object:
        """The rest of a call whose answer is armed for the instance's thread and that did
        not park at once: ANSWERED once the thread wrote it, else the answer's chunks."""
        parked = False
        try:
            if isinstance(begun, Lifecycle):  # (it did not park: model_infer_now)
                run: Lifecycle | InferenceResponse = begun
            else:
                run = await begun
                if not isinstance(run, InferenceResponse) and self._parked(
                    run, answer, call, shared_memory
                ):  # (begun without a wait after all)
                    parked = True
                    return PARKED
            if isinstance(run, InferenceResponse):  # (the response cache's)
                response = run
            else:
                response = await self.dataplane.finish(run)
        finally:
            # (failed or cancelled after the thread's answer: the client has it)
            if not parked:
                taken = answer.take()
        if taken != grpc_answer.DISARMED:
            return grpc_answer.ANSWERED
        return _encoded(response, request, shared_memory)

    async def _infer(self, request: InferenceRequest, shared_memory: RequestRegions | None) -> list:
        """The rest of a call whose answer the loop writes: the answer's chunks."""
        response = await self.dataplane.infer(request, endpoint="ModelInfer RPC")
        return _encoded(response, request, shared_memory)

    async def _logged_infer(
        self, request: InferenceRequest, shared_memory: RequestRegions | None
    ) -> list:
        """ModelInfer's request served with verbose logging: an access-log line
        once answered (protocol, model, status, latency)."""
        log.debug("infer request", protocol="GRPC", model=request.model_name, id=request.id)
        started = time.perf_counter()
        status = "CANCELLED"  # unless it ends otherwise
        try:
            response = await self.dataplane.infer(request, endpoint="ModelInfer RPC")
            encoded = _encoded(response, request, shared_memory)
            status = "OK"
            return encoded
        except TritonError as error:
            status = error.status.name
            log_infer_failed(request.id, error.message)
            raise
        finally:
            log.debug(
                "infer response",
                protocol="GRPC",
                model=request.model_name,
                id=request.id,
                status=status,
                latency_ms=round((time.perf_counter() - started) * 1000, 3),
            )

    def _answerable(self, request: InferenceRequest) -> bool:
        """Whether the instance's thread may write this call's answer (see
        :mod:`~trionserve.protocol.grpc.answer`): nothing but the encoding
        between the backend's response and the client (no trace, first-response
        time, classification, debug delay), no output into shared memory; as
        over HTTP (``InferHandler._answerable``). Verbose logging is checked by
        the caller; compression and the connection's state by ``answer.arm``."""
        if self.dataplane.tracing.active or self.delays.before_answer or self._first_response:
            return False
        outputs = request.requested_outputs
        return outputs is None or not any(
            o.parameters.get("classification") or "shared_memory_region" in o.parameters
            for o in outputs
        )

    async def model_stream_infer(self, call: GrpcCall) -> None:
        """Serve every request of the stream concurrently; answer each in turn.

        A request's error is sent as that request's ``error_message`` and the stream
        goes on. When the client half-closes, the pending requests finish first; when
        it cancels or goes away, they are cancelled with the call.
        """
        budget = StreamBudget(STREAM_PENDING_LIMIT, self.options.max_connection_buffer)
        error: GRPCError | None = None
        turn: Turn | None = None
        async with trio.open_nursery() as nursery:
            on_model_error = None
            if any(k == "triton_grpc_error" and v == "true" for k, v in call.metadata):

                def on_model_error(model_error: TritonError) -> None:
                    nonlocal error
                    if error is None:
                        error = grpc_error(model_error)
                        nursery.cancel_scope.cancel()

            tracing = self.dataplane.tracing
            while True:
                # While tracing is on, each request's GRPC_WAITREAD_START / _END
                # (server src/grpc/stream_infer_handler.cc, Process at READ).
                waiting = now_ns() if tracing.active else 0
                try:
                    data = await call.receive()
                except GRPCError as exc:
                    error = error or exc
                    nursery.cancel_scope.cancel()
                    break
                if data is None:
                    break
                stamps = None
                if waiting:
                    stamps = FrontendStamps(deferred=True)
                    stamps.after += (
                        ("GRPC_WAITREAD_START", waiting),
                        ("GRPC_WAITREAD_END", now_ns()),
                    )
                    metadata = dict(call.metadata)
                    stamps.take_context(metadata.get("traceparent"), metadata.get("tracestate"))
                await budget.acquire(len(data))
                queued = trio.Event()
                turn = Turn(turn.written if turn is not None else None)
                nursery.start_soon(
                    self._stream_request, call, data, budget, queued, on_model_error, turn, stamps
                )
                # Queue the stream's requests in the order they came (as Triton does),
                # so that the requests of a sequence reach its model in order.
                await queued.wait()
        if error is not None:
            raise error
        if call.draining:
            raise GRPCError(Status.UNAVAILABLE, "the server is shutting down")

    async def _stream_request(
        self,
        call: GrpcCall,
        data: grpc_framing.Message,
        budget: StreamBudget,
        queued: trio.Event,
        on_model_error: Callable[[TritonError], None] | None = None,
        turn: Turn | None = None,
        stamps: FrontendStamps | None = None,
    ) -> None:
        """Serve one request of a stream. ``on_model_error`` is given on a stream
        opened with the ``triton_grpc_error: true`` header: an error the model
        answered (the request was queued) ends the whole stream with its status,
        instead of an ``error_message`` response (server src/grpc/infer_handler.h
        ExtractStateFromHeaders, stream_infer_handler.cc StreamInferResponseComplete
        -> WriteGRPCErrorResponse). Errors before the request is queued are still
        that request's response, as Triton answers errors of its issue step.

        ``turn`` keeps the stream's answers in request order: the response (or
        error) of a request to a model that is not decoupled is written only after
        the requests before it were answered, as Triton writes a stream's
        non-decoupled responses from the front of its queue (server
        src/grpc/infer_handler.h WriteResponseIfReady, stream_infer_handler.cc
        StreamInferResponseComplete); a decoupled model's responses go out as they
        come. ``stamps``: the request's trace timestamps, while tracing is on
        (GRPC_SEND_START / GRPC_SEND_END around each response's send)."""
        turn = turn or Turn(None)
        message = request = None
        shared_memory = self.dataplane.request_regions()
        started = time.perf_counter()
        status = "CANCELLED"  # unless it ends otherwise
        try:
            message, raws = grpc_codec.parse_infer_request(data)
            request = grpc_codec.decode_infer_request(message, shared_memory, raws)
            turn.ordered = not self._decoupled(request)
            empty_final = grpc_codec.empty_final_response_enabled(message)
            self._forward_headers(call, request)
            request.trace_context = stamps
            if self.verbose or verbose_logging():
                log.debug("stream infer request", model=request.model_name, id=request.id)

            # Every response says whether it is the request's last
            # (triton_final_response), asked or not; a bare final flag becomes an
            # empty response only for clients that enabled those (Triton's
            # src/grpc/stream_infer_handler.cc, the response-complete callback).
            async def deliver(response: InferenceResponse | None, final: bool) -> None:
                if response is None:
                    if not empty_final:
                        return
                    inner = grpc_codec.encode_empty_final_response(request)
                else:
                    inner = grpc_codec.encode_infer_response(
                        response, request, final, shared_memory
                    )
                message = grpc_codec.encode_stream_response(inner)
                budget.observe(sum(len(c) for c in message))
                await turn.wait()
                if stamps is not None:
                    stamps.stamp("GRPC_SEND_START")
                await call.send(message)
                if stamps is not None:
                    stamps.stamp("GRPC_SEND_END")

            await self.dataplane.infer_stream(request, deliver, queued=queued)
            status = "OK"
        except TritonError as error:
            status = error.status.name
            log_infer_failed(message.id if message is not None else None, error.message)
            if on_model_error is not None and queued.is_set():
                on_model_error(error)
                return
            queued.set()
            await turn.wait()
            await self._send_stream_error(call, error.message, request or message)
        except trio.BrokenResourceError:
            pass  # the client reset the stream; the call is being cancelled
        except Exception as exc:
            status = "INTERNAL"
            queued.set()
            log.exception("grpc stream request failed", method=call.method)
            text = as_triton_error(exc, "internal error").message
            await turn.wait()
            await self._send_stream_error(call, text, request or message)
        finally:
            if shared_memory is not None:
                shared_memory.release()
            if stamps is not None:
                stamps.release()
            queued.set()
            budget.release()
            call.answered()  # its bytes leave the connection's buffer
            await turn.done()
            if request is not None and (self.verbose or verbose_logging()):
                log.debug(
                    "infer response",
                    protocol="GRPC stream",
                    model=request.model_name,
                    id=request.id,
                    status=status,
                    latency_ms=round((time.perf_counter() - started) * 1000, 3),
                )

    def _decoupled(self, request: InferenceRequest) -> bool:
        try:
            model = self.dataplane.model(
                request.model_name, request.model_version, request.model_namespace
            )
        except TritonError:
            return False  # its error is answered in turn
        return bool(model.config.model_transaction_policy.decoupled)

    @staticmethod
    async def _send_stream_error(
        call: GrpcCall, text: str, request: InferenceRequest | pb.ModelInferRequest | None
    ) -> None:
        try:
            await call.send(grpc_codec.encode_stream_error(text, request))
        except trio.BrokenResourceError:
            pass

    def _forward_headers(self, call: GrpcCall, request: InferenceRequest) -> None:
        if self._forward is None:
            return
        for key, value in call.metadata:
            if isinstance(value, str) and self._forward.search(key):
                check_forwarded_header(key)
                request.parameters.setdefault(key, value)


def _encoded(
    response: InferenceResponse, request: InferenceRequest, shared_memory: RequestRegions | None
) -> list:
    """ModelInfer's answer as chunks to write (infercache's common form, else protobuf's)."""
    return grpc_infercache.encode_response(response, request) or grpc_codec.encode_infer_response(
        response, request, None, shared_memory
    )
