"""In-process Python models: ``model.py`` on a thread of the server, no stub process.

Chosen per model with ``parameters { key: "EXECUTION_MODE" value: { string_value:
"in_process" } }``. Each instance gets one thread of its own (an
:class:`~trionserve.backends.instance_thread.InstanceThread`) that imports
``model.py``, runs ``initialize``, every ``execute`` and ``finalize``, one after
the other, so a model keeps the thread affinity it has in a stub (thread-local
state, a CUDA device set in ``initialize``). Requests reach the model as
``pb_utils.InferenceRequest`` objects that wrap the server's tensors, with no copy
and no message; what it returns, or sends through a response sender from any
thread, becomes the server's response on the Trio thread (``run_sync_soon``).

The model sees the same ``triton_python_backend_utils`` API as in a stub: the
module is the stub's own, loaded once per instance (:mod:`.model_namespace`) with
an :class:`~.inprocess_runtime.InProcessRuntime` behind it (the model's side, on
its threads), so two models (or two instances) share no module globals, as two
stub processes would not. BLS calls, custom metrics, the model loading API and log
lines go to the server's objects directly.

This module holds the server's side: :class:`InProcessInstance`, on the Trio
thread (Triton's ``TritonModelInstance`` of an in-process model).

With ``parameters { key: "INPROCESS_EXECUTE_ON" value: { string_value:
"event_loop" } }`` a cheap ``execute`` runs on the event loop's own thread
instead, with no hand-off to the instance's thread and back (for a small model,
a quarter to a half of the server's CPU per inference, and at high concurrency
the two threads' fight for the GIL), and a request submitted while the instance
is idle runs straight from the scheduler (an ``InlineAsyncBackendInstance``).
The rule is the ONNX Runtime backend's inline rule with a Python-sized budget: a
batch runs on the loop while the instance's previous execute took at most
:data:`EVENT_LOOP_BUDGET_NS`, else on the instance's thread, so a model whose
execute turns long blocks the loop once, then runs on its thread until an
execute there is cheap again. Unlike ONNX Runtime's automatic rule, the first
batch runs on the loop too: the model was put there on purpose, and what it
does there that cannot work (below) then fails from its first request, not its
second. ``initialize``, ``finalize`` and ``is_ready`` stay on the instance's
thread. What cannot work on the loop's thread is refused clearly: an ``async
def execute`` at load (unless the model is decoupled: its coroutine is left
running on its asyncio loop, as in a stub); a BLS ``exec()`` / ``async_exec()``
or a model loading API call from execute (it would wait for the loop it
blocks), with a ``TritonModelException`` naming the parameter.

What is lost against a stub: a crash (``os._exit``, a segfault in an extension) or
a leak in model.py is the server's; the GIL is shared with the frontends; there is
no per-model Python environment (EXECUTION_ENV_PATH is refused) and no execute
timeout or restart (a thread cannot be killed).
"""

from __future__ import annotations

import contextvars
import gc
import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVarTuple

import structlog
import trio

from trionserve.backends.base import ExecuteResult, InstanceSpec, ModelContext
from trionserve.backends.instance_thread import InstanceThread, Job
from trionserve.backends.python.bls import Outcome, run_bls
from trionserve.backends.python.control import ModelControl
from trionserve.backends.python.delivery import deliver, deliver_sent, initialize_args
from trionserve.backends.python.inprocess_runtime import (
    RESCHEDULED,
    BLSCall,
    ExecuteFailed,
    InProcessRuntime,
)
from trionserve.backends.python.runtime import describe_exception
from trionserve.backends.python.settings import EVENT_LOOP, StubSettings
from trionserve.core.errors import (
    Cancelled,
    InternalError,
    InvalidArgument,
    TritonError,
    Unavailable,
)
from trionserve.core.inference import InferenceRequest, InferenceResponse

log = structlog.get_logger(__name__)

Args = TypeVarTuple("Args")

# How long a readiness check waits for the model's is_ready() (as a stub's).
READINESS_TIMEOUT_SECONDS = 5.0
# With INPROCESS_EXECUTE_ON 'event_loop': a batch runs on the event loop while the
# instance's previous execute took at most this long. The hand-off it saves costs
# about 0.1 ms of CPU per batch, so past 1 ms the instance's thread costs at most
# a tenth more, and every other client stops waiting for the execute.
EVENT_LOOP_BUDGET_NS = 1_000_000


