"""The gRPC frontend: inference.GRPCInferenceService's methods on the DataPlane.

Each method decodes its request message, calls the DataPlane and encodes the
answer; TritonErrors become gRPC statuses with the same message text as over HTTP.
HTTP/2 (and TLS) is the transport's business: h2 on Trio sockets
(:mod:`trionserve.protocol.grpc.transport`), behind a Method table and a call interface.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import structlog
import trio
from google.protobuf import json_format
from google.protobuf.message import Message

from trionserve._generated import grpc_service_pb2 as pb
from trionserve.core.errors import InvalidArgument, TritonError, Unimplemented, as_triton_error
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.core.parameters import check_forwarded_header
from trionserve.core.shared_memory import RequestRegions
from trionserve.core.validation import parse_model_version
from trionserve.dataplane import DataPlane
from trionserve.lifecycle import Lifecycle
from trionserve.observability.logging import SETTINGS as LOG_SETTINGS
from trionserve.observability.logging import log_infer_failed
from trionserve.observability.logging import update_settings as update_log_settings
from trionserve.observability.logging import verbose as verbose_logging
from trionserve.observability.trace.frontend import (
    FrontendStamps,
    now_ns,
)
from trionserve.observability.trace.settings import settings_to_grpc
from trionserve.protocol.grpc import answer as grpc_answer
from trionserve.protocol.grpc import codec as grpc_codec
from trionserve.protocol.grpc import framing as grpc_framing
from trionserve.protocol.grpc import infercache as grpc_infercache
from trionserve.protocol.grpc import laterread as grpc_laterread
from trionserve.protocol.grpc.options import GrpcOptions
from trionserve.protocol.grpc.parkedinfer import ParkedInfer
from trionserve.protocol.grpc.parking import PARKED
from trionserve.protocol.grpc.streams import STREAM_PENDING_LIMIT, StreamBudget, Turn
from trionserve.protocol.grpc.transport import (
    GrpcCall,
    GRPCError,
    GrpcTransport,
    Method,
    Status,
    server_ssl_context,
)
from trionserve.protocol.grpc.unary import DebugDelays, common_method, grpc_error, unary_method
from trionserve.protocol.restricted import RestrictedCategory, Restriction

log = structlog.get_logger(__name__)

SERVICE_PATH = "/inference.GRPCInferenceService/"


class GrpcService:
    """The methods of inference.GRPCInferenceService, by request path.

    Stateless beyond its settings: every call runs in its own transport task, so a
    cancelled call cancels exactly its own DataPlane work.
    """

    def __init__(
        self, dataplane: DataPlane, options: GrpcOptions | None = None, verbose: bool = False
    ) -> None:
        self.dataplane = dataplane
        self.options = options or GrpcOptions()
        self.verbose = verbose
        self.delays = DebugDelays.from_environment()  # Triton's debugging delays
        pattern = self.options.header_forward_pattern
        self._forward = re.compile(pattern) if pattern else None
        # (nv_inference_first_response_histogram_ms is timed on the loop.)
        self._first_response = getattr(dataplane, "_first_response", False)

    def methods(self) -> dict[str, Method]:
        unary = common_method(self.delays)
        table = {
            "ServerLive": unary(pb.ServerLiveRequest, self.server_live),
            "ServerReady": unary(pb.ServerReadyRequest, self.server_ready),
            "ModelReady": unary(pb.ModelReadyRequest, self.model_ready),
            "ServerMetadata": unary(pb.ServerMetadataRequest, self.server_metadata),
            "ModelMetadata": unary(pb.ModelMetadataRequest, self.model_metadata),
            "ModelConfig": unary(pb.ModelConfigRequest, self.model_config),
            "ModelInfer": unary_method(None, self.model_infer, self.dataplane, self.delays.infer()),
            "ModelStreamInfer": Method(self.model_stream_infer, client_streaming=True),
            "RepositoryIndex": unary(pb.RepositoryIndexRequest, self.repository_index),
            "RepositoryModelLoad": unary(pb.RepositoryModelLoadRequest, self.repository_load),
            "RepositoryModelUnload": unary(pb.RepositoryModelUnloadRequest, self.repository_unload),
            "ModelStatistics": unary(pb.ModelStatisticsRequest, self.model_statistics),
            "LogSettings": unary(pb.LogSettingsRequest, self.log_settings),
            "TraceSetting": unary(pb.TraceSettingRequest, self.trace_setting),
            "SystemSharedMemoryStatus": unary(
                pb.SystemSharedMemoryStatusRequest, self.system_shm_status
            ),
            "SystemSharedMemoryRegister": unary(
                pb.SystemSharedMemoryRegisterRequest, self.system_shm_register
            ),
            "SystemSharedMemoryUnregister": unary(
                pb.SystemSharedMemoryUnregisterRequest, self.system_shm_unregister
            ),
            "CudaSharedMemoryStatus": unary(pb.CudaSharedMemoryStatusRequest, self.cuda_shm_status),
            "CudaSharedMemoryRegister": unary(
                pb.CudaSharedMemoryRegisterRequest, self.cuda_shm_register
            ),
            "CudaSharedMemoryUnregister": unary(
                pb.CudaSharedMemoryUnregisterRequest, self.cuda_shm_unregister
            ),
        }
        return {
            SERVICE_PATH + name: self._checked(_METHOD_GROUPS[name], method)
            for name, method in table.items()
        }

    def _checked(self, group: RestrictedCategory, method: Method) -> Method:
        """``method``, behind the header check of its group if the group is
        restricted: a call without the header and value ends UNAVAILABLE before its
        request is decoded (a stream before its first request is read), as Triton's
        (src/grpc/grpc_server.cc CommonCallData::Execute, infer_handler.cc,
        stream_infer_handler.cc)."""
        restriction = self.options.restricted_protocols.get(group)
        if restriction is None:
            return method
        return Method(_restricted(restriction, method.handler), method.client_streaming)

    # -- health, metadata, configuration ------------------------------------------

    async def server_live(self, request: pb.ServerLiveRequest, call: GrpcCall) -> Message:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    async def server_ready(self, request: pb.ServerReadyRequest, call: GrpcCall) -> Message:
        return pb.ServerReadyResponse(ready=await self.dataplane.server_is_ready())

    async def model_ready(self, request: pb.ModelReadyRequest, call: GrpcCall) -> Message:
        version = parse_model_version(request.version)
        ready = await self.dataplane.model_is_ready(request.name, version)
        return pb.ModelReadyResponse(ready=ready)

    async def server_metadata(self, request: pb.ServerMetadataRequest, call: GrpcCall) -> Message:
        metadata = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(
            name=metadata["name"], version=metadata["version"], extensions=metadata["extensions"]
        )

    async def model_metadata(self, request: pb.ModelMetadataRequest, call: GrpcCall) -> Message:
        version = parse_model_version(request.version)
        await self.dataplane.load_on_demand(request.name, version)
        metadata = self.dataplane.model_metadata(request.name, version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=metadata["name"],
            versions=metadata["versions"],
            platform=metadata["platform"],
            inputs=[tensor(**t) for t in metadata["inputs"]],
            outputs=[tensor(**t) for t in metadata["outputs"]],
        )

    async def model_config(self, request: pb.ModelConfigRequest, call: GrpcCall) -> Message:
        version = parse_model_version(request.version)
        await self.dataplane.load_on_demand(request.name, version)
        return pb.ModelConfigResponse(config=self.dataplane.model_config(request.name, version))

    # -- statistics and logging ------------------------------------------------------

    async def model_statistics(self, request: pb.ModelStatisticsRequest, call: GrpcCall) -> Message:
        version = parse_model_version(request.version)
        statistics = await self.dataplane.model_statistics(request.name or None, version)
        return json_format.ParseDict(statistics, pb.ModelStatisticsResponse())

    async def log_settings(self, request: pb.LogSettingsRequest, call: GrpcCall) -> Message:
        current = LOG_SETTINGS.as_dict()
        if "log_file" in request.settings:
            # Writing the log to a path a client names would let any client create
            # or append to files (CVE-2024-0087); Triton refuses it the same way
            # (src/grpc/grpc_server.cc, LogSettings).
            raise Unimplemented("log file location can not be updated through network protocol")
        if request.settings:
            changes = {}
            for key, value in request.settings.items():
                kind = value.WhichOneof("parameter_choice")
                if kind is None:
                    raise InvalidArgument(f"log setting '{key}' has no value")
                changes[key] = getattr(value, kind)
            current = update_log_settings(changes)
        response = pb.LogSettingsResponse()
        for key, value in current.items():
            setting = response.settings[key]
            if isinstance(value, bool):
                setting.bool_param = value
            elif isinstance(value, int):
                setting.uint32_param = value
            else:
                setting.string_param = str(value)
        return response

    async def trace_setting(self, request: pb.TraceSettingRequest, call: GrpcCall) -> Message:
        """Update (when settings are given) and return the trace settings; an empty
        value list clears a setting, as in Triton."""
        changes = None
        if request.settings:
            changes = {key: (list(value.value) or None) for key, value in request.settings.items()}
        current = self.dataplane.trace_settings(request.model_name or None, changes)
        response = pb.TraceSettingResponse()
        for key, values in settings_to_grpc(current).items():
            response.settings[key].value.extend(values)
        return response

    # -- repository ------------------------------------------------------------------

    async def repository_index(self, request: pb.RepositoryIndexRequest, call: GrpcCall) -> Message:
        _no_repository_name(request.repository_name)
        rows = self.dataplane.repository_index(ready_only=request.ready)
        index = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(
            models=[
                index(
                    name=row["name"],
                    version=row.get("version", ""),
                    state=row.get("state", ""),
                    reason=row.get("reason", ""),
                )
                for row in rows
            ]
        )

    async def repository_load(
        self, request: pb.RepositoryModelLoadRequest, call: GrpcCall
    ) -> Message:
        """Parameters as over HTTP: ``config`` (JSON text) and ``file:<path>`` bytes."""
        _no_repository_name(request.repository_name)
        config = None
        files: dict[str, bytes] = {}
        for key, param in request.parameters.items():
            kind = param.WhichOneof("parameter_choice")
            if key == "config":
                if kind != "string_param":
                    raise InvalidArgument(
                        f"load parameter 'config' must be a string_param, got {kind}"
                    )
                config = param.string_param
            elif key.startswith("file:"):
                if kind != "bytes_param":
                    raise InvalidArgument(
                        f"load parameter '{key}' must be a bytes_param, got {kind}"
                    )
                files[key] = param.bytes_param
        await self.dataplane.load_model(
            request.model_name, config_override=config, files=files or None
        )
        return pb.RepositoryModelLoadResponse()

    async def repository_unload(
        self, request: pb.RepositoryModelUnloadRequest, call: GrpcCall
    ) -> Message:
        _no_repository_name(request.repository_name)
        unload_dependents = False
        if "unload_dependents" in request.parameters:
            param = request.parameters["unload_dependents"]
            kind = param.WhichOneof("parameter_choice")
            if kind != "bool_param":
                raise InvalidArgument(
                    f"unload parameter 'unload_dependents' must be a bool_param, got {kind}"
                )
            unload_dependents = param.bool_param
        await self.dataplane.unload_model(request.model_name, unload_dependents=unload_dependents)
        return pb.RepositoryModelUnloadResponse()

    # -- system shared memory -------------------------------------------------------

    async def system_shm_status(
        self, request: pb.SystemSharedMemoryStatusRequest, call: GrpcCall
    ) -> Message:
        response = pb.SystemSharedMemoryStatusResponse()
        if self.dataplane.shared_memory is not None:
            for region in self.dataplane.shared_memory.status(request.name):
                response.regions[region["name"]].CopyFrom(
                    pb.SystemSharedMemoryStatusResponse.RegionStatus(**region)
                )
        return response

    async def system_shm_register(
        self, request: pb.SystemSharedMemoryRegisterRequest, call: GrpcCall
    ) -> Message:
        self.dataplane.client_system_shared_memory(request.name).register(
            request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    async def system_shm_unregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, call: GrpcCall
    ) -> Message:
        self.dataplane.client_shared_memory().unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    # -- CUDA shared memory ---------------------------------------------------------

    async def cuda_shm_status(
        self, request: pb.CudaSharedMemoryStatusRequest, call: GrpcCall
    ) -> Message:
        response = pb.CudaSharedMemoryStatusResponse()
        if self.dataplane.cuda_shared_memory is not None:
            for region in self.dataplane.cuda_shared_memory.status(request.name):
                response.regions[region["name"]].CopyFrom(
                    pb.CudaSharedMemoryStatusResponse.RegionStatus(**region)
                )
        return response

    async def cuda_shm_register(
        self, request: pb.CudaSharedMemoryRegisterRequest, call: GrpcCall
    ) -> Message:
        self.dataplane.client_cuda_shared_memory().register(
            request.name, request.raw_handle, request.device_id, request.byte_size
        )
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_shm_unregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, call: GrpcCall
    ) -> Message:
        self.dataplane.client_cuda_shared_memory().unregister(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- inference -------------------------------------------------------------------

    async def model_infer(self, data: grpc_framing.Message, call: GrpcCall) -> list:
        # The common request (infercache): it names no shared memory, so no
        # regions are held for it; any other goes through protobuf (codec).
        # (its last raw contents may still be in the socket: grpc/laterread.py)
        later = grpc_laterread.rest_of(call, data)
        request = grpc_infercache.decode_request(data)
        shared_memory = None
        if request is None:
            shared_memory = self.dataplane.request_regions()
        try:
            if request is None:
                message, raws = grpc_codec.parse_infer_request(data)
                try:
                    request = grpc_codec.decode_infer_request(message, shared_memory, raws)
                except TritonError as error:  # Triton's Execute logs it (infer_handler.cc:987)
                    log_infer_failed(message.id, error.message)
                    raise
            if self._forward is not None:
                self._forward_headers(call, request)
            if self.dataplane.tracing.active:  # GRPC_WAITREAD_START ... (unary.unary_method)
                request.trace_context = getattr(call, "stamps", None)
            if self.verbose or LOG_SETTINGS.log_verbose_level > 0:  # (verbose_logging())
                if later is not None:
                    later.now()
                return await self._logged_infer(request, shared_memory)
            # (here, not in a coroutine of its own: a parked call is carried on
            # through each of its frames)
            answer = (
                grpc_answer.arm(call, request, ParkedInfer) if self._answerable(request) else None
            )
            if later is not None:  # read by the instance's thread, or now
                grpc_laterread.place(later, answer, self.dataplane, request)
            if answer is None:
                response = await self.dataplane.infer(request, endpoint="ModelInfer RPC")
            else:
                parked = False
                try:
                    begun = self.dataplane.begin_now(request, "ModelInfer RPC")
                    run = begun if isinstance(begun, Lifecycle) else await begun
                    if isinstance(run, InferenceResponse):  # (the response cache's)
                        response = run
                    else:
                        # (how the call goes on if it parks: the answer is its Parked)
                        answer.dataplane, answer.run = self.dataplane, run
                        if (
                            answer.state == grpc_answer.ARMED  # (else: written, swept as it waits)
                            and shared_memory is None
                            and call.connection.park(call, run.request, answer)
                        ):  # the outcome carries the call on (parking.py): it returns now
                            parked = True
                            return PARKED
                        response = await self.dataplane.finish(run)
                finally:
                    # (failed or cancelled after the thread's answer: the client has it)
                    if not parked:
                        taken = answer.take()
                if taken != grpc_answer.DISARMED:
                    return grpc_answer.ANSWERED
            return grpc_infercache.encode_response(
                response, request
            ) or grpc_codec.encode_infer_response(response, request, None, shared_memory)
        finally:
            if shared_memory is not None:
                shared_memory.release()

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
            encoded = grpc_infercache.encode_response(
                response, request
            ) or grpc_codec.encode_infer_response(response, request, None, shared_memory)
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


# Each method's protocol group (Triton's src/grpc/grpc_server.cc: the
# RestrictedCategory each CommonCallData is registered with; ModelInfer and
# ModelStreamInfer are INFERENCE).
_METHOD_GROUPS = {
    "ServerLive": RestrictedCategory.HEALTH,
    "ServerReady": RestrictedCategory.HEALTH,
    "ModelReady": RestrictedCategory.HEALTH,
    "ServerMetadata": RestrictedCategory.METADATA,
    "ModelMetadata": RestrictedCategory.METADATA,
    "ModelConfig": RestrictedCategory.MODEL_CONFIG,
    "ModelInfer": RestrictedCategory.INFERENCE,
    "ModelStreamInfer": RestrictedCategory.INFERENCE,
    "RepositoryIndex": RestrictedCategory.MODEL_REPOSITORY,
    "RepositoryModelLoad": RestrictedCategory.MODEL_REPOSITORY,
    "RepositoryModelUnload": RestrictedCategory.MODEL_REPOSITORY,
    "ModelStatistics": RestrictedCategory.STATISTICS,
    "LogSettings": RestrictedCategory.LOGGING,
    "TraceSetting": RestrictedCategory.TRACE,
    "SystemSharedMemoryStatus": RestrictedCategory.SHARED_MEMORY,
    "SystemSharedMemoryRegister": RestrictedCategory.SHARED_MEMORY,
    "SystemSharedMemoryUnregister": RestrictedCategory.SHARED_MEMORY,
    "CudaSharedMemoryStatus": RestrictedCategory.SHARED_MEMORY,
    "CudaSharedMemoryRegister": RestrictedCategory.SHARED_MEMORY,
    "CudaSharedMemoryUnregister": RestrictedCategory.SHARED_MEMORY,
}


def _restricted(
    restriction: Restriction, handler: Callable[[GrpcCall], Awaitable[object]]
) -> Callable[[GrpcCall], Awaitable[object]]:
    async def checked(call: GrpcCall) -> object:
        if not restriction.admits_grpc(call.metadata):
            raise GRPCError(
                Status.UNAVAILABLE,
                f"This protocol is restricted, expecting header '{restriction.header}'",
            )
        return await handler(call)  # (PARKED, if it parked the call)

    return checked


def _no_repository_name(name: str) -> None:
    if name:
        raise Unimplemented(f"'repository_name' specification is not supported (got '{name}')")


async def serve_grpc(
    dataplane: DataPlane,
    address: str,
    port: int,
    shutdown: trio.Event,
    graceful_timeout: float,
    options: GrpcOptions | None = None,
    verbose: bool = False,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve gRPC until ``shutdown`` is set, then drain for ``graceful_timeout``."""
    service = GrpcService(dataplane, options, verbose)
    options = service.options
    transport = GrpcTransport(
        service.methods(),
        replace(options.transport_options(), budget=dataplane.budget),
        ssl_context=None
        if options.ssl is None
        else server_ssl_context(
            options.ssl.server_cert,
            options.ssl.server_key,
            options.ssl.root_cert,
            mutual=options.ssl.mutual,
        ),
    )
    await transport.serve(address, port, shutdown, graceful_timeout, task_status=task_status)
