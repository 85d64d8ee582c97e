"""The HTTP/REST frontend: KServe v2 endpoints with Triton's extensions.

``POST .../infer`` is handled by a lean handler (Quart's per-request machinery
would cost more than the inference of a small model), everything else by a
quart-trio app. Both only decode, call the DataPlane and encode.

Two transports serve them (``HttpOptions.transport``): by default HTTP/1.1 with
h11 on Trio sockets (:mod:`trionserve.protocol.http.transport`), which calls the
infer handler directly and Quart through a minimal ASGI adapter; or hypercorn,
with the whole frontend as one ASGI app.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import re
import zlib
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio

from trionserve.core.cuda_shared_memory import decode_raw_handle
from trionserve.core.errors import (
    InternalError,
    InvalidArgument,
    Status,
    TritonError,
    as_triton_error,
)
from trionserve.core.types import InferenceRequest
from trionserve.dataplane import DataPlane, ShuttingDown
from trionserve.observability.logging import update_settings, verbose
from trionserve.observability.logging import SETTINGS as LOG_SETTINGS
from trionserve.observability.statistics import select_statistics
from trionserve.observability.trace import settings_from_json
from trionserve.protocol.http import codec as http_codec, generate as generate_codec
from trionserve.protocol.http.transport import H11Server, HttpServerOptions
from trionserve.protocol.listeners import reuse_port_binds
from trionserve.repository.config import model_config_to_json
from trionserve.repository.overrides import FILE_PREFIX

log = structlog.get_logger(__name__)

HTTP_STATUS = {
    Status.INVALID_ARGUMENT: 400,
    Status.NOT_FOUND: 404,
    Status.UNAVAILABLE: 503,
    Status.INTERNAL: 500,
    Status.UNIMPLEMENTED: 501,
    Status.ALREADY_EXISTS: 409,
    Status.CANCELLED: 499,
    Status.DEADLINE_EXCEEDED: 504,
}

_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]*))?/infer$")
_JSON_TYPE = (b"content-type", b"application/json")
# On a request refused because the server is draining: the client should take its
# next request elsewhere (another replica), so the connection is not kept.
_CLOSE = (b"connection", b"close")
_BINARY_TYPE = (b"content-type", b"application/octet-stream")


def error_status(error: TritonError) -> int:
    return HTTP_STATUS.get(error.status, 500)


def _decompress(body: bytes, encoding: str) -> bytes:
    try:
        if encoding == "gzip":
            return gzip.decompress(body)
        if encoding == "deflate":
            return zlib.decompress(body)
    except (OSError, zlib.error) as exc:
        raise InvalidArgument(f"failed to decompress the {encoding} request body: {exc}")
    raise InvalidArgument(f"unsupported Content-Encoding '{encoding}'")


def _compress(body: bytes, accept_encoding: str) -> tuple[bytes, bytes | None]:
    accepted = {part.split(";")[0].strip() for part in accept_encoding.split(",")}
    if "gzip" in accepted:
        return gzip.compress(body, compresslevel=1), b"gzip"
    if "deflate" in accepted:
        return zlib.compress(body, 1), b"deflate"
    return body, None


class _Disconnected(Exception):
    """The client went away before its request body arrived."""


class InferHandler:
    """``POST /v2/models/{name}[/versions/{v}]/infer``: decode, infer, encode.

    ``handle`` is the whole request -> response step, shared by both transports:
    the h11 server calls it directly, hypercorn through the ASGI ``__call__``.
    """

    def __init__(
        self, dataplane: DataPlane, verbose: bool = False, forward_headers: str | None = None
    ) -> None:
        self.dataplane = dataplane
        self.verbose = verbose
        # --http-header-forward-pattern: matching headers become request parameters.
        self._forward = re.compile(forward_headers) if forward_headers else None

    async def __call__(self, scope, receive, send, match: re.Match) -> None:
        try:
            body = await self._read_body(receive)
        except _Disconnected:
            return
        status, headers, chunks = await self.handle(match, scope["headers"], body)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        # One join: h11 wants bytes, and one write beats several small ones.
        await send({"type": "http.response.body", "body": b"".join(chunks)})

    async def handle(
        self, match: re.Match, request_headers, body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], list]:
        """The response to one infer request: (status, headers, body chunks)."""
        header_length = None
        content_encoding = None
        accept_encoding = None
        for key, value in request_headers:
            if key == b"inference-header-content-length":
                header_length = value
            elif key == b"content-encoding":
                content_encoding = value.decode("latin-1").strip().lower()
            elif key == b"accept-encoding":
                accept_encoding = value.decode("latin-1")
        try:
            if content_encoding and content_encoding != "identity":
                body = _decompress(body, content_encoding)
            if header_length is not None:
                try:
                    header_length = int(header_length)
                except ValueError:
                    raise InvalidArgument(
                        "Inference-Header-Content-Length must be an integer, got "
                        f"{header_length.decode('latin-1')!r}"
                    ) from None
            version = http_codec.parse_model_version(match.group(2) or "")
            shared_memory = self.dataplane.shm_resolver
            infer_request = http_codec.decode_infer_request(
                body, header_length, match.group(1), version, shared_memory
            )
            if self._forward is not None:
                self._forward_headers(request_headers, infer_request)
            if verbose():
                log.debug("infer request", model=infer_request.model_name, id=infer_request.id)
            response = await self.dataplane.infer(infer_request)
            chunks, json_length = http_codec.encode_infer_response(
                response, infer_request, shared_memory
            )
        except TritonError as error:
            return _error_response(error)
        except Exception as exc:  # a bug must not take the connection task down
            log.exception("infer handler failed")
            return _error_response(as_triton_error(exc, "internal error"))

        if json_length is None:
            headers = [_JSON_TYPE]
        else:
            headers = [_BINARY_TYPE, (b"inference-header-content-length", b"%d" % json_length)]
        total = 0
        for chunk in chunks:
            total += len(chunk)
        if accept_encoding and "identity" != accept_encoding.strip():
            payload, encoding = _compress(b"".join(chunks), accept_encoding)
            if encoding is not None:
                chunks, total = [payload], len(payload)
                headers.append((b"content-encoding", encoding))
        headers.append((b"content-length", b"%d" % total))
        return 200, headers, chunks

    def _forward_headers(self, request_headers, request: InferenceRequest) -> None:
        """Headers whose name matches the pattern, as string parameters (a parameter
        the request sets itself wins, as over gRPC)."""
        for key, value in request_headers:
            name = key.decode("latin-1")
            if self._forward.search(name):
                request.parameters.setdefault(name, value.decode("latin-1"))

    @staticmethod
    async def _read_body(receive) -> bytes:
        message = await receive()
        body = message.get("body", b"")
        if not message.get("more_body", False):
            return body
        parts = [body]
        while message.get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            parts.append(message.get("body", b""))
        return b"".join(parts)


def _error_response(error: TritonError) -> tuple[int, list[tuple[bytes, bytes]], list]:
    body = http_codec.encode_error(error.message)
    headers = [_JSON_TYPE, (b"content-length", b"%d" % len(body))]
    if isinstance(error, ShuttingDown):
        headers.append(_CLOSE)
    return error_status(error), headers, [body]


def _json(payload, status: int = 200) -> Response:
    return Response(
        json.dumps(payload, separators=(",", ":")), status=status, content_type="application/json"
    )


def _error(error: TritonError) -> Response:
    response = Response(
        http_codec.encode_error(error.message),
        status=error_status(error),
        content_type="application/json",
    )
    if isinstance(error, ShuttingDown):
        response.headers["Connection"] = "close"
    return response


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


def build_api_app(dataplane: DataPlane) -> QuartTrio:
    """The quart-trio app for every endpoint except infer."""
    app = QuartTrio("trionserve")
    app.config["MAX_CONTENT_LENGTH"] = None
    app.config["BODY_TIMEOUT"] = None
    app.config["RESPONSE_TIMEOUT"] = None

    @app.errorhandler(TritonError)
    async def triton_error(error: TritonError):
        return _error(error)

    @app.errorhandler(404)
    async def not_found(_error):
        return _json({"error": f"Not Found: {request.method} {request.path}"}, 404)

    @app.errorhandler(405)
    async def not_allowed(_error):
        return _json(
            {"error": f"method {request.method} is not allowed for {request.path}"}, 405
        )

    def status_only(ok: bool) -> Response:
        return Response(b"", status=200 if ok else 400)

    @app.get("/v2/health/live")
    async def health_live():
        return status_only(dataplane.live())

    @app.get("/v2/health/ready")
    async def health_ready():
        if dataplane.draining:
            # As Triton while it exits: 503 with the reason.
            return _json({"error": "server is shutting down"}, 503)
        return status_only(dataplane.ready())

    @app.get("/v2")
    async def server_metadata():
        return _json(dataplane.server_metadata())

    def version_of(version: str | None) -> int | None:
        return http_codec.parse_model_version(version or "")

    @app.get("/v2/models/<name>")
    @app.get("/v2/models/<name>/versions/<version>")
    async def model_metadata(name: str, version: str | None = None):
        return _json(dataplane.model_metadata(name, version_of(version)))

    @app.get("/v2/models/<name>/ready")
    @app.get("/v2/models/<name>/versions/<version>/ready")
    async def model_ready(name: str, version: str | None = None):
        return status_only(dataplane.model_ready(name, version_of(version)))

    @app.get("/v2/models/stats")
    @app.get("/v2/models/<name>/stats")
    @app.get("/v2/models/<name>/versions/<version>/stats")
    async def model_statistics(name: str | None = None, version: str | None = None):
        selected = select_statistics(dataplane.registry, name, version_of(version))
        return _json({"model_stats": [stats.as_json() for stats in selected]})

    @app.get("/v2/models/<name>/config")
    @app.get("/v2/models/<name>/versions/<version>/config")
    async def model_config(name: str, version: str | None = None):
        return _json(model_config_to_json(dataplane.model_config(name, version_of(version))))

    async def json_body() -> dict:
        raw = await request.get_data()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise InvalidArgument(f"failed to parse the request JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the request body must be a JSON object")
        return body

    @app.post("/v2/repository/index")
    async def repository_index():
        body = await json_body()
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgument("'ready' in the repository index request must be a boolean")
        return _json(dataplane.repository_index(ready_only=ready))

    @app.post("/v2/repository/models/<name>/load")
    async def repository_load(name: str):
        config, files = load_parameters(await json_body())
        await dataplane.load_model(name, config, files=files)
        return Response(b"", status=200)

    @app.post("/v2/repository/models/<name>/unload")
    async def repository_unload(name: str):
        unload_dependents = unload_parameters(await json_body())
        await dataplane.unload_model(name, unload_dependents=unload_dependents)
        return Response(b"", status=200)

    @app.get("/v2/logging")
    async def get_log_settings():
        return _json(LOG_SETTINGS.as_dict())

    @app.post("/v2/logging")
    async def set_log_settings():
        return _json(update_settings(await json_body()))

    add_shared_memory_routes(app, dataplane, json_body)
    add_trace_routes(app, dataplane, json_body)
    add_generate_routes(app, dataplane)
    return app


def add_trace_routes(app: QuartTrio, dataplane: DataPlane, json_body) -> None:
    """The trace extension: ``GET/POST /v2[/models/{name}]/trace/setting``."""

    @app.get("/v2/trace/setting")
    @app.get("/v2/models/<name>/trace/setting")
    async def get_trace_settings(name: str | None = None):
        return _json(dataplane.trace_settings(name))

    @app.post("/v2/trace/setting")
    @app.post("/v2/models/<name>/trace/setting")
    async def set_trace_settings(name: str | None = None):
        changes = settings_from_json(await json_body())
        return _json(dataplane.trace_settings(name, changes))


def add_generate_routes(app: QuartTrio, dataplane: DataPlane) -> None:
    """The generate extension: ``POST .../generate`` (one JSON response) and
    ``.../generate_stream`` (server-sent events, streamed as the model answers).

    Errors before the first response are JSON errors with their status code; an
    error after the stream started is sent as an error event.
    """

    async def decode(name: str, version: str | None) -> InferenceRequest:
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise InvalidArgument("Unsupported content-encoding, only 'identity' is supported.")
        number = http_codec.parse_model_version(version or "")
        model = dataplane.model(name, number)
        body = await request.get_data()
        return generate_codec.decode_generate_request(body, name, number, model.signature)

    @app.post("/v2/models/<name>/generate")
    @app.post("/v2/models/<name>/versions/<version>/generate")
    async def generate(name: str, version: str | None = None):
        infer_request = await decode(name, version)
        responses = []
        async with aclosing(dataplane.responses(infer_request)) as stream:
            async for response, _final in stream:
                if response is not None:
                    responses.append(response)
        if len(responses) != 1:
            raise InternalError(generate_codec.NOT_ONE_RESPONSE)
        payload = generate_codec.encode_generate_response(responses[0], infer_request.id)
        return Response(generate_codec.encode_json(payload), content_type="application/json")

    @app.post("/v2/models/<name>/generate_stream")
    @app.post("/v2/models/<name>/versions/<version>/generate_stream")
    async def generate_stream(name: str, version: str | None = None):
        infer_request = await decode(name, version)
        stream = dataplane.responses(infer_request)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = (None, True)
        request_id = infer_request.id

        async def events():
            try:
                response = first[0]
                if response is not None:
                    payload = generate_codec.encode_generate_response(response, request_id)
                    yield generate_codec.encode_event(payload)
                async for response, _final in stream:
                    if response is not None:
                        payload = generate_codec.encode_generate_response(response, request_id)
                        yield generate_codec.encode_event(payload)
            except TritonError as error:
                yield generate_codec.encode_error_event(error.message)
            except Exception as exc:  # a bug must end this stream only, with an answer
                log.exception("generate_stream failed", model=name)
                yield generate_codec.encode_error_event(as_triton_error(exc).message)
            finally:
                await stream.aclose()

        return Response(events(), content_type=generate_codec.SSE_CONTENT_TYPE)


def add_shared_memory_routes(app: QuartTrio, dataplane: DataPlane, json_body) -> None:
    """The system and CUDA shared memory extensions' register / unregister / status routes."""

    def non_negative_int(body: dict, key: str, default: int | None = None) -> int:
        value = body.get(key, default)
        if type(value) is not int or value < 0:
            raise InvalidArgument(
                f"'{key}' in the shared memory register request must be a "
                f"non-negative integer, got {json.dumps(value)}"
            )
        return value

    @app.get("/v2/systemsharedmemory/status")
    @app.get("/v2/systemsharedmemory/region/<name>/status")
    async def system_shm_status(name: str | None = None):
        if dataplane.shared_memory is None:
            return _json([])
        return _json(dataplane.shared_memory.status(name))

    @app.post("/v2/systemsharedmemory/region/<name>/register")
    async def system_shm_register(name: str):
        body = await json_body()
        key = body.get("key")
        if type(key) is not str or not key:
            raise InvalidArgument("'key' in the shared memory register request must be a string")
        dataplane.client_system_shared_memory(name).register(
            name, key, non_negative_int(body, "offset", 0), non_negative_int(body, "byte_size")
        )
        return Response(b"", status=200)

    @app.post("/v2/systemsharedmemory/unregister")
    @app.post("/v2/systemsharedmemory/region/<name>/unregister")
    async def system_shm_unregister(name: str | None = None):
        dataplane.client_shared_memory().unregister(name)
        return Response(b"", status=200)

    @app.get("/v2/cudasharedmemory/status")
    @app.get("/v2/cudasharedmemory/region/<name>/status")
    async def cuda_shm_status(name: str | None = None):
        if dataplane.cuda_shared_memory is None:
            return _json([])
        return _json(dataplane.cuda_shared_memory.status(name))

    @app.post("/v2/cudasharedmemory/region/<name>/register")
    async def cuda_shm_register(name: str):
        body = await json_body()
        cuda = dataplane.client_cuda_shared_memory()
        raw_handle = decode_raw_handle(body.get("raw_handle"))
        cuda.register(
            name, raw_handle, non_negative_int(body, "device_id", 0),
            non_negative_int(body, "byte_size"),
        )
        return Response(b"", status=200)

    @app.post("/v2/cudasharedmemory/unregister")
    @app.post("/v2/cudasharedmemory/region/<name>/unregister")
    async def cuda_shm_unregister(name: str | None = None):
        dataplane.client_cuda_shared_memory().unregister(name)
        return Response(b"", status=200)


