"""What a new load of a loaded model changes, and the least work that applies it.

Triton reloads a model whenever anything in its directory changed. trionserve
compares the loaded state with the new one and does only what the difference needs:
nothing when nothing that matters changed (an edited comment in config.pbtxt;
a file whose size or mtime changed still counts as changed); new or removed executors
when only instance counts changed; loading and unloading single versions when
version directories or the version policy changed; a full reload otherwise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trionserve.repository.snapshot import ModelSnapshot, file_changes

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig


class ConfigChange(enum.Enum):
    INSTANCE_COUNT = "instance_group count"
    VERSION_POLICY = "version_policy"
    OTHER = "other fields"


def config_changes(old: ModelConfig, new: ModelConfig) -> frozenset[ConfigChange]:
    """How two prepared (completed, normalised) model configurations differ."""
    if old == new:
        return frozenset()
    changes: set[ConfigChange] = set()
    a, b = type(old)(), type(new)()
    a.CopyFrom(old)
    b.CopyFrom(new)
    if a.version_policy != b.version_policy:
        changes.add(ConfigChange.VERSION_POLICY)
        a.ClearField("version_policy")
        b.ClearField("version_policy")
    # Counts and rate_limiter blocks are applied to the running instances (an
    # instance whose rate_limiter changed is replaced), as Triton updates them.
    if [(g.count, g.rate_limiter) for g in a.instance_group] != [
        (g.count, g.rate_limiter) for g in b.instance_group
    ]:
        changes.add(ConfigChange.INSTANCE_COUNT)
        for group in (*a.instance_group, *b.instance_group):
            group.count = 0
            group.ClearField("rate_limiter")
    if a != b:
        changes.add(ConfigChange.OTHER)
    return frozenset(changes)


@dataclass(frozen=True)
class LoadedSource:
    """What the serving versions of a model were loaded from."""

    model_dir: Path
    snapshot: ModelSnapshot | None
    config: ModelConfig  # as prepared
    override_digest: str  # of the load request's config and files; "" for none


@dataclass(frozen=True)
class ReloadPlan:
    """Versions to keep serving, to load beside them, and to unload afterwards."""

    keep: tuple[int, ...]
    load: tuple[int, ...]
    unload: tuple[int, ...]
    update_instances: bool  # kept versions adopt the new instance counts
    reason: str

    @property
    def nothing(self) -> bool:
        return not (self.load or self.unload or self.update_instances)


def plan_reload(
    loaded: LoadedSource | None,
    serving: set[int],
    new: LoadedSource,
    selected: list[int],
) -> ReloadPlan:
    """The least work that takes ``serving`` (loaded from ``loaded``) to ``new``.

    ``selected`` are the versions the new configuration's policy picks. Kept
    versions are those selected, serving, and whose version directory is unchanged
    while nothing shared by all versions changed.
    """
    everything = ReloadPlan((), tuple(selected), tuple(sorted(serving)), False, "")
    if loaded is None or not serving:
        return _with_reason(everything, "first load")
    if loaded.model_dir != new.model_dir:
        return _with_reason(everything, "loaded from a different directory")
    files = file_changes(loaded.snapshot, new.snapshot)
    changes = config_changes(loaded.config, new.config)
    if ConfigChange.OTHER in changes:
        return _with_reason(everything, "configuration changed")
    if files.shared:
        return _with_reason(everything, "model files outside the version directories changed")
    keep = tuple(v for v in selected if v in serving and v not in files.versions)
    load = tuple(v for v in selected if v not in keep)
    unload = tuple(sorted(v for v in serving if v not in keep))
    update = ConfigChange.INSTANCE_COUNT in changes and bool(keep)
    parts = []
    if load:
        parts.append(f"versions {list(load)} to load")
    if unload:
        parts.append(f"versions {list(unload)} to unload")
    if update:
        parts.append("instance count changed")
    if ConfigChange.VERSION_POLICY in changes:
        parts.append("version_policy changed")
    return ReloadPlan(keep, load, unload, update, "; ".join(parts) or "no change")


def _with_reason(plan: ReloadPlan, reason: str) -> ReloadPlan:
    return ReloadPlan(plan.keep, plan.load, plan.unload, plan.update_instances, reason)
