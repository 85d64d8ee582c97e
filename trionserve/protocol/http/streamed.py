"""A streamed answer (a handler's body an async iterator of chunks: server-sent events),
written as its chunks come, apart from :mod:`~trionserve.protocol.http.transport` for its size."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import trio

from trionserve.observability.trace.frontend import HTTP_STAMPS, FrontendStamps, now_ns
from trionserve.protocol.http.h1 import LAST_CHUNK, H1Connection, LastChunk, frame_chunk
from trionserve.protocol.sockets import send_all

__all__ = ["JOIN_LIMIT", "send_streamed"]

# Responses up to this size are joined with their head and written at once; larger bodies are
# written from their buffers, gathered (writev), without joining.
JOIN_LIMIT = 64 * 1024

# Runs a write of so many bytes counted in the client budget as held for the client.
Held = Callable[[int, Awaitable[None]], Awaitable[None]]


async def send_streamed(
    h1: H1Connection,
    stream: trio.abc.SendStream,
    draining: bool,
    held: Held,
    status: int,
    headers: list[tuple[bytes, bytes]],
    chunks: AsyncIterator[bytes],
) -> None:
    """Write the head, then each chunk as the iterator yields it (chunked transfer encoding; to
    an HTTP/1.0 client as is, ending with the close); the iterator is closed however this ends
    (a client gone mid-stream included). The head is written with the first chunk, the end of
    the body with a :class:`LastChunk`, and a chunk the socket takes at once without a
    checkpoint (the iterator's wait for its next chunk is one)."""
    stamps = HTTP_STAMPS.get()
    try:
        head = h1.start_response(status, headers, draining, streamed=True)
        if h1.head_only:
            await send_all(stream, head)
            return
        chunked = h1.chunked_response
        # The head goes out with the first chunk: one write, not two, for the first event (a
        # streamed answer's body is made once its first response is there, so its first chunk is
        # not waited for).
        waiting: bytes = head
        async for chunk in chunks:
            if chunk:
                waiting += frame_chunk(chunk) if chunked else chunk
            if type(chunk) is LastChunk:
                break  # the end of the body goes with it
            if chunk:
                # Written from ``waiting``: the chunk itself is let go, not held twice while a
                # slow client takes it.
                chunk = b""
                await _send_chunk(stream, held, waiting, stamps)
                waiting = b""
        last = waiting  # the last chunk's data, if any, goes with the end
        if chunked:
            waiting += LAST_CHUNK
        if waiting:
            await _send_chunk(stream, held, waiting, stamps if last else None)
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            with trio.CancelScope(shield=True):
                await aclose()


async def _send_chunk(
    stream: trio.abc.SendStream, held: Held, data: bytes, stamps: FrontendStamps | None
) -> None:
    """A streamed chunk: over 64 KB, counted in the budget while written. A traced request's
    chunk has an HTTP_SEND_START / HTTP_SEND_END pair, as Triton's generate_stream writes one
    per response (server src/http_server.cc GenerateRequestClass::SendChunkResponse)."""
    start = now_ns() if stamps is not None else 0
    if len(data) <= JOIN_LIMIT:
        await send_all(stream, data)
    else:
        await held(len(data), send_all(stream, data))
    if stamps is not None:
        stamps.sent_chunk(start, now_ns())
