"""gRPC message framing, sans-I/O: length-prefixed messages and status trailers.

A gRPC message on an HTTP/2 stream is a 1-byte compressed flag, a 4-byte big-endian
length and the message bytes; a call ends with ``grpc-status`` and, for errors, a
percent-encoded ``grpc-message``. Pure functions and one small parser, tested with
byte strings; the connection code around them does the I/O. Also what a response
looks like on the wire: its constant headers and trailers, and which of the
buffers written are joined (:func:`coalesce`).
"""

from __future__ import annotations

import gzip
import sys
import zlib

import numpy as np

from trionserve.protocol.grpc.status import GRPCError, Status, encode_grpc_message

# The length prefix is 32 bits: the most any message can be.
MAX_MESSAGE_SIZE = 2**32 - 1
ENCODINGS = (b"identity", b"gzip", b"deflate")
# A received message: a writable buffer of its own (see MessageReader), or the
# bytes decompression produced.
Message = bytes | bytearray | memoryview
ACCEPT_ENCODING = (b"grpc-accept-encoding", b"identity,deflate,gzip")
# Messages up to this size go out as one joined DATA payload; larger ones are
# written chunk by chunk from memoryviews, without joining.
JOIN_LIMIT = 64 * 1024
# The most bytes of buffers a connection keeps for its repeated calls'
# messages (CallBuffers): three of a message up to a third of it, else fewer,
# none past it; and all connections of the process together (kept for no
# request, they count in no client budget: this bounds their sum).
KEPT_BYTES = 8 * 1024 * 1024
KEPT_TOTAL = 64 * 1024 * 1024


def prefix(size: int, compressed: bool = False) -> bytes:
    """The 5-byte header of a message of ``size`` bytes."""
    return (b"\x01" if compressed else b"\x00") + size.to_bytes(4, "big")


def compress(message: bytes, level: int) -> bytes:
    return gzip.compress(message, level)


def status_headers(status: Status, message: str | None) -> list[tuple[bytes, bytes]]:
    """The trailers that end a call; errors always carry a grpc-message."""
    headers = [(b"grpc-status", str(status.value).encode())]
    if status is not Status.OK:
        text = message or status.name
        headers.append((b"grpc-message", encode_grpc_message(text).encode("ascii")))
    return headers


CONTENT_TYPE = (b"content-type", b"application/grpc")
RESPONSE_HEADERS = [(b":status", b"200"), CONTENT_TYPE, ACCEPT_ENCODING]
GZIP_RESPONSE_HEADERS = [*RESPONSE_HEADERS, (b"grpc-encoding", b"gzip")]
OK_TRAILERS = status_headers(Status.OK, None)
# What nearly every call sends: HPACK-encoded once per connection
# (upstream.CachingEncoder).
CONSTANT_HEADERS = (RESPONSE_HEADERS, GZIP_RESPONSE_HEADERS, OK_TRAILERS)


class Compressed(bytes):
    """A compressed message, returned as is by a reader that defers decompression."""

    __slots__ = ()


