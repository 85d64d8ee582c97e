"""GlobalMap: the models known by each name, and which one a name means.

Triton core's ``ModelRepositoryManager`` keeps ``global_map_``
(src/model_repository_manager/model_repository_manager.h): a name -> the
``ModelIdentifier``s of the models known by it. With model namespacing
(``repository.namespacing``) several repositories may have a model of one name:
a request's name is resolved with ``FindModelIdentifier``, an ensemble step's
with ``DependencyGraph::FindNode``, and an ensemble's steps are bound to the
models they resolve to (``ConnectDependencyGraph``). The
:class:`~trionserve.actors.registry.ModelRegistry` decides when a model becomes
known and when it stops being known.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from trionserve.actors.registry_entries import composing_models, missing_models
from trionserve.core.errors import InvalidArgument
from trionserve.repository.repository import ModelId

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.actors.registry_entries import ModelEntry


def ambiguity(name: str, count: int) -> InvalidArgument:
    """A request names a model that several namespaces have (core
    ``model_repository_manager.cc``, ``FindModelIdentifier``)."""
    return InvalidArgument(
        f"There are {count} identifiers of model '{name}' in global map, model "
        "namespace must be provided to resolve ambiguity."
    )


class GlobalMap:
    """Triton's global map: name -> the ids of the models known by that name, and
    the resolution of a request's or an ensemble step's model name through it."""

    def __init__(self, namespacing: bool) -> None:
        self._namespacing = namespacing
        self._by_name: dict[str, set[ModelId]] = {}

    def ids(self, name: str) -> tuple[ModelId, ...]:
        """The ids of the models known by ``name`` now (none when unknown)."""
        return tuple(self._by_name.get(name, ()))

    def add(self, model_id: ModelId) -> None:
        self._by_name.setdefault(model_id.name, set()).add(model_id)

    def discard(self, model_id: ModelId) -> None:
        ids = self._by_name.setdefault(model_id.name, set())
        ids.discard(model_id)
        if not ids:
            del self._by_name[model_id.name]

    def identify(self, name: str) -> ModelId:
        """The one model a request's name means (Triton's ``FindModelIdentifier``):
        with namespacing, an unknown name and an ambiguous one are errors."""
        if not self._namespacing:
            return ModelId("", name)
        ids = self._by_name.get(name)
        if not ids:
            raise InvalidArgument(f"Request for unknown model: '{name}' is not found")
        if len(ids) > 1:
            raise ambiguity(name, len(ids))
        return next(iter(ids))

    def resolve(self, namespace: str, name: str) -> ModelId | None:
        """The model an ensemble step of ``name`` in ``namespace`` calls: the one in
        its own namespace, else the only one of that name, else None (Triton's
        ``DependencyGraph::FindNode`` with fuzzy matching)."""
        known = self._by_name.get(name, set())
        preferred = ModelId(namespace, name)
        if preferred in known:
            return preferred
        return next(iter(known)) if len(known) == 1 else None

    def bind_steps(
        self,
        entry: ModelEntry,
        config: ModelConfig,
        errors: dict[str, str],
        entries: Mapping[str, ModelEntry],
    ) -> None:
        """Set each step's ``model_namespace`` to the model it resolves to (Triton's
        ``ConnectDependencyGraph``); a load error of another namespace's model of
        the same name is no error of this ensemble."""
        bound: dict[str, ModelId] = {}
        missing: list[str] = []
        for step in composing_models(config):
            model_id = self.resolve(entry.model_id.namespace, step)
            if model_id is None:
                missing.append(step)
                continue
            bound[step] = model_id
            composing = entries.get(model_id)
            if composing is not None and composing.serving:
                errors.pop(step, None)
            elif step not in errors:
                errors[step] = (composing.reason if composing else "") or "it is not loaded"
        entry.unresolved = frozenset(missing)
        if missing:
            raise InvalidArgument(missing_models(entry.model_id, missing))
        for step_config in config.ensemble_scheduling.step:
            step_config.model_namespace = bound[step_config.model_name].namespace
