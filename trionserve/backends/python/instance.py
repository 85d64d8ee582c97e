"""PythonInstance: one instance of a Python model, served by its stub process.

It is an async backend instance (see ``AsyncBackendInstance`` in
:mod:`trionserve.backends.base`): its executor runs :meth:`PythonInstance.run` as
a child task and awaits :meth:`PythonInstance.execute_async` on the Trio thread,
so nothing blocks a worker thread while the stub computes, and responses that a
decoupled model sends after ``execute`` returned still reach their requests.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import structlog
import trio

from trionserve.backends.base import Ahead, ExecuteResult, InstanceSpec, ModelContext
from trionserve.backends.python.bls import serve_stub_bls
from trionserve.backends.python.calls import Call, Open, Readiness
from trionserve.backends.python.delivery import deliver, deliver_sent
from trionserve.backends.python.lane_calls import LaneCalls
from trionserve.backends.python.messages import (
    EncodedResponse,
    read_response,
    release_outputs,
    request_message,
)
from trionserve.backends.python.process import StubProcess, TrioChannel, log_stub_line
from trionserve.backends.python.settings import StubSettings
from trionserve.core.client_budget import ClientBudget
from trionserve.core.errors import InternalError, InvalidArgument, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, InferenceResponse

log = structlog.get_logger(__name__)

# What sending to a stub raises once it is gone.
_GONE = (OSError, trio.ClosedResourceError, trio.BrokenResourceError)
# Restart delays: 0.1 s after the first failure, doubling, at most 5 s.
BACKOFF_SECONDS = 0.1
BACKOFF_CAP_SECONDS = 5.0


class PythonInstance(LaneCalls):
    """One model instance in a stub process, restarted when the process fails.

    Owns the current :class:`StubProcess` and, while it lives, the tasks that serve
    it: the reader of its messages and one task per BLS request it made.
    Guarantees: every request handed to ``execute_async`` gets one final outcome —
    its response(s), or an error naming how the stub failed (crash, signal,
    ``os._exit``, a hang past ``execute-timeout-seconds``). A failed stub is
    replaced after a backoff; after more than ``stub-max-restarts`` failures in a
    row ``run`` raises Unavailable with the reason, which makes the model
    UNAVAILABLE. On cancellation the stub keeps running until ``close``
    finalizes it.
    """

    def __init__(
        self,
        context: ModelContext,
        spec: InstanceSpec,
        settings: StubSettings,
        start_stub: Callable[[], StubProcess],
        stub: StubProcess,
    ) -> None:
        config = context.config
        self.spec = spec
        self.model_name = context.name
        self.model_version = str(context.version)
        self.label = f"model '{context.name}' instance '{spec.name}'"
        self._inference = getattr(context, "inference", None)
        self._decoupled = config.model_transaction_policy.decoupled
        # Only an iterative sequence batcher takes rescheduled requests back.
        self._reschedulable = config.sequence_batching.iterative_sequence
        self._output_names = [o.name for o in config.output]
        self._settings = settings
        self._start_stub = start_stub
        self._stub: StubProcess | None = stub
        self._channel: TrioChannel | None = None
        self._nursery: trio.Nursery | None = None
        self._ready = trio.Event()
        self._fatal: TritonError | None = None
        self._hang: str | None = None
        self._failures = 0
        self._calls: dict[int, Call] = {}
        self._open: dict[int, Open] = {}
        self._bls_requests: dict[int, InferenceRequest] = {}
        self._ids = itertools.count(1)
        self._readiness = Readiness()
        # Set while a stub that died with nothing in flight waits for the next
        # request to be restarted; that request gets ``_dead``.
        self._wanted: trio.Event | None = None
        self._dead: TritonError | None = None
        # The stub's replies on the lane are read by the task waiting for one
        # (an execute), or by a task of the nursery after that one was cancelled;
        # ``_pump_scope`` is the scope its wait runs in, cancelled to stop it.
        self._pumping = False
        self._pump_scope: trio.CancelScope | None = None
        self._quiet: trio.Event | None = None  # set when the reading task stops
        # (messages, event): the event is set once the reader has handled that
        # many of the stub's socket messages (see _pump).
        self._handed_wait: tuple[int, trio.Event] | None = None
        # A reply taken from the lane that waits for the socket to catch up.
        self._held_reply: tuple | None = None
        # The server's budget of bytes held for clients, once a request brought
        # it: the stub is told each time it turns full or has room, so that the
        # model's response senders wait for room (numbered: the latest wins).
        self._budget: ClientBudget | None = None
        self._budget_notices = itertools.count(1)
        self._budget_flipped = False

    def runs_direct(self) -> bool:
        """Whether a batch would start at once and only wait for its answer (see
        DirectAsyncBackendInstance): the stub is up and has no call, and the
        model is not decoupled (its requests' streams count on the scheduler
        holding a request before its responses come)."""
        return (
            self._channel is not None
            and not self._calls
            and not self._pumping
            and not self._decoupled
        )

    @property
    def pid(self) -> int | None:
        """The stub's process id (for tests and logs)."""
        return self._stub.pid if self._stub is not None else None

    # -- the actor -----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            stub = self._stub
            assert stub is not None  # given at creation, then started by _restart
            try:
                how = await self._serve(stub)
            except BaseException:
                # Stopped (unload, shutdown): a call awaited in a submitting
                # task (DirectAsyncBackendInstance) ends now; they stay in
                # _calls, so ``close`` kills the busy stub instead of finalizing it.
                stopped = Unavailable(f"model instance '{self.spec.name}' was stopped")
                for call in self._calls.values():
                    call.results = [stopped] * len(call.requests)
                    call.finish()
                raise
            # Triton's wording (python_be.cc RespondErrorToAllRequests, and
            # stub_launcher.cc), then how the stub ended.
            name = self.spec.name
            error = InternalError(
                f"Failed to process the request(s) for model instance '{name}', message: "
                f"Stub process '{name}' is not healthy: the stub process {how}"
            )
            log.error("stub process failed", source=self.label, reason=how)
            busy = bool(self._calls or self._open)
            self._fail_everything(error)
            self._stub = None
            if not busy:
                # Nobody was told: the model is not ready (check_ready) until the
                # next request, which fails with the reason and restarts the stub
                # (python_backend's restart on the next execute, qa/L0_backend_python
                # restart; python_be.cc TRITONBACKEND_ModelInstanceReady).
                self._dead, self._wanted = error, trio.Event()
                await self._wanted.wait()
                self._dead = self._wanted = None
            await self._restart(how)

    async def _serve(self, stub: StubProcess) -> str:
        """Serve one stub until it is gone; how it ended."""
        channel = TrioChannel(stub)
        self._hang = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery, self._channel = nursery, channel
                if self._budget is not None and self._budget.full:
                    self._budget_changed(True)
                self._ready.set()
                await self._read(channel)
                nursery.cancel_scope.cancel()
        finally:
            self._channel = self._held_reply = None
            self._ready = trio.Event()
            self._stop_pump()
            channel.close()
            self._readiness.stub_gone()
        how = await trio.to_thread.run_sync(stub.wait_exit)
        stub.close()
        if self._hang is not None:
            return self._hang
        return how + (" while executing" if self._calls else "")

    async def _restart(self, how: str) -> None:
        """Start a new stub after a backoff; raise once too many failed in a row."""

        def start() -> None:
            # Kept on self at once, so that ``close`` ends it if we are cancelled.
            self._stub = self._start_stub()

        while True:
            self._failures += 1
            if self._failures > self._settings.max_restarts:
                self._fatal = Unavailable(
                    f"{self.label}: the stub process failed {self._failures} times in a "
                    f"row; not restarting it (last: the stub process {how})"
                )
                self._ready.set()  # executes waiting for a stub fail with the reason
                raise self._fatal
            delay = min(BACKOFF_CAP_SECONDS, BACKOFF_SECONDS * 2 ** (self._failures - 1))
            log.warning("restarting stub process", source=self.label, in_s=delay)
            await trio.sleep(delay)
            try:
                await trio.to_thread.run_sync(start)
            except TritonError as exc:
                how = f"could not be restarted: {exc.message}"
                continue
            log.info("stub process restarted", source=self.label, pid=self.pid)
            return

    def _fail_everything(self, error: TritonError) -> None:
        self._stop_pump()
        self._settled()
        for call in self._calls.values():
            call.results = None if self._decoupled else [error] * len(call.requests)
            call.finish()
        self._calls.clear()
        for entry in self._open.values():
            entry.request.fail(error)
        self._open.clear()

    # -- execute ---------------------------------------------------------------------

    async def execute_async(
        self, requests: list[InferenceRequest], ahead: Ahead | None = None
    ) -> ExecuteResult | None:
        """Run one batch in the stub.

        Returns one response or error per request, or None when the requests are
        answered as the model sends their responses (decoupled models, and
        models that answer through response senders).
        """
        while self._channel is None:
            if self._fatal is not None:
                raise self._fatal
            if self._dead is not None and self._wanted is not None:
                dead = self._dead
                self._wanted.set()
                if not self._decoupled:
                    return [dead] * len(requests)
                for request in requests:
                    request.fail(dead)
                return None
            await self._ready.wait()
            if self._fatal is not None:
                raise self._fatal
        channel = self._channel
        if self._budget is None and self._decoupled and requests[0].budget is not None:
            self._budget = requests[0].budget
            self._budget.subscribe(self._budget_changed)
        call, message = self._start(channel, requests)
        if message is not None:
            try:
                await channel.send(message)
            except _GONE:
                pass  # the stub is gone; the reader fails this call
        await self._await_timed(channel, call, ahead)
        return call.results

    async def execute_ahead(
        self, requests: list[InferenceRequest], ahead: Ahead
    ) -> ExecuteResult | None:
        """:meth:`execute_async`, posting the batches ``ahead`` gives behind the
        one the stub runs while it waits (see PipelinedAsyncBackendInstance)."""
        return await self.execute_async(requests, ahead if not self._decoupled else None)

    async def settle(self, ahead: Ahead) -> None:
        """Await the calls posted ahead, in turn, as :meth:`execute_async` awaits
        its own (posting more meanwhile), until none is in flight."""
        while self._calls:
            channel = self._channel
            if channel is None:
                return  # no stub: run() fails its calls
            await self._await_timed(channel, next(iter(self._calls.values())), ahead)

    def _start(
        self,
        channel: TrioChannel,
        requests: list[InferenceRequest],
        on_done: Callable[[ExecuteResult | None, float], None] | None = None,
    ) -> tuple[Call, dict | None]:
        """Post a call on the lane; the socket message to send instead if it
        cannot go there."""
        entries, keys = [], []
        for request in requests:
            key = next(self._ids)
            entry, blocks = request_message(key, request, channel.endpoint, self._output_names)
            entries.append(entry)
            keys.append(key)
            self._open[key] = Open(request, blocks, cancel_sent=request.cancelled)
            request.on_cancel(functools.partial(self._forward_cancel, key))
        call_id = next(self._ids)
        call = Call(requests, keys, on_done=on_done)
        self._calls[call_id] = call
        if self._post(channel, call_id, entries):
            return call, None
        call.socket = True
        return call, {"op": "execute", "id": call_id, "requests": entries}

    # -- readiness ------------------------------------------------------------------------

    async def check_ready(self) -> None:
        """Triton's instance readiness (python_be.cc TRITONBACKEND_ModelInstanceReady):
        the stub must be alive, and a model with ``is_ready()`` must say True within
        5 s. One call is in flight at a time; checks that come meanwhile wait for
        its answer (RunUserModelReadinessCheck)."""
        name = self.spec.name
        stub, channel = self._stub, self._channel
        if stub is None or channel is None or stub.process.poll() is not None:
            raise InternalError(f"Stub process '{name}' is not healthy.")
        if stub.has_is_ready:
            await self._readiness.ask(name, channel, next(self._ids), _GONE)

    # -- the stub's messages -------------------------------------------------------------

    async def _read(self, channel: TrioChannel) -> None:
        while True:
            handed_wait = self._handed_wait
            if handed_wait is not None and channel.handed >= handed_wait[0]:
                handed_wait[1].set()
            message = await channel.receive()
            if message is None:
                return
            op = message["op"]
            if op == "executed":
                self._executed(
                    message["id"], message["error"], message["rescheduled"], message["responses"]
                )
                self._stop_pump()  # its waiter looks again
            elif op == "response":
                self._response(channel, message)
            elif op == "bls":
                assert self._nursery is not None
                self._nursery.start_soon(self._bls, channel, message)
            elif op == "bls_cancel":
                self._bls_cancel(message["call"])
            elif op == "log":
                log_stub_line(self.label, message["level"], message["message"])
            elif op == "ready_state":
                self._readiness.answered(message)
            elif op == "control":
                assert self._nursery is not None
                self._nursery.start_soon(self._control, channel, message)
            elif op == "metric":
                reply = channel.metrics.handle(channel.metrics_owner, message)
                if reply is not None:
                    self._send_soon(channel, reply)
            if channel.endpoint.should_flush():
                self._send_soon(channel, {"op": "free"})
            if self._budget_flipped:
                # The notice goes before the next message is read: a stub that
                # keeps this loop busy would otherwise never be told.
                self._budget_flipped = False
                await trio.lowlevel.checkpoint()

    async def _control(self, channel: TrioChannel, message: dict) -> None:
        """A model loading API call from ``execute``: answered when it is done."""
        if channel.control is None:
            reply = {
                "op": "control_reply",
                "call": message["call"],
                "result": None,
                "error": "the model loading API is not available here",
            }
        else:
            reply = await channel.control.handle(message)
        try:
            await channel.send(reply)
        except _GONE:
            pass  # the stub is gone

    def _budget_changed(self, full: bool) -> None:
        """Tell the stub that the budget of bytes held for clients turned full
        (its senders wait) or has room again."""
        channel = self._channel
        if channel is not None:
            notice = next(self._budget_notices)
            self._send_soon(channel, {"op": "budget", "full": full, "notice": notice})
            self._budget_flipped = True

    def _send_soon(self, channel: TrioChannel, message: dict) -> None:
        async def send() -> None:
            try:
                await channel.send(message)
            except _GONE:
                pass  # the stub is gone; the reader will notice

        assert self._nursery is not None
        self._nursery.start_soon(send)

    def _close_open(self, key: int) -> None:
        entry = self._open.pop(key, None)
        if entry is None:
            return
        entry.request.on_cancel(None)
        if entry.blocks and self._stub is not None:
            self._stub.endpoint.arena.free(entry.blocks)

    def _forward_cancel(self, key: int) -> None:
        """The client cancelled a request the stub has: its model's
        ``is_cancelled()`` turns true now, not at the model's next response."""
        entry = self._open.get(key)
        channel = self._channel
        if entry is None or entry.cancel_sent or channel is None:
            return
        entry.cancel_sent = True
        self._send_soon(channel, {"op": "cancel", "keys": [key]})

    def _executed(
        self,
        call_id: int,
        raised: str | None,
        rescheduled_keys: list[int],
        responses: list[EncodedResponse | None] | None,
    ) -> None:
        """The stub's reply to an execute (from the lane or the socket)."""
        stub = self._stub
        assert stub is not None  # messages come from the stub being served
        self._failures = 0
        call = self._calls.pop(call_id, None)
        following = next(iter(self._calls.values()), None)
        if following is not None and following.behind:  # the stub starts it now
            following.started, following.behind = trio.current_time(), False
        if call is None:
            for encoded in responses or ():
                release_outputs(encoded, stub.endpoint)
            return
        rescheduled = set(rescheduled_keys) if rescheduled_keys else ()
        if raised is not None:
            # Logged as Triton's stub logs it (pb_stub.cc ProcessRequests).
            log.error("execute raised", source=self.label, error=raised)
            error = InternalError(raised)
            for key, request in zip(call.keys, call.requests):
                self._close_open(key)
                if self._decoupled:
                    request.fail(error)
            call.results = None if self._decoupled else [error] * len(call.requests)
        elif responses is not None:
            endpoint = stub.endpoint
            outcomes: list[InferenceResponse | TritonError | None] = []
            sent = False  # a request answered through its response sender
            for key, request, encoded in zip(call.keys, call.requests, responses):
                if key in rescheduled:
                    refused = self._reschedule(key, request)
                    sent = sent or refused is None
                    outcomes.append(refused)
                    continue
                if encoded is None:
                    sent = True
                    outcomes.append(None)
                    continue
                self._close_open(key)
                outcomes.append(read_response(encoded, endpoint, request, self.model_version))
            if sent:
                for request, outcome in zip(call.requests, outcomes):
                    if outcome is not None:
                        deliver(request, outcome)
            else:
                call.results = outcomes  # type: ignore[assignment]  # no None: none sent
        else:
            for key, request in zip(call.keys, call.requests):
                if key in rescheduled:
                    refused = self._reschedule(key, request)
                    if refused is not None:
                        request.fail(refused)
        call.finish()

    def _reschedule(self, key: int, request: InferenceRequest) -> TritonError | None:
        """The model released ``request`` with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
        this execution of it is over, and its scheduler queues it again. A model
        whose scheduler cannot do that gets Triton's error (core infer_request.cc,
        the outermost release callback)."""
        self._close_open(key)
        if not self._reschedulable:
            return InvalidArgument(
                "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while "
                "the model is not configured to handle such a flag."
            )
        request.rescheduled = True
        return None

    def _response(self, channel: TrioChannel, message: dict) -> None:
        """A response (or the final flag) a model sent through a response sender."""
        key, encoded, final = message["key"], message["response"], message["final"]
        entry = self._open.get(key)
        if entry is None:
            release_outputs(encoded, channel.endpoint)
            return
        request = entry.request
        outcome = (
            None
            if encoded is None
            else read_response(encoded, channel.endpoint, request, self.model_version)
        )
        deliver_sent(request, outcome, final, self._decoupled)
        if not final and request.done:
            # Answered already (a failure, or a model that is not decoupled): the
            # model's is_cancelled() says so, and what it still sends is dropped.
            self._forward_cancel(key)
            final = True
        if final:
            self._close_open(key)

    async def _bls(self, channel: TrioChannel, message: dict) -> None:
        """One BLS request of the model (:func:`.bls.serve_stub_bls`)."""
        key = message.get("trace")  # the request whose trace it is a child of, if any
        parent = None if key is None else self._open.get(key)
        await serve_stub_bls(
            self._inference,
            channel,
            message,
            self._bls_requests,
            self.label,
            _GONE,
            None if parent is None else parent.request.trace,
        )

    def _bls_cancel(self, call: int) -> None:
        """``ResponseIterator.cancel()``: cancel the called request (pb_bls_cancel)."""
        request = self._bls_requests.get(call)
        if request is not None:
            request.cancelled = True

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Finalize the model and end the stub (blocking; after ``run`` ended)."""
        if self._budget is not None:
            self._budget.unsubscribe(self._budget_changed)
        stub, self._stub = self._stub, None
        if stub is not None:
            # A stub still busy in execute (hung) could not finalize: end it.
            stub.stop(finalize=not self._calls)
