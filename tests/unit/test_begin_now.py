"""The data plane's begin as plain calls (InferencePath.begin_now): a request its model's
dynamic batcher takes without a wait is begun in one step, a Lifecycle returned; where the
batcher's queue is full, or the model's scheduler only queues by awaiting, the rest of the way
is returned to await (begin's), the request counted once and answered once either way."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import trio
import trio.testing

from tests.blocking_backend import (
    GATE,
    counted,
    repository_fixture,
    request,
    served,
    wait_entered,
)
from trionserve.core.errors import NotFound, Unavailable
from trionserve.lifecycle import Lifecycle
from trionserve.server import Server

repository = repository_fixture("dynamic_batching { }")
unbatched = repository_fixture()


async def answered(server: Server, run: Lifecycle, value: float) -> None:
    outcome = trio.Event()
    run.request.on_final(outcome.set)
    if not run.request.done:
        await outcome.wait()
    response = server.dataplane.end(run)
    np.testing.assert_array_equal(response.outputs[0].data, np.full((1, 4), value, np.float32))


async def test_begin_now_takes_an_idle_batchers_request_in_one_step(repository):
    async def body(server: Server) -> None:
        req = request(3.0)
        run = server.dataplane.begin_now(req, "test")
        assert type(run) is Lifecycle and run.request is req  # nothing to await
        await wait_entered()
        assert not req.done and counted(server) == 1
        GATE.release.set()
        await answered(server, run, 3.0)
        assert counted(server) == 0

    await served(repository, body)


async def test_begin_now_leaves_a_full_queue_to_begins_wait(repository):
    async def body(server: Server) -> None:
        model = server.registry.route("blocking", None)
        scheduler = model._scheduler
        scheduler._capacity = 1  # one request queued fills it
        first = server.dataplane.begin_now(request(1.0), "test")
        await wait_entered()  # its instance holds it
        second = server.dataplane.begin_now(request(2.0), "test")
        assert type(first) is Lifecycle and type(second) is Lifecycle
        assert scheduler._queued == 1 and counted(server) == 2
        third_request = request(3.0)
        rest = server.dataplane.begin_now(third_request, "test")
        # Not queued and not counted: the rest of the way is begin's, awaited.
        assert type(rest) is not Lifecycle and inspect.isawaitable(rest)
        assert scheduler._queued == 1 and counted(server) == 2
        third: list[Lifecycle] = []

        async def wait_for_space() -> None:
            third.append(await rest)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_space)
            await trio.testing.wait_all_tasks_blocked()
            assert not third and counted(server) == 3  # counted once, waiting for space
            GATE.release.set()
        assert type(third[0]) is Lifecycle and third[0].request is third_request
        await answered(server, first, 1.0)
        await answered(server, second, 2.0)
        await answered(server, third[0], 3.0)
        assert counted(server) == 0 and scheduler._queued == 0

    await served(repository, body)


async def test_begin_now_refused_leaves_nothing_to_end(repository):
    async def body(server: Server) -> None:
        with pytest.raises(NotFound):
            server.dataplane.begin_now(request(1.0, model="missing"), "test")
        assert counted(server) == 0

    await served(repository, body)


async def test_begin_now_awaits_a_scheduler_without_a_plain_submit(unbatched):
    async def body(server: Server) -> None:
        assert server.registry.route("blocking", None).submit_now is None
        rest = server.dataplane.begin_now(request(5.0), "test")
        assert type(rest) is not Lifecycle
        run = await rest
        assert type(run) is Lifecycle and counted(server) == 1
        GATE.release.set()
        await answered(server, run, 5.0)
        assert counted(server) == 0

    await served(unbatched, body)


async def test_begin_now_on_a_version_no_longer_ready_says_why_and_counts_nothing(repository):
    """A version leaving READY (unavailable, unloading) takes no request through its
    batcher's plain submit (``ModelVersion.submit_now`` is None from then on, so that
    begin_now looks at no state per request): the rest of begin is returned, whose
    await says why the version is not ready; nothing stays counted."""

    async def body(server: Server) -> None:
        model = server.registry.route("blocking", None)
        assert model.submit_now is not None  # READY
        model._set_unavailable("taken down by the test")
        assert model.submit_now is None
        rest = server.dataplane.begin_now(request(1.0), "test")
        assert type(rest) is not Lifecycle  # not queued at the batcher
        with pytest.raises(Unavailable, match="taken down by the test"):
            await rest
        assert counted(server) == 0 and model._scheduler._queued == 0

    await served(repository, body)


async def test_begin_now_on_a_closed_batcher_answers_unloading(repository):
    """A batcher closed under a READY version (its unload's first step) refuses the
    plain submit: UNAVAILABLE "is unloading", as ``ModelVersion.infer`` says it, and
    nothing stays counted."""

    async def body(server: Server) -> None:
        model = server.registry.route("blocking", None)
        model._scheduler.close()
        with pytest.raises(Unavailable, match="version 1 is unloading"):
            server.dataplane.begin_now(request(1.0), "test")
        assert counted(server) == 0

    await served(repository, body)
