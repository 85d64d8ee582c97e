"""ModelVersion: the actor that owns one loaded version of one model."""

from __future__ import annotations

import enum
from pathlib import Path

import structlog
import trio

from trionserve.actors.executor import InstanceExecutor
from trionserve.actors.scheduler import DefaultScheduler, Scheduler
from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.backends.gpu import gpu_count
from trionserve.core.errors import TritonError, Unavailable, as_triton_error
from trionserve.core.types import InferenceRequest
from trionserve.core.validation import ModelSignature

log = structlog.get_logger(__name__)

# Bound of each model's batch queue: requests beyond it wait in submit().
QUEUE_CAPACITY = 1024


class ModelState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


def resolve_instance_kinds(config, gpus: int) -> None:
    """KIND_AUTO becomes KIND_GPU when a GPU exists, else KIND_CPU, as in Triton."""
    for group in config.instance_group:
        if group.kind == group.KIND_AUTO:
            group.kind = group.KIND_GPU if gpus > 0 else group.KIND_CPU


def instance_specs(config, gpus: int) -> list[InstanceSpec]:
    """One spec per instance from instance_group, named like Triton's instances."""
    specs: list[InstanceSpec] = []
    for index, group in enumerate(config.instance_group):
        group_name = group.name or f"{config.name}_{index}"
        kind = type(group).Kind.Name(group.kind)
        count = group.count or 1
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if gpus > 0 else "KIND_CPU"
        if kind == "KIND_GPU":
            if gpus == 0:
                raise Unavailable(
                    f"instance group '{group_name}' of model '{config.name}' is "
                    "KIND_GPU but no GPU is available on this host"
                )
            devices = list(group.gpus) or list(range(gpus))
            bad = [d for d in devices if d >= gpus or d < 0]
            if bad:
                raise Unavailable(
                    f"instance group '{group_name}' of model '{config.name}' names "
                    f"GPU(s) {bad} but this host has {gpus}"
                )
            for device in devices:
                for i in range(count):
                    n = len([s for s in specs if s.group == group_name])
                    specs.append(InstanceSpec(f"{group_name}_{n}", group_name, kind, device))
        else:
            for i in range(count):
                specs.append(InstanceSpec(f"{group_name}_{i}", group_name, kind, 0))
    return specs