class HttpFrontend:
    """Infer to the lean handler, everything else to Quart.

    As an ASGI app it dispatches by itself (the hypercorn transport); the h11
    transport asks ``route`` first and calls the infer handler directly.
    """

    def __init__(
        self, dataplane: DataPlane, verbose: bool = False, forward_headers: str | None = None
    ) -> None:
        self.infer = InferHandler(dataplane, verbose, forward_headers)
        self.api = build_api_app(dataplane)

    def route(self, method: bytes, path: str):
        """The direct handler of a request, or None: the ASGI app serves it."""
        if method == b"POST" and path.endswith("/infer"):
            match = _INFER_PATH.match(path)
            if match is not None:
                return partial(self.infer.handle, match)
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _INFER_PATH.match(scope["path"])
            if match is not None:
                await self.infer(scope, receive, send, match)
                return
        await self.api(scope, receive, send)


@dataclass(frozen=True)
class HttpOptions:
    """The HTTP frontend's settings."""

    # "h11": HTTP/1.1 with h11 directly on Trio sockets (faster); "hypercorn":
    # hypercorn serving the whole frontend as an ASGI app.
    transport: str = "h11"
    # Largest request body accepted (h11 transport), in bytes; None: no limit.
    max_input_size: int | None = None
    # Bind with SO_REUSEPORT: worker processes share the port (--workers,
    # --reuse-http-port).
    reuse_port: bool = False
    # Headers of infer requests whose name matches this regular expression reach
    # the model as request parameters (--http-header-forward-pattern).
    header_forward_pattern: str | None = None


