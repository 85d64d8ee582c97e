"""The OpenAI-compatible HTTP frontend: its route table on the HTTP/1.1 transport.

Endpoints as Triton's frontend serves them (server
``python/openai/openai_frontend/frontend/fastapi/routers/``): ``GET /v1/models``,
``GET /v1/models/{model}``, ``POST /v1/models/{model}/load`` and ``/unload``
(EXPLICIT model control), ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /v1/embeddings``, ``GET /health/ready`` and ``GET /metrics``.

Handlers parse (:mod:`.schemas`), map (:mod:`.engine`), call the DataPlane and
encode; every error is OpenAI's error object with its status. A streamed answer
is server-sent events, the way the generate extension streams
(:mod:`trionserve.protocol.http.frontend`): the first response is awaited before
the head is written, so a request the server refuses gets its status; each
response then is one ``data:`` chunk, a usage chunk follows when
``stream_options.include_usage`` asks, and ``data: [DONE]`` ends it. A client that
hangs up closes the stream, which cancels the model's request (its
``is_cancelled()`` turns true).

Access: ``--openai-api-key`` makes every ``/v1`` endpoint require
``Authorization: Bearer <key>``; ``--openai-restricted-api`` restricts Triton's
groups (``inference``, ``model-repository``, ``metrics``, ``health``) to requests
with a header and value (``frontend/fastapi/middleware/api_restriction.py``).
Both answer 401. The request body limit is ``--http-max-input-size`` (413).
"""

from __future__ import annotations

import hmac
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import trio

from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import NotFound, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.dataplane import DataPlane
from trionserve.observability.exposition import CONTENT_TYPE, exposition_text
from trionserve.observability.metrics import MetricsOptions, build_metrics_registry
from trionserve.protocol.http.frontend import error_status
from trionserve.protocol.http.h1 import LastChunk
from trionserve.protocol.http.transport import Handler as RequestHandler
from trionserve.protocol.http.transport import (
    Headers,
    HttpServer,
    HttpServerOptions,
    RequestBody,
    Response,
)
from trionserve.protocol.openai import engine, schemas
from trionserve.protocol.openai.chat import ChatTemplates
from trionserve.protocol.openai.schemas import OpenAIError, client_error

log = structlog.get_logger(__name__)

_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
DONE = b"data: [DONE]\n\n"
# A streamed answer's events that are ready together are written together, up to
# about this many bytes per write (bounded: one write's buffer).
COALESCE_BYTES = 64 * 1024

# Triton's groups and the endpoints each covers: method and path prefix
# (api_restriction.py ENDPOINT_MAPPING).
RESTRICTED_GROUPS: dict[str, tuple[tuple[str, str], ...]] = {
    "inference": (
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/embeddings"),
    ),
    "model-repository": (("GET", "/v1/models"), ("POST", "/v1/models/")),
    "metrics": (("GET", "/metrics"),),
    "health": (("GET", "/health/ready"),),
}


def parse_restricted_apis(settings: list[list[str]]) -> dict[str, tuple[str, str]]:
    """``--openai-restricted-api <APIs> <key> <value>`` settings as group -> (header,
    value); ValueError with Triton's words for an unknown group or one named twice
    (``RestrictedFeatures.ParseRestrictedFeatureOption``)."""
    restrictions: dict[str, tuple[str, str]] = {}
    for apis, key, value in settings:
        for api in apis.split(","):
            if api not in RESTRICTED_GROUPS:
                raise ValueError(f"Unknown API '{api}'. Available APIs: {list(RESTRICTED_GROUPS)}")
            if api in restrictions:
                raise ValueError(
                    f"restricted api '{api}' can not be specified in multiple config groups"
                )
            restrictions[api] = (key.lower(), value)
    return restrictions


@dataclass(frozen=True)
class OpenAIOptions:
    """The OpenAI frontend's settings (``--openai-*``)."""

    # Tokenizer files (a chat template) for models without their own (--openai-tokenizer).
    tokenizer: Path | None = None
    # A Jinja chat template used for every model (--openai-chat-template).
    chat_template: Path | None = None
    # max_tokens of a request that sets none (--openai-default-max-tokens, Triton's 16).
    default_max_tokens: int = 16
    # 'vllm' or 'tensorrtllm': the request format of every model (--openai-backend).
    backend: str | None = None
    # Every /v1 endpoint requires "Authorization: Bearer <key>" (--openai-api-key).
    api_key: str | None = None
    # group -> (header, value) (--openai-restricted-api).
    restricted_apis: dict[str, tuple[str, str]] = field(default_factory=dict)


