"""The scenarios; importing this package registers every one of them."""

from simulations.scenarios import (  # noqa: F401
    backend_faults,
    load,
    python_stub,
    repository_changes,
    sequences,
    shutdown,
)
