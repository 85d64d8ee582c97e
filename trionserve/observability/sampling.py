"""The loop of the CPU and GPU metric samplers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def sample_every(
    sample: Callable[[], Awaitable[None]],
    interval: float,
    stop: trio.Event,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sample now, report started, then every ``interval`` seconds until ``stop``."""
    await sample()
    task_status.started()
    while True:
        with trio.move_on_after(interval):
            await stop.wait()
        if stop.is_set():
            return
        await sample()
