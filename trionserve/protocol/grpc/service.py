"""The gRPC frontend: inference.GRPCInferenceService's methods on the DataPlane.

Each method decodes its request message, calls the DataPlane and encodes the
answer; TritonErrors become gRPC statuses with the same message text as over HTTP.
HTTP/2 (and TLS) is the transport's business: h2 on Trio sockets
(:mod:`trionserve.protocol.grpc.transport`), behind a Method table and a call interface.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import replace

import structlog
import trio
from google.protobuf import json_format
from google.protobuf.message import Message

from trionserve._generated import grpc_service_pb2 as pb
from trionserve.core.errors import InvalidArgument, Unimplemented
from trionserve.core.validation import parse_model_version
from trionserve.dataplane import DataPlane
from trionserve.observability.logging import SETTINGS as LOG_SETTINGS
from trionserve.observability.logging import update_settings as update_log_settings
from trionserve.observability.trace.settings import settings_to_grpc
from trionserve.protocol.grpc.infermethods import InferMethods
from trionserve.protocol.grpc.options import GrpcOptions
from trionserve.protocol.grpc.transport import (
    GrpcCall,
    GRPCError,
    GrpcTransport,
    Method,
    Status,
    server_ssl_context,
)
from trionserve.protocol.grpc.unary import DebugDelays, common_method, unary_method
from trionserve.protocol.restricted import RestrictedCategory, Restriction

log = structlog.get_logger(__name__)

SERVICE_PATH = "/inference.GRPCInferenceService/"


class GrpcService(InferMethods):
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
            "ModelInfer": unary_method(
                None, self.model_infer, self.dataplane, self.delays.infer(), self.model_infer_now
            ),
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
