"""A predicted call's frames checked as bytes, without h2's frame loop: the
head of a call read whole (its HEADERS, window updates and its message's
first DATA header), the bytes between its DATA frames, and the template the
next call's are compared with in slices. A part of the predicted call's read
(:mod:`~trionserve.protocol.grpc.inflow`), apart for its size.
"""

from __future__ import annotations

import struct

from trionserve.protocol.grpc import h2frames

__all__ = ["call_head", "pieces", "same_as", "whole_call", "window_updates"]

_FRAME_HEADER = struct.Struct(">HBBBL")
_INCREMENT = struct.Struct(">L")
_DATA_FRAME, _HEADERS_FRAME, _WINDOW_UPDATE_FRAME, _PADDED = 0x0, 0x1, 0x8, 0x8
_END_STREAM, _END_HEADERS = 0x1, 0x4


def pieces(data: bytes, sid: bytes) -> tuple[tuple[tuple[int, int, bytes], ...], tuple[int, ...]]:
    """``data`` (whole frames, and the head of one) as a template: its slices
    around each frame header's stream id that is ``sid`` (start, stop and
    bytes), and where those stream ids are."""
    pieces, owns, start, pos = [], [], 0, 0
    while pos + 9 <= len(data):
        high, low = _FRAME_HEADER.unpack_from(data, pos)[:2]
        if data[pos + 5 : pos + 9] == sid:
            pieces.append((start, pos + 5, data[start : pos + 5]))
            owns.append(pos + 5)
            start = pos + 9
        pos += 9 + (high << 8) + low
    pieces.append((start, len(data), data[start:]))
    return tuple(pieces), tuple(owns)


def same_as(
    template: tuple[tuple[tuple[int, int, bytes], ...], tuple[int, ...]],
    data: bytes | memoryview,
    sid: bytes,
) -> bool:
    """Whether ``data`` is as the ``template`` (_pieces) with ``sid`` for its stream id,
    of its length."""
    pieces, owns = template
    if len(data) != pieces[-1][1]:
        return False
    for start, stop, piece in pieces:
        if data[start:stop] != piece:
            return False
    for at in owns:
        if data[at : at + 4] != sid:
            return False
    return True


def call_head(data: bytes, length: int, first: int) -> int:
    """The stream of the call whose head ``data`` is when it is whole frames:
    a new stream's HEADERS, any frames but DATA, that stream's DATA header for
    a frame of ``first`` bytes (the stream's end only with the message's) and
    the prefix of an uncompressed message of ``length`` bytes; else 0."""
    pos, size, opened = 0, len(data) - 5, 0
    while size - pos >= 9:
        high, low, kind, flags, stream = _FRAME_HEADER.unpack_from(data, pos)
        stream &= 0x7FFFFFFF
        end = pos + 9 + (high << 8) + low
        if kind == _DATA_FRAME:
            if (
                stream != opened
                or end - pos - 9 != first
                or flags & _PADDED
                or (flags & _END_STREAM and first != length + 5)  # (it ends with the message)
                or pos + 9 != size
                or data[size:] != b"\0" + length.to_bytes(4, "big")
            ):
                return 0
            return stream
        if kind == _HEADERS_FRAME and not opened and flags & _END_HEADERS:
            opened = stream
        if end > size:
            return 0
        pos = end
    return 0


def whole_call(
    head: bytes, slot: memoryview | None, stream_id: int, rest: int
) -> tuple[bytes, list[tuple[int, int]], int] | None:
    """A call of ``stream_id`` read whole (_call_head checked its ``head``)
    that ``h2frames.open_whole`` may take: its HEADERS frame first, with
    END_HEADERS its only flag, then only WINDOW_UPDATE frames before its
    message's first DATA frame; that frame with END_STREAM, or ``slot`` (the
    bytes between its two DATA frames) WINDOW_UPDATE frames, then the header
    of the last DATA frame, of ``rest`` bytes, with END_STREAM its only flag.
    Its HEADERS block, the window updates' (stream, increment) and its
    largest frame's size; else None."""
    high, low, kind, flags = _FRAME_HEADER.unpack_from(head)[:4]
    block = 9 + (high << 8) + low
    if kind != _HEADERS_FRAME or flags != _END_HEADERS:
        return None
    windows: list[tuple[int, int]] = []
    data = window_updates(head, block, len(head) - 14, stream_id, windows)
    if data < 0:
        return None
    high, low, _, flags = _FRAME_HEADER.unpack_from(head, data)[:4]
    largest = max(block - 9, (high << 8) + low, rest)
    if slot is None:
        return (head[9:block], windows, largest) if flags & _END_STREAM else None
    end = window_updates(slot, 0, len(slot) - 9, stream_id, windows)
    if end < 0:
        return None
    high, low, kind, flags, stream = _FRAME_HEADER.unpack_from(slot, end)
    if (
        kind != _DATA_FRAME
        or flags != _END_STREAM
        or (high << 8) + low != rest
        or stream & 0x7FFFFFFF != stream_id
    ):
        return None
    return head[9:block], windows, largest


def window_updates(
    data: bytes | memoryview, pos: int, end: int, stream_id: int, windows: list[tuple[int, int]]
) -> int:
    """The WINDOW_UPDATE frames from ``pos`` to ``end`` in ``data``, their
    (stream, increment) added to ``windows`` (``stream_id``'s as
    h2frames.NEW_STREAM): ``end``, or -1 when other bytes are there."""
    while pos < end:
        high, low, kind, _, stream = _FRAME_HEADER.unpack_from(data, pos)
        if kind != _WINDOW_UPDATE_FRAME or high or low != 4 or pos + 13 > end:
            return -1
        stream &= 0x7FFFFFFF
        increment = _INCREMENT.unpack_from(data, pos + 9)[0]
        windows.append((h2frames.NEW_STREAM if stream == stream_id else stream, increment))
        pos += 13
    return end if pos == end else -1
