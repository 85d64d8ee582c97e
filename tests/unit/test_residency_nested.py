"""A load under a memory budget while another load is being measured: known as
part of that load when it carries the load's context (a model's initialize
loading another, pb_utils.load_model), even through a thread of its own as an
in-process Python model's; held up behind it otherwise, and taken as part of it
after NESTED_WAIT_SECS at most, with a warning naming it."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import trio
from structlog.testing import capture_logs

from trionserve._generated.model_config_pb2 import ModelConfig
from trionserve.actors import residency
from trionserve.actors.residency import NESTED_WAIT_SECS, ResidencyManager, ResidencyOptions
from trionserve.actors.residency_budget import parse_memory_limit


@asynccontextmanager
async def measuring() -> AsyncIterator[ResidencyManager]:
    """A manager with a budget whose measured load (of "outer", in a task of its
    own) is under way throughout."""
    manager = ResidencyManager(
        SimpleNamespace(),  # type: ignore[arg-type]  # the registry: only evictions use it
        ResidencyOptions(memory_limits=[parse_memory_limit("host:1GiB")]),
    )

    async def outer(task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with manager._measuring:
            manager._reserved = (("outer", "1"), {"host": 1})  # type: ignore[assignment]
            task_status.started()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await nursery.start(outer)
        yield manager
        nursery.cancel_scope.cancel()


async def charge_inner(manager: ResidencyManager, tmp_path) -> float:
    """The virtual seconds "inner"'s load waited to be charged."""
    entry = SimpleNamespace(model_id=("inner", "1"), name="inner", serving=False)
    started = trio.current_time()
    async with manager.charging(entry, ModelConfig(name="inner"), tmp_path):  # type: ignore[arg-type]
        return trio.current_time() - started


async def test_a_load_without_the_context_waits_at_most_the_nested_wait(autojump_clock, tmp_path):
    async with measuring() as manager:
        with capture_logs() as logs:
            waited = await charge_inner(manager, tmp_path)
    assert waited == NESTED_WAIT_SECS
    assert [entry["model"] for entry in logs if "without measuring" in entry["event"]] == ["inner"]


async def test_a_load_from_a_thread_run_in_the_loads_context_does_not_wait(
    autojump_clock, tmp_path
):
    """As an in-process model's initialize: a thread of its own (the instance's)
    running it in the load's context, its call back into Trio (from_thread.run)
    carrying that context."""
    token = residency._MEASURED_LOAD.set(residency._MeasuredLoad())
    load_context = contextvars.copy_context()
    residency._MEASURED_LOAD.reset(token)
    trio_token = trio.lowlevel.current_trio_token()
    waited: list[float] = []

    def initialize() -> None:
        waited.append(trio.from_thread.run(charge_inner, manager, tmp_path, trio_token=trio_token))

    async with measuring() as manager:
        thread = threading.Thread(target=lambda: load_context.run(initialize))
        with capture_logs() as logs:
            thread.start()
            await trio.to_thread.run_sync(thread.join)
    assert waited == [0.0]
    assert not [entry for entry in logs if "without measuring" in entry["event"]]
