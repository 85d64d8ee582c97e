"""The scenarios; importing this package registers every one of them."""

from simulations.scenarios import (  # noqa: F401
    backend_faults,
    client_budget,
    grpc_frontend,
    http_frontend,
    load,
    on_demand,
    python_stub,
    repository_changes,
    sequences,
    shutdown,
)
