"""create_scheduler: the scheduler a model configuration asks for.

As in Triton core: an ensemble gets the ensemble scheduler (``EnsembleModel::Create``),
and ``TritonModel::SetConfiguredScheduler`` (backend_model.cc) gives
``sequence_batching`` the sequence batcher, ``dynamic_batching`` the dynamic batcher,
anything else the default scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trionserve.backends.ensemble import EnsemblePlan
from trionserve.core.errors import InternalError
from trionserve.observability.statistics import ModelStatistics
from trionserve.schedulers.default import DefaultScheduler
from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler
from trionserve.schedulers.ensemble import EnsembleScheduler, StepService
from trionserve.schedulers.scheduler import Scheduler
from trionserve.schedulers.sequence_batch import SequenceBatchScheduler
from trionserve.schedulers.sequence_state import StateSpec

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig


def create_scheduler(
    config: ModelConfig,
    statistics: ModelStatistics,
    *,
    plan: EnsemblePlan | None = None,
    inference: StepService | None = None,
    states: list[StateSpec] | None = None,
) -> Scheduler:
    """The scheduler for one model version.

    ``plan`` and ``inference`` are the ensemble's steps and the service that runs
    them (required for an ensemble); ``states`` are the implicit sequence states
    read at load (sequence batching only).
    """
    if config.platform == "ensemble":
        if plan is None or inference is None:
            raise InternalError(f"ensemble '{config.name}' needs its plan and an inference service")
        # No instances: the scheduler sends each step to its composing model.
        return EnsembleScheduler(plan, inference, statistics)
    if config.HasField("sequence_batching"):
        return SequenceBatchScheduler(config, statistics, states=states or [])
    if config.HasField("dynamic_batching"):
        return DynamicBatchScheduler(config, statistics)
    return DefaultScheduler(statistics=statistics)
