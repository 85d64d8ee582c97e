"""A test backend whose instances block in execute until the test releases them.

A server given ``BACKENDS`` serves it as ``backend: "test_blocking"``; it echoes INPUT0 to OUTPUT0. Tests use
its threading events to know, without sleeping, that a request is executing.
A test module's ``repository`` fixture is ``repository_fixture()``: a repository
holding the model "blocking", the gate reset before and released after.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.fake_backend import echo_responses, instance_backend
from tests.repository import echo_model
from trionserve.backends.base import ModelContext

if TYPE_CHECKING:
    from trionserve.core.inference import InferenceRequest
    from trionserve.server import Server

BACKEND = "test_blocking"


class Gate:
    """Counts executions entering and lets them through when released."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.fail_next = False

    def reset(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.fail_next = False


GATE = Gate()

# Bound on every wait for the backend in tests: a request that never arrives must
# fail its test, never hang the suite.
ENTER_TIMEOUT = 60.0


async def wait_entered(timeout: float = ENTER_TIMEOUT) -> None:
    """Wait until one more execution has entered the backend (in a worker thread)."""
    import trio

    entered = await trio.to_thread.run_sync(GATE.entered.acquire, True, timeout)
    assert entered, f"no request reached the blocking backend within {timeout} s"


class _Instance:
    def __init__(self, context: ModelContext) -> None:
        self.name = context.name
        self.version = str(context.version)

    def execute(self, requests):
        GATE.entered.release()
        assert GATE.release.wait(timeout=ENTER_TIMEOUT), "the test never released the gate"
        if GATE.fail_next:
            GATE.fail_next = False
            raise RuntimeError("injected backend failure")
        return echo_responses(requests, self.name, self.version)

    def close(self) -> None:
        pass


def make_model(repository: Path, name: str, config: str = "") -> Path:
    return echo_model(repository, name, BACKEND, config=config)


@contextlib.contextmanager
def gated_repository(path: Path, config: str = "", released: bool = False) -> Iterator[Path]:
    """``path`` holding the model "blocking" (``config`` appended to its configuration)
    with the gate reset; ``released``: every execution goes straight through. The
    gate is released at the end, so that no worker thread is left blocked."""
    GATE.reset()
    if released:
        GATE.release.set()
    make_model(path, "blocking", config)
    try:
        yield path
    finally:
        GATE.release.set()


def repository_fixture(config: str = "", released: bool = False):
    """A ``repository`` fixture for a test module (``repository = repository_fixture()``):
    a temporary directory made a :func:`gated_repository` with these arguments."""

    @pytest.fixture
    def repository(tmp_path: Path) -> Iterator[Path]:
        with gated_repository(tmp_path, config, released) as path:
            yield path

    return repository


# For Server(options, backends=BACKENDS).
BACKENDS = instance_backend(BACKEND, lambda context, spec: _Instance(context))


def http_server(repository: Path, backends=BACKENDS, **options) -> Server:
    """An in-process server of ``repository`` over HTTP only, on a free loopback
    port, with ``backends`` (this module's gated one unless given)."""
    from tests.serverproc import free_port
    from trionserve.protocol.http.frontend import HttpOptions
    from trionserve.server import Server, ServerOptions

    return Server(
        ServerOptions(
            model_repositories=[repository],
            http_address="127.0.0.1",
            http_port=free_port(),
            http=HttpOptions(),
            allow_grpc=False,
            allow_metrics=False,
            exit_timeout_secs=20.0,
            **options,
        ),
        backends=backends,
    )


def request(value: float, model: str = "blocking") -> InferenceRequest:
    """An FP32 ``[1, 4]`` request of ``model`` filled with ``value``."""
    import numpy as np

    from trionserve.core.inference import InferenceRequest, Tensor

    data = np.full((1, 4), value, dtype=np.float32)
    return InferenceRequest(model, inputs={"INPUT0": Tensor("INPUT0", "FP32", data)})


async def served(repository: Path, body) -> None:
    """Runs ``body(server)`` against an in-process server of ``repository`` with no
    listeners, the gate released and the server shut down after it."""
    import trio

    from trionserve.server import Server, ServerOptions

    options = ServerOptions(
        model_repositories=[repository], allow_http=False, allow_grpc=False, allow_metrics=False
    )
    server = Server(options, backends=BACKENDS)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        try:
            await body(server)
        finally:
            GATE.release.set()
            server.shutdown()


def counted(server: Server) -> int:
    """Requests of the model "blocking" counted in flight."""
    return server.registry.route("blocking", None).inflight
