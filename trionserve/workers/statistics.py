"""The private statistics routes of ``--workers``, so that the statistics extension
counts every worker's requests as one server would.

Each worker serves its own statistics (``OWN_STATISTICS``) on a loopback port it
binds; the supervisor serves every worker's added up (``ALL_STATISTICS``) on a
loopback port of its own. A worker asked for statistics asks the supervisor,
which fetches each ready worker's concurrently and merges them
(:func:`trionserve.observability.statistics.merge_model_stats`). Both listeners
have the HTTP port's limits.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
import trio

from trionserve.core.errors import InvalidArgument, TritonError
from trionserve.observability.statistics import merge_model_stats, statistics_json
from trionserve.protocol.http.frontend import error_status
from trionserve.protocol.http.transport import (
    Handler,
    Headers,
    HttpServer,
    HttpServerOptions,
    RequestBody,
    Response,
    Router,
)

if TYPE_CHECKING:
    from trionserve.dataplane import DataPlane
    from trionserve.server import Server

log = structlog.get_logger(__name__)

# A worker's own statistics, and every worker's at the supervisor.
OWN_STATISTICS = "/worker/statistics"
ALL_STATISTICS = "/workers/statistics"
QUERY_TIMEOUT_SECS = 5.0


def statistics_query(body: bytes | bytearray | memoryview) -> tuple[str | None, int | None]:
    """The model name and version of a private statistics request."""
    try:
        query = json.loads(bytes(body))
        name, version = query["name"], query["version"]
    except (ValueError, TypeError, KeyError):
        raise InvalidArgument("expected a JSON object with 'name' and 'version'") from None
    if not (name is None or isinstance(name, str)) or not (version is None or type(version) is int):
        raise InvalidArgument("'name' must be a string or null, 'version' an integer or null")
    return name, version


# -- a worker's side ------------------------------------------------------------------


async def serve_own_statistics(
    server: Server,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``server``'s own statistics, for the supervisor, on a loopback port it binds
    (any free one: ``task_status.started`` gives the binds), until cancelled."""
    dataplane = server.dataplane

    async def own_statistics(headers: Headers, body: RequestBody) -> Response:
        try:
            name, version = statistics_query(body)
            return json_response(200, statistics_json(dataplane.registry, name, version))
        except TritonError as error:  # a model this worker does not have (yet)
            return json_response(error_status(error), {"error": error.message})

    private = HttpServer(
        post_route(OWN_STATISTICS, own_statistics),
        server.options.http.transport_options(reuse_port=False),
    )
    # Never set: the worker's nursery cancels this server when the worker ends.
    await private.serve("127.0.0.1", 0, trio.Event(), 1.0, task_status=task_status)


async def all_workers_statistics(
    dataplane: DataPlane, supervisor_port: int, name: str | None, version: int | None
) -> dict[str, Any]:
    """Every worker's statistics added up, from the supervisor; this worker's
    own when the supervisor cannot answer (logged)."""
    query = json.dumps({"name": name, "version": version}).encode()
    try:
        answer = await trio.to_thread.run_sync(_post_json, supervisor_port, ALL_STATISTICS, query)
    except (OSError, ValueError) as exc:
        log.warning("statistics of the other workers unavailable", error=str(exc))
        return statistics_json(dataplane.registry, name, version)
    return answer


# -- the supervisor's side ------------------------------------------------------------


async def serve_all_statistics(
    options: HttpServerOptions,
    worker_ports: Callable[[], list[tuple[int, int]]],
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Every ready worker's statistics added up, for the workers, on a loopback
    port (any free one: ``task_status.started`` gives the binds), until cancelled.
    ``worker_ports()``: (index, private statistics port) of each ready worker."""

    async def all_statistics(headers: Headers, body: RequestBody) -> Response:
        try:
            name, version = statistics_query(body)
        except TritonError as error:
            return json_response(error_status(error), {"error": error.message})
        query = json.dumps({"name": name, "version": version}).encode()
        parts: dict[int, list[dict]] = {}

        async def fetch(index: int, port: int) -> None:
            try:
                answer = await trio.to_thread.run_sync(_post_json, port, OWN_STATISTICS, query)
                parts[index] = answer["model_stats"]
            except (OSError, ValueError, KeyError) as exc:
                # A worker that does not know the model (yet) says so with a 4xx.
                log.debug("worker statistics unavailable", worker=index, error=str(exc))

        async with trio.open_nursery() as nursery:
            for index, port in worker_ports():
                nursery.start_soon(fetch, index, port)
        merged = merge_model_stats([parts[i] for i in sorted(parts)])
        return json_response(200, {"model_stats": merged})

    server = HttpServer(post_route(ALL_STATISTICS, all_statistics), options)
    # Never set: the supervisor's nursery cancels it once the workers exit.
    await server.serve("127.0.0.1", 0, trio.Event(), 1.0, task_status=task_status)


# -- the HTTP of both sides -----------------------------------------------------------


def _post_json(port: int, path: str, body: bytes) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=body,
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=QUERY_TIMEOUT_SECS) as response:
        return json.loads(response.read())


def json_response(status: int, value: dict[str, Any]) -> Response:
    data = json.dumps(value).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    return status, headers, [data]


def post_route(path: str, handler: Handler) -> Router:
    """A router with one handler, for POST ``path``; a JSON 404 elsewhere."""

    async def not_found(headers: Headers, body: RequestBody) -> Response:
        return json_response(404, {"error": "Not Found"})

    def route(method: bytes, request_path: str) -> Handler:
        return handler if method == b"POST" and request_path == path else not_found

    return route