HTTP_TRANSPORTS = ("h11", "hypercorn")


def hypercorn_config(address: str, port: int, graceful_timeout: float) -> HypercornConfig:
    config = HypercornConfig()
    host = f"[{address}]" if ":" in address else address
    config.bind = [f"{host}:{port}"]
    # Load generators keep connections open for millions of requests; hypercorn's
    # defaults (1,000 requests, 5 s idle) would show up as client socket errors.
    config.keep_alive_max_requests = 2**62
    config.keep_alive_timeout = 3600
    config.graceful_timeout = graceful_timeout
    config.backlog = 1024
    config.accesslog = None
    config.errorlog = None
    config.h11_max_incomplete_size = 1024 * 1024
    return config


async def serve_http(
    dataplane: DataPlane,
    address: str,
    port: int,
    shutdown: trio.Event,
    graceful_timeout: float,
    verbose: bool = False,
    options: HttpOptions | None = None,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP until ``shutdown`` is set, then drain for ``graceful_timeout``."""
    options = options or HttpOptions()
    frontend = HttpFrontend(dataplane, verbose, options.header_forward_pattern)
    if options.transport == "hypercorn":
        config = hypercorn_config(address, port, graceful_timeout)
        if options.reuse_port:
            config.bind = reuse_port_binds(address, port)
        await hypercorn_serve(
            frontend,
            config,
            shutdown_trigger=shutdown.wait,
            task_status=task_status,
            mode="asgi",
        )
        return
    if options.transport != "h11":
        raise ValueError(f"unknown HTTP transport {options.transport!r}")
    server = H11Server(
        frontend,
        frontend.route,
        HttpServerOptions(
            max_request_body=options.max_input_size, reuse_port=options.reuse_port
        ),
    )
    await server.serve(address, port, shutdown, graceful_timeout, task_status=task_status)
