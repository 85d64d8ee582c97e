"""The data plane's begin / end pair (trionserve/inference_path.py): a request admitted and
queued without a coroutine awaiting its outcome, carried on by the outcome's callback, and
ended with exactly one of end, finish or drop."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from tests.blocking_backend import (
    GATE,
    counted,
    repository_fixture,
    request,
    served,
    wait_entered,
)
from trionserve.core.errors import NotFound, TritonError
from trionserve.lifecycle import Lifecycle
from trionserve.server import Server

repository = repository_fixture()


async def test_begin_then_end_on_the_outcome_callback(repository):
    async def body(server: Server) -> None:
        dataplane = server.dataplane
        req = request(3.0)
        run = await dataplane.begin(req, endpoint="test")
        assert type(run) is Lifecycle and run.request is req
        outcome = trio.Event()
        req.on_final(outcome.set)  # called once, on the Trio thread, by the outcome
        await wait_entered()
        assert not req.done and counted(server) == 1
        GATE.release.set()
        await outcome.wait()
        response = dataplane.end(run)
        np.testing.assert_array_equal(response.outputs[0].data, np.full((1, 4), 3.0, np.float32))
        assert counted(server) == 0

    await served(repository, body)


async def test_end_raises_the_model_error_and_counts_out(repository):
    async def body(server: Server) -> None:
        GATE.fail_next = True
        GATE.release.set()
        req = request(1.0)
        run = await server.dataplane.begin(req)
        assert type(run) is Lifecycle
        outcome = trio.Event()
        req.on_final(outcome.set)
        await outcome.wait()
        with pytest.raises(TritonError, match="injected backend failure"):
            server.dataplane.end(run)
        assert counted(server) == 0

    await served(repository, body)


async def test_answered_counts_out_and_lets_go_what_the_request_holds(repository):
    # A caller whose answer is written already (a gRPC call the instance's
    # thread answered) does not take the outcome: the request is counted out,
    # and anything it holds for responses not taken is let go.
    async def body(server: Server) -> None:
        req = request(4.0)
        run = await server.dataplane.begin(req)
        assert type(run) is Lifecycle
        outcome = trio.Event()
        req.on_final(outcome.set)
        await wait_entered()
        GATE.release.set()
        await outcome.wait()
        assert counted(server) == 1 and req.held_bytes == 0
        req._undelivered = 16  # (as a response not taken would hold)
        server.dataplane.answered(run)
        assert counted(server) == 0 and req.held_bytes == 0 and not req._responses

    await served(repository, body)


async def test_drop_flags_cancelled_and_forgets_the_callback(repository):
    async def body(server: Server) -> None:
        req = request(2.0)
        run = await server.dataplane.begin(req)
        assert type(run) is Lifecycle
        called: list[int] = []
        req.on_final(lambda: called.append(1))
        await wait_entered()  # its model runs it
        server.dataplane.drop(run)
        assert req.cancelled and counted(server) == 0
        GATE.release.set()
        # The outcome still comes (its model ran it: delivered before the next request's,
        # which the one instance runs after it) and nobody is told of it.
        await server.dataplane.infer(request(4.0))
        assert req.done and called == []

    await served(repository, body)


async def test_begin_refused_leaves_nothing_to_end(repository):
    async def body(server: Server) -> None:
        with pytest.raises(NotFound):
            await server.dataplane.begin(request(1.0, model="missing"))
        assert counted(server) == 0
        GATE.release.set()
        # infer is begin then finish: the same request awaited whole.
        response = await server.dataplane.infer(request(5.0))
        np.testing.assert_array_equal(response.outputs[0].data, np.full((1, 4), 5.0, np.float32))
        assert counted(server) == 0

    await served(repository, body)
