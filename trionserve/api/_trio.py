"""The in-process server for Trio programs: ``open_server`` and what it yields.

Everything runs in the caller's Trio run, on the same core the command line's
server runs (:class:`trionserve.server.Server`): one registry, one DataPlane, one
drain. No network frontend runs unless attached.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import aclosing, asynccontextmanager
from typing import Any, Self
from urllib.parse import unquote

import trio
from prometheus_client import CollectorRegistry

from trionserve.api._errors import CancelledError, InvalidArgumentError, TritonError
from trionserve.api._models import ModelDictionary, describe_model, load_arguments, route_version
from trionserve.api._options import (
    MetricFormat,
    ModelBatchFlag,
    ModelTxnPropertyFlag,
    Options,
    server_options,
)
from trionserve.api._request import InferenceRequest, build_request
from trionserve.api._response import (
    HttpResponse,
    InferenceResponse,
    ResponseModel,
    check_output_memory_type,
    error_response,
    response_from,
)
from trionserve.core.errors import as_triton_error
from trionserve.core.inference import InferenceRequest as CoreRequest
from trionserve.core.inference import InferenceResponse as CoreResponse
from trionserve.dataplane import DataPlane
from trionserve.observability.exposition import exposition_text
from trionserve.observability.gpu_metrics import GpuMetricsCollector
from trionserve.observability.logging import configure_logging
from trionserve.observability.metrics import CpuMetricsCollector, build_metrics_registry
from trionserve.observability.statistics import statistics_json
from trionserve.protocol.grpc.options import GrpcOptions
from trionserve.protocol.http.frontend import HttpFrontend, HttpOptions
from trionserve.protocol.http.infer import body_too_large
from trionserve.protocol.openai.frontend import OpenAIOptions
from trionserve.repository.config import model_config_to_json
from trionserve.server import Server, ServerOptions


def new_core(options: Options | ServerOptions | None, kwargs: dict) -> Server:
    """The core for these options, logging set up as they say (process-wide)."""
    settings = server_options(options, kwargs)
    configure_logging(
        settings.log_format,
        settings.log_verbose,
        log_file=settings.log_file,
        log_info=settings.log_info,
        log_warning=settings.log_warning,
        log_error=settings.log_error,
    )
    return Server(settings)


def sole_exception(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member groups, else ``exc``: a
    failure to start is one error, whatever nurseries it crossed."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@asynccontextmanager
async def open_server(
    options: Options | ServerOptions | None = None, **kwargs: Any
) -> AsyncIterator[AsyncServer]:
    """Start a server in this Trio run and yield it once started (startup models
    loaded; see ``AsyncServer.ready`` for readiness).

    Leaving the block drains as the command line's server does on SIGTERM: new
    requests are refused with UnavailableError, those in flight and open sequences
    finish (up to ``exit_timeout``), then every model unloads. Cancelling the
    enclosing scope instead stops everything at once. A failure to start raises
    InternalError (models failed to load, with ``exit_on_error``) or the error
    that stopped it.
    """
    core = new_core(options, kwargs)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(core.serve)
            try:
                yield AsyncServer(core)
            finally:
                core.shutdown()
    except BaseExceptionGroup as group:
        raise sole_exception(group) from None


class AsyncServer:
    """A running in-process server, for Trio code; from :func:`open_server`.

    Methods mirror Triton's ``tritonserver.Server``; those that wait are async.
    """

    def __init__(self, core: Server) -> None:
        self.core = core
        self.dataplane: DataPlane = core.dataplane
        # The HTTP frontend's route table, for http_request (made when first used).
        self._http: HttpFrontend | None = None
        # metrics()' collectors (made when first used); CPU sampled at each call.
        self._metrics: tuple[CollectorRegistry, CpuMetricsCollector | None, Any] | None = None

    # -- health and metadata --------------------------------------------------

    def live(self) -> bool:
        return self.dataplane.live()

    def ready(self) -> bool:
        return self.dataplane.ready()

    def metadata(self) -> dict[str, Any]:
        return self.dataplane.server_metadata()

    def metrics(self, metric_format: MetricFormat = MetricFormat.PROMETHEUS) -> str:
        """The server's metrics in Prometheus' text format, as the metrics
        endpoint answers them (Triton's ``Server.metrics``): the model counters
        and, with ``cpu_metrics`` / ``gpu_metrics``, the CPU (utilization between
        this call and the last) and GPU gauges."""
        if MetricFormat(metric_format) != MetricFormat.PROMETHEUS:
            raise InvalidArgumentError(f"unknown metric format {metric_format!r}")
        if self._metrics is None:
            options = self.core.options.metrics
            cpu = CpuMetricsCollector() if options.allow_cpu_metrics else None
            gpu = GpuMetricsCollector.create() if options.allow_gpu_metrics else None
            if cpu is not None:
                cpu.sample()
            registry = build_metrics_registry(self.core.registry, options, cpu, gpu)
            self._metrics = (registry, cpu, gpu)
        registry, cpu, gpu = self._metrics
        for collector in (cpu, gpu):
            if collector is not None:
                collector.sample()
        return exposition_text(registry).decode("utf-8")

    async def wait_until_ready(self, polling_interval: float = 0.1) -> None:
        """Return once the server is ready (every model, with strict readiness);
        bound it with ``trio.fail_after``."""
        # Polled, as Triton's wait_until_ready polls: readiness has no event.
        while not self.ready():  # noqa: ASYNC110
            await trio.sleep(polling_interval)

    # -- models ------------------------------------------------------------------

    def model(self, model_name: str, model_version: int = -1) -> AsyncModel:
        """The model ``model_name`` (-1: the version its policy routes to); not
        checked until used."""
        route_version(model_version)
        return AsyncModel(self, model_name, model_version)

    def models(self, exclude_not_ready: bool = False) -> ModelDictionary[AsyncModel]:
        """The repository index: (name, version) -> model with its state and reason."""
        rows = self.dataplane.repository_index(ready_only=exclude_not_ready)
        return ModelDictionary(
            lambda name, version, state, reason: AsyncModel(self, name, version, state, reason),
            rows,
        )

    async def load(
        self,
        model_name: str,
        parameters: dict[str, Any] | None = None,
        *,
        config: str | dict | None = None,
        files: dict[str, bytes] | None = None,
    ) -> AsyncModel:
        """Load or reload a model (ModelControlMode.EXPLICIT) and wait until it has
        loaded. ``config``: the configuration as JSON (replaces config.pbtxt);
        ``files``: ``"<version>/<name>"`` -> contents, with ``config``; or both in
        Triton's ``parameters`` ({"config": ..., "file:1/model.onnx": ...})."""
        config_json, contents = load_arguments(parameters, config, files)
        await self.dataplane.load_model(model_name, config_json, contents)
        return self.model(model_name)

    async def unload(
        self,
        model: str | AsyncModel,
        unload_dependents: bool = False,
        wait_until_unloaded: bool = True,
    ) -> None:
        """Unload a model (ModelControlMode.EXPLICIT). It stops taking requests at
        once; this returns once those in flight finished and it unloaded (always:
        ``wait_until_unloaded`` is accepted for Triton's signature)."""
        name = model if isinstance(model, str) else model.name
        await self.dataplane.unload_model(name, unload_dependents=unload_dependents)

    # -- network frontends ---------------------------------------------------------

    async def attach_http(
        self, address: str = "127.0.0.1", port: int = 8000, options: HttpOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve the KServe v2 HTTP/REST protocol on this core (port 0: a free port);
        returns the bound (host, port) pairs. It closes after the drain."""
        return await self.core.attach_http(address, port, options)

    async def attach_grpc(
        self, address: str = "127.0.0.1", port: int = 8001, options: GrpcOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve the KServe v2 gRPC protocol on this core (as :meth:`attach_http`)."""
        return await self.core.attach_grpc(address, port, options)

    async def attach_metrics(
        self, address: str = "127.0.0.1", port: int = 8002
    ) -> list[tuple[str, int]]:
        """Serve Prometheus ``/metrics`` for this core (as :meth:`attach_http`)."""
        return await self.core.attach_metrics(address, port)

    async def attach_openai(
        self, address: str = "127.0.0.1", port: int = 9000, options: OpenAIOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve the OpenAI-compatible API for this core (as :meth:`attach_http`)."""
        return await self.core.attach_openai(address, port, options)

    async def http_request(
        self,
        method: str,
        path: str,
        headers: Iterable[tuple[str | bytes, str | bytes]] = (),
        body: bytes | str = b"",
    ) -> HttpResponse:
        """Answer one request of the HTTP/REST protocol (KServe v2 JSON and
        binary tensors, Triton's extensions) with the HTTP frontend's own route
        table, without a socket: for a host that receives HTTP itself (a Ray Serve
        ingress) and hands it on. The body size limit is the HTTP frontend's
        (``ServerOptions.http.max_input_size``)."""
        if self._http is None:
            options = self.core.options
            self._http = HttpFrontend(
                self.dataplane,
                options.log_verbose > 0,
                options.http.header_forward_pattern,
                options.http.max_input_size,
            )
        if isinstance(body, str):
            body = body.encode("utf-8")
        request_headers = [(_bytes(k).lower(), _bytes(v)) for k, v in headers]
        limit = self.core.options.http.max_input_size
        if limit is not None and len(body) > limit:
            status, message = body_too_large(_bytes(path), request_headers, len(body), limit)
            payload = json.dumps({"error": message}).encode()
            return HttpResponse(status, [("content-type", "application/json")], payload)
        raw_path = path.partition("?")[0]
        handler = self._http.route(method.upper().encode("ascii"), unquote(raw_path))
        status, response_headers, content = await handler(request_headers, bytes(body))
        text_headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response_headers]
        if isinstance(content, (list, tuple)):
            return HttpResponse(status, text_headers, b"".join(content))
        return HttpResponse(status, text_headers, stream=content)

    def stop(self) -> None:
        """Begin the drain now; ``open_server``'s block still waits for its end."""
        self.core.shutdown()


class AsyncModel:
    """One model of an in-process server, as Triton's ``tritonserver.Model``.

    ``state`` and ``reason`` are what the repository index said when this object
    came from ``models()``; ``ready()`` asks now.
    """

    def __init__(
        self,
        server: AsyncServer,
        name: str,
        version: int = -1,
        state: str | None = None,
        reason: str | None = None,
    ) -> None:
        self._server = server
        self.name = name
        self.version = version
        self.state = state
        self.reason = reason

    def _at_version(self, version: int) -> AsyncModel:
        return self if version == self.version else AsyncModel(self._server, self.name, version)

    @property
    def _routing(self) -> tuple[str, int | None]:
        return self.name, route_version(self.version)

    def create_request(self, **kwargs: Any) -> InferenceRequest:
        return InferenceRequest(model=self, **kwargs)

    def infer(
        self,
        inference_request: InferenceRequest | None = None,
        raise_on_error: bool = True,
        **kwargs: Any,
    ) -> AsyncResponseIterator:
        """Send a request; iterate its responses with ``async for`` (one for most
        models, a stream for decoupled ones). The keywords are
        :class:`InferenceRequest`'s: ``inputs`` ({name: Tensor, numpy array,
        DLPack object, list}), ``parameters``, ``request_id``, ``flags``,
        ``correlation_id``, ``priority``, ``timeout`` (microseconds),
        ``output_memory_type``. (``response_queue`` is the blocking and asyncio
        faces'; in Trio, iterate in a task of your own and send on a channel.)"""
        responses = self._infer(self, inference_request, raise_on_error, kwargs)
        if responses.response_queue is not None:
            raise InvalidArgumentError(
                "response_queue is taken by Server.model(...).infer and async_infer; "
                "in Trio, iterate the responses in a task and send them on a channel"
            )
        return responses

    def _infer(
        self,
        owner: ResponseModel,
        inference_request: InferenceRequest | None,
        raise_on_error: bool,
        kwargs: dict[str, Any],
    ) -> AsyncResponseIterator:
        """The request, its responses made for ``owner`` (this model or the
        blocking Model around it)."""
        if inference_request is None:
            inference_request = InferenceRequest(model=owner, **kwargs)
        elif kwargs:
            raise TypeError("give either an InferenceRequest or its fields as keywords")
        check_output_memory_type(inference_request.output_memory_type)
        request = build_request(
            self.name,
            self.version,
            inputs=inference_request.inputs,
            parameters=inference_request.parameters,
            request_id=inference_request.request_id,
            flags=inference_request.flags,
            correlation_id=inference_request.correlation_id,
            priority=inference_request.priority,
            timeout=inference_request.timeout,
        )
        return AsyncResponseIterator(
            self._server.dataplane,
            owner,
            request,
            raise_on_error,
            inference_request.output_memory_type,
            inference_request.response_queue,
        )

    def metadata(self) -> dict[str, Any]:
        return self._server.dataplane.model_metadata(*self._routing)

    def batch_properties(self) -> ModelBatchFlag:
        """FIRST_DIM for a model that batches (max_batch_size > 0), else UNKNOWN
        (Triton's TRITONSERVER_ServerModelBatchProperties)."""
        config = self._server.dataplane.model_config(*self._routing)
        return ModelBatchFlag.FIRST_DIM if config.max_batch_size > 0 else ModelBatchFlag.UNKNOWN

    def transaction_properties(self) -> ModelTxnPropertyFlag:
        """DECOUPLED or ONE_TO_ONE (TRITONSERVER_ServerModelTransactionProperties)."""
        config = self._server.dataplane.model_config(*self._routing)
        if config.model_transaction_policy.decoupled:
            return ModelTxnPropertyFlag.DECOUPLED
        return ModelTxnPropertyFlag.ONE_TO_ONE

    def ready(self) -> bool:
        return self._server.dataplane.model_ready(*self._routing)

    def config(self) -> dict[str, Any]:
        """The model configuration as Triton's ``GET .../config`` returns it."""
        return model_config_to_json(self._server.dataplane.model_config(*self._routing))

    def statistics(self) -> dict[str, Any]:
        """``{"model_stats": [...]}`` for this model's READY versions (or version)."""
        return statistics_json(self._server.dataplane.registry, *self._routing)

    def __repr__(self) -> str:
        return describe_model(self.name, self.version, self.state)


class AsyncResponseIterator:
    """The responses of one request, in order, until the one marked ``final``.

    The request is sent when first iterated. Its error is raised (or, with
    ``raise_on_error=False``, returned as a final response with ``error`` set).
    Close it (``async with`` or ``aclose``) to abandon a request early: it is
    cancelled, as when an HTTP client goes away; ``cancel()`` ends it with
    CancelledError. Responses the model sent and the caller has not taken yet
    are bounded by ``--max-undelivered-response-bytes`` (64 MiB) per request.
    """

    def __init__(
        self,
        dataplane: DataPlane,
        owner: ResponseModel,
        request: CoreRequest,
        raise_on_error: bool,
        output_memory_type: Any = None,
        response_queue: Any = None,
    ) -> None:
        self._owner = owner
        self._request = request
        self.raise_on_error = raise_on_error
        self._output_memory_type = output_memory_type
        self.response_queue = response_queue
        self._pairs = _pairs(dataplane, request)
        self._complete = False

    def __aiter__(self) -> AsyncResponseIterator:
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._complete:
            raise StopAsyncIteration
        try:
            response, final = await self._pairs.__anext__()
        except StopAsyncIteration:
            self._complete = True
            raise
        except Exception as exc:
            self._complete = True
            error = as_triton_error(exc, f"model '{self._request.model_name}'")
            if self.raise_on_error:
                if error is exc:
                    raise
                raise error from exc
            return error_response(self._owner, self._request, error)
        self._complete = final
        try:
            return response_from(
                self._owner, self._request, response, final, self._output_memory_type
            )
        except TritonError as error:
            self._complete = True
            if self.raise_on_error:
                raise
            return error_response(self._owner, self._request, error)

    def cancel(self) -> None:
        """End the request with CancelledError; its model is told, as when its
        client goes away (Triton's ``ResponseIterator.cancel``)."""
        request = self._request
        request.fail(CancelledError(f"request for model '{request.model_name}' was cancelled"))
        request.cancelled = True

    async def aclose(self) -> None:
        self._complete = True
        await self._pairs.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")


async def _pairs(
    dataplane: DataPlane, request: CoreRequest
) -> AsyncGenerator[tuple[CoreResponse | None, bool]]:
    """``(response, final)`` pairs through the DataPlane's own paths: ``infer``
    (one response; the response cache applies) or, for a decoupled model,
    ``responses`` (the stream), so admission, the drain, statistics and tracing
    are the frontends' own."""
    model = dataplane.model(request.model_name, request.model_version)
    if not model.config.model_transaction_policy.decoupled:
        yield await dataplane.infer(request, endpoint="in-process infer"), True
        return
    async with aclosing(dataplane.responses(request)) as pairs:
        async for pair in pairs:
            yield pair


__all__ = [
    "AsyncModel",
    "AsyncResponseIterator",
    "AsyncServer",
    "TritonError",
    "open_server",
]