class ModelVersion:
    """One version of one model: loads it, serves it, drains and unloads it.

    Children (in its own nursery): the scheduler and one InstanceExecutor per
    instance. Guarantees: a request accepted by ``submit`` gets exactly one outcome;
    on unload, new requests are refused, in-flight ones are given ``drain_timeout``
    seconds to finish, and whatever remains is answered with an error before the
    backend is released.
    """

    def __init__(
        self,
        name: str,
        version: int,
        config,
        model_dir: Path,
        backend: Backend,
        load_limiter: trio.CapacityLimiter,
        drain_timeout: float = 30.0,
    ) -> None:
        self.name = name
        self.version = version
        self.config = config
        self.model_dir = model_dir
        self.backend = backend
        self.signature = ModelSignature.from_config(config)
        self.state = ModelState.LOADING
        self.reason = ""
        self.stopped = trio.Event()
        self._load_limiter = load_limiter
        self._drain_timeout = drain_timeout
        self._scheduler: Scheduler | None = None
        self._executors: list[InstanceExecutor] = []
        self._unload_requested = trio.Event()
        self._inflight = 0
        self._idle = trio.Event()
        self._idle.set()

    def __repr__(self) -> str:
        return f"ModelVersion({self.name!r}, {self.version}, {self.state.value})"

    # -- the actor -------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Load, then serve until unload is requested or the parent is cancelled.

        A load failure is raised before ``started``, so ``nursery.start`` raises it
        to the caller; failures after that are contained here.
        """
        started_at = trio.current_time()
        self._log_state("loading")
        try:
            loaded, instances = await self._load()
        except BaseException as exc:
            self._set_unavailable(as_triton_error(exc, "failed to load").message)
            self.stopped.set()
            raise
        batch_send, batch_recv = trio.open_memory_channel[list[InferenceRequest]](
            QUEUE_CAPACITY
        )
        try:
            async with trio.open_nursery() as nursery:
                self._scheduler = DefaultScheduler(batch_send)
                await nursery.start(self._scheduler.run)
                for spec, instance in instances:
                    executor = InstanceExecutor(spec, instance, batch_recv.clone())
                    self._executors.append(executor)
                    await nursery.start(executor.run)
                self.state = ModelState.READY
                self._log_state(
                    "ready",
                    instances=len(instances),
                    duration_s=round(trio.current_time() - started_at, 3),
                )
                task_status.started()
                await self._unload_requested.wait()
                await self._drain()
                nursery.cancel_scope.cancel()
        except Exception as exc:
            # A bug in this model's actors: contained to this model.
            log.exception("model version failed", model=self.name, version=self.version)
            self._set_unavailable(f"internal error: {as_triton_error(exc).message}")
        finally:
            self._fail_queued(batch_recv, batch_send)
            with trio.CancelScope(shield=True):
                await self._release(loaded, [i for _, i in instances])
            if self.state is not ModelState.UNAVAILABLE:
                self._set_unavailable("unloaded")
            self.stopped.set()

    async def _load(self):
        """Load the model and create its instances in worker threads."""
        context = ModelContext(
            self.name,
            self.version,
            self.config,
            self.model_dir,
            self.model_dir / str(self.version),
        )
        specs = instance_specs(self.config, gpu_count())
        async with self._load_limiter:
            loaded = await trio.to_thread.run_sync(self.backend.load, context)
            instances = []
            try:
                for spec in specs:
                    instance = await trio.to_thread.run_sync(loaded.create_instance, spec)
                    instances.append((spec, instance))
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self._release(loaded, [i for _, i in instances])
                raise
        return loaded, instances

    async def _release(self, loaded, instances) -> None:
        def release() -> None:
            for instance in instances:
                try:
                    instance.close()
                except Exception:
                    log.exception("instance close failed", model=self.name)
            try:
                loaded.unload()
            except Exception:
                log.exception("model unload failed", model=self.name)

        await trio.to_thread.run_sync(release)

    async def _drain(self) -> None:
        self.state = ModelState.UNLOADING
        self._log_state("unloading", inflight=self._inflight)
        assert self._scheduler is not None
        self._scheduler.close()
        with trio.move_on_after(self._drain_timeout) as scope:
            await self._idle.wait()
        if scope.cancelled_caught:
            log.warning(
                "unload deadline passed with requests in flight",
                model=self.name,
                version=self.version,
                inflight=self._inflight,
            )

    def _fail_queued(self, receive: trio.MemoryReceiveChannel, send) -> None:
        """Answer every request still queued once the executors are gone."""
        send.close()
        error = Unavailable(f"model '{self.name}' version {self.version} was unloaded")
        while True:
            try:
                batch = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            for request in batch:
                request.fail(error)
        receive.close()

    def _set_unavailable(self, reason: str) -> None:
        self.state = ModelState.UNAVAILABLE
        self.reason = reason
        self._log_state("unavailable", reason=reason)

    def _log_state(self, event: str, **fields) -> None:
        log.info(f"model {event}", model=self.name, version=self.version, **fields)

    # -- used by the registry and the data plane -----------------------------

    def request_unload(self) -> None:
        self._unload_requested.set()

    async def infer(self, request: InferenceRequest) -> None:
        """Queue a validated request; its outcome arrives on the request itself."""
        if self.state is not ModelState.READY or self._scheduler is None:
            raise Unavailable(
                f"model '{self.name}' version {self.version} is not ready "
                f"({self.state.value})"
            )
        try:
            await self._scheduler.submit(request)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise Unavailable(
                f"model '{self.name}' version {self.version} is unloading"
            ) from None

    def begin_request(self) -> None:
        if self._inflight == 0:
            self._idle = trio.Event()
        self._inflight += 1

    def end_request(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()
