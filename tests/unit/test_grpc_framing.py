"""gRPC message framing with byte strings: prefixes, split deliveries, limits."""

from __future__ import annotations

import gzip
import resource
import zlib

import numpy as np
import pytest

from trionserve.protocol.grpc.framing import (
    _ALONE,
    KEPT_BYTES,
    KEPT_TOTAL,
    CallBuffers,
    Compressed,
    MessageReader,
    _counts,
    prefix,
    status_headers,
)
from trionserve.protocol.grpc.status import decode_grpc_message
from trionserve.protocol.grpc.transport import GRPCError, Status


def framed(message: bytes, compressed: bool = False) -> bytes:
    return prefix(len(message), compressed) + message


def test_prefix():
    assert prefix(0) == b"\x00\x00\x00\x00\x00"
    assert prefix(258, compressed=True) == b"\x01\x00\x00\x01\x02"


def test_messages_split_anywhere_come_out_whole():
    messages = [b"", b"a", b"hello" * 1000, bytes(range(256))]
    wire = b"".join(framed(m) for m in messages)
    for step in (1, 2, 5, 7, 4096, len(wire)):
        reader = MessageReader()
        got = []
        for i in range(0, len(wire), step):
            got.extend(reader.feed(wire[i : i + step]))
        assert got == messages, step


def test_compressed_messages():
    text = b"x" * 10_000
    gzipped = MessageReader(b"gzip").feed(framed(gzip.compress(text), compressed=True))
    deflated = MessageReader(b"deflate").feed(framed(zlib.compress(text), compressed=True))
    assert gzipped == deflated == [text]
    # Messages without the flag are not decompressed, whatever the encoding.
    assert MessageReader(b"gzip").feed(framed(b"plain")) == [b"plain"]


@pytest.mark.parametrize(
    "reader,wire,status,fragment",
    [
        (
            MessageReader(max_size=10),
            framed(b"x" * 11),
            Status.RESOURCE_EXHAUSTED,
            "received message larger than max (11 vs. 10)",
        ),
        (MessageReader(max_size=10), prefix(2**31), Status.RESOURCE_EXHAUSTED, "larger than max"),
        (
            MessageReader(b"gzip", max_size=100),
            framed(gzip.compress(b"y" * 101), True),
            Status.RESOURCE_EXHAUSTED,
            "decompressed message larger than max (100)",
        ),
        (
            MessageReader(),
            framed(b"zz", compressed=True),
            Status.INTERNAL,
            "compressed message received without a grpc-encoding",
        ),
        (
            MessageReader(b"gzip"),
            framed(b"not gzip", compressed=True),
            Status.INTERNAL,
            "failed to decompress a gzip message",
        ),
    ],
)
def test_bad_messages(reader, wire, status, fragment):
    with pytest.raises(GRPCError) as info:
        reader.feed(wire)
    assert info.value.status is status
    assert fragment in info.value.message


def test_status_headers():
    assert status_headers(Status.OK, None) == [(b"grpc-status", b"0")]
    headers = dict(status_headers(Status.INVALID_ARGUMENT, "bad 'x': 100% ünïcode\n"))
    assert headers[b"grpc-status"] == b"3"
    assert headers[b"grpc-message"].isascii()
    assert decode_grpc_message(headers[b"grpc-message"].decode()) == "bad 'x': 100% ünïcode\n"
    # An error always says something.
    assert dict(status_headers(Status.INTERNAL, ""))[b"grpc-message"] == b"INTERNAL"


def test_frame_repr_is_short():
    """h2 formats every received frame for its trace log; the transport makes a
    frame's repr its type and stream only, reading neither flags nor payload."""
    from hyperframe.frame import DataFrame, HeadersFrame

    import trionserve.protocol.grpc.connection  # noqa: F401  (installs the repr)

    assert repr(DataFrame(1, b"\x01" * 1_000_000)) == "DataFrame(stream_id=1)"
    assert repr(HeadersFrame(3, b"ab")) == "HeadersFrame(stream_id=3)"


def test_deferred_decompression_returns_compressed_messages_as_is():
    reader = MessageReader(b"gzip", max_size=100, defer_decompression=True)
    wire = framed(gzip.compress(b"z" * 50), True) + framed(b"plain")
    first, second = reader.feed(wire)
    assert type(first) is Compressed and second == b"plain"
    assert reader.decompress(first) == b"z" * 50
    bomb = reader.feed(framed(gzip.compress(b"z" * 101), True))[0]
    with pytest.raises(GRPCError) as info:
        reader.decompress(bomb)
    assert info.value.status is Status.RESOURCE_EXHAUSTED


