"""A call's message rest left in the socket for the instance's thread (gRPC's side of
:mod:`trionserve.protocol.later`).

A call read whole as predicted (:mod:`~trionserve.protocol.grpc.inflow`, ``_read_call``'s one
wait for the whole call) is read by the loop up to the start of its message's last raw contents
(where infercache cut the last message: ``infercache.raw_at``), which nothing on the loop reads.
When the socket holds the rest and the bytes between the message's two DATA frames are as the
last call's (peeked at their offset, nothing read: one ``MSG_PEEK`` ``recvmsg`` at
``SO_PEEK_OFF``, Linux 6.10, whose ``TCP_INQ`` says what the socket holds:
``LaterBody.offer_peeked``; the offset set by the last rest's reader, the thread, for the next
call), the rest (the first frame's rest, those bytes, the second frame's payload) is offered to
the connection's :class:`~trionserve.protocol.later.LaterBody` and the call taken as if read
whole. ModelInfer (:func:`decoded`, then :func:`place`) leaves it to the instance's thread where
the request's inputs are read by nothing before that thread (infercache cut the message as the
last one, decoding none of the rest, no
trace, no verbose log, the answer armed for the thread, a blocking backend:
``later.routed_on_thread``), else reads it at once; anything else that takes the call (the frame
loop, a call not as predicted, a refused call) finds it read first (:meth:`LaterReads._read_later`,
the receiver's reads: ``EagerReceiver.later``). Elsewhere (no ``SO_PEEK_OFF``, TLS, a smaller
message) the loop reads the whole call as before.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import trio
from h2.errors import ErrorCodes

from trionserve.actors.executor import INLINE_MAX_INPUT_BYTES
from trionserve.protocol import later as later_module
from trionserve.protocol.grpc import infercache
from trionserve.protocol.later import LaterBody

if TYPE_CHECKING:
    from trionserve.core.inference import InferenceRequest
    from trionserve.dataplane import DataPlane
    from trionserve.protocol.grpc.answer import CallAnswer
    from trionserve.protocol.grpc.call import GrpcCall
    from trionserve.protocol.sockets import EagerReceiver

__all__ = ["LaterReads", "decoded", "place"]

# The slot the thread reads the bytes between the DATA frames into (inflow.SLOT's size).
_SPARE = 64
# The only method whose message's rest is left in the socket (service.model_infer takes it).
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


class LaterReads:
    """A base of :class:`~trionserve.protocol.grpc.inflow.MessageReads`: the rest of a call's
    message left in the socket (``later``: made at the first call read so), where the message's
    bytes left begin (``later_at``), and the slot the thread reads the bytes between its DATA
    frames into (the loop checked them, peeked)."""

    later: LaterBody | None = None
    later_at: int = 0
    # The call layout (inflow's _call) later_at was found for: the next call of that layout
    # reuses it, no raw_at (decoded checks the message against the last one's cut anyway, and
    # forgets it when the message is not so cut).
    later_call: tuple[int, int, int] | None = None
    _call: tuple[int, int, int] | None
    _spare: memoryview
    socket: trio.socket.SocketType | None
    _starting: list

    def close(self, code: ErrorCodes = ErrorCodes.NO_ERROR) -> None:
        raise NotImplementedError

    def _left_for_infer(self) -> bool:
        """After a call read so was taken whole, not a ModelInfer one (whose handler takes its
        rest: :func:`decoded`; _take_read sees to that, and to a call with no rest left): its
        rest read now. False when that read failed (the connection closes)."""
        later = self.later
        if later is None or later.settle():
            return True
        self.close(ErrorCodes.PROTOCOL_ERROR)
        return False

    def _later_at(self, receiver: EagerReceiver, length: int, first: int) -> int:
        """Where a call of a message of ``length`` bytes, its first DATA frame
        holding ``first`` of them, may leave its message's rest to the instance's
        thread (protocol/later.py): the start of its last raw contents when the
        last message decoded was cut so (infercache.raw_at), inside the first
        frame, with more past it than a batch run on the loop may hold; 0: none."""
        at = infercache.raw_at(length)
        if not 0 < at < first or length - at <= INLINE_MAX_INPUT_BYTES:
            return 0
        later = self.later
        if later is None:
            socket = self.socket
            if socket is None or later_module.PEEK_OFF is None:
                return 0
            later = self.later = LaterBody(socket)
            self._spare = memoryview(bytearray(_SPARE))
            receiver.attach(later)
        self.later_at, self.later_call = at, self._call
        return at

    def _defer(
        self, at: int, first: int, views: tuple[memoryview, ...], received: int, total: int
    ) -> int:
        """A call read up to its message's last raw contents (``at``, inside its first DATA
        frame's ``first`` bytes; ``views`` as _read_call made them, ``received`` of its ``total``
        bytes read): when the socket holds its rest and the bytes between its DATA frames,
        peeked into the slot (``SO_PEEK_OFF``), the rest is left in the socket (``later``,
        offered once the call proves as predicted, else read: _read_later); else what it holds
        of the rest is read now. The bytes read of the call, as one readv would have."""
        _, prefix, slot, tail = views
        later = self.later
        assert later is not None
        part = prefix[at:first]
        spare = self._spare[: slot.nbytes]
        later.next_peek = received - at + first  # (the next call's slot, as this one's)
        if later.offer_peeked(part, slot, (spare, tail), total - received):
            return total
        try:
            more = os.readv(later.fd, (part, slot, tail))
        except BlockingIOError:
            more = 0
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc
        return received + more

    def _read_later(self) -> None:
        """A call whose rest was left in the socket (_defer) goes through the
        frame loop, or is not taken whole: its rest read now (the slot's bytes
        read again over those peeked, the same)."""
        later = self.later
        if later is not None and later.view is not None and not later.settle():
            raise trio.BrokenResourceError(later.broken)


def decoded(
    call: GrpcCall, data: bytes | bytearray | memoryview
) -> tuple[InferenceRequest | None, LaterBody | None]:
    """ModelInfer's first step: infercache's request of ``data``, this call's message (None:
    the codec's case), and the connection's rest of it still in the socket, if any, for
    :func:`place`. A message cut as the last one is decoded reading none of its rest (its last
    raw contents, from ``later_at`` on); any other has its rest read first."""
    conn = call.connection
    later = conn.later
    if later is None or later.view is None or later.view.obj is not getattr(data, "obj", None):
        return infercache.decode_request(data), None
    request = infercache.decode_request(data, conn.later_at)
    if request is None:
        conn.later_call = None  # (found again for the next call: raw_at)
        later.now()
        return infercache.decode_request(data), None
    return request, later


def place(
    later: LaterBody, answer: CallAnswer | None, dataplane: DataPlane, request: InferenceRequest
) -> None:
    """The rest (:func:`decoded`) left to the instance's thread, where the request's inputs are
    read by nothing before it (its answer armed for that thread, the model's instances blocking
    ones: ``later.routed_on_thread``, kept on the rest for the next call of the same model while
    the routes stand); else read now."""
    if later.view is None:
        return
    if answer is not None:
        routes = dataplane.registry.lifecycle
        known = later.routed
        if (
            known is not None
            and known[0] is routes
            and known[1] == routes.generation
            and known[2] == request.model_name
            and known[3] == request.model_version
            and known[4] == request.model_namespace
        ):
            on_thread = known[5]
        else:
            generation = routes.generation
            on_thread = later_module.routed_on_thread(dataplane, request)
            later.routed = (
                routes,
                generation,
                request.model_name,
                request.model_version,
                request.model_namespace,
                on_thread,
            )
        if on_thread:
            later.defer()
            return
    later.now()
