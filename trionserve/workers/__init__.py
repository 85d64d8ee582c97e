"""``--workers N``: a supervisor process and N trionserve worker processes sharing ports.

The supervisor starts N copies of ``python -m trionserve`` with the same arguments
plus hidden worker flags. Each worker is a complete server (its own event loop,
models, schedulers) that binds the HTTP and gRPC ports with ``SO_REUSEPORT``
(:mod:`trionserve.protocol.listeners`), so the kernel spreads incoming
connections across the workers; a connection, and every request on it, stays on
the worker that accepted it.

One module per job:

- :mod:`~trionserve.workers.flags`: ``--workers`` and the hidden worker flags, and
  the settings that cannot be shared by several processes.
- :mod:`~trionserve.workers.readiness`: the readiness pipe. A worker writes one
  line when its frontends listen and its models are loaded, naming the private
  ports it has bound; the supervisor reads it.
- :mod:`~trionserve.workers.worker`: a worker process (the server, its private
  statistics port, following its supervisor).
- :mod:`~trionserve.workers.statistics`: the private statistics routes (a
  worker's own; every worker's added up at the supervisor).
- :mod:`~trionserve.workers.metrics`: the supervisor's metrics port, every
  worker's exposition merged.
- :mod:`~trionserve.workers.supervisor`: starting, watching, restarting and
  stopping the workers.

Every listener (the supervisor's metrics and private ports, each worker's private
ports) has the HTTP port's limits (``--http-*`` flags,
``HttpOptions.transport_options``). No port is chosen by one process and bound by
another: a worker binds its private ports itself (port 0) and reports the bound
numbers through its readiness pipe, and the supervisor binds its own private port
before it starts any worker, so no other local process can take a port between a
choice and a bind.
"""

from trionserve.workers.flags import add_worker_flags, parse_workers, worker_conflicts
from trionserve.workers.supervisor import run_supervisor
from trionserve.workers.worker import serve_worker

__all__ = [
    "add_worker_flags",
    "parse_workers",
    "run_supervisor",
    "serve_worker",
    "worker_conflicts",
]
