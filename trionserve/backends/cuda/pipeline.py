"""The pipelined executor of an instance that computes on a device of its own (a GPU).

A batch runs in three steps on its instance's thread
(:class:`~trionserve.backends.instance_thread.InstanceThread`): ``stage`` gathers
its inputs into the instance's reusable host buffers (pinned on a GPU:
:func:`pinned_bytes`) and starts their copy to the device; ``launch`` starts the
computation; ``finish`` waits for it and builds the responses. When ``launch``
returns before the device is done (``overlaps``), the thread stages the next batch
before it finishes the current one, so the next batch's gather and copy overlap the
current batch's compute, and its executor
(:class:`~trionserve.actors.executor.InstanceExecutor`) takes up to
``PIPELINE_DEPTH`` batches at once. Graph replay, where a config asks for CUDA
graphs, is inside ``launch`` (:mod:`trionserve.backends.cuda.graphs`).

Triton's counterpart is spread over core (src/rate_limiter.cc: two payloads per
instance) and each backend's instance (pytorch_backend, tensorrt_backend: inputs
collected into pinned buffers, copied on the instance's stream, outputs read back
when the stream's events say so). The PyTorch and TensorRT instances are staged;
ONNX Runtime's instance is not (its ``run`` returns when the batch is done, so
there is nothing to overlap: it gathers into its :class:`HostBuffers` within one
``execute``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from trionserve.backends.base import ExecuteResult, TimedBackendInstance
from trionserve.core.inference import InferenceRequest

# Batches of an instance whose device computes on its own (a GPU: ``overlaps``)
# in flight at once: one computing, the next one taken and staged meanwhile
# (Triton's dynamic batcher prefetches two payloads per instance: core
# src/rate_limiter.cc PayloadSlotAvailable). A CPU instance has one: its thread
# could not start the next batch any sooner, and the batcher goes on gathering
# requests into that batch while the current one runs (taken early, batches of
# the small CNN at c=8 shrank from 3.9 to 2.7 requests and throughput 0.8x).
PIPELINE_DEPTH = 2


@runtime_checkable
class StagedBackendInstance(TimedBackendInstance, Protocol):
    """A timed instance whose batches run in three steps, so that its thread can
    prepare the next batch while the current one computes (see
    :mod:`trionserve.backends.instance_thread`); ``execute`` stays for callers that
    run one batch (warmup).

    ``stage(requests)`` gathers the inputs into the instance's reusable host
    buffers (pinned on a GPU) and starts their copy to the device, returning a
    handle; ``launch(requests, handle)`` starts the computation and returns the
    handle ``finish(requests, handle)`` takes to wait for it and build one
    response or error per request, after which ``compute_times`` holds this
    batch's phases. ``overlaps`` says whether ``launch`` returns before the device
    is done (a GPU instance): only then is the next batch staged before the
    current one finishes. Two staged batches may be in flight at once, so
    ``stage`` must not reuse the buffers of the batch before it.
    """

    overlaps: bool

    def stage(self, requests: list[InferenceRequest]) -> object: ...

    def launch(self, requests: list[InferenceRequest], staged: object) -> object: ...

    def finish(self, requests: list[InferenceRequest], launched: object) -> ExecuteResult: ...


class PipelineJob(Protocol):
    """What the pipeline reads and writes of one batch on its way through an
    instance's thread (:class:`~trionserve.backends.instance_thread.Job`)."""

    requests: list[InferenceRequest]
    staged: object
    results: ExecuteResult | None
    error: Exception | None


class Pipeline:
    """The three steps of a staged instance's batches, as its thread runs them: a
    step that raises sets the job's ``error`` and the steps after it are skipped,
    so every job ends with ``results`` or ``error``."""

    def __init__(self, instance: StagedBackendInstance) -> None:
        self.instance = instance
        # Whether the next batch is staged before the current one finishes.
        self.overlaps = bool(instance.overlaps)

    def stage(self, job: PipelineJob) -> None:
        try:
            job.staged = self.instance.stage(job.requests)
        except Exception as exc:
            job.error = exc

    def launch(self, job: PipelineJob) -> None:
        try:
            job.staged = self.instance.launch(job.requests, job.staged)
        except Exception as exc:
            job.error = exc

    def finish(self, job: PipelineJob) -> None:
        try:
            job.results = self.instance.finish(job.requests, job.staged)
        except Exception as exc:
            job.error = exc


def _host_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


class HostBuffers:
    """One reusable host buffer per input, grown to the largest batch seen.

    ``allocate(nbytes)`` makes a byte buffer (pinned host memory for a GPU
    instance); an array handed out by :meth:`gather` is valid until the next
    ``gather`` of the same input, so an instance with two batches in flight keeps
    two of these and alternates.
    """

    def __init__(self, allocate: Callable[[int], np.ndarray] = _host_bytes) -> None:
        self._allocate = allocate
        self._buffers: dict[str, np.ndarray] = {}

    def gather(self, name: str, parts: Sequence[np.ndarray]) -> np.ndarray:
        """``parts`` concatenated along their first dimension, in this buffer."""
        first = parts[0]
        rows = sum(part.shape[0] for part in parts)
        shape = (rows,) + first.shape[1:]
        nbytes = rows * int(np.prod(shape[1:], dtype=np.int64)) * first.itemsize
        buffer = self._buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._buffers[name] = self._allocate(nbytes)
        out = buffer[:nbytes].view(first.dtype).reshape(shape)
        start = 0
        for part in parts:
            stop = start + part.shape[0]
            out[start:stop] = part
            start = stop
        return out

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array`` may share memory with one of these buffers."""
        return any(np.may_share_memory(array, buffer) for buffer in self._buffers.values())


def pinned_bytes(torch: Any) -> Callable[[int], np.ndarray]:
    """An allocator of pinned (page-locked) host byte buffers through torch, for
    :class:`HostBuffers` of a GPU instance: a copy from pinned memory runs
    asynchronously on a stream (kept alive by their numpy views)."""

    def allocate(nbytes: int) -> np.ndarray:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    return allocate
