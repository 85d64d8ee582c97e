"""merge_model_stats: several servers' statistics added up as one server counts them."""

from __future__ import annotations

import copy

import pytest
import trio

from trionserve.core.errors import InvalidArgument
from trionserve.observability.statistics import FailureReason, ModelStatistics, merge_model_stats
from trionserve.workers.statistics import statistics_query


def _record(stats: ModelStatistics, batches: list[tuple[int, float]]) -> None:
    """Executions of ``(batch size, end time)``, each request a success."""
    for size, end in batches:
        stats.record_execution(size, 10 * size, 100 * size, 1 * size, end)
        for _ in range(size):
            stats.record_success(1, 500, 50, 10, 100, 1)


async def test_merged_statistics_equal_one_server_counting_everything():
    first, second, together = (ModelStatistics("m", 1) for _ in range(3))
    first_batches = [(1, 1.0), (4, 2.0)]
    second_batches = [(4, 3.0), (2, 5.0), (1, 4.0)]
    _record(first, first_batches)
    _record(second, second_batches)
    _record(together, first_batches + second_batches)
    second.record_failure(700, FailureReason.BACKEND)
    together.record_failure(700, FailureReason.BACKEND)
    second.record_cache_miss(30)
    together.record_cache_miss(30)

    (merged,) = merge_model_stats([[first.as_json()], [second.as_json()]])

    expected = together.as_json()
    # The latest of the two (each maps Trio's clock to the wall clock on its own).
    assert merged.pop("last_inference") == max(first.last_inference, second.last_inference)
    expected.pop("last_inference")
    assert merged == expected
    assert [b["batch_size"] for b in merged["batch_stats"]] == [1, 2, 4]
    assert merged["batch_stats"][2]["compute_infer"] == {"count": 2, "ns": 800}


async def test_entries_of_other_models_and_versions_are_kept_apart_and_ordered():
    def entry(name: str, version: str, count: int) -> dict:
        stats = ModelStatistics(name, int(version))
        for _ in range(count):
            stats.record_success(1, 1, 1, 1, 1, 1)
        return stats.as_json()

    merged = merge_model_stats(
        [
            [entry("b", "1", 1), entry("b", "10", 2)],
            [entry("a", "3", 4), entry("b", "2", 8), entry("b", "1", 16)],
            [],
        ]
    )
    assert [(e["name"], e["version"], e["inference_count"]) for e in merged] == [
        ("a", "3", 4),
        ("b", "1", 17),
        ("b", "2", 8),
        ("b", "10", 2),
    ]


def test_the_inputs_are_left_as_they_were():
    async def make() -> list[dict]:
        stats = ModelStatistics("m", 1)
        _record(stats, [(2, trio.current_time())])
        return [stats.as_json()]

    one, two = trio.run(make), trio.run(make)
    before = copy.deepcopy(one)
    merge_model_stats([one, two])
    assert one == before
    assert one[0]["batch_stats"][0]["compute_infer"]["count"] == 1


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b'{"name": "m"}',
        b'{"name": 3, "version": null}',
        b'{"name": "m", "version": "1"}',
    ],
)
def test_a_malformed_private_statistics_query_is_invalid_argument(body):
    """The workers' private statistics routes answer a bad query with a 4xx, not a 500."""
    with pytest.raises(InvalidArgument):
        statistics_query(body)


def test_a_private_statistics_query():
    assert statistics_query(b'{"name": "m", "version": 2}') == ("m", 2)
    assert statistics_query(b'{"name": null, "version": null}') == (None, None)


async def test_response_statistics_are_added_per_key():
    def entry(stats: dict) -> dict:
        value = ModelStatistics("d", 1).as_json()
        value["response_stats"] = stats
        return value

    one = {"0": {"compute_infer": {"count": 1, "ns": 10}, "success": {"count": 1, "ns": 20}}}
    two = {
        "0": {"compute_infer": {"count": 2, "ns": 30}, "success": {"count": 2, "ns": 40}},
        "1": {"success": {"count": 5, "ns": 50}},
    }
    (merged,) = merge_model_stats([[entry(one)], [entry(two)]])
    assert merged["response_stats"] == {
        "0": {"compute_infer": {"count": 3, "ns": 40}, "success": {"count": 3, "ns": 60}},
        "1": {"success": {"count": 5, "ns": 50}},
    }
    assert two["1"] == {"success": {"count": 5, "ns": 50}}  # inputs untouched