class InProcessInstance:
    """One in-process instance: an async backend instance (see
    ``AsyncBackendInstance``) whose ``execute_async`` hands the batch to the
    instance's thread and awaits it, and whose ``run`` holds the nursery of the
    model's BLS calls.

    Guarantees, as a stub-backed instance's: every request handed to
    ``execute_async`` gets one final outcome — the model's response(s), its
    error, or Triton's error for a response sender let go unanswered; a
    decoupled model's responses reach their request in the order it sent them.
    """

    def __init__(
        self,
        context: ModelContext,
        spec: InstanceSpec,
        settings: StubSettings,
        model_file: Path,
        config_json: str,
    ) -> None:
        config = context.config
        self.spec = spec
        self.model_name = context.name
        self.model_version = str(context.version)
        self.label = f"model '{context.name}' instance '{spec.name}'"
        self.decoupled = config.model_transaction_policy.decoupled
        self._reschedulable = config.sequence_batching.iterative_sequence
        self.output_names = [o.name for o in config.output]
        self._settings = settings
        self._inference = context.inference
        self.control = ModelControl(context.inference, context.name)
        self.metrics = context.metrics
        self.metrics_owner = self.metrics.new_owner()
        self._nursery: trio.Nursery | None = None
        self._has_is_ready = False
        self.inline = settings.execute_on == EVENT_LOOP  # InlineAsyncBackendInstance
        # How long the previous execute took (the first batch runs on the loop).
        self._last_ns = 0
        self.token = trio.from_thread.run_sync(trio.lowlevel.current_trio_token)
        self._runtime = InProcessRuntime(self, model_file, str(context.version_dir))
        self._thread = InstanceThread(spec.name, self._runtime)
        self._thread.start(self.token)
        args = initialize_args(context, spec, config_json)
        # initialize runs in the load's context (contextvars), as a stub's calls
        # are served: a model it loads (pb_utils.load_model) is then known as part
        # of this load (a budget's measured load), not waited for behind it.
        load_context = contextvars.copy_context()
        try:
            self._has_is_ready = self._thread.call(
                lambda: load_context.run(self._runtime.load, args)
            )
        except BaseException as exc:
            self._stop_thread()
            if isinstance(exc, Exception):
                raise Unavailable(
                    f"{self.label}: initialize failed: {describe_exception(exc)}"
                ) from None
            raise
        if (
            self.inline
            and not self.decoupled
            and inspect.iscoroutinefunction(self._runtime.model.execute)
        ):
            # The loop would wait for the coroutine (a decoupled one is left running).
            self.close()
            raise InvalidArgument(
                f"{self.label}: parameter INPROCESS_EXECUTE_ON 'event_loop' cannot wait "
                "for an 'async def execute' of a model that is not decoupled; use "
                "'instance_thread'"
            )

    # -- the actor -----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def execute_async(self, requests: list[InferenceRequest]) -> ExecuteResult | None:
        job = Job(requests)
        if self.runs_inline():
            self._execute_here(job)
        else:
            self._thread.submit(job)
            await self._thread.wait(job)
            self._last_ns = int((job.ended - job.started) * 1e9)
        return self._answer(job)

    def runs_inline(self) -> bool:
        """Whether the next batch runs on the event loop (``InlineAsyncBackendInstance``)."""
        return self.inline and self._last_ns <= EVENT_LOOP_BUDGET_NS

    def execute_inline(self, requests: list[InferenceRequest]) -> ExecuteResult | None:
        """``execute_async`` of a batch while :meth:`runs_inline`, with no await."""
        job = Job(requests)
        self._execute_here(job)
        return self._answer(job)

    def _answer(self, job: Job) -> ExecuteResult | None:
        for request in job.cancelled:  # cancelled while waiting for the thread
            request.fail(
                Cancelled(
                    f"request '{request.id}' for model '{request.model_name}' was "
                    "cancelled before it executed"
                )
            )
        if job.error is not None:
            if not isinstance(job.error, ExecuteFailed):
                raise job.error
            # Logged as Triton's stub logs it (pb_stub.cc ProcessRequests).
            log.error("execute raised", source=self.label, error=str(job.error))
            error = InternalError(str(job.error))
            if self.decoupled or job.cancelled:
                for request in job.requests:
                    request.fail(error)
                return None
            return [error] * len(job.requests)
        assert job.results is not None
        outcomes: list[InferenceResponse | TritonError | None] = []
        for request, result in zip(job.requests, job.results):
            outcomes.append(self._reschedule(request) if result is RESCHEDULED else result)
        if job.cancelled or any(outcome is None for outcome in outcomes):
            for request, outcome in zip(job.requests, outcomes):
                if outcome is not None:
                    deliver(request, outcome)
            return None
        return outcomes  # type: ignore[return-value]  # no None in it

    def _execute_here(self, job: Job) -> None:
        """Run the batch on this (the event loop's) thread, as the instance's
        thread would (``InstanceThread._stage`` and ``_launch``), timing it."""
        job.drop_cancelled()
        if not job.requests:
            job.results = []
            return
        started = time.perf_counter()
        try:
            job.results = self._runtime.execute_on_loop(job.requests)
        except Exception as exc:
            job.error = exc
        self._last_ns = int((time.perf_counter() - started) * 1e9)

    def _reschedule(self, request: InferenceRequest) -> TritonError | None:
        """Released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE (see the stub-backed
        instance's ``_reschedule``)."""
        if not self._reschedulable:
            return InvalidArgument(
                "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while "
                "the model is not configured to handle such a flag."
            )
        request.rescheduled = True
        return None

    async def check_ready(self) -> None:
        """The model's ``is_ready()``, within 5 s (as a stub-backed instance)."""
        if not self._has_is_ready:
            return
        with trio.move_on_after(READINESS_TIMEOUT_SECONDS):
            try:
                ready = await trio.to_thread.run_sync(
                    self._runtime.is_ready, abandon_on_cancel=True
                )
            except Exception as exc:
                raise InternalError(describe_exception(exc)) from None
            if not ready:
                raise Unavailable(
                    f"Model '{self.spec.name}' is not ready (user-defined check failed)."
                )
            return
        raise Unavailable("Timed out waiting for user-defined is_ready() response")

    # -- what the model's threads post ---------------------------------------------------

    def post(self, fn: Callable[[*Args], object], *args: *Args) -> None:
        self.token.run_sync_soon(fn, *args)

    def deliver_sent(
        self,
        request: InferenceRequest,
        outcome: InferenceResponse | TritonError | None,
        final: bool,
    ) -> None:
        """A response (or the final flag) the model sent through a response sender."""
        deliver_sent(request, outcome, final, self.decoupled)

    def released(self, request: InferenceRequest) -> None:
        if not request.done:
            request.fail(
                InternalError(
                    "the model released the request without sending its final response "
                    "(a response returned from execute, or one sent with "
                    "TRITONSERVER_RESPONSE_COMPLETE_FINAL)"
                )
            )

    def start_bls(self, call: BLSCall, decoupled: bool, model_name: str) -> None:
        nursery = self._nursery
        try:
            if nursery is None:
                raise RuntimeError("no nursery")
            nursery.start_soon(self._bls, call, decoupled, model_name)
        except RuntimeError:
            call.put(Unavailable(f"{self.label}: the model instance is stopping"), True)

    async def _bls(self, call: BLSCall, decoupled: bool, model_name: str) -> None:
        async def reply(outcome: Outcome, final: bool) -> None:
            call.put(outcome, final)

        try:
            await run_bls(
                self._inference,
                lambda: call.request,
                decoupled=decoupled,
                timeout_us=call.request.timeout_us,
                model_name=model_name,
                label=self.label,
                reply=reply,
            )
        finally:
            # Cut short (the instance stops): the model's iterator still ends.
            call.put(Unavailable(f"{self.label}: the model instance was stopped"), True)

    # -- shutdown ---------------------------------------------------------------------

    def close(self) -> None:
        """Finalize the model on its thread, then end the thread (blocking)."""
        try:
            self._thread.call(self._runtime.finalize, timeout=self._settings.stub_timeout)
        except TimeoutError:
            log.warning(
                "finalize failed",
                source=self.label,
                error=(
                    f"the model did not finish its batches and finalize within "
                    f"{self._settings.stub_timeout:g}s (stub-timeout-seconds); its thread "
                    "is left behind"
                ),
            )
        self._stop_thread()

    def _stop_thread(self) -> None:
        self._thread.stop()
        self.metrics.release(self.metrics_owner)
        namespace = self._runtime.namespace
        if namespace is not None:
            namespace.close()
            # The model's objects live in the server's heap and hold each other
            # (module, class, instance, pb_utils): without a collection they
            # outlive the unload until the cyclic collector next runs a full pass,
            # which a few large arrays never trigger (100 load/unload cycles of a
            # model holding 20 MiB grew the server by 80 MiB in 5 cycles).
            gc.collect()
