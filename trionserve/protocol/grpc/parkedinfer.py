"""How a parked ModelInfer call goes on (:mod:`~trionserve.protocol.grpc.parking`).

A ModelInfer call whose answer is armed for the instance's thread
(:mod:`~trionserve.protocol.grpc.answer`) parks once its request is queued
(``service.model_infer``: the data plane's ``begin``): its handler returns, and
no coroutine waits for the outcome. At c=1 the client's next call brings the
sweep that delivers the outcome (after h2 saw that read: ``Connection._read``),
and the outcome's callback, :meth:`ParkedInfer.__call__`, ends a call the
thread answered right there with plain calls (``dataplane.answered``; then
the connection's ``_ended``, which lets the request's bytes go), instead of
resuming the six coroutine frames that awaited it or carrying it on after the
read. Any other outcome goes the awaited way,
:meth:`ParkedInfer.rest`: the rest of ``model_infer`` and of the unary handler
(``unary.unary_method``).

The call's armed answer and how it goes on are one object, a
:class:`~trionserve.protocol.grpc.answer.CallAnswer` that is a ``Parked``; a
call that ends the common way (:meth:`ParkedInfer.__call__`) leaves it to its
connection, which arms it again for the next call (``answer.arm``): nothing
refers to it any more then (taken: not the connection's nor the request's
answer; the handler returned as it parked; the outcome's callback spent), unless
the loop took its thread's write in progress (the thread may still hand it the
write's rest), which keeps it from being armed again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from trionserve.core.errors import TritonError, as_triton_error
from trionserve.protocol.grpc import codec as grpc_codec
from trionserve.protocol.grpc import infercache as grpc_infercache
from trionserve.protocol.grpc.answer import ANSWERED, DISARMED, PARTIAL, WRITTEN, CallAnswer
from trionserve.protocol.grpc.parking import Parked
from trionserve.protocol.grpc.unary import grpc_error

if TYPE_CHECKING:
    from trionserve.core.inference import InferenceRequest
    from trionserve.dataplane import DataPlane
    from trionserve.lifecycle import Lifecycle
    from trionserve.protocol.grpc.call import GrpcCall
    from trionserve.protocol.grpc.connection import Connection

__all__ = ["ParkedInfer"]

log = structlog.get_logger(__name__)


class ParkedInfer(CallAnswer, Parked):
    """A ModelInfer call's armed answer, which is also how the call goes on
    once parked, its request ``run`` queued (``dataplane.begin``; ``dataplane``
    and ``run`` set by the caller before it parks): exactly one of
    :meth:`__call__` (the outcome's callback) and :meth:`rest` ends it. One object per call, not
    two; one per connection while calls end the common way (the connection's
    ``spare``, armed again: ``answer.arm``)."""

    __slots__ = ("dataplane", "run")

    def __init__(self, conn: Connection, call: GrpcCall, request: InferenceRequest) -> None:
        super().__init__(conn, call, request)
        self.dataplane: DataPlane | None = None
        self.run: Lifecycle | None = None

    def __call__(self) -> None:
        """The request's outcome (its ``on_final``, set as the call parked:
        ``ParkedCalls.park``). Delivered by the reader's sweep with the
        thread's answer written (taken as the outcome came:
        ``CallAnswer.finalized``), the call not reset, and nothing to await
        for it (untraced, ``run.plain``), the call ends here: the request
        ends (``dataplane.answered``: its outcome not taken; an error after
        the answer is dropped, the client has the answer, as ``model_infer``
        drops it), then the call with its bytes (``Connection._ended``: the
        buffer's ``close`` releases the work ``answered_all`` would, and wakes
        receivers waiting for room as it does). Nothing refers to this answer
        any more then unless the loop took the thread's write in progress
        (``_token`` set: the thread may still report it): else it is the
        connection's spare, armed again for its next call, and the call its
        ``spare_call``, made a later call (``GrpcCall.again``). Any other call
        goes on as ``ParkedCalls._carry`` says (its handler's :meth:`rest`;
        ``Parked.ended`` is False for it)."""
        conn = self._conn
        call = self._call
        if conn._parked.pop(call, None) is None:  # (gone on in a task already)
            return
        run = self.run
        state = self.state
        assert run is not None and self.dataplane is not None
        if (
            not conn._sweeping
            or (state != WRITTEN and state != PARTIAL)
            or call.state.reset
            or run.trace is not None
            or not run.plain
        ):
            conn._carry(call, self)
            return
        try:
            self.dataplane.answered(run)
        except Exception:
            log.exception("grpc method failed", method=call.method)
        self.run = None
        if self._token is None and conn.answer is not self:
            conn.spare = self
            # Nor anything to the call: it makes a later call (Connection._on_request).
            conn.spare_call = call
        conn._ended(call)

    async def rest(self, call: GrpcCall) -> object:
        """``model_infer`` and the unary handler from the wait for the outcome
        on: the answer taken, or the response encoded and sent; a failure as
        the handler answers it."""
        run = self.run
        assert run is not None and self.dataplane is not None
        try:
            try:
                response = await self.dataplane.finish(run)
            finally:
                # (failed or cancelled after the thread's answer: the client has it)
                taken = self.take()
            if taken != DISARMED:
                message = ANSWERED
            else:
                request = run.request
                message = grpc_infercache.encode_response(
                    response, request
                ) or grpc_codec.encode_infer_response(response, request, None, None)
        except TritonError as error:
            raise grpc_error(error) from None
        except Exception as exc:
            log.exception("grpc method failed", method=call.method)
            raise grpc_error(as_triton_error(exc, "internal error")) from None
        await call.send(message)
        return None