def test_a_message_in_many_pieces_is_one_writable_buffer():
    """A message arriving across many DATA payloads is copied once into a buffer of
    the size its prefix announced; what the reader holds meanwhile is what arrived
    (the connection's buffer limit counts it), and the message is writable."""
    message = bytes(range(256)) * 4000  # 1,024,000 bytes
    wire = framed(message) + framed(b"tail")
    reader = MessageReader()
    got = []
    for i in range(0, len(wire), 16_384):
        got.extend(reader.feed(wire[i : i + 16_384]))
        if not got:
            assert reader.buffered == min(i + 16_384, len(wire))
    assert got == [message, b"tail"]
    assert reader.buffered == 0
    for received in got:
        assert not memoryview(received).readonly
    # A message whole in one feed is its own writable copy too.
    (small,) = MessageReader().feed(framed(b"abc"))
    assert small == b"abc" and not memoryview(small).readonly


def test_an_announced_message_costs_only_what_arrived():
    """A prefix announcing a large message allocates its buffer without writing
    it: the memory held grows with the bytes received."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    readers = [MessageReader(max_size=2**30) for _ in range(2)]
    for reader in readers:
        assert reader.feed(prefix(128 * 1024 * 1024) + b"x" * 10) == []
        assert reader.buffered == 15
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024, f"peak RSS grew by {grown_kib} KiB"


def address(buffer: memoryview) -> int:
    return np.frombuffer(buffer, np.uint8).ctypes.data


def test_call_buffers_reused_only_once_nothing_views_them():
    """A repeated call's message buffer is taken again only when no message,
    tensor or answer views it; the last three of the size are kept (at c=1: the
    call read, the call running, the last call's message still held a while)."""
    buffers = CallBuffers()
    first = buffers.take(1000)
    tensor = np.frombuffer(first[8:], np.float32)  # a tensor of the message, parked
    del first
    held = [buffers.take(1000) for _ in range(3)]  # all viewed: new ones
    addresses = [tensor.ctypes.data - 8] + [address(b) for b in held]
    assert len(set(addresses)) == 4
    del tensor  # the first is no longer kept (the last three are)
    again = buffers.take(1000)
    assert address(again) not in addresses[1:]
    del held[1]
    assert address(buffers.take(1000)) == addresses[2]  # free again: taken
    assert len(buffers.take(2000)) == 2000  # another size: those of 1000 let go
    assert len(buffers._arrays) == 1


def test_a_buffer_is_alone_only_when_nothing_views_it():
    """The count a kept buffer is reused at is the interpreter's own (read by the
    same function): one view of it, a slice's, or a tensor over a slice counts."""
    array = np.empty(64, np.uint8)
    arrays = [array]
    del array
    assert _counts(arrays) == [_ALONE]
    view = arrays[0].data
    assert _counts(arrays)[0] > _ALONE
    tensor = np.frombuffer(view[8:], np.float32)
    del view
    assert _counts(arrays)[0] > _ALONE
    del tensor
    assert _counts(arrays) == [_ALONE]


def test_call_buffers_keep_fewer_large_ones():
    """Past a third of KEPT_BYTES a connection keeps fewer of them."""
    buffers = CallBuffers()
    large = KEPT_BYTES // 2
    held = [buffers.take(large) for _ in range(3)]
    assert len({address(b) for b in held}) == 3 and len(buffers._arrays) == 2
    held.clear()
    buffers.take(KEPT_BYTES + 1)
    buffers.take(KEPT_BYTES + 1)
    assert not buffers._arrays  # (past KEPT_BYTES: none)
    buffers.let_go()


def test_call_buffers_of_all_connections_bounded_together(monkeypatch):
    """The buffers kept by every connection count together, up to KEPT_TOTAL:
    past it a connection keeps none (each is as before: a new buffer per call),
    and a connection that ends lets its kept bytes go."""
    monkeypatch.setattr(CallBuffers, "kept", 0)  # (connections of other tests not ended)
    before = CallBuffers.kept
    size = KEPT_BYTES // 3
    connections = [CallBuffers() for _ in range(KEPT_TOTAL // size + 2)]  # (past the cap)
    for buffers in connections:
        for _ in range(3):
            buffers.take(size)  # nothing holds them: one kept per connection
    assert CallBuffers.kept - before <= KEPT_TOTAL
    held = [buffers.take(size) for buffers in connections for _ in range(3)]
    assert CallBuffers.kept - before <= KEPT_TOTAL
    assert any(not buffers._arrays for buffers in connections)  # the cap was met
    for buffers in connections:
        buffers.let_go()
    assert CallBuffers.kept == before
    del held
