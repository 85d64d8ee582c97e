"""In-process API: a trionserve server inside a Python program, no network needed.

The names of Triton's ``tritonserver`` package, so code written for it runs with
``import trionserve.api as tritonserver``::

    from trionserve import api

    server = api.Server(model_repository="models").start(wait_until_ready=True)
    for response in server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b}):
        print(numpy.from_dlpack(response.outputs["OUTPUT0"]))

and Trio-native for Trio programs::

    async with api.open_server(model_repository="models") as server:
        async for response in server.model("simple").infer(inputs={...}):
            ...

Both run the command line's core (:class:`trionserve.server.Server`: registry,
DataPlane, drain); HTTP, gRPC and metrics frontends can be attached to it while it
runs (``attach_http``). See docs/in_process_api.md for how it differs from Triton's.
"""

from trionserve.api._blocking import Model, ResponseIterator, Server
from trionserve.api._errors import (
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TritonError,
    UnavailableError,
    UnknownError,
    UnsupportedError,
)
from trionserve.api._models import ModelDictionary
from trionserve.api._options import (
    InstanceGroupKind,
    LogFormat,
    MetricFormat,
    ModelBatchFlag,
    ModelControlMode,
    ModelLoadDeviceLimit,
    ModelTxnPropertyFlag,
    Options,
    RateLimiterResource,
    RateLimitMode,
)
from trionserve.api._request import InferenceRequest, RequestFlag
from trionserve.api._response import HttpResponse, InferenceResponse
from trionserve.api._tensor import DataType, DLDeviceType, MemoryBuffer, MemoryType, Tensor
from trionserve.api._trio import AsyncModel, AsyncResponseIterator, AsyncServer, open_server

__all__ = [
    "AlreadyExistsError",
    "AsyncModel",
    "AsyncResponseIterator",
    "AsyncServer",
    "CancelledError",
    "DLDeviceType",
    "DataType",
    "DeadlineExceededError",
    "HttpResponse",
    "InferenceRequest",
    "InferenceResponse",
    "InstanceGroupKind",
    "InternalError",
    "InvalidArgumentError",
    "LogFormat",
    "MemoryBuffer",
    "MemoryType",
    "MetricFormat",
    "Model",
    "ModelBatchFlag",
    "ModelControlMode",
    "ModelDictionary",
    "ModelLoadDeviceLimit",
    "ModelTxnPropertyFlag",
    "NotFoundError",
    "Options",
    "RateLimitMode",
    "RateLimiterResource",
    "RequestFlag",
    "ResourceExhaustedError",
    "ResponseIterator",
    "Server",
    "Tensor",
    "TritonError",
    "UnavailableError",
    "UnknownError",
    "UnsupportedError",
    "open_server",
]
