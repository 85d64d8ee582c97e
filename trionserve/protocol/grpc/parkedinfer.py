"""How a parked ModelInfer call goes on (:mod:`~trionserve.protocol.grpc.parking`).

A ModelInfer call whose answer is armed for the instance's thread
(:mod:`~trionserve.protocol.grpc.answer`) parks once its request is queued
(``service.model_infer``: the data plane's ``begin``): its handler returns, and
no coroutine waits for the outcome. At c=1 the client's next call brings the
sweep that delivers the outcome; then :meth:`ParkedInfer.ended` ends the call
in the reader with plain calls (``dataplane.end``, then the connection's
``_ended``, which lets the request's bytes go), instead of resuming the six
coroutine frames that awaited it. Any other outcome goes the awaited way,
:meth:`ParkedInfer.rest`: the rest of ``model_infer`` and of the unary handler
(``unary.unary_method``).
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
    from trionserve.dataplane import DataPlane
    from trionserve.lifecycle import Lifecycle
    from trionserve.protocol.grpc.call import GrpcCall

__all__ = ["ParkedInfer"]

log = structlog.get_logger(__name__)


class ParkedInfer(Parked):
    """A ModelInfer call parked with its answer armed, its request ``run``
    queued (``dataplane.begin``): exactly one of :meth:`ended` (True) and
    :meth:`rest` ends it."""

    __slots__ = ("_answer", "_call", "_dataplane", "_run")

    def __init__(
        self, dataplane: DataPlane, call: GrpcCall, run: Lifecycle, answer: CallAnswer
    ) -> None:
        self._dataplane = dataplane
        self._call = call
        self._run = run
        self._answer = answer

    def ended(self) -> bool:
        """The outcome came with the thread's answer written (taken as the
        outcome came: ``CallAnswer.finalized``) and nothing to await for it:
        the request ends (its error, if it failed after the answer, is
        dropped: the client has the answer, as ``model_infer`` drops it). The
        call's bytes are let go with the call (``Connection._ended``, next:
        the buffer's ``close`` releases the work ``answered_all`` would, and
        wakes receivers waiting for room as it does)."""
        run = self._run
        state = self._answer.state
        if (state != WRITTEN and state != PARTIAL) or run.trace is not None or not run.plain:
            return False
        try:
            self._dataplane.end(run)
        except TritonError:
            pass
        except Exception:
            log.exception("grpc method failed", method=self._call.method)
        return True

    async def rest(self, call: GrpcCall) -> object:
        """``model_infer`` and the unary handler from the wait for the outcome
        on: the answer taken, or the response encoded and sent; a failure as
        the handler answers it."""
        run = self._run
        try:
            try:
                response = await self._dataplane.finish(run)
            finally:
                # (failed or cancelled after the thread's answer: the client has it)
                taken = self._answer.take()
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
