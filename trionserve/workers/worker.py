"""A worker process of ``--workers``: one complete server, plus what the supervisor
needs from it.

What a worker owns and guarantees:

- Its server (its own event loop, models and schedulers), serving the HTTP and
  gRPC ports with ``SO_REUSEPORT`` next to the other workers.
- Its own statistics on a loopback port it binds
  (:func:`~trionserve.workers.statistics.serve_own_statistics`), and its metrics on
  another (``--metrics-port=0``, given by the supervisor).
- Readiness: once its frontends listen and its models are loaded it reports the
  ports it bound through its readiness pipe (:mod:`trionserve.workers.readiness`).
- Statistics it answers are every worker's, from the supervisor (its own when the
  supervisor cannot answer); errors are checked against its own registry first,
  so they are a single server's.
- Health endpoints are its own: a probe's connection lands on one worker and
  reports that worker's state.
- A worker whose supervisor vanished (SIGKILL) shuts itself down gracefully.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING

import structlog
import trio

from trionserve.workers.readiness import ReadyReporter, WorkerPorts
from trionserve.workers.statistics import all_workers_statistics, serve_own_statistics

if TYPE_CHECKING:
    from trionserve.actors.registry import ModelRegistry
    from trionserve.server import Server

log = structlog.get_logger(__name__)

# How often a worker checks that its supervisor is still there.
ORPHAN_CHECK_SECS = 1.0


async def serve_worker(
    server: Server,
    index: int,
    ready_fd: int | None,
    supervisor_port: int | None = None,
) -> None:
    """Run ``server`` as worker ``index``: readiness, with the ports it bound,
    through ``ready_fd``; shut down gracefully if the supervisor goes away. Its
    own statistics are served on a loopback port of its own; the statistics it
    answers come from the supervisor at ``supervisor_port`` (every worker's,
    added up)."""
    parent = os.getppid()
    if ready_fd is not None:
        os.set_inheritable(ready_fd, False)  # not into Python-backend stub processes
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_follow_parent, server, parent)
            binds = await nursery.start(serve_own_statistics, server)
            statistics_port = binds[0][1]

            def ports() -> WorkerPorts:
                # Read when the server reports it started: its metrics port is bound.
                metrics = server.metrics_binds[0][1] if server.metrics_binds else None
                return WorkerPorts(statistics=statistics_port, metrics=metrics)

            if supervisor_port is not None:
                server.dataplane.statistics_source = partial(
                    all_workers_statistics, server.dataplane, supervisor_port
                )
            on_ready = partial(warn_sequence_models, server.registry) if index == 0 else _nothing
            try:
                await server.serve(task_status=ReadyReporter(ready_fd, on_ready, ports))
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Only serve() can fail here: give the caller its exception, as without workers.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def _nothing() -> None:
    pass


async def _follow_parent(server: Server, parent: int) -> None:
    # Another process's end has no event to wait on (no pidfd for a parent).
    while os.getppid() == parent:  # noqa: ASYNC110
        await trio.sleep(ORPHAN_CHECK_SECS)
    log.warning("supervisor process is gone: shutting down")
    server.shutdown()


def warn_sequence_models(registry: ModelRegistry) -> None:
    """Log which loaded models keep sequence state in one worker."""
    names = []
    for entry in sorted(registry.entries().values(), key=lambda e: e.model_id.order()):
        try:
            version = registry.route(entry.name, None, entry.model_id.namespace)
        except Exception:
            continue
        if version.config.HasField("sequence_batching"):
            names.append(entry.model_id.display)
    if names:
        log.warning(
            "sequence models with --workers > 1: each sequence's state lives in the "
            "worker that received its START; send all its requests over one "
            "connection (one gRPC client or stream, one keep-alive HTTP connection)",
            models=names,
        )
