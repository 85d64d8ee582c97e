"""What a Python instance keeps per call to its stub (:mod:`.instance`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from trionserve.backends.base import ExecuteResult
from trionserve.backends.python.process import TrioChannel
from trionserve.core.errors import InternalError, Unavailable
from trionserve.core.inference import InferenceRequest

# How long a readiness check waits for the model's is_ready() (python_backend
# pb_utils.h kUserModelReadinessTimeoutMs).
READINESS_TIMEOUT_SECONDS = 5.0


@dataclass(eq=False)
class ReadinessCheck:
    """A model ``is_ready()`` call in flight; concurrent checks share it."""

    id: int
    done: trio.Event = field(default_factory=trio.Event)
    ready: bool = False
    error: str | None = None


class Readiness:
    """An instance's ``is_ready()`` calls to its stub: one in flight at a time;
    checks that come meanwhile wait for its answer (python_be.cc
    RunUserModelReadinessCheck)."""

    def __init__(self) -> None:
        self._check: ReadinessCheck | None = None

    async def ask(
        self, name: str, channel: TrioChannel, check_id: int, gone: tuple[type[BaseException], ...]
    ) -> None:
        """Raise unless the model's ``is_ready()`` says True within 5 s."""
        check = self._check
        if check is None:
            check = self._check = ReadinessCheck(check_id)
            try:
                await channel.send({"op": "is_ready", "id": check.id})
            except gone:
                pass  # the stub is gone; stub_gone ends the check
        with trio.move_on_after(READINESS_TIMEOUT_SECONDS):
            await check.done.wait()
        if not check.done.is_set():
            raise Unavailable("Timed out waiting for user-defined is_ready() response")
        if check.error is not None:
            raise InternalError(check.error)
        if not check.ready:
            raise Unavailable(f"Model '{name}' is not ready (user-defined check failed).")

    def answered(self, message: dict) -> None:
        """The stub's ``ready_state`` message."""
        check = self._check
        if check is not None and check.id == message["id"]:
            self._check = None
            check.ready, check.error = message["ready"], message["error"]
            check.done.set()

    def stub_gone(self) -> None:
        check, self._check = self._check, None
        if check is not None:
            check.error = "Stub process is not healthy while waiting for is_ready()"
            check.done.set()


@dataclass(eq=False)
class Call:
    """One execute sent to the stub; ``results`` is what execute_async returns."""

    requests: list[InferenceRequest]
    keys: list[int]
    done: trio.Event = field(default_factory=trio.Event)
    results: ExecuteResult | None = None
    # Called with ``results`` and ``started`` when done, for a call posted
    # behind another one (see PythonInstance.execute_ahead): nobody awaits it.
    on_done: Callable[[ExecuteResult | None, float], None] | None = None
    socket: bool = False  # sent on the socket, not the lane
    # When the stub could start it: posted, or (``behind``) once the call
    # before it was answered.
    started: float = 0.0
    behind: bool = False

    def finish(self) -> None:
        self.done.set()
        if self.on_done is not None:
            self.on_done(self.results, self.started)


@dataclass(eq=False)
class Open:
    """A request the stub has and has not finished; its input blocks."""

    request: InferenceRequest
    blocks: list
    cancel_sent: bool = False
