"""Model versions: which version directories exist and which the version policy loads.

A version directory is a subdirectory of the model directory whose name is a
positive decimal integer without leading zeros (``1``, ``2``, ``10``). Like Triton,
``01`` is ignored (Triton warns and skips names with leading zeros), and so is any
other name (``0``, ``-1``, ``v1``, hidden directories, ``__pycache__``, ``warmup``).
When a model loads, each ignored directory but Triton's own (``warmup``,
``initial_state``, ``configs``) is logged as a warning in Triton's words (core
src/model_repository_manager/model_lifecycle.cc:102 VersionsToLoad).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from trionserve.core.errors import InvalidArgument, Unavailable

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

log = structlog.get_logger(__name__)

_VERSION_NAME = re.compile(r"[1-9][0-9]*")
_STOLL = re.compile(r"\s*[+-]?[0-9]")  # what std::stoll reads a number from
_MAX_VERSION = 2**63 - 1  # versions are int64 on the wire
# Subdirectories of a model that are not versions (core constants.h kWarmupDataFolder,
# kInitialStateFolder, kModelConfigFolder).
_NOT_VERSIONS = ("warmup", "initial_state", "configs")


def list_versions(model_dir: Path, *, warn: bool = False) -> list[int]:
    """The version numbers present under ``model_dir``, ascending; with ``warn``,
    Triton's warning for each other subdirectory."""
    try:
        with os.scandir(model_dir) as entries:
            versions = []
            for entry in entries:
                if _VERSION_NAME.fullmatch(entry.name) and entry.is_dir():
                    versions.append(int(entry.name))
                elif warn and entry.name not in _NOT_VERSIONS and entry.is_dir():
                    _ignored(entry.name)
    except OSError as exc:
        raise Unavailable(
            f"model '{Path(model_dir).name}': cannot list its version directories: "
            f"{exc.strerror or exc}"
        ) from None
    return sorted(v for v in versions if v <= _MAX_VERSION)


def _ignored(name: str) -> None:
    if len(name) > 1 and name[0] == "0":
        log.warning(
            f"ignore version directory '{name}' which contains leading zeros in its directory name"
        )
    elif not _STOLL.match(name):  # "0", "-1", "2x" convert in Triton: not warned of
        log.warning(f"ignore version directory '{name}' which fails to convert to integral number")


def _policy(config: ModelConfig) -> str:
    # An unset policy means latest { num_versions: 1 }, as in Triton.
    return config.version_policy.WhichOneof("policy_choice") or "latest"


def missing_versions(config: ModelConfig, available: list[int]) -> list[int]:
    """Versions named by a ``specific`` policy that have no version directory.

    Triton logs these and loads the versions that do exist; the caller reports them
    the same way (they are not an error unless nothing at all can be loaded).
    """
    if _policy(config) != "specific":
        return []
    present = set(available)
    return sorted({v for v in config.version_policy.specific.versions if v not in present})


def select_versions(config: ModelConfig, available: list[int]) -> list[int]:
    """The versions to load under the config's version policy, ascending.

    ``latest {num_versions: n}`` takes the n numerically greatest versions, ``all``
    takes every version, ``specific {versions: [...]}`` takes the listed versions
    that exist (see :func:`missing_versions` for the others). Raises InvalidArgument
    (Triton's status for this load failure) when the policy selects nothing.
    """
    name = config.name
    policy = _policy(config)
    ordered = sorted(set(available))
    if policy == "all":
        chosen = ordered
    elif policy == "specific":
        wanted = set(config.version_policy.specific.versions)
        chosen = [v for v in ordered if v in wanted]
    else:
        has_latest = config.version_policy.HasField("latest")
        n = config.version_policy.latest.num_versions if has_latest else 1
        chosen = ordered[len(ordered) - n :] if n > 0 else []

    if chosen:
        return chosen
    if not ordered:
        raise InvalidArgument(
            f"model '{name}' has no versions to load: no version directories found "
            "(expected subdirectories named by positive integers, like '1')"
        )
    if policy == "specific":
        missing = missing_versions(config, available)
        raise InvalidArgument(
            f"model '{name}' has no versions to load: version_policy specific versions "
            f"{missing} have no version directory (found {ordered})"
        )
    raise InvalidArgument(
        f"model '{name}' has no versions to load under its version_policy "
        f"(latest num_versions is 0; found {ordered})"
    )
