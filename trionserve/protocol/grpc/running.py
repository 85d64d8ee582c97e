"""Running a connection's calls: started after the read that brought them, in
the reader's own task until they would wait (:mod:`~trionserve.protocol.grpc.inline`),
parked in no task (:mod:`~trionserve.protocol.grpc.parking`), or in a task of
their own; each ended with its status, and let go. A part of
:class:`~trionserve.protocol.grpc.connection.Connection`, apart for its size.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
import trio

from trionserve.observability.logging import SETTINGS as LOGGING
from trionserve.observability.logging import log_grpc_state
from trionserve.protocol.grpc import inline
from trionserve.protocol.grpc.parking import PARKED, PARKED_KINDS, Handler, Parked
from trionserve.protocol.grpc.state import ResponseEvent
from trionserve.protocol.grpc.status import GRPCError, Status
from trionserve.protocol.grpc.writing import CLOSED

if TYPE_CHECKING:
    from trionserve.protocol.grpc.call import GrpcCall
    from trionserve.protocol.grpc.flow import ConnectionBuffer, Window
    from trionserve.protocol.grpc.state import ConnectionState

__all__ = ["CallRunner"]

log = structlog.get_logger(__name__)

_CUT_MESSAGE = (
    "the server is shutting down: the request was still running at the exit timeout "
    "(--exit-timeout-secs)"
)


class CallRunner:
    """The connection's running of its calls (a base of
    :class:`~trionserve.protocol.grpc.connection.Connection`, which sets the
    attributes below)."""

    calls: dict[int, GrpcCall]
    state: ConnectionState
    buffer: ConnectionBuffer
    writing: bool
    _written: trio.Event | None
    _starting: list[tuple[GrpcCall, Handler | Parked]]
    _inline: GrpcCall | None
    _awaiting: dict[int, tuple[GrpcCall, Handler]]
    _reader_scope: trio.CancelScope | None
    _nursery: trio.Nursery | None
    _server_draining: trio.Event
    _idle: dict
    _clock: trio.abc.Clock
    idle_scope: trio.CancelScope | None
    idle_since: float | None
    idle_timeout: float
    _room: trio.lowlevel.ParkingLot
    _room_waiters: int
    # A call ended the common way (its answer the connection's spare, which
    # alone refers to it: ParkedInfer.__call__), made a later call (_on_request).
    spare_call: GrpcCall | None = None
    # (ParkedCalls', a base after this one)
    _go_on: Callable[[GrpcCall, Handler | Parked], None]

    def flush(self) -> None:
        raise NotImplementedError

    def _give(self, windows: list[Window]) -> None:
        raise NotImplementedError

    def _write_at_once(self) -> inline.Resume | None:
        raise NotImplementedError

    async def _write_now(self, at_once: bool | None = None, first: list | None = None) -> None:
        raise NotImplementedError

    async def _write_pending(self) -> None:
        raise NotImplementedError

    async def _read(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    async def _start_calls(self) -> bool:
        """Start the calls whose HEADERS came in the last read, then write what
        they answered; True when this task stays with a call (a new one reads on).

        A unary call whose request came whole runs here, in the reader's task
        and the read's order, until it ends or would wait, as an HTTP/1.1
        request runs in its connection's: most end, answered (a batch an idle
        instance runs inline runs in the submitting task), written with the
        read's other output in one write, with no task of their own and no pass
        of the run loop more. One that would wait has made this task its own
        (inline.step) and keeps it; the calls after it, and any other, get tasks.

        A call run here has no cancel scope of its own while it runs without
        waiting (nothing can cancel it then: neither a reset nor its deadline,
        which take a pass of the run loop); one that keeps the task takes the
        task's scope (_read) as its own, its deadline with it. A call reset
        already runs in a scope of its own, cancelled at once. A parked call
        with its outcome ends here if it can (``Parked.ended``), else its
        handler's rest runs as a handler (parking.py)."""
        starting, self._starting = self._starting, []
        for index, (call, entry) in enumerate(starting):
            # A handler, or a parked call's Parked (typed Any: told apart by its
            # type, without an isinstance call).
            carried: Any = entry
            if type(carried) in PARKED_KINDS:  # parked: its request has its outcome
                if not call.state.reset and carried.ended():
                    self._ended(call)
                    continue
                carried = carried.rest
            handler: Handler = carried
            if call.client_streaming or not call.state.client_done:
                if call.client_streaming or call.deadline is not None or call.state.reset:
                    self._spawn(call, handler)
                else:  # started here once its request is whole (_release)
                    self._awaiting[call.stream_id] = (call, handler)
                continue
            self._inline = call
            kept = None if call.state.reset else self._reader_scope
            if kept is None or LOGGING.log_verbose_level >= 2:  # (StateNew logged first)
                resume = inline.step(self._run_call(call, handler, kept))
            else:
                # The handler's first step taken here, not under _run_call: a
                # call it parks needs nothing more of _run_call (two Python
                # calls fewer), one it ended is ended here as _run_call ends
                # it (OK: its trailers, then _ended); any other goes on through
                # _run_call from where the handler stands, as if _run_call had
                # taken the step.
                # (ModelInfer's handler steps its handle itself: unary._direct)
                direct = getattr(handler, "direct", None)
                first: Awaitable[object] | None = None
                try:
                    coroutine: Any = handler(call) if direct is None else direct(call)
                    message = None if coroutine is PARKED else coroutine.send(None)
                except StopIteration as stop:
                    if stop.value is not PARKED:
                        try:
                            if call.state.answerable:
                                call.finish(Status.OK, None)
                        finally:
                            self._ended(call)
                except BaseException as exc:
                    first = inline.Failed(exc)
                else:
                    if coroutine is not PARKED:  # (else parked by _direct's step)
                        first = inline.Resume(coroutine, message)
                resume = None
                if first is not None:
                    resume = inline.step(self._run_call(call, handler, kept, first))
            self._inline = None
            if resume is not None:
                if kept is not None:  # the call keeps this task, and its scope
                    call.scope = kept
                    if call.deadline is not None:
                        kept.deadline = call.deadline
                rest = starting[index + 1 :]
                break
        else:
            rest = []
            resume = self._write_at_once()
            if resume is None:  # all written
                return False
        # This task stays with what would wait (a call, or the rest of the write).
        for call, entry in rest:
            self._go_on(call, entry)
        self.flush()
        assert self._nursery is not None
        self._nursery.start_soon(self._read)
        await resume
        return True

    def _spawn(self, call: GrpcCall, handler: Handler) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._run_call, call, handler)

    async def _run_call(
        self,
        call: GrpcCall,
        handler: Handler,
        kept: trio.CancelScope | None = None,
        first: Awaitable[object] | None = None,
    ) -> None:
        """Run the handler under the call's deadline and end the call with its
        status (none when there is nobody left to answer). ``kept``: the scope
        the call takes as its own if it keeps the reader's task (_start_calls),
        its cancellation caught here; else the handler runs in a scope of its
        own. ``first`` (with ``kept``): the handler after its first step,
        taken by _start_calls, awaited instead of the handler. (All in this
        coroutine: each frame more would be one call more each time the call
        waits and is carried on.) A call its handler parked
        (PARKED) goes on without this coroutine (parking.py)."""
        if LOGGING.log_verbose_level >= 2:  # (Triton's verbose lines: nothing else)
            log_grpc_state("StateNew", call.method, call.stream_id)
        parked = False
        try:
            if kept is not None:  # (the handler awaited here: no _status frame)
                cancelled = False
                try:
                    parked = await (handler(call) if first is None else first) is PARKED
                except trio.Cancelled:
                    # (the scope it took: the task's it kept)
                    if call.scope is None or not call.scope.cancel_called:  # the connection's
                        raise
                    cancelled = True
                except Exception as exc:
                    status, message = self._failed(call, exc)
                else:
                    status, message = Status.OK, None
            else:
                with trio.CancelScope() as scope:
                    call.scope = scope
                    if call.state.reset:  # reset before this task started: nobody to answer
                        scope.cancel()
                    if call.deadline is not None:
                        scope.deadline = call.deadline
                    status, message = await self._status(call, handler)
                cancelled = scope.cancelled_caught
            if call.state.answerable and not parked:
                if cancelled:
                    call.finish(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")
                else:
                    call.finish(status, message)
        except BaseException:
            # Cancelled (alone or grouped by the handler's nursery): when the server
            # is draining, that is the exit timeout cutting the call.
            if self._server_draining.is_set() and call.state.answerable:
                await self._cut(call)
            raise
        finally:
            if not parked:
                self._ended(call)
        if self._inline is call:  # the reader writes it after the read
            return
        if kept is not None and call.scope is not None and call.scope.cancel_called:
            self.flush()  # this task is cancelled: the writer writes it
        else:
            await self._write_now()

    def _ended(self, call: GrpcCall) -> None:
        """The call is over (_run_call; _start_calls: parked): it leaves."""
        if LOGGING.log_verbose_level >= 2:
            log_grpc_state("StateRelease", call.method, call.stream_id, call.state.reset)
        self.calls.pop(call.stream_id, None)
        if not self.calls and not self.state.closing:  # idle
            self._idle[self] = None
            self.idle_since = now = self._clock.current_time()
            idle = self.idle_scope
            if idle is not None and idle.deadline == math.inf:
                idle.deadline = now + self.idle_timeout
        working = call.account.working
        if windows := self.buffer.close(call.account):
            self._give(windows)
        if working and self._room_waiters:  # receivers wait for room: there may be some
            self._room.unpark_all()
        if self.state.draining and not self.calls:
            self.close()

    @staticmethod
    async def _status(call: GrpcCall, handler: Handler) -> tuple[Status, str | None]:
        """Run the handler: the status it ends the call with (a call whose stream
        is gone is abandoned: nobody to answer)."""
        try:
            await handler(call)
        except Exception as exc:
            return CallRunner._failed(call, exc)
        return Status.OK, None

    @staticmethod
    def _failed(call: GrpcCall, exc: Exception) -> tuple[Status, str | None]:
        """The status a call whose handler raised ``exc`` ends with (called
        where it is caught)."""
        if isinstance(exc, GRPCError):
            return exc.status, exc.message
        if isinstance(exc, trio.BrokenResourceError):  # the stream is gone: nobody to answer
            call.state.response_event(ResponseEvent.ABANDON)
            return Status.OK, None
        log.exception("grpc handler failed", method=call.method)
        return Status.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"

    async def _cut(self, call: GrpcCall) -> None:
        """The server cut this call (its drain ended at the exit timeout): end it
        UNAVAILABLE, if the socket takes the trailers within a second."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + 1.0
            call.finish(Status.UNAVAILABLE, _CUT_MESSAGE)
            # The task writing now may be one being cancelled, which would leave
            # these trailers unwritten: wait for it, then write them from here.
            while self.writing:
                if self._written is None:
                    self._written = trio.Event()
                await self._written.wait()
            try:
                await self._write_pending()
            except (*CLOSED, OSError):
                pass
