"""create_scheduler picks the scheduler a model configuration asks for, as Triton core
does: ensemble, sequence batcher, dynamic batcher, or the default scheduler."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from trionserve._generated import model_config_pb2 as mc
from trionserve.backends.ensemble import EnsemblePlan
from trionserve.core.errors import InternalError
from trionserve.observability.statistics import ModelStatistics
from trionserve.schedulers.default import DefaultScheduler
from trionserve.schedulers.dynamic_batch import DynamicBatchScheduler
from trionserve.schedulers.ensemble import EnsembleScheduler
from trionserve.schedulers.factory import create_scheduler
from trionserve.schedulers.sequence_batch import SequenceBatchScheduler

MODEL = """
    name: "m"
    max_batch_size: 4
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def config(extra: str = "") -> mc.ModelConfig:
    return text_format.Parse(MODEL + extra, mc.ModelConfig())


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("", DefaultScheduler),
        ("dynamic_batching { }", DynamicBatchScheduler),
        ("sequence_batching { }", SequenceBatchScheduler),
    ],
)
async def test_the_config_chooses_the_scheduler(extra, expected):
    scheduler = create_scheduler(config(extra), ModelStatistics("m", 1))
    assert type(scheduler) is expected


async def test_an_ensemble_gets_the_ensemble_scheduler_and_needs_its_plan():
    ensemble = config('platform: "ensemble"')
    with pytest.raises(InternalError, match="ensemble 'm' needs its plan"):
        create_scheduler(ensemble, ModelStatistics("m", 1))
    plan = EnsemblePlan(
        name="m",
        version=1,
        steps=(),
        inputs=("IN",),
        outputs=("OUT",),
        output_dims={"OUT": (1,)},
        batching=False,
        optional_inputs=frozenset(),
        producers=(),
        consumers={},
        streaming=False,
        max_inflight_requests=1,
    )
    scheduler = create_scheduler(ensemble, ModelStatistics("m", 1), plan=plan, inference=NoSteps())
    assert type(scheduler) is EnsembleScheduler
    assert scheduler.plan is plan


class NoSteps:
    """A StepService for an ensemble that is only built here, never run."""

    async def infer_stream(self, request, deliver, queued=None) -> None:
        raise AssertionError("no step runs in this test")
