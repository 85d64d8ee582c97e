"""The HTTP/REST frontend: KServe v2 endpoints with Triton's extensions.

One route table (:data:`ROUTES`: method, path pattern, API group, handler) serves
every endpoint on the HTTP/1.1 transport (:mod:`trionserve.protocol.http.transport`),
infer first (:class:`~trionserve.protocol.http.infer.InferHandler`, the hot path);
an endpoint of a group restricted by ``--http-restricted-api`` answers 403 to a
request without the group's header.
Handlers only decode, call the DataPlane and encode; a TritonError they raise
becomes its status code with a JSON ``{"error": ...}`` body, any other exception
a 500 with the same shape (logged), and an unknown path a 404 / a known path
with another method a 405, as JSON too.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import partial

import structlog
import trio

from trionserve.core.cuda_shared_memory import decode_raw_handle
from trionserve.core.errors import (
    InternalError,
    InvalidArgument,
    TritonError,
    as_triton_error,
)
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.dataplane import DataPlane
from trionserve.observability.logging import SETTINGS as LOG_SETTINGS
from trionserve.observability.logging import log_http_request, update_settings
from trionserve.observability.trace.frontend import HTTP_STAMPS
from trionserve.observability.trace.settings import settings_from_json
from trionserve.protocol.http import codec as http_codec
from trionserve.protocol.http import generate as generate_codec
from trionserve.protocol.http.h1 import JSON, ProtocolError, Request, keepable

# The infer handler and the error mapping, importable from here as before.
from trionserve.protocol.http.infer import HTTP_STATUS as HTTP_STATUS
from trionserve.protocol.http.infer import INFLATE_IN_THREAD_BYTES as INFLATE_IN_THREAD_BYTES
from trionserve.protocol.http.infer import InferHandler as InferHandler
from trionserve.protocol.http.infer import body_too_large, error_response, error_status
from trionserve.protocol.http.infer import decompress as decompress
from trionserve.protocol.http.transport import (
    Handler,
    Headers,
    HttpServer,
    HttpServerOptions,
    RequestBody,
    Response,
)
from trionserve.protocol.restricted import RestrictedCategory, RestrictedFeatures, Restriction
from trionserve.repository.config import model_config_to_json
from trionserve.repository.overrides import FILE_PREFIX

log = structlog.get_logger(__name__)

# Infer paths whose handlers are kept (HttpFrontend.route); kept anew once full.
_INFER_ROUTES = 64
_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]*))?/infer$")
_JSON_TYPE = JSON


def _parameters(body: dict, action: str) -> dict:
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"'parameters' of the {action} request must be a JSON object")
    return parameters


def load_parameters(body: dict) -> tuple[str | None, dict[str, bytes]]:
    """The ``config`` and ``file:<path>`` parameters of a repository load request."""
    parameters = _parameters(body, "load")
    config = parameters.get("config")
    if isinstance(config, dict):
        config = json.dumps(config)
    elif config is not None and not isinstance(config, str):
        raise InvalidArgument("load parameter 'config' must be a JSON string")
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if not key.startswith(FILE_PREFIX):
            continue
        if not isinstance(value, str):
            raise InvalidArgument(f"load parameter '{key}' must be a base64 string")
        try:
            files[key] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"load parameter '{key}' is not valid base64") from None
    return config, files


def unload_parameters(body: dict) -> bool:
    """The ``unload_dependents`` parameter of a repository unload request."""
    value = _parameters(body, "unload").get("unload_dependents", False)
    if not isinstance(value, bool):
        raise InvalidArgument("unload parameter 'unload_dependents' must be a boolean")
    return value


# -- response helpers ----------------------------------------------------------

_EMPTY_OK: Response = (200, [(b"content-length", b"0")], ())


def _empty(ok: bool = True) -> Response:
    """No body: 200, or 400 for a health / readiness check that says no."""
    if ok:
        return 200, [(b"content-length", b"0")], ()
    return 400, [(b"content-length", b"0")], ()


def _json(payload: object, status: int = 200) -> Response:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return status, [_JSON_TYPE, (b"content-length", b"%d" % len(body))], [body]


def json_body(body: RequestBody) -> dict:
    """A control-plane request body: a JSON object ({} when empty)."""
    if not body:
        return {}
    try:
        doc = json.loads(body if not isinstance(body, memoryview) else bytes(body))
    except RecursionError:
        raise InvalidArgument("failed to parse the request JSON: nested too deeply") from None
    except ValueError as exc:
        raise InvalidArgument(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return doc


def _version(match: re.Match[str]) -> int | None:
    return http_codec.parse_model_version(match.groupdict().get("version") or "")


def _header(headers: Headers, name: bytes) -> str:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return ""


def _non_negative_int(body: dict, key: str, default: int | None = None) -> int:
    value = body.get(key, default)
    if type(value) is not int or value < 0:
        raise InvalidArgument(
            f"'{key}' in the shared memory register request must be a "
            f"non-negative integer, got {json.dumps(value)}"
        )
    return value


# A handler of the route table: the frontend, the path's match, the request's
# headers and body -> the response.
RouteHandler = Callable[["HttpFrontend", re.Match[str], Headers, RequestBody], Awaitable[Response]]
# A row of the route table: method, path pattern, API group, handler.
Route = tuple[bytes, re.Pattern[str], RestrictedCategory, RouteHandler]


class HttpFrontend:
    """The route table's handlers over one DataPlane, and the router the HTTP
    transport asks for each request (:meth:`route`).

    ``restricted_apis`` (--http-restricted-api): a request to an endpoint of a
    restricted group without the group's header and value is answered 403 before
    anything else is looked at, its method included, as Triton does.
    """

    def __init__(
        self,
        dataplane: DataPlane,
        verbose: bool = False,
        forward_headers: str | None = None,
        max_input_size: int | None = None,
        restricted_apis: RestrictedFeatures | None = None,
    ) -> None:
        self.dataplane = dataplane
        self.infer = InferHandler(dataplane, verbose, forward_headers, max_input_size)
        self._restricted = restricted_apis or RestrictedFeatures()
        # The handlers of the infer paths routed last, by path: a client sends
        # one path over and over (no pattern match, no partial per request).
        self._infer_routes: dict[str, Handler] = {}

    def route(self, method: bytes, path: str) -> Handler:
        """The handler of a request: infer first (the hot path), then the table;
        a path the table knows with another method gets 405, any other 404."""
        if LOG_SETTINGS.log_verbose_level:
            log_http_request(method, path)
        if method == b"POST":
            infer = self._infer_routes.get(path)
            if infer is not None:
                return infer
            match = _INFER_PATH.match(path) if path.endswith("/infer") else None
            if match is not None:
                infer = keepable(
                    self._checked(RestrictedCategory.INFERENCE, partial(self.infer.handle, match))
                )
                infer.later = True  # type: ignore[attr-defined]  # (its tensors: http/later.py)
                if len(self._infer_routes) >= _INFER_ROUTES:
                    self._infer_routes.clear()
                self._infer_routes[path] = infer
                return infer
        if method == b"HEAD":
            method = b"GET"
        # Inference is POST only: another method on its path is 405, as in Triton
        # (src/http_server.cc HandleInfer answers EVHTP_RES_METHNALLOWED).
        known: RestrictedCategory | None = (
            RestrictedCategory.INFERENCE if _INFER_PATH.match(path) is not None else None
        )
        for route_method, pattern, category, handler in ROUTES:
            match = pattern.match(path)
            if match is None:
                continue
            if route_method == method:
                return self._checked(category, partial(self._guarded, handler, match))
            if known is None:  # the first route of the path names its group
                known = category
        if known is not None:
            message = f"method {method.decode('latin-1')} is not allowed for {path}"
            return self._checked(known, partial(_answer, _json({"error": message}, 405)))
        return partial(
            _answer, _json({"error": f"Not Found: {method.decode('latin-1')} {path}"}, 404)
        )

    def _checked(self, category: RestrictedCategory, handler: Handler) -> Handler:
        """``handler``, behind the header check of its group if the group is restricted."""
        restriction = self._restricted.get(category) if self._restricted else None
        if restriction is None:
            return handler
        return partial(_restricted, restriction, handler)

    async def _guarded(
        self, handler: RouteHandler, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        try:
            return await handler(self, match, headers, body)
        except TritonError as error:
            return error_response(error)
        except Exception as exc:  # a bug must not take the connection task down
            log.exception("http handler failed", handler=handler.__name__)
            return error_response(as_triton_error(exc, "internal error"))

    # -- health and metadata -----------------------------------------------------

    async def health_live(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        return _empty(self.dataplane.live())

    async def health_ready(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        if self.dataplane.drain.draining:
            # As Triton while it exits: 503 with the reason.
            return _json({"error": "server is shutting down"}, 503)
        return _empty(await self.dataplane.server_is_ready())

    async def server_metadata(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        return _json(self.dataplane.server_metadata())

    async def model_metadata(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        await self.dataplane.load_on_demand(match["name"], _version(match))
        return _json(self.dataplane.model_metadata(match["name"], _version(match)))

    async def model_ready(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        return _empty(await self.dataplane.model_is_ready(match["name"], _version(match)))

    async def model_config(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        await self.dataplane.load_on_demand(match["name"], _version(match))
        config = self.dataplane.model_config(match["name"], _version(match))
        return _json(model_config_to_json(config))

    async def model_statistics(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        name = match.groupdict().get("name")
        return _json(await self.dataplane.model_statistics(name, _version(match)))

    # -- model repository ----------------------------------------------------------

    async def repository_index(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        ready = json_body(body).get("ready", False)
        if not isinstance(ready, bool):
            # Triton's words (src/http_server.cc HandleRepositoryIndex).
            raise InvalidArgument("Invalid value for 'ready': expected a boolean")
        return _json(self.dataplane.repository_index(ready_only=ready))

    async def repository_load(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        config, files = load_parameters(json_body(body))
        await self.dataplane.load_model(match["name"], config, files=files)
        return _EMPTY_OK

    async def repository_unload(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        unload_dependents = unload_parameters(json_body(body))
        await self.dataplane.unload_model(match["name"], unload_dependents=unload_dependents)
        return _EMPTY_OK

    # -- logging and trace settings -----------------------------------------------

    async def get_log_settings(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        return _json(LOG_SETTINGS.as_dict())

    async def set_log_settings(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        return _json(update_settings(json_body(body)))

    async def get_trace_settings(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        return _json(self.dataplane.trace_settings(match.groupdict().get("name")))

    async def set_trace_settings(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        changes = settings_from_json(json_body(body))
        return _json(self.dataplane.trace_settings(match.groupdict().get("name"), changes))

    # -- shared memory ---------------------------------------------------------------

    async def system_shm_status(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        if self.dataplane.shared_memory is None:
            return _json([])
        return _json(self.dataplane.shared_memory.status(match.groupdict().get("name")))

    async def system_shm_register(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        name = match["name"]
        # Refused before the body is read when not allowed, as Triton does.
        shared_memory = self.dataplane.client_system_shared_memory(name)
        request = json_body(body)
        key = request.get("key")
        if type(key) is not str or not key:
            raise InvalidArgument("'key' in the shared memory register request must be a string")
        shared_memory.register(
            name,
            key,
            _non_negative_int(request, "offset", 0),
            _non_negative_int(request, "byte_size"),
        )
        return _EMPTY_OK

    async def system_shm_unregister(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        self.dataplane.client_shared_memory().unregister(match.groupdict().get("name"))
        return _EMPTY_OK

    async def cuda_shm_status(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        if self.dataplane.cuda_shared_memory is None:
            return _json([])
        return _json(self.dataplane.cuda_shared_memory.status(match.groupdict().get("name")))

    async def cuda_shm_register(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        cuda = self.dataplane.client_cuda_shared_memory()
        request = json_body(body)
        raw_handle = decode_raw_handle(request.get("raw_handle"))
        cuda.register(
            match["name"],
            raw_handle,
            _non_negative_int(request, "device_id", 0),
            _non_negative_int(request, "byte_size"),
        )
        return _EMPTY_OK

    async def cuda_shm_unregister(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        self.dataplane.client_cuda_shared_memory().unregister(match.groupdict().get("name"))
        return _EMPTY_OK

    # -- generate extension ------------------------------------------------------------
    # ``.../generate``: one JSON response; ``.../generate_stream``: server-sent
    # events, streamed as the model answers. Errors before the first response are
    # JSON errors with their status code; an error after the stream started is
    # sent as an error event.

    def _generate_request(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> InferenceRequest:
        encoding = _header(headers, b"content-encoding").strip().lower()
        if encoding not in ("", "identity"):
            raise InvalidArgument("Unsupported content-encoding, only 'identity' is supported.")
        name, number = match["name"], _version(match)
        model = self.dataplane.model(name, number)
        request = generate_codec.decode_generate_request(body, name, number, model.signature)
        if self.dataplane.tracing.active:  # HTTP_RECV_START ... (trace.frontend)
            request.trace_context = HTTP_STAMPS.get()
        return request

    async def generate(self, match: re.Match[str], headers: Headers, body: RequestBody) -> Response:
        infer_request = self._generate_request(match, headers, body)
        responses = []
        async with aclosing(self.dataplane.responses(infer_request)) as stream:
            async for response, _final in stream:
                if response is not None:
                    responses.append(response)
        if len(responses) != 1:
            raise InternalError(generate_codec.NOT_ONE_RESPONSE)
        payload = generate_codec.encode_generate_response(responses[0], infer_request.id)
        data = generate_codec.encode_json(payload)
        return 200, [_JSON_TYPE, (b"content-length", b"%d" % len(data))], [data]

    async def generate_stream(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        infer_request = self._generate_request(match, headers, body)
        admitted = trio.Event()
        stream = self.dataplane.responses(infer_request, admitted)
        content_type = (b"content-type", generate_codec.SSE_CONTENT_TYPE.encode())
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = (None, True)
        except TritonError as error:
            await stream.aclose()
            if not admitted.is_set():
                raise  # the request's own error: a JSON answer
            # The model's error as the first response: its status, and the error as
            # the one event, as Triton answers it (src/http_server.cc
            # GenerateRequestClass::StartResponse with the response's code).
            event = generate_codec.encode_error_event(error.message)
            length = (b"content-length", b"%d" % len(event))
            return error_status(error), [content_type, length], [event]
        except BaseException:
            await stream.aclose()
            raise
        return 200, [content_type], _events(stream, first[0], infer_request.id, match["name"])


async def _events(
    stream: AsyncGenerator[tuple[InferenceResponse | None, bool]],
    first: InferenceResponse | None,
    request_id: str,
    model: str,
) -> AsyncIterator[bytes]:
    """The server-sent events of a generate_stream answer; closes ``stream``."""
    try:
        if first is not None:
            yield generate_codec.encode_event(
                generate_codec.encode_generate_response(first, request_id)
            )
        async for response, _final in stream:
            if response is not None:
                yield generate_codec.encode_event(
                    generate_codec.encode_generate_response(response, request_id)
                )
    except TritonError as error:
        yield generate_codec.encode_error_event(error.message)
    except Exception as exc:  # a bug must end this stream only, with an answer
        log.exception("generate_stream failed", model=model)
        yield generate_codec.encode_error_event(as_triton_error(exc).message)
    finally:
        await stream.aclose()


async def _answer(response: Response, headers: Headers, body: RequestBody) -> Response:
    return response


async def _restricted(
    restriction: Restriction, handler: Handler, headers: Headers, body: RequestBody
) -> Response:
    """403 with Triton's message unless the headers satisfy the restriction
    (src/http_server.cc, RespondIfRestricted)."""
    if restriction.admits_http(headers):
        return await handler(headers, body)
    message = f"This API is restricted, expecting header '{restriction.header}'"
    return _json({"error": message}, 403)


def _path(pattern: str) -> re.Pattern[str]:
    """A route's path: ``{name}`` and ``{version}`` stand for one path segment;
    ``{any_name}`` for one or more, so that a load or unload of ``../x`` reaches
    the registry and is refused there with a 400 saying why, not a 404."""
    return re.compile(
        "^"
        + pattern.replace("{name}", "(?P<name>[^/]+)")
        .replace("{any_name}", "(?P<name>.+)")
        .replace("{version}", "(?P<version>[^/]*)")
        + "$"
    )


def _routes(
    method: bytes, category: RestrictedCategory, handler: RouteHandler, *paths: str
) -> list[Route]:
    return [(method, _path(path), category, handler) for path in paths]


_MODEL = "/v2/models/{name}"
_VERSION = "/v2/models/{name}/versions/{version}"
F = HttpFrontend
C = RestrictedCategory
# (method, path pattern, API group, handler): every endpoint but infer, which
# route() finds first. The groups are Triton's (src/http_server.cc: each handler
# begins with RETURN_AND_RESPOND_IF_RESTRICTED for its category).
ROUTES: list[Route] = [
    *_routes(b"GET", C.HEALTH, F.health_live, "/v2/health/live"),
    *_routes(b"GET", C.HEALTH, F.health_ready, "/v2/health/ready"),
    *_routes(b"GET", C.METADATA, F.server_metadata, "/v2"),
    *_routes(
        b"GET",
        C.STATISTICS,
        F.model_statistics,
        "/v2/models/stats",
        f"{_MODEL}/stats",
        f"{_VERSION}/stats",
    ),
    *_routes(b"GET", C.METADATA, F.model_metadata, _MODEL, _VERSION),
    *_routes(b"GET", C.HEALTH, F.model_ready, f"{_MODEL}/ready", f"{_VERSION}/ready"),
    *_routes(b"GET", C.MODEL_CONFIG, F.model_config, f"{_MODEL}/config", f"{_VERSION}/config"),
    *_routes(b"POST", C.INFERENCE, F.generate, f"{_MODEL}/generate", f"{_VERSION}/generate"),
    *_routes(
        b"POST",
        C.INFERENCE,
        F.generate_stream,
        f"{_MODEL}/generate_stream",
        f"{_VERSION}/generate_stream",
    ),
    *_routes(b"POST", C.MODEL_REPOSITORY, F.repository_index, "/v2/repository/index"),
    *_routes(
        b"POST", C.MODEL_REPOSITORY, F.repository_load, "/v2/repository/models/{any_name}/load"
    ),
    *_routes(
        b"POST",
        C.MODEL_REPOSITORY,
        F.repository_unload,
        "/v2/repository/models/{any_name}/unload",
    ),
    *_routes(b"GET", C.LOGGING, F.get_log_settings, "/v2/logging"),
    *_routes(b"POST", C.LOGGING, F.set_log_settings, "/v2/logging"),
    *_routes(b"GET", C.TRACE, F.get_trace_settings, "/v2/trace/setting", f"{_MODEL}/trace/setting"),
    *_routes(
        b"POST", C.TRACE, F.set_trace_settings, "/v2/trace/setting", f"{_MODEL}/trace/setting"
    ),
    *_routes(
        b"GET",
        C.SHARED_MEMORY,
        F.system_shm_status,
        "/v2/systemsharedmemory/status",
        "/v2/systemsharedmemory/region/{name}/status",
    ),
    *_routes(
        b"POST",
        C.SHARED_MEMORY,
        F.system_shm_register,
        "/v2/systemsharedmemory/region/{name}/register",
    ),
    *_routes(
        b"POST",
        C.SHARED_MEMORY,
        F.system_shm_unregister,
        "/v2/systemsharedmemory/unregister",
        "/v2/systemsharedmemory/region/{name}/unregister",
    ),
    *_routes(
        b"GET",
        C.SHARED_MEMORY,
        F.cuda_shm_status,
        "/v2/cudasharedmemory/status",
        "/v2/cudasharedmemory/region/{name}/status",
    ),
    *_routes(
        b"POST",
        C.SHARED_MEMORY,
        F.cuda_shm_register,
        "/v2/cudasharedmemory/region/{name}/register",
    ),
    *_routes(
        b"POST",
        C.SHARED_MEMORY,
        F.cuda_shm_unregister,
        "/v2/cudasharedmemory/unregister",
        "/v2/cudasharedmemory/region/{name}/unregister",
    ),
]
del F, C


@dataclass(frozen=True)
class HttpOptions:
    """The HTTP frontend's settings."""

    # Largest request body accepted, in bytes (after decompression too); None: no
    # limit. Triton's default: 64 MiB (--http-max-input-size).
    max_input_size: int | None = 64 << 20
    # Connections served at once; more are answered 503 (--http-max-connections).
    max_connections: int | None = 1024
    # Seconds a connection has to deliver a whole request head (--http-header-timeout).
    header_timeout: float = 30.0
    # Seconds an idle keep-alive connection stays open (--http-keep-alive-timeout).
    keep_alive_timeout: float = 60.0
    # Bind with SO_REUSEPORT: worker processes share the port (--workers,
    # --reuse-http-port).
    reuse_port: bool = False
    # Headers of infer requests whose name matches this regular expression reach
    # the model as request parameters (--http-header-forward-pattern).
    header_forward_pattern: str | None = None
    # API groups whose requests must carry a header (--http-restricted-api).
    restricted_apis: RestrictedFeatures = field(default_factory=RestrictedFeatures)

    def transport_options(self, reuse_port: bool | None = None) -> HttpServerOptions:
        """The limits of every HTTP listener: the HTTP port's, and also the metrics
        port's and the private ports of ``--workers`` (one set of limits, set by
        the ``--http-*`` flags). ``reuse_port`` None: this frontend's own."""
        return HttpServerOptions(
            max_request_body=self.max_input_size,
            max_connections=self.max_connections,
            header_timeout=self.header_timeout,
            keep_alive_timeout=self.keep_alive_timeout,
            reuse_port=self.reuse_port if reuse_port is None else reuse_port,
        )


def refuse_large_body(request: Request, size: int | None, limit: int) -> ProtocolError:
    """A body over --http-max-input-size refused in Triton's words (infer.body_too_large)."""
    return ProtocolError(*body_too_large(request.target, request.headers, size, limit))


async def serve_http(
    dataplane: DataPlane,
    address: str,
    port: int,
    shutdown: trio.Event,
    graceful_timeout: float,
    verbose: bool = False,
    options: HttpOptions | None = None,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP until ``shutdown`` is set, then drain for ``graceful_timeout``."""
    options = options or HttpOptions()
    frontend = HttpFrontend(
        dataplane,
        verbose,
        options.header_forward_pattern,
        options.max_input_size,
        options.restricted_apis,
    )
    # A body over the limit refused in Triton's words on this port (the metrics
    # and OpenAI ports, and the workers' private ones, answer 413).
    transport = replace(
        options.transport_options(),
        body_refusal=refuse_large_body,
        budget=dataplane.budget,
        tracing=dataplane.tracing,
    )
    server = HttpServer(frontend.route, transport)
    await server.serve(address, port, shutdown, graceful_timeout, task_status=task_status)
