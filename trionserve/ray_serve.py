"""trionserve on Ray Serve: each replica runs the in-process core
(:mod:`trionserve.api`) and answers Triton's HTTP/REST protocol (KServe v2 JSON
and binary tensors, Triton's extensions) received by Ray Serve's proxy.

``pip install -e '.[ray]'``, then, in a Serve config file or a Python program::

    from trionserve.ray_serve import app

    serve.run(app(model_repository="models", num_replicas=2), route_prefix="/")

A replica hands each request to the HTTP frontend's own route table in its core
(``Server.http_request``): the same decoding, DataPlane, encoding and status codes
as the ``trionserve`` command's HTTP port, so ``tritonclient.http`` pointed at
Serve's proxy works unchanged. Ray owns placement and scaling (``num_replicas``
or ``autoscaling_config``); at a replica's stop, Serve first stops routing to it
and waits for its ongoing requests (``graceful_shutdown_wait_loop_s``), then
``__del__`` drains the core as ``stop()`` does (new requests refused, requests in
flight and open sequences finished, models unloaded, Python stubs ended) within
``graceful_shutdown_timeout_s``. Ray's health check asks the core whether it is
ready (every model ready): a replica whose model became unavailable is replaced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Iterator
from dataclasses import fields, replace
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from trionserve import api

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024  # --http-max-input-size's default
DEFAULT_MAX_ONGOING_REQUESTS = 32
_MAX_THREADS = 1024
_END = object()


class TrionserveReplica:
    """One Serve replica: an in-process trionserve core answering HTTP.

    ``options`` are :class:`trionserve.api.Options` fields as a dict (Serve
    passes arguments through its config file as JSON), ``max_input_size`` the
    HTTP body limit (``--http-max-input-size``), ``start_timeout`` the seconds
    the replica's constructor waits for every model to be ready.
    """

    def __init__(
        self,
        model_repository: str | list[str],
        options: dict[str, Any] | None = None,
        max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
        start_timeout: float = 120.0,
    ) -> None:
        known = {field.name for field in fields(api.Options)}
        unknown = sorted(set(options or {}) - known)
        if unknown:
            raise ValueError(
                f"unknown trionserve option(s) {unknown}: expected some of {sorted(known)}"
            )
        server_options = api.Options(
            model_repository=model_repository, **(options or {})
        ).server_options()
        http = replace(server_options.http, max_input_size=max_input_size)
        server_options = replace(server_options, http=http)
        self._max_input_size = max_input_size
        # Each request waits in one of these threads while the core answers it.
        # Serve's max_ongoing_requests bounds how many come at once, so no more
        # threads than that are ever made (they are made as needed).
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=_MAX_THREADS, thread_name_prefix="trionserve-ray"
        )
        self._server = api.Server(server_options)
        self._server.start(wait_until_ready=True, timeout=start_timeout)

    async def __call__(self, request: Request) -> Response:
        body = await self._read_body(request)
        path = request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):  # an application under a route prefix
            path = path[len(root) :] or "/"
        if request.url.query:
            path = f"{path}?{request.url.query}"
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(
            self._threads,
            self._server.http_request,
            request.method,
            path,
            request.headers.raw,
            body,
        )
        if answer.stream is None:
            response: Response = Response(answer.body, status_code=answer.status)
        else:
            response = StreamingResponse(self._chunks(answer.stream), status_code=answer.status)
        # As the route table wrote them (a repeated header stays repeated).
        response.raw_headers = [
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in answer.headers
            if answer.stream is None or name != "content-length"
        ]
        return response

    async def _read_body(self, request: Request) -> bytes:
        """The body, read no further than one byte past the limit: a longer one
        is handed on cut there, and the route table answers 413 naming the
        limit, as the HTTP frontend does."""
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            parts.append(chunk)
            size += len(chunk)
            if size > self._max_input_size:
                break
        return b"".join(parts)[: self._max_input_size + 1]

    async def _chunks(self, stream: Iterator[Any]) -> AsyncIterator[Any]:
        """A streamed answer's chunks (``generate_stream``), each taken in a
        thread; leaving early (the client went away) closes the stream, which
        ends its request."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                chunk = await loop.run_in_executor(self._threads, next, stream, _END)
                if chunk is _END:
                    return
                yield chunk
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                await loop.run_in_executor(self._threads, close)

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose core is not ready (a model
        failed, the core stopped) raises, and Serve replaces it."""
        ready = await asyncio.get_running_loop().run_in_executor(self._threads, self._ready)
        if not ready:
            raise RuntimeError("trionserve core is not ready")

    def _ready(self) -> bool:
        try:
            return self._server.ready()
        except api.TritonError:
            return False

    async def __del__(self) -> None:
        """At a replica's stop (Serve awaits it, after its own wait for ongoing
        requests): the core's drain, then its models unloaded."""
        server = getattr(self, "_server", None)
        if server is not None:
            await asyncio.get_running_loop().run_in_executor(None, server.stop)
        threads = getattr(self, "_threads", None)
        if threads is not None:
            threads.shutdown(wait=False)


def deployment(**deployment_options: Any) -> serve.Deployment:
    """The Serve deployment of :class:`TrionserveReplica` with our defaults
    (``max_ongoing_requests`` 32, the health check every 5 s), overridden by
    ``deployment_options`` (any of ``serve.deployment``'s: ``num_replicas``,
    ``autoscaling_config``, ``ray_actor_options``, ``max_replicas_per_node``,
    ``graceful_shutdown_timeout_s``, ...)."""
    options: dict[str, Any] = {
        "name": "trionserve",
        "max_ongoing_requests": DEFAULT_MAX_ONGOING_REQUESTS,
        "health_check_period_s": 5.0,
        "graceful_shutdown_timeout_s": 30.0,
    }
    options.update(deployment_options)
    return serve.deployment(**options)(TrionserveReplica)


def app(
    model_repository: str | list[str],
    options: dict[str, Any] | None = None,
    max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
    **deployment_options: Any,
) -> serve.Application:
    """A Serve application serving ``model_repository`` (see
    :func:`deployment` for ``deployment_options``)."""
    return deployment(**deployment_options).bind(model_repository, options, max_input_size)


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder, for config files (``import_path:
    trionserve.ray_serve:build_app`` with ``args``): ``model_repository``,
    ``options``, ``max_input_size``. Replicas, autoscaling and the rest are the
    config file's ``deployments`` section, which Serve applies over ours."""
    args = dict(args)
    repository = args.pop("model_repository")
    return app(repository, **args)
