"""Per-model-version inference statistics, as Triton's statistics extension reports them.

One :class:`ModelStatistics` per loaded model version (Triton core's
``InferenceStatsAggregator``, src/infer_stats.cc) counts what happened to its
requests and batches. The runtime records into it (the executor after each batch,
the schedulers when they reject, time out or drop a request); readers take the
plain counters: the statistics endpoints through :meth:`ModelStatistics.as_json`,
and Prometheus collectors, which read the same attributes at scrape time. Writes
happen on the Trio thread, except a batch's, which the instance's thread that
wrote its answers may count itself (see ``InstanceThread._answered``): every
write and every reader that reads more than one counter holds the version's
``lock``, so a reader sees each batch counted whole or not at all. Every
duration comes from Trio's clock (the instance's thread maps its own readings
onto it), so simulations on a virtual clock record virtual durations.
"""

from __future__ import annotations

import copy
import enum
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import trio

from trionserve.core.deferred import sweep_deferred
from trionserve.core.errors import TritonError
from trionserve.observability.quantiles import Summary, Target

if TYPE_CHECKING:  # metrics imports this module
    from trionserve._generated.model_config_pb2 import ModelConfig
    from trionserve.core.inference import InferenceRequest
    from trionserve.observability.custom_metrics import CustomMetrics
    from trionserve.observability.metrics import FirstResponseHistogram
    from trionserve.observability.trace.trace_file import Trace
    from trionserve.repository.repository import ModelId

NS_PER_S = 1_000_000_000

# Triton's summaries of a model (core src/metric_model_reporter.cc
# InitializeSummaries): request, queue and compute durations; with the response
# cache, cache hit and miss durations instead of the request's.
SUMMARY_DURATIONS = (
    "request_duration",
    "queue_duration",
    "compute_input_duration",
    "compute_infer_duration",
    "compute_output_duration",
)
CACHE_SUMMARY_DURATIONS = ("cache_hit_duration", "cache_miss_duration")


class FailureReason(enum.Enum):
    """Why a request failed, with the labels of Triton's failure metric."""

    REJECTED = "REJECTED"  # queue full, or its queue timeout expired
    CANCELED = "CANCELED"  # the client went away
    BACKEND = "BACKEND"  # the backend answered with an error or raised
    OTHER = "OTHER"  # anything else (unload, shutdown)


class ComputeTimes(NamedTuple):
    """How a backend split one batch's execution, in nanoseconds of its own clock.

    A backend instance may set ``compute_times`` to one of these at the end of each
    batch; the executor then reports the three phases as given. Backends that do
    not set it have the whole execution, as the executor measured it, counted as
    compute_infer.
    """

    input_ns: int
    infer_ns: int
    output_ns: int


