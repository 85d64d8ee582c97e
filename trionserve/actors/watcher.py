"""RepositoryWatcher: turns the model control mode into load and unload commands."""

from __future__ import annotations

import enum

import structlog
import trio

from trionserve.actors.registry import ModelRegistry
from trionserve.core.errors import TritonError

log = structlog.get_logger(__name__)


class ControlMode(enum.Enum):
    NONE = "none"
    EXPLICIT = "explicit"
    POLL = "poll"


class RepositoryWatcher:
    """Loads the startup model set and, per mode, follows the repository.

    NONE: load every model at start, then ignore the repository. EXPLICIT: load the
    ``startup_models`` (``*`` for all), then only API calls change what is loaded.
    POLL: load every model at start, then follow the repository. ``run`` reports
    started once the startup loads have finished, successful or not; the startup
    failures are kept in ``startup_errors``.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        mode: ControlMode,
        startup_models: list[str] | None = None,
        poll_interval: float = 15.0,
    ) -> None:
        self.registry = registry
        self.mode = mode
        self.startup_models = startup_models or []
        self.poll_interval = poll_interval
        self.startup_errors: dict[str, str] = {}

    def _startup_names(self) -> list[str]:
        everything = sorted(self.registry.repository.scan())
        if self.mode is ControlMode.EXPLICIT and "*" not in self.startup_models:
            return list(self.startup_models)
        return everything

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        names = self._startup_names()
        log.info("loading startup models", mode=self.mode.value, models=names)
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(self._load_at_startup, name)
        task_status.started()
        # POLL follows the repository in its own issue; NONE and EXPLICIT idle here.
        await trio.sleep_forever()

    async def _load_at_startup(self, name: str) -> None:
        try:
            await self.registry.load(name)
        except TritonError as exc:
            self.startup_errors[name] = exc.message
