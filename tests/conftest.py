"""Shared fixtures: a real trionserve serving the example repository."""

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