@dataclass(slots=True)
class Duration:
    """A count and a cumulative duration, Triton's ``StatisticDuration``."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns

    def as_json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStatistics:
    """Executions of one batch size: each phase counted once per batch."""

    batch_size: int
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)

    def as_json(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "compute_input": self.compute_input.as_json(),
            "compute_infer": self.compute_infer.as_json(),
            "compute_output": self.compute_output.as_json(),
        }


class ModelStatistics:
    """The counters of one model version, with the meaning Triton gives them.

    - ``success``: requests answered with a response; duration from arrival to the
      end of their batch. ``queue`` and ``compute_*`` are counted for the same
      requests: time queued, and their batch's phases (once per request).
    - ``fail``: requests answered with an error, for any ``FailureReason``
      (``failures`` keeps the count per reason).
    - ``inference_count``: batch sizes of successful requests summed;
      ``execution_count``: batches the backend executed; ``batch_stats``: the
      executions per batch size.
    - ``last_inference``: wall-clock milliseconds of the last execution.
    """

    __slots__ = (
        "name",
        "version",
        "success",
        "fail",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
        "cache_hit",
        "cache_miss",
        "inference_count",
        "execution_count",
        "failures",
        "batch_stats",
        "traces",
        "first_response",
        "summaries",
        "_last_execution",
        "_wall_offset",
        "lock",
    )

    def __init__(self, name: str, version: int) -> None:
        self.name = name
        self.version = version
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.cache_hit = Duration()
        self.cache_miss = Duration()
        self.inference_count = 0
        self.execution_count = 0
        self.failures: dict[FailureReason, int] = {reason: 0 for reason in FailureReason}
        self.batch_stats: dict[int, BatchStatistics] = {}
        # Requests being traced -> their Trace (observability.trace): the executor
        # adds its compute timestamps to these; empty unless a request is sampled.
        self.traces: dict[InferenceRequest, Trace] = {}
        # Request-to-first-response histogram (observability.metrics), kept only
        # when the metrics ask for it (--metrics-config histogram_latencies=true).
        self.first_response: FirstResponseHistogram | None = None
        # Latency summaries by Triton's name (SUMMARY_DURATIONS), in microseconds,
        # kept only when the metrics ask for them (summary_latencies=true).
        self.summaries: dict[str, Summary] | None = None
        self._last_execution: float | None = None
        # Trio's clock has an arbitrary origin; this maps it to the wall clock once,
        # so recording never reads the wall clock.
        self._wall_offset = time.time() - trio.current_time()
        # Held by every write and by readers of more than one counter (see the
        # module docstring): an instance's thread may count a batch.
        self.lock = threading.Lock()

    def enable_summaries(self, targets: Sequence[Target], cache_enabled: bool) -> None:
        """Keep Triton's latency summaries with these quantiles from now on. A model
        with the response cache has no request summary (Triton leaves it out, its
        FIXME DLIS-4762) and has the cache hit and miss summaries."""
        names = [n for n in SUMMARY_DURATIONS if not (cache_enabled and n == "request_duration")]
        if cache_enabled:
            names += CACHE_SUMMARY_DURATIONS
        now = trio.current_time()
        self.summaries = {name: Summary(targets, now) for name in names}

    def _observe(self, durations: Sequence[tuple[str, int]]) -> None:
        summaries = self.summaries
        if summaries is None:
            return
        now = trio.current_time()
        for name, ns in durations:
            summary = summaries.get(name)
            if summary is not None:
                summary.observe(ns // 1000, now)

    # -- recording (the runtime) ------------------------------------------------

    def record_execution(
        self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int, end: float
    ) -> None:
        """One batch executed by the backend; ``end`` is Trio's clock at its end."""
        with self.lock:
            self.execution_count += 1
            self._last_execution = end
            stats = self.batch_stats.get(batch_size)
            if stats is None:
                stats = self.batch_stats[batch_size] = BatchStatistics(batch_size)
            stats.compute_input.add(input_ns)
            stats.compute_infer.add(infer_ns)
            stats.compute_output.add(output_ns)

    def record_success(
        self,
        batch_size: int,
        request_ns: int,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
    ) -> None:
        """One request answered with a response."""
        with self.lock:
            self._record_success(batch_size, request_ns, queue_ns, input_ns, infer_ns, output_ns)

    def _record_success(
        self,
        batch_size: int,
        request_ns: int,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
    ) -> None:
        """:meth:`record_success`, the lock held."""
        self.inference_count += batch_size
        self.success.add(request_ns)
        self.queue.add(queue_ns)
        self.compute_input.add(input_ns)
        self.compute_infer.add(infer_ns)
        self.compute_output.add(output_ns)
        if self.summaries is not None:
            self._observe(
                (
                    ("request_duration", request_ns),
                    ("queue_duration", queue_ns),
                    ("compute_input_duration", input_ns),
                    ("compute_infer_duration", infer_ns),
                    ("compute_output_duration", output_ns),
                )
            )

    def record_batch(
        self,
        requests: Sequence[InferenceRequest],
        outcomes: Sequence[object] | None,
        start: float,
        end: float,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
    ) -> None:
        """One batch the backend executed from ``start`` to ``end`` (Trio's clock),
        in one place: each request's success (``record_success``) or failure (an
        outcome that is a ``TritonError``; ``outcomes`` None: all succeeded), then
        the execution if any request succeeded (``record_execution``). Written
        out, as it runs once per batch (on the event loop, or the thread of an
        instance that wrote the batch's answers: Trio's clock is not read here)."""
        with self.lock:
            batch_size = 0
            succeeded = False
            summaries = self.summaries
            for index, request in enumerate(requests):
                size = request.batch_size or 1
                batch_size += size
                if not request.collect_stats:
                    continue  # a sequence batcher's null request: in the batch size only
                arrival = request.arrival_time
                request_ns = int((end - arrival) * NS_PER_S)
                if request_ns < 0:
                    request_ns = 0
                if outcomes is not None and isinstance(outcomes[index], TritonError):
                    self.fail.add(request_ns)  # (record_failure: the lock is held)
                    self.failures[FailureReason.BACKEND] += 1
                    continue
                if summaries is not None:
                    self._record_success(
                        size,
                        request_ns,
                        max(0, int((start - arrival) * NS_PER_S)),
                        input_ns,
                        infer_ns,
                        output_ns,
                    )
                else:
                    queue_ns = int((start - arrival) * NS_PER_S)
                    self.inference_count += size
                    duration = self.success
                    duration.count += 1
                    duration.ns += request_ns
                    duration = self.queue
                    duration.count += 1
                    duration.ns += queue_ns if queue_ns > 0 else 0
                    duration = self.compute_input
                    duration.count += 1
                    duration.ns += input_ns
                    duration = self.compute_infer
                    duration.count += 1
                    duration.ns += infer_ns
                    duration = self.compute_output
                    duration.count += 1
                    duration.ns += output_ns
                succeeded = True
            if not succeeded:
                return
            # record_execution, written out.
            self.execution_count += 1
            self._last_execution = end
            stats = self.batch_stats.get(batch_size)
            if stats is None:
                stats = self.batch_stats[batch_size] = BatchStatistics(batch_size)
            duration = stats.compute_input
            duration.count += 1
            duration.ns += input_ns
            duration = stats.compute_infer
            duration.count += 1
            duration.ns += infer_ns
            duration = stats.compute_output
            duration.count += 1
            duration.ns += output_ns

    def record_cache_hit(self, request_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache: a success, not an inference."""
        with self.lock:
            self.success.add(request_ns)
            self.cache_hit.add(lookup_ns)
        if self.summaries is not None:
            self._observe((("cache_hit_duration", lookup_ns),))

    def record_cache_miss(self, lookup_ns: int) -> None:
        """A cache lookup that missed; ``lookup_ns`` covers the lookup and the insert."""
        with self.lock:
            self.cache_miss.add(lookup_ns)
        if self.summaries is not None:
            self._observe((("cache_miss_duration", lookup_ns),))

    def record_failure(self, request_ns: int, reason: FailureReason) -> None:
        """One request answered with an error."""
        with self.lock:
            self.fail.add(request_ns)
            self.failures[reason] += 1

    # -- reading (frontends, metrics) ---------------------------------------------

    @property
    def last_inference(self) -> int:
        """Milliseconds since the epoch of the last execution; 0 before the first."""
        if self._last_execution is None:
            return 0
        return int((self._last_execution + self._wall_offset) * 1000)

    def as_json(self) -> dict:
        """This version's entry of Triton's ``model_stats`` list (HTTP JSON shape)."""
        with self.lock:
            return self._as_json()

    def _as_json(self) -> dict:
        return {
            "name": self.name,
            "version": str(self.version),
            "last_inference": self.last_inference,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_json(),
                "fail": self.fail.as_json(),
                "queue": self.queue.as_json(),
                "compute_input": self.compute_input.as_json(),
                "compute_infer": self.compute_infer.as_json(),
                "compute_output": self.compute_output.as_json(),
                "cache_hit": self.cache_hit.as_json(),
                "cache_miss": self.cache_miss.as_json(),
            },
            "response_stats": {},
            "batch_stats": [self.batch_stats[size].as_json() for size in sorted(self.batch_stats)],
            "memory_usage": [],
        }


def to_ns(seconds: float) -> int:
    """Trio clock seconds to integer nanoseconds, never negative."""
    return max(0, int(seconds * NS_PER_S))


def merge_model_stats(parts: Sequence[Sequence[dict]]) -> list[dict]:
    """Several servers' ``model_stats`` lists (HTTP JSON shape) as one, the way one
    server would have counted all their requests (the workers of ``--workers``).

    Entries of the same model name and version are added up: every count and
    duration summed, ``last_inference`` the latest, ``batch_stats`` summed per
    batch size, ``response_stats`` per key; ``memory_usage`` entries are kept
    side by side. The result is ordered by name, then version, as one server
    orders it.
    """
    merged: dict[tuple[str, str], dict] = {}
    for entries in parts:
        for entry in entries:
            key = (entry["name"], entry["version"])
            if key in merged:
                _add_entry(merged[key], entry)
            else:
                merged[key] = copy.deepcopy(entry)
    return [merged[key] for key in sorted(merged, key=_order)]


def _order(key: tuple[str, str]) -> tuple[str, int, str]:
    name, version = key
    return (name, int(version), "") if version.isdigit() else (name, -1, version)


def _add_entry(total: dict, entry: dict) -> None:
    total["last_inference"] = max(total["last_inference"], entry["last_inference"])
    total["inference_count"] += entry["inference_count"]
    total["execution_count"] += entry["execution_count"]
    _add_counts(total["inference_stats"], entry["inference_stats"])
    _add_counts(total["response_stats"], entry["response_stats"])
    by_size = {batch["batch_size"]: batch for batch in total["batch_stats"]}
    for batch in entry["batch_stats"]:
        if batch["batch_size"] in by_size:
            _add_counts(by_size[batch["batch_size"]], batch)
        else:
            by_size[batch["batch_size"]] = copy.deepcopy(batch)
    total["batch_stats"] = [by_size[size] for size in sorted(by_size)]
    total["memory_usage"] = [*total["memory_usage"], *entry["memory_usage"]]


def _add_counts(total: dict, more: dict) -> None:
    """Add the ``{"count", "ns"}`` durations of ``more`` into ``total``."""
    for name, value in more.items():
        if name == "batch_size":
            continue
        if isinstance(value, dict):
            if name in total:
                _add_counts(total[name], value)
            else:
                total[name] = copy.deepcopy(value)
        else:
            total[name] = total.get(name, 0) + value


# -- what the readers read of the registry ---------------------------------------------
#
# The registry and its model versions are actors (trionserve.actors), which record
# into this package; the statistics endpoints and the metrics collectors read them
# through these views, so nothing here imports upward.


class ObservedVersion(Protocol):
    """A loaded model version, as its readers see it (actors' ``ModelVersion``)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def namespace(self) -> str: ...
    @property
    def config(self) -> ModelConfig: ...
    @property
    def state(self) -> enum.Enum: ...
    @property
    def statistics(self) -> ModelStatistics: ...


class ObservedModel(Protocol):
    """One model's serving versions (actors' ``ModelEntry``)."""

    @property
    def model_id(self) -> ModelId: ...
    @property
    def versions(self) -> Mapping[int, ObservedVersion]: ...


class ObservedRegistry(Protocol):
    """The models a server knows (actors' ``ModelRegistry``)."""

    @property
    def custom_metrics(self) -> CustomMetrics:
        """The metric families its models define."""
        ...

    def entries(self) -> Mapping[str, ObservedModel]: ...
    def entry(self, name: str, namespace: str | None = None) -> ObservedModel | None: ...
    def route(self, name: str, version: int | None) -> ObservedVersion: ...


def statistics_json(registry: ObservedRegistry, name: str | None, version: int | None) -> dict:
    """The statistics extension's answer for ``name``/``version`` (HTTP JSON shape);
    raises as :func:`select_statistics` does."""
    return {"model_stats": [s.as_json() for s in select_statistics(registry, name, version)]}


def select_statistics(
    registry: ObservedRegistry, name: str | None, version: int | None
) -> list[ModelStatistics]:
    """The statistics a request for ``name``/``version`` covers, like Triton.

    No name: every READY version of every model. A name alone: every READY version
    of that model. Name and version: that version. Unknown names and versions raise
    the registry's NotFound / Unavailable errors.
    """
    sweep_deferred()  # answers written by instances' threads are counted first
    if name is None:
        selected: list[ModelStatistics] = []
        for entry in sorted(registry.entries().values(), key=lambda e: e.model_id.order()):
            selected.extend(_ready_versions(entry))
        return selected
    if version is not None:
        return [registry.route(name, version).statistics]
    model = registry.route(name, None)  # raises when the model has no READY version
    return _ready_versions(registry.entry(name, model.namespace))


def _ready_versions(entry: ObservedModel | None) -> list[ModelStatistics]:
    if entry is None:
        return []
    return [
        entry.versions[number].statistics
        for number in sorted(entry.versions)
        if entry.versions[number].state.value == "READY"
    ]
