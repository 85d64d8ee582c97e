"""Shared fixtures: a real trionserve serving the example repository, one for the
session and, with client shared memory allowed, one for each module that asks."""

from __future__ import annotations

import pytest

from tests.serverproc import ServerProcess


@pytest.fixture(scope="session")
def server():
    """One server for the session, serving examples/model_repository."""
    proc = ServerProcess()
    try:
        proc.wait_ready()
        yield proc
        code = proc.stop()
        assert code == 0, f"server exited with {code}:\n{proc.output()}"
    finally:
        proc.close()


@pytest.fixture
def http_client(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def shm_server():
    """A server of the example repository with --allow-client-shm=true, for one module."""
    server = ServerProcess(args=["--allow-client-shm=true"])
    try:
        server.wait_ready()
        yield server
        assert server.stop() == 0
    finally:
        server.close()
