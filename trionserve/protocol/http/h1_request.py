"""A request as :class:`~trionserve.protocol.http.h1.H1Connection` receives it
(its head, then its body into one buffer), apart from the connection's
protocol for its size."""

from __future__ import annotations

import numpy as np

__all__ = ["TENSOR_ALIGNMENT", "Request", "body_buffer"]


class Request:
    """One request as the parser delivers it: its head, then its body."""

    __slots__ = (
        "began",
        "buffer",
        "chunked",
        "chunks",
        "complete",
        "expects_continue",
        "head_done",
        "head_size",
        "headers",
        "in_chunk",
        "keep_alive",
        "length",
        "method",
        "size",
        "target",
        "version",
    )

    # Set by on_headers_complete, before anything reads them.
    method: bytes
    version: str
    keep_alive: bool
    expects_continue: bool
    length: int  # the declared Content-Length; -1: none (chunked, or no body)

    def __init__(self) -> None:
        self.target = b""
        self.head_size = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        # The body: received into ``buffer`` when its length is declared (and within
        # the limit), else (chunked) appended to ``chunked``.
        self.buffer: memoryview | None = None
        self.chunked = bytearray()
        self.chunks = 0  # non-empty chunks of a chunked body
        self.in_chunk = False  # a chunk header was parsed, its data not counted yet
        self.size = 0
        self.complete = False
        self.began = 0  # when its first byte was parsed, in ns, if tracing was on


# The alignment of a body's binary tensors (the first one's, and each one after
# a tensor of a multiple of it), for a framework that takes them as they are.
TENSOR_ALIGNMENT = 64


def body_buffer(length: int, tensors_at: int) -> memoryview:
    """A writable buffer of ``length`` bytes for a request body whose binary
    tensors begin ``tensors_at`` bytes in (``Inference-Header-Content-Length``;
    0 for a raw binary request or none said): placed so that they begin on a
    64-byte boundary, so the views the codec makes of them are aligned for a
    framework (a cache line; what vectorised kernels and DMA prefer) without a
    copy. np.empty: allocated, not written, so the memory a connection holds grows
    with the bytes it has sent, as it did with a list of chunks."""
    if tensors_at > length:  # (refused by the infer handler, in its words)
        tensors_at = 0
    block = np.empty(length + TENSOR_ALIGNMENT - 1, np.uint8)
    skip = -(block.ctypes.data + tensors_at) % TENSOR_ALIGNMENT
    return block[skip : skip + length].data
