"""RepositoryWatcher: turns the model control mode into load and unload commands.

The polling half of Triton core's ``ModelRepositoryManager`` (``PollAndUpdate``,
src/model_repository_manager/model_repository_manager.cc) and the server's
``--model-control-mode`` handling (NONE, EXPLICIT, POLL).
"""

from __future__ import annotations

import enum
from functools import partial

import structlog
import trio

from trionserve.actors.registry import ModelRegistry
from trionserve.core.errors import InvalidArgument, TritonError
from trionserve.repository.repository import ModelId, duplicate_reason
from trionserve.repository.snapshot import Duplicate, ModelSnapshot, snapshot_repository

log = structlog.get_logger(__name__)

# A model still changing after this many polls is reported again.
PENDING_REPORT_EVERY = 10
# A change a poll sees is looked at again this long after (at most the poll
# interval) and acted on in that poll when both looks agree.
SETTLE_SECS = 1.0


class ControlMode(enum.Enum):
    NONE = "none"
    EXPLICIT = "explicit"
    POLL = "poll"


class RepositoryWatcher:
    """Loads the startup model set and, in POLL mode, follows the repository.

    NONE: load every model at start, then ignore the repository. EXPLICIT: load the
    ``startup_models`` (``*`` alone for all), then only API calls change what is
    loaded. POLL: load every model at start, then every ``poll_interval`` seconds
    snapshot each model directory and act on what changed: a new model loads, a
    removed one unloads (its in-flight requests finish), a changed one reloads
    only what its change needs. Triton acts on the poll that first sees a change
    (core model_repository_manager.cc:664-705 PollAndUpdateInternal, polled every
    --repository-poll-secs by server main.cc:540-556) and documents that it may
    load a model still being copied (model_management.md, "no synchronization");
    here that poll looks again ``settle`` seconds later (1 s, or the poll
    interval if shorter) and acts when both looks agree, so a copy that writes
    at least once a second is never loaded half-written. A change whose files
    differ between the two looks waits for a later look that agrees with the one
    before it; one that keeps changing is logged as pending.

    ``run`` reports started once the startup loads have finished, successful or
    not; their failures are kept in ``startup_errors``. Children: one task per
    model action (so a slow or stuck load never stops polling or other models).
    A failed action is logged and the next change of that model is acted on.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        mode: ControlMode,
        startup_models: list[str] | None = None,
        poll_interval: float = 15.0,
        settle: float | None = None,
    ) -> None:
        self.registry = registry
        self.mode = mode
        self.startup_models = list(startup_models or [])
        if "*" in self.startup_models and len(self.startup_models) > 1:
            raise InvalidArgument(
                "wildcard model name '*' must be the only startup model if given at all"
            )
        self.poll_interval = poll_interval
        self.settle = min(SETTLE_SECS, poll_interval) if settle is None else settle
        self.startup_errors: dict[str, str] = {}
        # POLL state: the snapshot acted on last, the previous poll's, and the
        # number of consecutive polls a change has been seen unsettled.
        self._applied: dict[ModelId, ModelSnapshot | Duplicate] = {}
        self._previous: dict[ModelId, ModelSnapshot | Duplicate] = {}
        self._pending: dict[str, int] = {}
        self._busy: set[str] = set()
        self.polls = 0

    def _startup_names(self, everything: list[str]) -> list[str]:
        if self.mode is ControlMode.EXPLICIT and "*" not in self.startup_models:
            return list(dict.fromkeys(self.startup_models))
        return everything

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        polling = self.mode is ControlMode.POLL and self.poll_interval > 0
        repository = self.registry.repository
        if self.mode is ControlMode.POLL:  # the first snapshot: what startup loads see
            snapshots = await trio.to_thread.run_sync(snapshot_repository, repository)
            self._applied = dict(snapshots)
            self._previous = dict(snapshots)
        scan = await trio.to_thread.run_sync(repository.scan)
        for name, dirs in scan.duplicates.items():
            log.error("model not loaded", model=name, reason=duplicate_reason(name, dirs))
        names = self._startup_names(sorted(scan))
        log.info("loading startup models", mode=self.mode.value, models=names)
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(self._load_at_startup, name)
        task_status.started()
        if not polling:
            await trio.sleep_forever()
        async with trio.open_nursery() as actions:
            while True:
                await trio.sleep(self.poll_interval)
                await self.poll(actions)

    async def _load_at_startup(self, name: str) -> None:
        try:
            await self.registry.load(
                name, reason="startup", stable_files=self.mode is ControlMode.POLL
            )
        except TritonError as exc:
            self.startup_errors[name] = exc.message

    async def poll_once(self) -> None:
        """One poll, returning once the actions it started have finished."""
        async with trio.open_nursery() as actions:
            await self.poll(actions)

    async def poll(self, actions: trio.Nursery) -> None:
        """Snapshot the repository (twice, ``settle`` apart, when it changed) and
        start the actions whose snapshots agree."""
        try:
            current = await self._snapshot()
            if self.settle > 0 and self._unconfirmed(current):
                self._previous = current
                await self._wait_settle()
                current = await self._snapshot()
        except TritonError as exc:
            log.error("model repository poll failed", reason=exc.message)
            return
        self.polls += 1
        for name in sorted(set(current) | set(self._applied) | set(self._previous)):
            snapshot = current.get(name)
            if snapshot == self._applied.get(name):
                self._settled(name)
                continue
            if name in self._busy:
                continue  # acted on once the action in progress has ended
            if snapshot != self._previous.get(name):
                self._report_pending(name)
                continue
            self._settled(name)
            if snapshot is None:
                self._applied.pop(name, None)
            else:
                self._applied[name] = snapshot
            self._busy.add(name)
            actions.start_soon(partial(self._act, name, snapshot))
        self._previous = current

    async def _snapshot(self) -> dict[ModelId, ModelSnapshot | Duplicate]:
        # Object-storage repositories: fetch what changed into the local copy first.
        await trio.to_thread.run_sync(self.registry.repository.refresh)
        return await trio.to_thread.run_sync(snapshot_repository, self.registry.repository)

    async def _wait_settle(self) -> None:
        await trio.sleep(self.settle)

    def _unconfirmed(self, current: dict[ModelId, ModelSnapshot | Duplicate]) -> bool:
        """Whether a model changed since it was acted on and no earlier look agrees."""
        return any(
            current.get(name) != self._applied.get(name)
            and current.get(name) != self._previous.get(name)
            and name not in self._busy
            for name in set(current) | set(self._applied)
        )

    def _settled(self, name: str) -> None:
        if self._pending.pop(name, 0) >= 2:
            log.info("model change settled", model=name)

    def _report_pending(self, name: str) -> None:
        count = self._pending.get(name, 0) + 1
        self._pending[name] = count
        if count == 2 or count % PENDING_REPORT_EVERY == 0:
            log.warning(
                "model change pending: its files are still changing",
                model=name,
                polls=count,
            )

    async def _act(self, name: str, snapshot: ModelSnapshot | Duplicate | None) -> None:
        try:
            if snapshot is None:
                await self.registry.unload(name, reason="removed from the model repository")
            elif isinstance(snapshot, Duplicate):
                log.error("model not loaded", model=name, reason=str(snapshot))
                await self.registry.unload(name, reason=str(snapshot))
            else:
                await self.registry.load(
                    name, reason="changed in the model repository", stable_files=True
                )
        except TritonError as exc:
            # Logged by the registry and shown in the index; POLL goes on.
            log.debug("repository change not applied", model=name, reason=exc.message)
        except Exception:
            log.exception("repository change failed", model=name)
        finally:
            self._busy.discard(name)
