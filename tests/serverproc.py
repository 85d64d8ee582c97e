"""Start the real trionserve as a subprocess on free loopback ports, for tests:
trionserve's own harness (:mod:`trionserve.testing`, shared with the benchmarks)
with the example repository as the default, and helpers around it."""

from __future__ import annotations

import contextlib
from pathlib import Path

from trionserve.testing import TrionServe, free_port

# free_port is the tests' too: they import it from here with the server.
__all__ = [
    "EXAMPLES",
    "ROOT",
    "ServerProcess",
    "free_port",
    "http_client",
    "scrape_metrics",
    "serving",
]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"


class ServerProcess(TrionServe):
    """trionserve on held loopback ports (:class:`trionserve.testing.TrionServe`),
    serving the example repository unless given others; ``stop`` sends SIGTERM and
    returns the exit code, ``close`` ends it and what it left."""

    def __init__(
        self,
        *repositories: Path,
        args: list[str] | None = None,
        workers: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(*(repositories or (EXAMPLES,)), args=args or (), workers=workers, env=env)


@contextlib.contextmanager
def serving(*repositories: Path, args: list[str] | None = None):
    """A started server for a ``with`` block; it must then stop cleanly (exit 0)."""
    proc = ServerProcess(*repositories, args=args)
    try:
        proc.wait_ready()
        yield proc
        code = proc.stop()
        assert code == 0, f"trionserve exited with {code}:\n{proc.output()}"
    finally:
        proc.close()


@contextlib.contextmanager
def http_client(proc: ServerProcess):
    """tritonclient's HTTP client for ``proc``, closed at the end of the block."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(proc.http_url)
    try:
        yield client
    finally:
        client.close()


def scrape_metrics(proc: ServerProcess) -> dict:
    """The server's /metrics, parsed: family name -> prometheus_client family."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.helpers import metrics_text

    text = metrics_text(proc.metrics_port)
    return {family.name: family for family in text_string_to_metric_families(text)}
