"""Triton's GPU metrics, read through NVML (``pip install nvidia-ml-py``, in the
``gpu`` extra), imported only when GPU metrics are on.

Per GPU that CUDA sees (Triton's core ``src/metrics.cc`` keeps the GPUs whose PCI
bus id a CUDA device has: ``CUDA_VISIBLE_DEVICES`` hides the others from its
metrics too; here the bus ids come from cupy, and without cupy every GPU NVML
sees is reported), labelled ``gpu_uuid`` as in Triton: ``nv_gpu_utilization`` (0.0-1.0),
``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes``, ``nv_gpu_power_usage``
and ``nv_gpu_power_limit`` (watts), ``nv_energy_consumption`` (joules since the
driver loaded). Sampled every metrics interval on a worker thread (NVML calls
block); a figure a GPU does not report is left out for that GPU. Without NVML or
without a GPU nothing is collected, and the server says so once in its log.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import TypeVar

import structlog
import trio
from prometheus_client.core import GaugeMetricFamily, Metric

from trionserve.observability.exposition import TritonCounter
from trionserve.observability.sampling import sample_every

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
# An NVML device handle (a ctypes pointer): opaque, only given back to NVML.
NvmlHandle = object

# name -> (help, sample field)
_GAUGES = {
    "nv_gpu_utilization": ("GPU utilization rate [0.0 - 1.0)", "utilization"),
    "nv_gpu_memory_total_bytes": ("GPU total memory, in bytes", "memory_total"),
    "nv_gpu_memory_used_bytes": ("GPU used memory, in bytes", "memory_used"),
    "nv_gpu_power_usage": ("GPU power usage in watts", "power_usage"),
    "nv_gpu_power_limit": ("GPU power management limit in watts", "power_limit"),
    "nv_energy_consumption": ("GPU energy consumption in joules since the driver loaded", "energy"),
}


@dataclass
class GpuSample:
    uuid: str
    utilization: float | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    power_usage: float | None = None
    power_limit: float | None = None
    energy: float | None = None


def _bus_id(text: str | bytes) -> tuple[int, str]:
    """A PCI bus id comparable between CUDA ("0000:3B:00.0") and NVML
    ("00000000:3B:00.0"): the domain as a number, the rest in lower case."""
    if isinstance(text, bytes):
        text = text.decode()
    domain, _, rest = text.strip().partition(":")
    return int(domain, 16), rest.lower()


def _cuda_bus_ids() -> set[tuple[int, str]] | None:
    """The PCI bus ids of the devices CUDA sees, where ``CUDA_VISIBLE_DEVICES``
    narrows them; None: every GPU (unset, or no cupy to ask)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return None
    try:
        import cupy

        runtime = cupy.cuda.runtime
        return {_bus_id(runtime.deviceGetPCIBusId(i)) for i in range(runtime.getDeviceCount())}
    except ImportError:
        log.info("GPU metrics: CUDA_VISIBLE_DEVICES is set but without cupy every GPU is reported")
        return None
    except Exception:  # no CUDA device (CUDA_VISIBLE_DEVICES empty, say)
        return set()


def _nvml_bus_id(nvml: ModuleType, handle: NvmlHandle) -> tuple[int, str] | None:
    try:
        return _bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except nvml.NVMLError:
        return None


class GpuMetricsCollector:
    """NVML's view of every visible GPU; a Prometheus collector."""

    def __init__(self, nvml: ModuleType, handles: list[NvmlHandle]) -> None:
        self._nvml = nvml
        self._handles = handles
        self.samples: list[GpuSample] = []

    @classmethod
    def create(cls) -> GpuMetricsCollector | None:
        """A collector, or None (logged) where NVML or GPUs are missing."""
        try:
            import pynvml
        except ImportError:
            log.info("GPU metrics off: NVML is not installed (pip install nvidia-ml-py)")
            return None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except pynvml.NVMLError as exc:
            log.info("GPU metrics off: NVML is not usable", reason=str(exc))
            return None
        visible = _cuda_bus_ids()
        if visible is not None:
            handles = [h for h in handles if _nvml_bus_id(pynvml, h) in visible]
        if not handles:
            pynvml.nvmlShutdown()
            log.info("GPU metrics off: no GPU is visible")
            return None
        return cls(pynvml, handles)

    def sample(self) -> None:
        """Read every GPU (blocking)."""
        samples = []
        for handle in self._handles:
            samples.append(self._read(handle))
        self.samples = samples

    def _read(self, handle: NvmlHandle) -> GpuSample:
        nvml = self._nvml

        def read(function: Callable[..., _T], *args: object) -> _T | None:
            try:
                return function(handle, *args)
            except nvml.NVMLError:
                return None  # this GPU does not report it

        uuid = read(nvml.nvmlDeviceGetUUID)
        sample = GpuSample(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        rates = read(nvml.nvmlDeviceGetUtilizationRates)
        if rates is not None:
            sample.utilization = rates.gpu / 100.0
        memory = read(nvml.nvmlDeviceGetMemoryInfo)
        if memory is not None:
            sample.memory_total, sample.memory_used = int(memory.total), int(memory.used)
        power = read(nvml.nvmlDeviceGetPowerUsage)  # milliwatts
        if power is not None:
            sample.power_usage = power / 1000.0
        limit = read(nvml.nvmlDeviceGetPowerManagementLimit)
        if limit is not None:
            sample.power_limit = limit / 1000.0
        energy = read(nvml.nvmlDeviceGetTotalEnergyConsumption)  # millijoules
        if energy is not None:
            sample.energy = energy / 1000.0
        return sample

    async def run(
        self,
        interval: float,
        stop: trio.Event,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Sample now and every ``interval`` seconds until ``stop`` is set."""
        try:
            await sample_every(
                lambda: trio.to_thread.run_sync(self.sample), interval, stop, task_status
            )
        finally:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    def collect(self) -> Iterable[Metric]:
        samples = self.samples
        for name, (documentation, field) in _GAUGES.items():
            # Triton's energy figure is a counter (core src/metrics.cc), the rest gauges.
            counter = name == "nv_energy_consumption"
            family = (
                TritonCounter(name, documentation)
                if counter
                else GaugeMetricFamily(name, documentation, labels=["gpu_uuid"])
            )
            for sample in samples:
                value = getattr(sample, field)
                if value is not None:
                    family.add_sample(name, {"gpu_uuid": sample.uuid}, value)
            if family.samples:
                yield family