class MessageReader:
    """Cuts the messages of one stream out of its DATA bytes, as they arrive.

    ``feed`` returns the messages completed by the new bytes (decompressed); a
    message over ``max_size`` or one that cannot be decompressed raises GRPCError.
    With ``defer_decompression``, compressed messages come back as
    :class:`Compressed`, for the caller to pass to ``decompress`` where it likes
    (off the event loop, for large ones).

    Each message is copied once out of the DATA bytes, into a writable buffer of
    its own: a bytearray when it arrives whole in one feed, else a memoryview of a
    buffer of the size its prefix announces, allocated then (its pages committed as
    bytes arrive, so a prefix announcing a large message costs only what was sent)
    and filled as the rest comes. Tensors viewing it are writable.
    """

    __slots__ = (
        "_encoding",
        "_max_size",
        "_prefix",
        "_message",
        "_filled",
        "_flag",
        "_defer",
        "offered",
    )

    def __init__(
        self,
        encoding: bytes = b"identity",
        max_size: int | None = None,
        defer_decompression: bool = False,
    ) -> None:
        self._defer = defer_decompression
        # A buffer the next message's bytes were read into before its prefix
        # was seen (the connection's read of a whole call, inflow.py): taken
        # as that message's buffer when the sizes agree.
        self.offered: memoryview | None = None
        self._encoding = encoding
        self._max_size = max_size or MAX_MESSAGE_SIZE
        self._prefix = bytearray()  # the next message's prefix, while incomplete
        self._message: memoryview | None = None  # an unfinished message's buffer
        self._filled = 0  # bytes of it received
        self._flag = 0  # its compressed flag

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished message (its prefix included) received so far."""
        if self._message is not None:
            return 5 + self._filled
        return len(self._prefix)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        messages: list[Message] = []
        view = memoryview(data)
        offset, end = 0, len(view)
        message = self._message
        if message is not None:  # the rest of an unfinished message first
            filled = self._filled
            take = min(len(message) - filled, end)
            message[filled : filled + take] = view[:take]
            offset = take
            if filled + take < len(message):
                self._filled = filled + take
                return messages
            self._message = None
            self._filled = 0
            messages.append(self._finish(self._flag, message))
        while offset < end:
            if self._prefix or end - offset < 5:
                take = min(5 - len(self._prefix), end - offset)
                self._prefix += view[offset : offset + take]
                offset += take
                if len(self._prefix) < 5:
                    break
                flag, size = self._read_prefix(self._prefix)
                self._prefix.clear()
            else:
                flag, size = self._read_prefix(view[offset : offset + 5])
                offset += 5
            stop = offset + size
            if stop <= end:  # whole in this feed
                messages.append(self._finish(flag, bytearray(view[offset:stop])))
                offset = stop
                continue
            message = self.offered
            self.offered = None
            if message is None or len(message) != size:
                message = np.empty(size, np.uint8).data
            message[: end - offset] = view[offset:end]
            self._message, self._filled, self._flag = message, end - offset, flag
            break
        return messages

    def room(self) -> memoryview | None:
        """The part of an unfinished message's buffer still to be received (for
        its bytes to be read straight into it, then ``filled``); None between
        messages."""
        message = self._message
        return None if message is None else message[self._filled :]

    @property
    def size(self) -> int:
        """The unfinished message's size (0 between messages)."""
        message = self._message
        return 0 if message is None else len(message)

    def holds(self, buffer: memoryview) -> bool:
        """Whether ``buffer`` (``offered``) is the unfinished message's, none of
        it received yet."""
        return self._message is buffer and not self._filled

    def filled(self, size: int) -> list[Message]:
        """``size`` more bytes of the unfinished message were written into its
        ``room``: the message when that completes it."""
        message = self._message
        assert message is not None and self._filled + size <= len(message)
        self._filled += size
        if self._filled < len(message):
            return []
        self._message = None
        self._filled = 0
        return [self._finish(self._flag, message)]

    def _read_prefix(self, prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
        """(compressed flag, size) of a message's prefix, checked."""
        size = int.from_bytes(prefix[1:5], "big")
        if size > self._max_size:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"received message larger than max ({size} vs. {self._max_size}); "
                "see --grpc-max-message-size",
            )
        if prefix[0] and self._encoding == b"identity":
            raise GRPCError(Status.INTERNAL, "compressed message received without a grpc-encoding")
        return prefix[0], size

    def _finish(self, flag: int, message: bytearray | memoryview) -> Message:
        if not flag:
            return message
        return Compressed(message) if self._defer else self.decompress(message)

    def decompress(self, message: bytes | bytearray | memoryview) -> bytes:
        """Inflate ``message``, never past ``max_size`` (RESOURCE_EXHAUSTED beyond)."""
        encoding = self._encoding
        wbits = 16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS
        decompressor = zlib.decompressobj(wbits)
        try:
            out = decompressor.decompress(message, self._max_size + 1)
        except zlib.error as exc:
            raise GRPCError(
                Status.INTERNAL, f"failed to decompress a {encoding.decode()} message: {exc}"
            ) from None
        if len(out) > self._max_size or decompressor.unconsumed_tail:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"decompressed message larger than max ({self._max_size}); "
                "see --grpc-max-message-size",
            )
        return out


def _counts(arrays: list[np.ndarray]) -> list[int]:
    """Each array's reference count as read here, where the list holds it and
    the interpreter's own references are added (the comprehension's, the
    argument's: how many depends on the interpreter, which borrows more of them
    from Python 3.14). Compared with _ALONE, read by this same function."""
    return [sys.getrefcount(array) for array in arrays]


# What _counts reads of an array that only its list holds (nothing views it).
_ALONE = _counts([np.empty(1, np.uint8)])[0]


class CallBuffers:
    """A connection's buffers for the messages of its repeated calls (the
    message read whole before its call comes, inflow.py), reused: a new one
    for each call would come from memory the allocator has just handed back to
    the kernel (two calls' messages held at once at c=1, the next one's buffer
    made while the last call runs, then both let go: the heap's top trimmed),
    its pages faulted in again as its bytes land (~25 faults and a brk per 602
    KB call on the loop). A buffer is taken again only once nothing views it
    (a message, a tensor of a parked or answered call, an answer: each holds
    its array through a view), read from its reference count. The last three of
    the call's size are kept (fewer past KEPT_BYTES): at c=1 one is read into
    while the next one's call runs and the one before is still held a while
    (its report not swept yet); the connection holds them (committed) until it
    ends (:meth:`let_go`), within KEPT_TOTAL for all connections together."""

    __slots__ = ("_arrays", "_bytes")
    # What every connection's CallBuffers keep together (on the loop only).
    kept = 0

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []
        self._bytes = 0

    def take(self, length: int) -> memoryview:
        """A buffer of ``length`` bytes that nothing else views."""
        arrays = self._arrays
        for array, count in zip(arrays, _counts(arrays), strict=True):
            if count == _ALONE and len(array) == length:
                return array.data
        array = np.empty(length, np.uint8)
        count = min(3, KEPT_BYTES // length)  # kept of this size, the new one with them
        kept = [a for a in arrays if len(a) == length][1 - count :] if count > 1 else []
        if count and CallBuffers.kept - self._bytes + (len(kept) + 1) * length <= KEPT_TOTAL:
            kept.append(array)
        else:  # (all connections keep their most: this one keeps none)
            kept = []
        self._arrays = kept
        self._keep(len(kept) * length)
        return array.data

    def let_go(self) -> None:
        """The connection ended: its buffers are no longer kept."""
        self._arrays = []
        self._keep(0)

    def _keep(self, size: int) -> None:
        CallBuffers.kept += size - self._bytes
        self._bytes = size


def coalesce(buffers: list) -> list:
    """The buffers with each run of small ones joined: few writes, no large copies."""
    if len(buffers) <= 1:
        return buffers
    out: list = []
    run: list = []
    for buffer in buffers:
        if len(buffer) > JOIN_LIMIT:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(buffer)
        else:
            run.append(buffer)
    if run:
        out.append(b"".join(run))
    return out
