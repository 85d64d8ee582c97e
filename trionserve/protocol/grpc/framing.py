"""gRPC message framing, sans-I/O: length-prefixed messages and status trailers.

A gRPC message on an HTTP/2 stream is a 1-byte compressed flag, a 4-byte big-endian
length and the message bytes; a call ends with ``grpc-status`` and, for errors, a
percent-encoded ``grpc-message``. Pure functions and one small parser, tested with
byte strings; the connection code around them does the I/O.
"""

from __future__ import annotations

import gzip
import zlib

from trionserve.protocol.grpc.status import GRPCError, Status, encode_grpc_message

# The length prefix is 32 bits: the most any message can be.
MAX_MESSAGE_SIZE = 2**32 - 1
ENCODINGS = (b"identity", b"gzip", b"deflate")
ACCEPT_ENCODING = (b"grpc-accept-encoding", b"identity,deflate,gzip")


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
    """

    __slots__ = ("_encoding", "_max_size", "_buffer", "_needed", "_defer")

    def __init__(
        self,
        encoding: bytes = b"identity",
        max_size: int | None = None,
        defer_decompression: bool = False,
    ) -> None:
        self._defer = defer_decompression
        self._encoding = encoding
        self._max_size = max_size or MAX_MESSAGE_SIZE
        self._buffer = bytearray()
        self._needed = 5  # bytes the buffer must hold before the next message can end

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished message held until the rest arrives."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        if buffer:
            buffer += data
            if len(buffer) < self._needed:
                return []
            source: bytes | bytearray = buffer
        else:
            source = data
        messages: list[bytes] = []
        offset, end = 0, len(source)
        while end - offset >= 5:
            size = int.from_bytes(source[offset + 1 : offset + 5], "big")
            if size > self._max_size:
                raise GRPCError(
                    Status.RESOURCE_EXHAUSTED,
                    f"received message larger than max ({size} vs. {self._max_size}); "
                    "see --grpc-max-message-size",
                )
            stop = offset + 5 + size
            if stop > end:
                self._needed = stop - offset
                break
            # One copy, out of a view (slicing the bytearray would copy twice).
            message = bytes(memoryview(source)[offset + 5 : stop])
            if source[offset]:
                if self._encoding == b"identity":
                    raise GRPCError(
                        Status.INTERNAL, "compressed message received without a grpc-encoding"
                    )
                message = Compressed(message) if self._defer else self.decompress(message)
            messages.append(message)
            offset = stop
        else:
            self._needed = 5
        # Keep the unfinished tail; a partial large message is never copied twice.
        if source is buffer:
            if offset:
                del buffer[:offset]
        elif offset < end:
            self._buffer = bytearray(memoryview(source)[offset:])
        return messages

    def decompress(self, message: bytes) -> bytes:
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
