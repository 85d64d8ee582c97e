"""Quantiles of a stream of latencies over a sliding time window, for Prometheus summaries.

Triton's summary metrics (``--metrics-config summary_latencies=true``) are
prometheus-cpp ``Summary`` objects: each keeps a count, a sum, and the targeted
quantiles of the observations of the last ``max_age`` (60 s) in a ring of
``age_buckets`` (5) estimators that are cleared one after the other, each every
``max_age / age_buckets``, so the estimator read always covers between 48 and 60
seconds. Each estimator is the CKMS algorithm (Cormode, Korn, Muthukrishnan,
Srivastava, "Effective Computation of Biased Quantiles over Data Streams", ICDE
2005): it keeps a sorted sample of (value, g, delta) tuples whose size is bounded
by the targets' errors, not by the number of observations, and answers each
target quantile ``q`` within its error ``e`` (a value whose rank is within
``e * n`` of ``q * n``). prometheus-client's Summary has no quantiles, hence this
module. Time is given by the caller (Trio's clock on the request path), so a
virtual clock drives it in tests.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

# (quantile, allowed error), e.g. (0.99, 0.001): the 99th percentile within 0.1 %
# of rank. Triton's defaults (core src/metric_model_reporter.h, quantiles_).
Target = tuple[float, float]
DEFAULT_TARGETS: tuple[Target, ...] = (
    (0.5, 0.05),
    (0.9, 0.01),
    (0.95, 0.001),
    (0.99, 0.001),
    (0.999, 0.001),
)
# prometheus-cpp's Summary defaults (Triton passes none of its own).
DEFAULT_MAX_AGE = 60.0
DEFAULT_AGE_BUCKETS = 5
# Observations buffered before they are merged into the sample, in one sorted
# batch (prometheus-cpp takes 500; a larger batch costs less per observation here).
_BUFFER = 2000


class CKMSQuantiles:
    """Targeted quantiles of every value inserted since the last ``reset``.

    The sample is three numpy arrays (values, g, delta) kept sorted by value;
    values are buffered and merged in sorted batches, and the error allowed at
    each rank is computed for a whole batch at once, so an observation costs a
    list append and its share of a batch (about a microsecond). Memory: at most
    ``_BUFFER`` pending values plus the sample, which ``_compress`` keeps to
    O(log(e n) / e) tuples for the smallest error e (an error of 0 keeps every
    value).
    """

    __slots__ = ("_targets", "_count", "_values", "_g", "_delta", "_buffer")

    def __init__(self, targets: Sequence[Target]) -> None:
        # (q, the error's slope below rank q * n, its slope above it)
        self._targets = tuple((q, 2.0 * e / (1.0 - q), 2.0 * e / q) for q, e in targets)
        self.reset()

    def reset(self) -> None:
        self._count = 0
        self._values = np.empty(0, dtype=np.float64)
        self._g = np.empty(0, dtype=np.int64)  # rank of a tuple minus the one before's
        self._delta = np.empty(0, dtype=np.int64)  # how far above that rank it may be
        self._buffer: list[float] = []

    def insert(self, value: float) -> None:
        self._buffer.append(value)
        if len(self._buffer) >= _BUFFER:
            self._flush()

    def insert_sorted(self, batch: np.ndarray) -> None:
        """Merge a sorted array of values (the window's shared buffer) at once."""
        self._flush()
        if len(batch):
            self._merge(batch)
            self._compress()

    def get(self, q: float) -> float:
        """The value at quantile ``q`` (one of the targets); NaN before any value."""
        self._flush()
        values = self._values
        if not len(values):
            return math.nan
        wanted = int(q * self._count)  # prometheus-cpp truncates the rank
        bound = wanted + float(self._allowed(np.array([wanted]), self._count)[0]) / 2
        rank_before = np.cumsum(self._g)[:-1]  # rank of the tuple before each from 1 on
        beyond = np.flatnonzero(rank_before + self._g[1:] + self._delta[1:] > bound)
        return float(values[beyond[0]] if len(beyond) else values[-1])

    def _allowed(self, ranks: np.ndarray, n: int | np.ndarray) -> np.ndarray:
        """How much uncertainty a tuple at each rank may carry (the paper's f(r, n));
        ``n`` is the count, one for all ranks or one per rank."""
        r = ranks.astype(np.float64)
        allowed = np.asarray(n, dtype=np.float64) + 1.0
        allowed = np.broadcast_to(allowed, r.shape).copy()
        for q, below, above in self._targets:
            error = np.where(r <= q * n, below * (n - r), above * r)
            np.minimum(allowed, error, out=allowed)
        return allowed

    def _flush(self) -> None:
        if self._buffer:
            batch = np.sort(np.array(self._buffer, dtype=np.float64))
            self._buffer = []
            self._merge(batch)
            self._compress()

    def _merge(self, batch: np.ndarray) -> None:
        """Insert the sorted ``batch``: a value with old tuples on both sides has the
        uncertainty its rank allows; one below or above all of them is exact."""
        old = self._values
        at = np.searchsorted(old, batch, side="left")  # insert before equal old values
        order = np.arange(len(batch))
        ranks = np.concatenate(([0], np.cumsum(self._g)))[at] + order
        counts = self._count + order + 1
        delta = np.maximum(np.floor(self._allowed(ranks, counts)).astype(np.int64) - 1, 0)
        delta[(at == 0) | (at == len(old))] = 0
        self._values = np.insert(old, at, batch)
        self._g = np.insert(self._g, at, 1)
        self._delta = np.insert(self._delta, at, delta)
        self._count += len(batch)

    def _compress(self) -> None:
        """Fold a tuple into its successor wherever the successor's uncertainty
        still fits the error allowed at its rank; the smallest value is kept."""
        values = self._values
        size = len(values)
        if size < 3:
            return
        ranks = np.concatenate(([0], np.cumsum(self._g)[:-1]))  # rank before each
        # Tuple i folds into its successor while g[i] + the successor's g and
        # delta stay within what rank r_i allows: room[i] = f(r_i) - g[i].
        room = (self._allowed(ranks, self._count) - self._g).tolist()
        g = self._g.tolist()
        delta = self._delta.tolist()
        keep = [size - 1]
        kept_g = g[-1]
        kept_delta = delta[-1]
        for i in range(size - 2, 0, -1):
            if kept_g + kept_delta <= room[i]:
                kept_g += g[i]
            else:
                g[keep[-1]] = kept_g
                keep.append(i)
                kept_g = g[i]
                kept_delta = delta[i]
        g[keep[-1]] = kept_g
        keep.append(0)
        keep.reverse()
        self._values = values[keep]
        self._g = np.array(g, dtype=np.int64)[keep]
        self._delta = self._delta[keep]

    def __len__(self) -> int:
        """Tuples held, pending values included (what bounds its memory)."""
        return len(self._values) + len(self._buffer)


class TimeWindowQuantiles:
    """CKMS quantiles of the values inserted in the last ``max_age`` seconds.

    A ring of ``age_buckets`` estimators all take every value; every
    ``max_age / age_buckets`` seconds the oldest is cleared and becomes the newest,
    and reads come from the oldest one still whole (prometheus-cpp's
    ``TimeWindowQuantiles``). Values are buffered once for the whole ring and
    sorted once per batch. ``now`` is the caller's clock, in seconds.
    """

    __slots__ = ("_ring", "_current", "_period", "_rotated", "_pending")

    def __init__(
        self,
        targets: Sequence[Target],
        now: float,
        max_age: float = DEFAULT_MAX_AGE,
        age_buckets: int = DEFAULT_AGE_BUCKETS,
    ) -> None:
        self._ring = [CKMSQuantiles(targets) for _ in range(age_buckets)]
        self._current = 0
        self._period = max_age / age_buckets
        self._rotated = now
        self._pending: list[float] = []

    def insert(self, value: float, now: float) -> None:
        if now - self._rotated > self._period:
            self._rotate(now)
        self._pending.append(value)
        if len(self._pending) >= _BUFFER:
            self._flush()

    def get(self, q: float, now: float) -> float:
        self._rotate(now)
        self._flush()
        return self._ring[self._current].get(q)

    def _flush(self) -> None:
        if self._pending:
            batch = np.sort(np.array(self._pending, dtype=np.float64))
            self._pending = []
            for bucket in self._ring:
                bucket.insert_sorted(batch)

    def _rotate(self, now: float) -> None:
        elapsed = now - self._rotated
        if elapsed <= self._period:
            return
        self._flush()  # what came before the rotation belongs to every bucket
        if elapsed > self._period * len(self._ring):  # idle for a whole window
            for bucket in self._ring:
                bucket.reset()
            self._rotated = now
            return
        while now - self._rotated > self._period:
            self._ring[self._current].reset()
            self._current = (self._current + 1) % len(self._ring)
            self._rotated += self._period

    def __len__(self) -> int:
        return len(self._pending) + sum(len(bucket) for bucket in self._ring)


class Summary:
    """One summary of Triton's: a count and a sum since start, and the quantiles
    of the last ``max_age`` seconds."""

    __slots__ = ("targets", "count", "sum", "_window")

    def __init__(self, targets: Sequence[Target], now: float) -> None:
        self.targets = tuple(targets)
        self.count = 0
        self.sum = 0.0
        self._window = TimeWindowQuantiles(self.targets, now)

    def observe(self, value: float, now: float) -> None:
        self.count += 1
        self.sum += value
        self._window.insert(value, now)

    def quantiles(self, now: float) -> list[tuple[float, float]]:
        """(quantile, value) for each target, NaN where the window is empty."""
        return [(q, self._window.get(q, now)) for q, _ in self.targets]


# What std::stod reads of a string: its leading decimal number.
_LEADING_FLOAT = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def parse_quantiles(text: str) -> tuple[Target, ...]:
    """``--metrics-config summary_quantiles=<q>:<error>[,<q>:<error>...]``.

    Each number is read as Triton reads it (core src/metric_model_reporter.cc
    ParseQuantiles, ``std::stod``: the leading number of the text, so ``0.0.1``
    is 0.0). Triton logs and skips a pair with no number at all; here that, or a
    quantile outside (0, 1) or an error outside [0, 1), is an error naming the
    pair, since a summary silently missing a quantile misleads. An error of 0
    keeps every observation of the window (exact quantiles). Raises ValueError.
    """
    targets: list[Target] = []
    for pair in text.split(","):
        quantile, colon, error = pair.partition(":")
        q_match, e_match = _LEADING_FLOAT.match(quantile), _LEADING_FLOAT.match(error)
        if not colon or q_match is None or e_match is None:
            raise ValueError(
                "--metrics-config summary_quantiles: expected <quantile>:<error> pairs "
                f"separated by ',', got '{pair}'"
            )
        q, e = float(q_match.group()), float(e_match.group())
        if not 0.0 < q < 1.0 or not 0.0 <= e < 1.0:
            raise ValueError(
                "--metrics-config summary_quantiles: a quantile must be between 0 and 1 "
                f"and its error at least 0 and below 1, got '{pair}'"
            )
        targets.append((q, e))
    return tuple(targets)