def _json(payload: Any, status: int = 200) -> Response:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return status, [_JSON, (b"content-length", b"%d" % len(body))], [body]


def _error(error: OpenAIError) -> Response:
    body = error.body()
    return error.status, [_JSON, (b"content-length", b"%d" % len(body))], [body]


def error_body(status: int, message: str) -> bytes:
    """The transport's own errors (413, 408, ...) in OpenAI's shape."""
    code = "content_too_large" if status == 413 else None
    return OpenAIError(status, message, code=code).body()


def _from_triton(error: TritonError) -> OpenAIError:
    status = error_status(error)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return OpenAIError(status, error.message, kind, code=error.status.name.lower())


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error_event(error: OpenAIError) -> bytes:
    return _event({"error": json.loads(error.body())["error"]})


Handler = Callable[["OpenAIFrontend", re.Match, Headers, RequestBody], Awaitable[Response]]


class OpenAIFrontend:
    """The route table's handlers over one DataPlane, and the transport's router.

    Owns the chat templates (read once per model directory) and each model's
    ``created`` time (when this frontend first listed it, as Triton's frontend
    stamps its model metadata).
    """

    def __init__(
        self,
        dataplane: DataPlane,
        options: OpenAIOptions | None = None,
        metrics: MetricsOptions | None = None,
    ) -> None:
        self.dataplane = dataplane
        self.options = options or OpenAIOptions()
        self.templates = ChatTemplates(self.options.tokenizer, self.options.chat_template)
        self._created: dict[str, int] = {}
        self._metrics = build_metrics_registry(dataplane.registry, metrics or MetricsOptions())

    # -- routing ----------------------------------------------------------------------

    def route(self, method: bytes, path: str) -> RequestHandler:
        """The handler of a request: 401 first where access is restricted, then
        the route table; 405 for a known path with another method, else 404."""
        name = method.decode("latin-1")
        known = False
        for route_method, pattern, handler in ROUTES:
            match = pattern.match(path)
            if match is None:
                continue
            if route_method == name:
                return partial(self._guarded, name, path, handler, match)
            known = True
        if known:
            error = OpenAIError(
                405, f"Method Not Allowed: {name} {path}", code="method_not_allowed"
            )
        else:
            error = OpenAIError(404, f"Not Found: {name} {path}", code="not_found")
        return partial(_answer, _error(error))

    def _refusal(self, method: str, path: str, headers: Headers) -> OpenAIError | None:
        key = self.options.api_key
        if key is not None and path.startswith("/v1/"):
            given = _header(headers, b"authorization")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), key.encode()
            ):
                return OpenAIError(
                    401,
                    "Incorrect API key provided: send 'Authorization: Bearer <key>' with "
                    "the key the server was started with (--openai-api-key)",
                    code="invalid_api_key",
                )
        for group, (header, value) in self.options.restricted_apis.items():
            for route_method, prefix in RESTRICTED_GROUPS[group]:
                if method == route_method and path.startswith(prefix):
                    if _header(headers, header.encode()) != value:
                        return OpenAIError(
                            401,
                            f"This API is restricted, expecting header '{header}' with valid value",
                            "authentication_error",
                            "invalid_auth",
                        )
                    return None
        return None

    async def _guarded(
        self,
        method: str,
        path: str,
        handler: Handler,
        match: re.Match,
        headers: Headers,
        body: RequestBody,
    ) -> Response:
        refusal = self._refusal(method, path, headers)
        if refusal is not None:
            return _error(refusal)
        try:
            return await handler(self, match, headers, body)
        except OpenAIError as error:
            return _error(error)
        except TritonError as error:
            return _error(_from_triton(error))
        except Exception as exc:  # a bug must not take the connection task down
            log.exception("openai handler failed", handler=handler.__name__)
            return _error(OpenAIError(500, f"internal error: {exc}", "server_error"))

    # -- models --------------------------------------------------------------------------

    def _model_object(self, name: str) -> dict[str, Any]:
        created = self._created.setdefault(name, int(time.time()))
        return {"id": name, "object": "model", "created": created, "owned_by": engine.OWNED_BY}

    def _model_names(self) -> list[str]:
        return sorted({version.name for version in self.dataplane.registry.serving()})

    async def list_models(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        data = [self._model_object(name) for name in self._model_names()]
        return _json({"object": "list", "data": data})

    async def retrieve_model(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        name = match["name"]
        if name not in self._model_names():
            raise OpenAIError(404, f"Unknown model: {name}", code="model_not_found")
        return _json(self._model_object(name))

    def _check_explicit(self) -> None:
        if self.dataplane.control_mode is not ControlMode.EXPLICIT:
            raise client_error("Model load/unload requires --model-control-mode=explicit")

    async def load_model(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        """Load a model (EXPLICIT control); answers once it is ready (Triton's
        ``TritonLLMEngine.load_model``)."""
        self._check_explicit()
        name = match["name"]
        if name in self._model_names():
            raise client_error(f"Model '{name}' is already loaded")
        try:
            await self.dataplane.load_model(name)
        except TritonError as exc:
            status = 400 if error_status(exc) < 500 else 500
            kind = "invalid_request_error" if status == 400 else "server_error"
            raise OpenAIError(
                status, f"Failed to load model '{name}': {exc.message}", kind
            ) from None
        self._created[name] = int(time.time())
        return _json(self._model_object(name))

    async def unload_model(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        self._check_explicit()
        name = match["name"]
        if name not in self._model_names():
            raise client_error(f"Unknown model: {name}")
        await self.dataplane.unload_model(name)
        self._created.pop(name, None)
        return _json({"status": "success", "model": name})

    # -- observability -------------------------------------------------------------------

    async def health_ready(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        if self.dataplane.drain.draining or not await self.dataplane.server_is_ready():
            return _json(
                {"detail": "Attached inference engine is not ready for inference requests."}, 400
            )
        return 200, [(b"content-length", b"0")], ()

    async def metrics(self, match: re.Match[str], headers: Headers, body: RequestBody) -> Response:
        data = exposition_text(self._metrics)
        content_type = (b"content-type", CONTENT_TYPE.encode())
        return 200, [content_type, (b"content-length", b"%d" % len(data))], [data]

    # -- inference -----------------------------------------------------------------------

    def _target(self, name: str) -> tuple[engine.Target, Any]:
        """The model a request names, as the engine maps onto it; 400 for a model
        not served (Triton's "Unknown model")."""
        try:
            model = self.dataplane.model(name, None)
        except (NotFound, Unavailable):
            raise client_error(f"Unknown model: {name}", code="model_not_found") from None
        request_format = engine.request_format(
            model.config.backend, model.config.platform, self.options.backend
        )
        target = engine.Target(
            name, model.signature, request_format, self.options.default_max_tokens
        )
        return target, model

    async def completions(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        request = schemas.parse_completion(body)
        target, _ = self._target(request.model)
        prompt = engine.check_completion(request, target)
        infer_request = engine.generate_request(target, prompt, request)
        answer = engine.Answer(request.model)
        if request.stream:
            return await self._stream(infer_request, _CompletionEvents(answer, request))
        response, usage = await self._collect(infer_request)
        return _json(answer.completion(engine.output_text(response), "stop", usage))

    async def chat_completions(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        request = schemas.parse_chat(body)
        target, model = self._target(request.model)
        engine.check_chat(request, target)
        prompt = self.templates.for_model(model.model_dir, model.version)(request.messages)
        infer_request = engine.generate_request(target, prompt, request)
        answer = engine.Answer(request.model)
        if request.stream:
            return await self._stream(infer_request, _ChatEvents(answer, request))
        response, usage = await self._collect(infer_request)
        return _json(answer.chat(engine.output_text(response), usage))

    async def embeddings(
        self, match: re.Match[str], headers: Headers, body: RequestBody
    ) -> Response:
        request = schemas.parse_embedding(body)
        target, _ = self._target(request.model)
        response, _usage = await self._collect(engine.embedding_request(target, request))
        return _json(engine.embedding_object(request.model, response, request.encoding_format))

    async def _collect(
        self, request: InferenceRequest
    ) -> tuple[InferenceResponse | None, dict[str, int] | None]:
        """Every response of a request that does not stream; the first one (the
        answer) and its usage."""
        pairs = []
        async with aclosing(self.dataplane.responses(request)) as stream:
            async for pair in stream:
                pairs.append(pair)
        engine.check_responses(len(pairs), bool(pairs) and pairs[-1][1])
        response = pairs[0][0]
        usage = engine.response_usage(response)
        return response, None if usage is None else engine.usage_object(*usage)

    async def _stream(self, request: InferenceRequest, events: _Events) -> Response:
        """Server-sent events of a streamed answer. The first response is awaited
        first: a request refused before it reaches its model is answered with
        its status."""
        stream = self.dataplane.responses(request)
        try:
            first = await anext(stream)
        except BaseException:
            await stream.aclose()
            raise
        return 200, list(_SSE), events.body(stream, first, request)


async def _answer(response: Response, headers: Headers, body: RequestBody) -> Response:
    return response


def _header(headers: Headers, name: bytes) -> str:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return ""


Pair = tuple[InferenceResponse | None, bool]


class _Events:
    """The chunks of one streamed answer."""

    def __init__(self, answer: engine.Answer, request: schemas.Sampling) -> None:
        self.answer = answer
        self.include_usage = bool(request.include_usage)
        self.usage = engine.UsageAccumulator()

    def opening(self) -> list[bytes]:
        return []

    def chunk(self, text: str, final: bool) -> bytes:
        raise NotImplementedError

    def usage_chunk(self, usage: dict) -> dict:
        raise NotImplementedError

    async def body(
        self, stream: AsyncIterator[Pair], first: Pair, request: InferenceRequest
    ) -> AsyncIterator[bytes]:
        """Every event, then ``[DONE]``; an error after the stream began is one
        error event before it. Closes ``stream`` however it ends (a client that
        hangs up included: its request is cancelled).

        Events are yielded as soon as they exist, never held back for more: the
        opening chunk with the first response's, and then each time the next
        response is not there yet. What is there already (``request.ready``: a
        model that answers faster than the client is written to) goes with them,
        up to ``COALESCE_BYTES``, in one write instead of one per token."""
        parts: list[bytes] = []
        size = 0
        try:
            parts.extend(self.opening())
            pair: Pair | None = first
            while pair is not None:
                response, final = pair
                if self.include_usage:
                    self.usage.update(response)
                chunk = self.chunk(engine.output_text(response), final)
                parts.append(chunk)
                if final:
                    break
                size += len(chunk)
                if size >= COALESCE_BYTES or not request.ready:
                    yield b"".join(parts)
                    parts.clear()
                    size = 0
                pair = await anext(stream, None)
            usage = self.usage.final() if self.include_usage else None
            if usage is not None:
                parts.append(_event(self.usage_chunk(usage)))
        except OpenAIError as error:
            parts.append(_error_event(error))
        except TritonError as error:
            parts.append(_error_event(_from_triton(error)))
        except Exception as exc:  # a bug ends this stream only, with an answer
            log.exception("openai stream failed", model=self.answer.model)
            parts.append(_error_event(OpenAIError(500, f"internal error: {exc}", "server_error")))
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()  # type: ignore[attr-defined]  # an async generator
        parts.append(DONE)
        yield LastChunk(b"".join(parts))


class _CompletionEvents(_Events):
    """``text_completion`` chunks: one per response, ``finish_reason`` on the final
    one (``_streaming_completion_iterator``)."""

    def chunk(self, text: str, final: bool) -> bytes:
        return self.answer.completion_event(text, final)

    def usage_chunk(self, usage: dict) -> dict:
        return self.answer.completion_usage(usage)


class _ChatEvents(_Events):
    """``chat.completion.chunk`` chunks: the role first, then one content delta per
    response, ``finish_reason`` on the final one (``_streaming_chat_iterator``)."""

    def opening(self) -> list[bytes]:
        return [_event(self.answer.chat_chunk({"role": "assistant", "content": ""}))]

    def chunk(self, text: str, final: bool) -> bytes:
        return self.answer.chat_event(text, final)

    def usage_chunk(self, usage: dict) -> dict:
        return self.answer.chat_usage(usage)


def _path(pattern: str) -> re.Pattern:
    return re.compile("^" + pattern.replace("{name}", "(?P<name>[^/]+)") + "$")


F = OpenAIFrontend
# (method, path pattern, handler), as Triton's routers declare them.
ROUTES: list[tuple[str, re.Pattern, Handler]] = [
    ("GET", _path("/v1/models"), F.list_models),
    ("GET", _path("/v1/models/{name}"), F.retrieve_model),
    ("POST", _path("/v1/models/{name}/load"), F.load_model),
    ("POST", _path("/v1/models/{name}/unload"), F.unload_model),
    ("POST", _path("/v1/completions"), F.completions),
    ("POST", _path("/v1/chat/completions"), F.chat_completions),
    ("POST", _path("/v1/embeddings"), F.embeddings),
    ("GET", _path("/health/ready"), F.health_ready),
    ("GET", _path("/metrics"), F.metrics),
]
del F


async def serve_openai(
    dataplane: DataPlane,
    address: str,
    port: int,
    shutdown: trio.Event,
    graceful_timeout: float,
    options: OpenAIOptions,
    transport: HttpServerOptions,
    metrics: MetricsOptions | None = None,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the OpenAI API until ``shutdown`` is set, then drain for
    ``graceful_timeout`` (as ``serve_http``), with the limits of ``transport``."""
    frontend = OpenAIFrontend(dataplane, options, metrics)
    server = HttpServer(frontend.route, transport)
    await server.serve(address, port, shutdown, graceful_timeout, task_status=task_status)
