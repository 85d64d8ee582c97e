"""InstanceExecutor: one actor per model instance, executing batches one at a time."""

from __future__ import annotations

import structlog
import trio

from trionserve.backends.base import BackendInstance, InstanceSpec
from trionserve.core.errors import InternalError, TritonError, Unavailable
from trionserve.core.types import InferenceRequest, InferenceResponse

log = structlog.get_logger(__name__)


class InstanceExecutor:
    """Owns one backend instance and runs its batches in a worker thread.

    Inbox: the model's shared channel of batches (lists of requests); whichever
    executor is idle takes the next batch. Guarantees: every request of a batch it
    took gets exactly one outcome — the backend's result, an error for that batch
    only when the backend raises, or an error when the executor is cancelled. The
    backend instance is never called from two threads at once.
    """

    def __init__(
        self,
        spec: InstanceSpec,
        instance: BackendInstance,
        batches: trio.MemoryReceiveChannel[list[InferenceRequest]],
    ) -> None:
        self.spec = spec
        self.instance = instance
        self._batches = batches
        self._limiter = trio.CapacityLimiter(1)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self._batches:
            task_status.started()
            async for batch in self._batches:
                await self._execute(batch)

    async def _execute(self, batch: list[InferenceRequest]) -> None:
        live = [r for r in batch if not r.cancelled and not r.done]
        if not live:
            return
        try:
            results = await trio.to_thread.run_sync(
                self.instance.execute, live, limiter=self._limiter
            )
        except Exception as exc:
            log.exception("backend execute raised", instance=self.spec.name)
            error = InternalError(
                f"instance '{self.spec.name}' failed to execute the batch: "
                f"{type(exc).__name__}: {exc}"
            )
            for request in live:
                request.fail(error)
            return
        except BaseException:
            # Cancelled (unload deadline or shutdown) once the thread has returned:
            # the batch's results are dropped, so its requests are answered here.
            stopped = Unavailable(f"model instance '{self.spec.name}' was stopped")
            for request in live:
                request.fail(stopped)
            raise
        self._deliver(live, results)

    def _deliver(self, requests: list[InferenceRequest], results: list) -> None:
        if len(results) != len(requests):
            error = InternalError(
                f"instance '{self.spec.name}' returned {len(results)} responses for "
                f"{len(requests)} requests"
            )
            for request in requests:
                request.fail(error)
            return
        for request, result in zip(requests, results):
            if isinstance(result, InferenceResponse):
                request.respond(result)
            elif isinstance(result, TritonError):
                request.fail(result)
            else:
                request.fail(
                    InternalError(
                        f"instance '{self.spec.name}' returned {type(result).__name__} "
                        "instead of a response"
                    )
                )
