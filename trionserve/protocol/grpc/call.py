"""One gRPC call as its method handler sees it.

A :class:`GrpcCall` carries its request metadata and deadline, takes request
messages and sends responses; its states are a :class:`~.state.CallState` and its
bytes an :class:`~.flow.Account` in its connection's buffer. The connection
(:mod:`~trionserve.protocol.grpc.connection`) feeds it what the client sends and
writes what it sends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import h2.errors
import h2.exceptions
import numpy as np
import trio

from trionserve.observability.logging import log_grpc_cancellation
from trionserve.protocol.grpc import framing as grpc_framing
from trionserve.protocol.grpc.answer import ANSWERED
from trionserve.protocol.grpc.flow import Account
from trionserve.protocol.grpc.framing import (
    CONTENT_TYPE,
    GZIP_RESPONSE_HEADERS,
    JOIN_LIMIT,
    OK_TRAILERS,
    RESPONSE_HEADERS,
    status_headers,
)
from trionserve.protocol.grpc.state import (
    CallState,
    Request,
    RequestEvent,
    Response,
    ResponseEvent,
)
from trionserve.protocol.grpc.status import GRPCError, Status, decode_metadata

if TYPE_CHECKING:  # the connection imports this module; no cycle at run time
    from trionserve.observability.trace.frontend import FrontendStamps
    from trionserve.protocol.grpc.connection import Connection

__all__ = ["GrpcCall", "Method"]

# Compressed messages up to this size are inflated on the event loop.
_INLINE_DECOMPRESS = 16 * 1024


@dataclass(frozen=True, slots=True)
class Method:
    """A handler and whether its client sends a stream of messages."""

    handler: Callable[[GrpcCall], Awaitable[object]]
    client_streaming: bool = False


class GrpcCall:
    """One call as its handler sees it.

    ``receive`` returns the next request message (None once the client finished
    sending, or, for client-streaming methods, once the server drains); its bytes
    count against the connection's buffer until the call ``answered`` them (a
    client-streaming handler, per request), its first response is sent (a unary
    call) or it ends; ``send`` writes one response message, waiting for HTTP/2
    flow control, and raises ``trio.BrokenResourceError`` once the stream is gone.
    A unary call's messages are sent by one task; a client-streaming call's may
    come from several at once. The handler ends the call by returning (OK) or
    raising :class:`GRPCError`.
    """

    __slots__ = (
        "method",
        "_headers",
        "_metadata",
        "deadline",
        "peer",
        "client_streaming",
        "state",
        "account",
        "error",
        "scope",
        "connection",
        "stream_id",
        "compress",
        "_encoding",
        # Made on first use (__getattr__): a call taken whole never feeds one.
        "reader",
        "_reading",  # (whether it was made: let go as the call is re-armed)
        "messages",
        "_wakeup",
        "window_waiter",
        "_send_lock",
        # Set only on a ModelInfer call that came while tracing was on: its
        # FrontendStamps (service._unary); unset otherwise (read with getattr).
        "stamps",
    )

    stamps: FrontendStamps

    def __init__(
        self,
        conn: Connection,
        account: Account,
        method: str,
        headers: Sequence[tuple[bytes, bytes]],
        deadline: float | None,
        client_streaming: bool,
        encoding: bytes,
        compress: bool,
        ended: bool = False,
    ) -> None:
        self.method = method
        self._headers = headers
        self._metadata: list[tuple[str, str | bytes]] | None = None
        self.deadline = deadline
        self.peer = conn.peer
        self.client_streaming = client_streaming
        self.state = CallState(ended)
        self.account = account
        self.error: GRPCError | None = None  # why a message was refused (Request.FAILED)
        # The cancel scope its handler runs in, once its task started.
        self.scope: trio.CancelScope | None = None
        self.connection = conn
        self.stream_id = account.stream_id
        self.compress = compress
        self._encoding = encoding
        self.messages: deque[grpc_framing.Message] = deque()  # received, not taken
        self._reading = False
        # Made as a task waits (most calls never wait): receive and send check
        # what they wait for right before, with no checkpoint between, so a
        # wake-up that comes before there is anything to set is not needed.
        self._wakeup: trio.Event | None = None
        self.window_waiter: trio.Event | None = None
        # Streaming calls' responses come from several tasks at once; a unary
        # call has one sender (its handler) and needs no lock.
        self._send_lock = trio.Lock() if client_streaming else None

    def again(
        self,
        account: Account,
        method: str,
        headers: Sequence[tuple[bytes, bytes]],
        deadline: float | None,
        encoding: bytes,
        compress: bool,
        ended: bool,
    ) -> None:
        """This ended unary call made the connection's next one (not client
        streaming: no send lock), ``__init__``'s per-call fields set again,
        ``account`` its own re-armed: for a call that ended the common way, which
        nothing refers to any more (``Connection.spare_call``). (Never traced:
        ``stamps`` is never set on it.)"""
        self.method = method
        self._headers = headers
        self._metadata = None
        self.deadline = deadline
        self.state.again(ended)
        self.account = account
        self.error = None
        self.scope = None
        self.stream_id = account.stream_id
        self.compress = compress
        self._encoding = encoding
        if self.messages:  # (its one message taken: none)
            self.messages.clear()
        if self._reading:
            del self.reader
            self._reading = False
        self._wakeup = self.window_waiter = None

    reader: grpc_framing.MessageReader

    def __getattr__(self, name: str) -> grpc_framing.MessageReader:
        """The call's message reader, made as it is first read (an unset slot
        comes here); no other attribute is made so."""
        if name != "reader":
            raise AttributeError(name)
        reader = self.reader = grpc_framing.MessageReader(
            self._encoding, self.connection.options.max_message_size, defer_decompression=True
        )
        self._reading = True
        return reader

    @property
    def metadata(self) -> list[tuple[str, str | bytes]]:
        """The request's metadata (custom headers), decoded on first use: most
        calls never look at it."""
        if self._metadata is None:
            self._metadata = decode_metadata(
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self._headers]
            )
        return self._metadata

    @property
    def draining(self) -> bool:
        """True once the server began shutting down."""
        return self.connection.state.draining

    async def receive(self) -> grpc_framing.Message | None:
        state = self.state
        while True:
            if self.error is not None:
                raise self.error
            if state.reset:
                raise trio.BrokenResourceError("the client reset the stream")
            if self.client_streaming and self.connection.state.draining:
                return None
            if self.messages:
                # Work not answered yet and responses the client does not take
                # hold new requests back (no checkpoint with room).
                size = len(self.messages[0])
                if not self.connection.buffer.has_room(size):
                    await self.connection.wait_for_room(size)
                if state.request is Request.RESET or self.error is not None:
                    continue  # raised above
                message = self.messages.popleft()
                self.connection.taken(self, len(message))
                if type(message) is grpc_framing.Compressed:
                    message = await self._decompress(message)
                return message
            if state.client_done:
                return None
            wakeup = self._wakeup
            if wakeup is None or wakeup.is_set():
                wakeup = self._wakeup = trio.Event()
            await wakeup.wait()

    def take_whole(self) -> grpc_framing.Message | None:
        """``receive``'s message without a wait, for a unary call whose request
        is whole: its one message, when the client sent exactly one and ended,
        nothing refused or reset, not compressed, and the buffer has room for
        it; else None (nothing taken: ``receive`` as ever)."""
        state = self.state
        messages = self.messages
        if not state.client_done or state.reset or self.error is not None or not messages:
            return None
        message = messages.popleft()
        if messages or type(message) is grpc_framing.Compressed:  # (receive's)
            messages.appendleft(message)
            return None
        conn = self.connection
        windows = conn.buffer.take(self.account, len(message))
        if windows is None:  # no room: receive waits for it
            messages.appendleft(message)
            return None
        if windows:
            conn._give(windows)
        return message

    async def _decompress(self, message: grpc_framing.Message) -> bytes:
        # Inflating can take many times the compressed size: large ones run in a
        # worker thread, so the event loop goes on serving everyone else.
        if len(message) <= _INLINE_DECOMPRESS:
            return self.reader.decompress(message)
        return await trio.to_thread.run_sync(self.reader.decompress, message)

    def answered(self) -> None:
        """The handler answered one of the messages it took (a request of a
        client-streaming call): its bytes (as received, the oldest taken's) no
        longer count against the connection's buffer."""
        self.connection.answered(self)

    async def send(self, message: bytes | Sequence[bytes | memoryview]) -> None:
        chunks: Sequence[bytes | memoryview]
        if message is ANSWERED:  # written by the instance's thread (answer.py)
            self.connection.answered_all(self)
            return
        if isinstance(message, (bytes, bytearray, memoryview)):
            chunks = [message]
        else:
            chunks = message
        conn = self.connection
        compressed = self.compress
        if self._send_lock is None:
            # A unary call's answer: its request's bytes are now its response's.
            conn.answered_all(self)
            state = self.state
            if not compressed and state.response is Response.IDLE and not state.reset:
                size = sum(map(len, chunks))
                # Small, in the windows, on a held stream: its headers and the
                # message written as their frames at once (upstream.send_unary),
                # never waiting, so never counted as waiting to be sent.
                if size + 5 <= JOIN_LIMIT and conn.h2.send_unary(
                    self.stream_id,
                    RESPONSE_HEADERS,
                    b"".join([grpc_framing.prefix(size), *chunks]),
                ):
                    state.response_event(ResponseEvent.HEADERS)
                    return
        if compressed:
            level = conn.options.response_compression_level or 0
            chunks = [grpc_framing.compress(b"".join(chunks), level)]
        size = sum(map(len, chunks))
        head = grpc_framing.prefix(size, compressed)
        conn.sending(size)
        try:
            if self._send_lock is None:
                await self._send_message(head, chunks, size)
                # The answer goes out with the trailers, written by the call's task
                # as it ends (Connection._run_call): no wakeup of the writer.
                return
            async with self._send_lock:
                await self._send_message(head, chunks, size)
        finally:
            conn.sending(-size)
        conn.flush()

    async def _send_message(
        self, head: bytes, chunks: Sequence[bytes | memoryview], size: int
    ) -> None:
        if self.state.reset:
            raise trio.BrokenResourceError("the client reset the stream")
        try:
            if self.state.response is Response.IDLE:
                headers = GZIP_RESPONSE_HEADERS if self.compress else RESPONSE_HEADERS
                self.state.response_event(ResponseEvent.HEADERS)
                self.connection.h2.send_headers(self.stream_id, headers)
            if size + 5 <= JOIN_LIMIT:
                await self._send_data([b"".join([head, *chunks])])
            else:
                await self._send_data([head, *chunks])
        except h2.exceptions.ProtocolError as exc:  # the stream or connection closed
            self.state.response_event(ResponseEvent.ABANDON)
            raise trio.BrokenResourceError(str(exc)) from exc

    async def _send_data(self, chunks: Sequence[bytes | memoryview]) -> None:
        h2conn = self.connection.h2
        stream_id = self.stream_id
        for chunk in chunks:
            if type(chunk) is bytes and h2conn.send_whole(stream_id, chunk):
                continue  # one frame, in the windows: made without h2's frame object
            # Large chunks go as uint8 views, written without copies (upstream.H2Connection).
            view = chunk if len(chunk) <= JOIN_LIMIT else np.frombuffer(chunk, np.uint8)
            while len(view):
                window = h2conn.local_flow_control_window(stream_id)
                if window <= 0:
                    self.connection.flush()
                    self.connection.hear()  # (a wait for a whole call ends)
                    await self.wait_for_window()
                    if self.state.reset:
                        raise trio.BrokenResourceError("the client reset the stream")
                    continue
                size = min(window, h2conn.max_outbound_frame_size, len(view))
                # cast: h2 annotates the data as bytes | memoryview; the uint8 array
                # views are upstream.H2Connection's own, written from their buffers.
                if size == len(view):
                    h2conn.send_data(stream_id, cast(memoryview, view))
                    break
                h2conn.send_data(stream_id, cast(memoryview, view[:size]))
                view = view[size:]

    def finish(self, status: Status, message: str | None) -> None:
        """End the call with ``status``: its trailers, or a trailers-only answer
        (queued in h2's output: the connection writes it)."""
        headers: list[tuple[bytes, bytes]]
        if self.state.response is Response.SENDING:
            headers = OK_TRAILERS if status is Status.OK else status_headers(status, message)
        else:  # "trailers only": one HEADERS frame carries the status
            headers = [(b":status", b"200"), CONTENT_TYPE, *status_headers(status, message)]
        self.state.response_event(ResponseEvent.FINISH)
        h2conn = self.connection.h2
        try:
            h2conn.send_headers(self.stream_id, headers, end_stream=True)
            if self.state.request is not Request.ENDED:
                # The client is still sending; tell it to stop.
                h2conn.reset_stream(self.stream_id, h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError:  # the stream or connection closed meanwhile
            pass

    async def wait_for_window(self) -> None:
        """Wait until the client may have given more window (or reset the stream)."""
        window = self.window_waiter
        if window is None or window.is_set():
            window = self.window_waiter = trio.Event()
        await window.wait()

    def reset_by_client(self) -> None:
        """The client reset the stream (cancelled the call): the handler's scope is
        cancelled; a call whose task has not started yet finds its state reset and
        runs under a cancelled scope (the connection's ``_run_call``)."""
        if self.state.response in (Response.IDLE, Response.SENDING):
            log_grpc_cancellation(self.method, self.stream_id)
        self.state.request_event(RequestEvent.RESET)
        self.state.response_event(ResponseEvent.ABANDON)
        if self.scope is not None:
            self.scope.cancel()
        self.wake()
        self.wake_sender()

    def wake(self) -> None:
        """Something changed for the call's receive (a message, the end, a reset,
        a drain)."""
        if self._wakeup is not None:
            self._wakeup.set()

    def wake_sender(self) -> None:
        """The client's window may have grown, or the stream is gone."""
        if self.window_waiter is not None:
            self.window_waiter.set()
