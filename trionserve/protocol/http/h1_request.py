"""A request as :class:`~trionserve.protocol.http.h1.H1Connection` receives it
(its head, then its body into one buffer), apart from the connection's
protocol for its size."""

from __future__ import annotations

import ctypes

import numpy as np

from trionserve.observability.trace.frontend import HTTP_STAMPS, FrontendStamps, now_ns

__all__ = ["TENSOR_ALIGNMENT", "LastHead", "Request", "body_buffer", "request_stamps"]


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
        "last",
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
        # The connection's last head it was made from (LastHead), None: the parser saw its head.
        self.last: LastHead | None = None


# The alignment of a body's binary tensors (the first one's, and each one after
# a tensor of a multiple of it), for a framework that takes them as they are.
TENSOR_ALIGNMENT = 64
# A buffer's address: that of a ctypes view of its first byte.
_address = ctypes.addressof
_byte_at = ctypes.c_char.from_buffer


def body_buffer(length: int, tensors_at: int) -> memoryview:
    """A writable buffer of ``length`` bytes for a request body whose binary
    tensors begin ``tensors_at`` bytes in (``Inference-Header-Content-Length``;
    0 for a raw binary request or none said): placed so that they begin on a
    64-byte boundary, so the views the codec makes of them are aligned for a
    framework (a cache line; what vectorised kernels and DMA prefer) without a
    copy. np.empty: allocated, not written, so the memory a connection holds grows
    with the bytes it has sent, as it did with a list of chunks. Its address is
    read through a ctypes view of it (``block.ctypes.data`` makes a Python
    object per call: 2.9 of this function's 5.8 us, warm)."""
    if tensors_at > length:  # (refused by the infer handler, in its words)
        tensors_at = 0
    block = np.empty(length + TENSOR_ALIGNMENT - 1, np.uint8)
    skip = -(_address(_byte_at(block.data)) + tensors_at) % TENSOR_ALIGNMENT
    return block[skip : skip + length].data


# The longest request head kept as a connection's last (LastHead).
LAST_HEAD_MAX_BYTES = 4096


class LastHead:
    """The bytes of the last request head a connection's parser read whole, and
    what the parser made of them. A client repeats its head with every request
    of one shape (tritonclient, perf_analyzer: the same target, headers and
    Content-Length), and the same bytes parse the same way, so the connection
    makes the next such request from this without the parser (issue 39:
    "nothing per request that a cache of the last header can answer").

    Kept (:meth:`of`) only for a head the fast path makes exactly: HTTP/1.1 kept
    alive, a body of declared length within the limit (so no Transfer-Encoding),
    no ``Expect``, at most LAST_HEAD_MAX_BYTES, and its bytes exactly its lines
    as parsed: the request line, one line per header, every line ending in CRLF
    (no bare CR or LF, no folded line), so that the first empty line ends it."""

    __slots__ = (
        "headers",
        "head_size",
        "length",
        "method",
        "raw",
        "scratch",
        "target",
        "tensors_at",
    )

    def __init__(self, raw: bytes, request: Request, tensors_at: int) -> None:
        self.raw = raw
        # Read into where the next head is expected to be these bytes (H1Connection.again_buffers).
        self.scratch = memoryview(bytearray(len(raw)))
        self.method = request.method
        self.target = request.target
        self.headers = tuple(request.headers)
        self.head_size = request.head_size
        self.length = request.length
        self.tensors_at = tensors_at

    @classmethod
    def of(cls, data: bytes | bytearray | memoryview, request: Request) -> LastHead | None:
        """The head ``request`` was parsed from, at the start of ``data``, if it
        may be kept (see the class)."""
        if not (
            request.head_done
            and request.version == "1.1"
            and request.keep_alive
            and not request.expects_continue
            and request.length > 0
            and request.buffer is not None
        ):
            return None
        start = bytes(data[:LAST_HEAD_MAX_BYTES])
        end = start.find(b"\r\n\r\n")
        if end < 0:
            return None
        raw = start[: end + 4]
        lines = raw.count(b"\r\n")
        if (
            lines != len(request.headers) + 2
            or raw.count(b"\n") != lines
            or raw.count(b"\r") != lines
            or not raw.startswith(b"%s %s HTTP/1.1\r\n" % (request.method, request.target))
        ):
            return None
        tensors_at = 0
        for name, value in request.headers:
            if name == b"expect":
                return None
            if name == b"inference-header-content-length" and value.isdigit():
                tensors_at = int(value)
        return cls(raw, request, tensors_at)


def request_stamps(request: Request) -> FrontendStamps:
    """The request's HTTP_RECV_* / HTTP_SEND_* stamps (tracing was on), set for its handler:
    they go with its trace if sampled (:mod:`trionserve.observability.trace.frontend`)."""
    stamps = FrontendStamps([("HTTP_RECV_START", request.began), ("HTTP_RECV_END", now_ns())])
    received = dict(request.headers)
    stamps.take_context(received.get(b"traceparent"), received.get(b"tracestate"))
    HTTP_STAMPS.set(stamps)
    return stamps
