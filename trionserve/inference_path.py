"""The data plane's inference path: a decoded request's admission, its one
lifecycle at its model, and the ways a frontend consumes its outcome.

Every frontend takes the same steps (:class:`InferencePath`, a base of
:class:`~trionserve.dataplane.DataPlane`): ``_admit`` (route, policy, budget,
drain, validation), ``_begin`` (trace, count in flight, queue at the model), the
outcome consumed, ``_end`` (count out, finish the trace). A caller consumes it
by awaiting it (``infer``, ``infer_stream``, ``responses``), or begins it and
ends it itself (``begin``, then exactly one of ``finish``, ``end`` or ``drop``):
a connection that waits on its socket meanwhile, not in a coroutine that waits
for the outcome, and is carried on by the outcome's callback.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, cast

import structlog
import trio

from trionserve.core.classification import classify, read_labels
from trionserve.core.errors import TritonError, Unimplemented
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.core.validation import validate_request
from trionserve.lifecycle import Lifecycle
from trionserve.observability.statistics import FailureReason, to_ns
from trionserve.observability.trace.trace_file import NOT_TRACED, Trace
from trionserve.repository.repository import ModelId

if TYPE_CHECKING:
    from trionserve.actors.model import ModelVersion
    from trionserve.actors.registry import ModelRegistry
    from trionserve.core.client_budget import ClientBudget
    from trionserve.core.response_cache import ResponseCache
    from trionserve.drain import Drain
    from trionserve.observability.trace.frontend import FrontendStamps
    from trionserve.observability.trace.manager import TraceManager

# How a streamed request's responses reach its frontend: ``await deliver(response, final)``
# per response, in order (``response`` None: a decoupled model ended it without one).
Deliver = Callable[[InferenceResponse | None, bool], Awaitable[None]]

log = structlog.get_logger(__name__)


class InferencePath:
    """The data plane's inference calls (see the module docstring). Its state is
    the :class:`~trionserve.dataplane.DataPlane`'s, set there."""

    registry: ModelRegistry
    budget: ClientBudget
    drain: Drain
    tracing: TraceManager
    response_cache: ResponseCache | None
    undelivered_response_limit: int
    _first_response: bool
    _label_cache: weakref.WeakKeyDictionary[ModelVersion, dict]

    def _admit(
        self,
        request: InferenceRequest,
        internal: bool = False,
        single_response: str | None = None,
    ) -> ModelVersion:
        """Route and check a request against its model's policy, then validate it.

        A request that fails validation is counted as a failure of its model
        (reason OTHER). While draining, refuse what the drain does not take (see
        :class:`~trionserve.drain.Drain`); ``internal``: a request made by a model on behalf of
        one already taken. ``single_response`` names the endpoint of a caller that
        takes exactly one response (``infer``): a decoupled model is refused there
        with UNIMPLEMENTED before it runs, whichever protocol asked, as Triton's
        frontends do (HTTP: ``src/http_server.cc`` CheckTransactionPolicy; gRPC
        ModelInfer: ``src/grpc/infer_handler.cc``).
        """
        model = self.registry.route(
            request.model_name, request.model_version, request.model_namespace
        )
        if internal and request.trace_context is None:
            request.trace_context = NOT_TRACED  # traced only as a traced request's child
        residency = self.registry.residency
        if residency is not None:
            residency.touch(model)
        request.undelivered_limit = self.undelivered_response_limit
        budget = request.budget = self.budget
        if not internal and budget.held >= budget.limit:
            budget.admit(f"request for model '{request.model_name}'")
        drain = self.drain
        if drain.draining and not internal:
            drain.refuse_unless_continuing(request, model)
        if single_response is not None and model.config.model_transaction_policy.decoupled:
            raise Unimplemented(
                f"{single_response} doesn't support models with decoupled transaction "
                f"policy (model '{request.model_name}' is decoupled; stream its "
                "responses: gRPC ModelStreamInfer or HTTP generate_stream)"
            )
        try:
            validate_request(request, model.signature)
        except TritonError:
            model.statistics.record_failure(0, FailureReason.OTHER)
            raise
        return model

    @asynccontextmanager
    async def _lifecycle(
        self, model: ModelVersion, request: InferenceRequest, queued: trio.Event | None = None
    ) -> AsyncIterator[Lifecycle]:
        """The one lifecycle of an admitted request, for every way of consuming it:
        trace, count it in flight, queue it at its model, let the caller consume its
        responses (each passed through :meth:`Lifecycle.deliverable`), then count it
        out and finish its trace. A caller that fails or is cancelled before the
        request's final outcome (a ``deliver`` that raised, a client gone, an
        iterator closed early) flags it cancelled, so its remaining work is dropped.
        ``queued`` is set once the model's scheduler holds the request.
        """
        run = await self._begin(model, request, queued)
        try:
            yield run
        except BaseException as exc:
            self._failed(run, exc)
            raise
        finally:
            self._end(run)

    async def _begin(
        self, model: ModelVersion, request: InferenceRequest, queued: trio.Event | None
    ) -> Lifecycle:
        """:meth:`_lifecycle` up to the request queued at its model."""
        run = self._began(model, request, queued)
        try:
            await model.infer(request)
        except BaseException as exc:
            self._failed(run, exc)
            self._end(run, queued=False)
            raise
        if queued is not None:
            queued.set()
        return run

    def _began(
        self, model: ModelVersion, request: InferenceRequest, queued: trio.Event | None
    ) -> Lifecycle:
        """:meth:`_begin` up to the request given to its model: traced, counted."""
        run = Lifecycle(model, request, self._first_response, self._classify)
        context = request.trace_context
        trace: Trace | None = None
        if context is None:
            if self.tracing.active:
                trace = self.tracing.start(model, request)
        elif type(context) is Trace:
            trace = self.tracing.start_child(model, context, request)
        elif context is not NOT_TRACED and self.tracing.active:  # a frontend's timestamps
            trace = self.tracing.start(model, request, cast("FrontendStamps", context))
        run.trace = request.trace = trace
        self.drain.request_began(model, request)
        request.queued = queued
        return run

    def _failed(self, run: Lifecycle, exc: BaseException) -> None:
        """The caller failed or was cancelled: a request without its final outcome
        is flagged cancelled; a traced one answered with an error says so."""
        if not run.request.done:
            run.request.cancelled = True
        elif run.trace is not None:
            self.tracing.answered_with_error(run.trace, exc)

    def _end(self, run: Lifecycle, queued: bool = True) -> None:
        """:meth:`_lifecycle`'s end: count the request out, finish its trace (that
        of a queued request its caller gave up on, with its outcome: its model may
        still run it; Triton's REQUEST_END is at the request's release, core src/
        infer_request.cc:475-503, after the compute its backend reports)."""
        request = run.request
        request.discard()
        self.drain.request_ended(run.model)
        trace = run.trace
        if trace is not None:
            if queued and not request.done:
                request.on_final(functools.partial(self.tracing.finish, trace, run.model, request))
            else:
                self.tracing.finish(trace, run.model, request, run.traced)

    async def infer(
        self,
        request: InferenceRequest,
        *,
        internal: bool = False,
        endpoint: str = "this endpoint",
        queued: trio.Event | None = None,
    ) -> InferenceResponse:
        """Route, validate, queue and await one request's single outcome: :meth:`begin`,
        then :meth:`finish` (or the cache's answer).

        ``endpoint`` names the caller in the error refusing a decoupled model
        (Triton's words: "HTTP end point", "ModelInfer RPC"); requests made by
        models themselves (``internal``) are not checked here. ``queued`` is set
        once the model's scheduler holds the request (or the cache answered it):
        an error raised before is one Triton's ServerInferAsync would return."""
        run = await self.begin(request, internal=internal, endpoint=endpoint, queued=queued)
        if type(run) is InferenceResponse:
            return run
        return await self.finish(run)  # type: ignore[arg-type]  # (a Lifecycle)

    async def begin(
        self,
        request: InferenceRequest,
        *,
        internal: bool = False,
        endpoint: str = "this endpoint",
        queued: trio.Event | None = None,
    ) -> Lifecycle | InferenceResponse:
        """:meth:`infer` up to the request queued at its model, without waiting for
        its outcome: its :class:`Lifecycle`, which the caller ends with exactly one
        of :meth:`finish` (await the outcome), :meth:`end` (take it once delivered)
        or :meth:`drop` (give up). A model with the response cache is answered here
        whole (the response itself, nothing to end). Raises as :meth:`infer` does,
        with nothing left to end. The request's final outcome calls
        ``request.answer.finalized()`` and then the ``request.on_final`` callback,
        if set, on the Trio thread: a caller may be carried on from there."""
        residency = self.registry.residency
        if residency is not None and (internal or not self.drain.draining):
            # A draining server starts no load for a request it will refuse.
            await residency.wait_routable(request)
        model = self._admit(request, internal, None if internal else endpoint)
        cache = self.response_cache
        if cache is not None and model.config.response_cache.enable:
            request.answer = None  # stored before it is answered (Triton's DelegateResponse)
            return await self._infer_cached(cache, model, request, queued)
        return await self._begin(model, request, queued)

    def begin_now(
        self, request: InferenceRequest, endpoint: str
    ) -> Lifecycle | Awaitable[Lifecycle | InferenceResponse]:
        """:meth:`begin` (a frontend's request, no ``queued``) as plain calls where
        nothing waits: its :class:`Lifecycle`, or else the awaitable that takes the
        rest of the way (:meth:`begin`, not begun yet; or, once admitted, its queueing
        at a model whose scheduler would wait or only queues by awaiting). The
        caller awaits it at once. Raises as :meth:`begin` does."""
        if (
            self.registry.residency is not None  # (its wait_routable)
            or self.response_cache is not None
            or self.tracing.active
            or request.trace_context is not None
        ):
            return self.begin(request, endpoint=endpoint)
        model = self._admit(request, False, endpoint)
        submit_now = model.submit_now  # (set while the model is READY)
        if submit_now is None:
            return self._begin(model, request, None)
        # _began for an untraced request (no trace, no ``queued``), written out.
        run = Lifecycle(model, request, self._first_response, self._classify)
        self.drain.request_began(model, request)
        try:
            if submit_now(request):
                return run
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            error = model.unloading()
            self._failed(run, error)
            self._end(run, queued=False)
            raise error from None
        except BaseException as exc:
            self._failed(run, exc)
            self._end(run, queued=False)
            raise
        # It would wait: counted again by _begin, which queues it as begin does
        # (untraced: an uncounted moment inside one step of the loop, unseen).
        self.drain.request_ended(model)
        return self._begin(model, request, None)

    async def finish(self, run: Lifecycle) -> InferenceResponse:
        """Await a begun request's one outcome: its response (made deliverable), or
        its error raised; the request is counted out either way. A caller cancelled
        before the outcome flags the request cancelled (:meth:`drop`)."""
        # _lifecycle written out: no async generator and context manager per call.
        try:
            response = await run.request.wait()
            if run.trace is not None or not run.plain:
                await run.deliverable(response)
        except BaseException as exc:
            self._failed(run, exc)
            raise
        finally:
            self._end(run)
        return response

    def end(self, run: Lifecycle) -> InferenceResponse:
        """:meth:`finish` without a wait, once the request has its final outcome
        (``run.request.done``), for a request with nothing to do before its
        response is handed on (``run.plain``, untraced): the response, or its
        error raised; the request is counted out either way."""
        assert run.request.done and run.plain and run.trace is None
        try:
            response = run.request.result()
        except BaseException as exc:
            self._failed(run, exc)
            self._end(run)
            raise
        # _end, for a request whose one response was just taken: nothing of it
        # is held (its discard finds nothing), no trace to finish.
        self.drain.request_ended(run.model)
        return response

    def answered(self, run: Lifecycle) -> None:
        """:meth:`end` for a caller that does not take the outcome (its answer
        is written already: a gRPC call the instance's thread answered), once
        final, untraced and ``run.plain``: counted out. The outcome stays with
        the request, which is let go with it; what it holds for responses not
        taken (none for a request with one response: ``send``) is let go now."""
        request = run.request
        if request.held_bytes:
            request.discard()
        self.drain.request_ended(run.model)

    def drop(self, run: Lifecycle) -> None:
        """The caller gives up on a begun request (its client went away) instead of
        taking its outcome: flagged cancelled if it has none yet (its scheduler
        drops it, or its result is discarded), and counted out; its ``on_final``
        callback is removed (not called by an outcome that comes later)."""
        request = run.request
        request.on_final(None)
        if not request.done:
            request.cancelled = True
        self._end(run)

    async def _infer_cached(
        self,
        cache: ResponseCache,
        model: ModelVersion,
        request: InferenceRequest,
        queued: trio.Event | None = None,
    ) -> InferenceResponse:
        """A hit is answered from the cache; a miss runs and stores a success.
        Statistics as Triton keeps them: a hit is a success with its lookup time
        and no inference; a miss counts its lookup and insert time."""
        started = trio.current_time()
        key = cache.key(ModelId(model.namespace, model.name), model.version, request)
        response = await cache.fetch(key, request, str(model.version))
        looked_up = trio.current_time()
        if response is not None:
            model.statistics.record_cache_hit(
                to_ns(looked_up - request.arrival_time), to_ns(looked_up - started)
            )
            if queued is not None:
                queued.set()
            return response
        lookup_ns = to_ns(looked_up - started)
        try:
            response = await self.finish(await self._begin(model, request, queued))
            inserting = trio.current_time()
            refused = await cache.store(key, response)
            lookup_ns += to_ns(trio.current_time() - inserting)
            if refused is not None:
                # core src/dynamic_batch_scheduler.cc / ensemble_scheduler.cc: the
                # response is answered all the same, the failure is logged.
                log.error(f"Failed to insert key [{key.hex()}] into response cache: {refused}")
        finally:
            model.statistics.record_cache_miss(lookup_ns)
        return response

    async def infer_stream(
        self,
        request: InferenceRequest,
        deliver: Deliver,
        *,
        queued: trio.Event | None = None,
        internal: bool = False,
    ) -> None:
        """Route, validate and queue one request, then ``await deliver(response,
        final)`` for each of its responses in order (``response`` is None when a
        decoupled model ends the request without one); raises the request's error.

        For gRPC streams and decoupled models. If ``deliver`` raises or the caller is
        cancelled, the request is flagged cancelled so its remaining work is dropped.
        ``queued`` is set once the model's scheduler holds the request (a stream
        waits for it so that a sequence's requests are queued in order).
        """
        residency = self.registry.residency
        if residency is not None and (internal or not self.drain.draining):
            await residency.wait_routable(request)
        model = self._admit(request, internal)
        cache = self.response_cache
        if cache is not None and model.config.response_cache.enable:
            # A model with the cache is never decoupled (config validation): its one response
            # is looked up and stored as for infer, whoever asks (a gRPC stream, an ensemble's
            # step: Triton's schedulers consult the cache, core src/dynamic_batch_scheduler.cc).
            await deliver(await self._infer_cached(cache, model, request, queued), True)
            return
        async with self._lifecycle(model, request, queued) as run:
            async for response, final in request.stream():
                await run.deliverable(response)
                await deliver(response, final)

    async def responses(
        self, request: InferenceRequest, admitted: trio.Event | None = None
    ) -> AsyncGenerator[tuple[InferenceResponse | None, bool]]:
        """Route, validate and queue a request when first iterated, then yield its
        ``(response, final)`` pairs as :meth:`infer_stream` delivers them.

        For frontends that hand the responses on as a body they stream (HTTP
        generate_stream). Close it (``aclosing``) when done: a request whose
        iterator is closed early is flagged cancelled. ``admitted`` is set once
        the request is routed and valid, so that a caller can tell an error of
        the request from one its model answered.
        """
        residency = self.registry.residency
        if residency is not None and not self.drain.draining:
            await residency.wait_routable(request)
        model = self._admit(request)
        if admitted is not None:
            admitted.set()
        async with self._lifecycle(model, request) as run:
            async for response, final in request.stream():
                await run.deliverable(response)
                yield response, final

    async def _classify(
        self, model: ModelVersion, request: InferenceRequest, response: InferenceResponse
    ) -> None:
        """Apply the classification extension to the outputs that asked for it."""
        wanted = {
            o.name: int(o.parameters["classification"])
            for o in request.requested_outputs or ()
            if o.parameters.get("classification")
        }
        batched = model.signature.max_batch_size > 0
        for index, tensor in enumerate(response.outputs):
            k = wanted.get(tensor.name)
            if k:
                labels = await self._labels(model, tensor.name)
                response.outputs[index] = classify(tensor, k, labels, batched)

    async def _labels(self, model: ModelVersion, output: str) -> list[str] | None:
        cache = self._label_cache.setdefault(model, {})
        if output not in cache:
            filename = next((o.label_filename for o in model.config.output if o.name == output), "")
            cache[output] = (
                await trio.to_thread.run_sync(read_labels, model.model_dir / filename)
                if filename
                else None
            )
        return cache[output]
