"""CKMS quantiles over a sliding window (trionserve.observability.quantiles), and the
summaries the statistics keep with them."""

from __future__ import annotations

import bisect
import math
import random

import pytest

from trionserve.observability.aggregate import merge_expositions
from trionserve.observability.quantiles import (
    DEFAULT_TARGETS,
    CKMSQuantiles,
    Summary,
    TimeWindowQuantiles,
    parse_quantiles,
)
from trionserve.observability.statistics import ModelStatistics


def rank_error(data_sorted: list[float], value: float, q: float) -> float:
    """How far, as a share of n, the ranks ``value`` may have are from q * n."""
    n = len(data_sorted)
    low = bisect.bisect_left(data_sorted, value)
    high = bisect.bisect_right(data_sorted, value)
    target = q * n
    if low <= target <= high:
        return 0.0
    return min(abs(low - target), abs(high - target)) / n


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: rng.random(),
        lambda rng: rng.lognormvariate(6, 1.5),  # latencies: a long tail
        lambda rng: float(rng.randrange(20)),  # many equal values
    ],
)
def test_each_target_within_its_error(make):
    rng = random.Random(7)
    data = [make(rng) for _ in range(50_000)]
    estimator = CKMSQuantiles(DEFAULT_TARGETS)
    for x in data:
        estimator.insert(x)
    data.sort()
    for q, error in DEFAULT_TARGETS:
        assert rank_error(data, estimator.get(q), q) <= error + 1 / len(data), q
    # Memory is bounded by the errors, not by the observations.
    assert len(estimator) < 2_000


def test_sorted_and_reversed_streams_hold_the_errors_and_the_bound():
    for data in (list(range(20_000)), list(range(20_000, 0, -1))):
        estimator = CKMSQuantiles(((0.5, 0.05), (0.99, 0.001)))
        for x in data:
            estimator.insert(float(x))
        ordered = sorted(float(x) for x in data)
        assert rank_error(ordered, estimator.get(0.5), 0.5) <= 0.05
        assert rank_error(ordered, estimator.get(0.99), 0.99) <= 0.001 + 1 / len(data)
        assert len(estimator) < 2_000


def test_empty_is_nan_and_few_values_are_kept_whole():
    estimator = CKMSQuantiles(DEFAULT_TARGETS)
    assert math.isnan(estimator.get(0.5))
    for x in (5.0, 1.0, 4.0, 2.0, 3.0):
        estimator.insert(x)
    # The rank q * n truncated, as prometheus-cpp's CKMSQuantiles::get does:
    # 2.5 -> 2, 4.5 -> 4, 4.995 -> 4.
    assert estimator.get(0.5) == 2.0
    assert estimator.get(0.9) == 4.0
    assert estimator.get(0.999) == 4.0
    estimator.reset()
    assert math.isnan(estimator.get(0.5))


def test_window_forgets_what_is_older_than_max_age():
    # Five buckets of 12 s each: a value stays readable 48 to 60 s.
    window = TimeWindowQuantiles(((0.5, 0.01),), now=0.0, max_age=60.0, age_buckets=5)
    for _ in range(100):
        window.insert(1.0, now=0.0)
    assert window.get(0.5, now=47.0) == 1.0
    for _ in range(300):
        window.insert(100.0, now=50.0)
    assert window.get(0.5, now=50.0) == 100.0  # both are in the window, 100 the median
    for _ in range(300):
        window.insert(1.0, now=50.0)
    assert window.get(0.5, now=59.0) in (1.0, 100.0)
    # At 61 s the values of 0 s are gone; those of 50 s stay, half 1 and half 100.
    assert window.get(0.1, now=61.0) == 1.0 and window.get(0.9, now=61.0) == 100.0
    assert window.get(0.5, now=61.0 + 60.0) != window.get(0.5, now=61.0 + 60.0)  # NaN


def test_summary_counts_everything_and_windows_the_quantiles():
    summary = Summary(((0.5, 0.05), (0.9, 0.01)), now=0.0)
    for x in range(1, 101):
        summary.observe(float(x), now=1.0)
    assert summary.count == 100 and summary.sum == 5050.0
    (q50, v50), (q90, v90) = summary.quantiles(now=2.0)
    assert (q50, q90) == (0.5, 0.9)
    assert 45 <= v50 <= 55 and 89 <= v90 <= 91
    later = summary.quantiles(now=200.0)
    assert all(math.isnan(v) for _, v in later)
    assert summary.count == 100  # count and sum are for all time, as Triton's


def test_parse_quantiles():
    assert parse_quantiles("0.5:0.05,0.9:0.01") == ((0.5, 0.05), (0.9, 0.01))
    assert parse_quantiles("0.1:0.0.1") == ((0.1, 0.0),)  # std::stod reads "0.0"
    for bad in ("0.5", "x:0.1", "0.5:y", "0:0.1", "1.5:0.1", "0.5:1"):
        with pytest.raises(ValueError, match="summary_quantiles"):
            parse_quantiles(bad)


async def test_statistics_keep_tritons_summaries():
    plain = ModelStatistics("m", 1)
    assert plain.summaries is None
    plain.record_success(1, 5_000, 1_000, 100, 2_000, 300)  # no summaries: nothing kept
    plain.enable_summaries(DEFAULT_TARGETS, cache_enabled=False)
    plain.record_success(1, 5_999, 1_000, 100, 2_000, 300)
    assert set(plain.summaries) == {
        "request_duration",
        "queue_duration",
        "compute_input_duration",
        "compute_infer_duration",
        "compute_output_duration",
    }
    request = plain.summaries["request_duration"]
    assert (request.count, request.sum) == (1, 5.0)  # microseconds, rounded down
    cached = ModelStatistics("c", 1)
    cached.enable_summaries(DEFAULT_TARGETS, cache_enabled=True)
    assert "request_duration" not in cached.summaries  # Triton's DLIS-4762
    cached.record_cache_hit(4_000, 2_000)
    cached.record_cache_miss(3_000)
    assert cached.summaries["cache_hit_duration"].sum == 2.0
    assert cached.summaries["cache_miss_duration"].sum == 3.0


def test_workers_summaries_merge_to_the_largest_quantile_and_summed_counts():
    def text(p50: str, count: int, total: float) -> str:
        name = "nv_inference_queue_summary_us"
        return (
            f"# HELP {name} q\n# TYPE {name} summary\n"
            f'{name}{{model="m",version="1",quantile="0.5"}} {p50}\n'
            f'{name}_count{{model="m",version="1"}} {count}\n'
            f'{name}_sum{{model="m",version="1"}} {total}\n'
        )

    (family,) = merge_expositions([text("NaN", 0, 0), text("40", 3, 100), text("25", 2, 60)])
    values = {(s.name, s.labels.get("quantile")): s.value for s in family.samples}
    assert values[("nv_inference_queue_summary_us", "0.5")] == 40
    assert values[("nv_inference_queue_summary_us_count", None)] == 5
    assert values[("nv_inference_queue_summary_us_sum", None)] == 160
