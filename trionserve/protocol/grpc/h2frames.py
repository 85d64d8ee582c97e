"""h2's frame buffer and hyperframe's frames made for the gRPC hot path.

Part of :mod:`~trionserve.protocol.grpc.upstream` (where trionserve leans on the
private parts of h2, hpack and hyperframe), apart for its size: hyperframe's
``Frame.__repr__`` replaced; ``FrameBuffer.__next__`` overridden, reading its
``_data``, ``max_frame_size``, ``_validate_frame_length`` and
``_update_header_buffer``; hyperframe's frames made from their header without
their ``__init__`` (``frame_header``); where the connection's reading stands
(``between_frames``, ``receive_window``: h2's frame buffer and window
managers); a new unary call received whole moved at once (``open_whole``:
the window managers, ``local_settings._settings``, and the stream opened by
``H2Connection._unary_open``). Each is checked by ``tests/unit/test_upstream_internals.py``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import h2.connection
import h2.exceptions
import h2.frame_buffer
import h2.settings
from hyperframe import frame as hyperframe_frame
from hyperframe.flags import Flags

if TYPE_CHECKING:
    from trionserve.protocol.grpc.upstream import H2Connection

__all__ = [
    "NEW_STREAM",
    "FrameBuffer",
    "between_frames",
    "frame_header",
    "new_call_window",
    "open_whole",
    "processed",
    "receive_window",
]

_FRAME_HEADER = struct.Struct(">HBBBL")
_HEADER_BLOCKS = (hyperframe_frame.HeadersFrame, hyperframe_frame.PushPromiseFrame)


def _frame_repr(frame: hyperframe_frame.Frame) -> str:
    # The frame's type and stream only: no flags, no payload.
    return f"{type(frame).__name__}(stream_id={frame.stream_id})"


# h2 formats repr(frame) for a trace log of every frame it receives, even with
# logging off; hyperframe's repr formats the flags and the payload (a DATA
# frame's re-serialized and hex-encoded whole before it is cut to 20
# characters): 4 to 5 µs per frame, about 2% of a unary call on the event loop,
# for a log no one reads. Every frame's repr is its type and stream id instead.
# The assignment replaces a method on purpose (mypy's method-assign).
hyperframe_frame.Frame.__repr__ = _frame_repr  # type: ignore[method-assign]


_IMMUTABLE = (int, bool, bytes, str, float, type(None))


def _frame_kinds() -> dict[int, tuple]:
    """Per frame type whose ``__init__`` gives a frame only immutable attributes
    besides ``stream_id`` and ``flags``: its class, those attributes, its flag
    names, the names set by each flag byte, and which stream ids it takes."""
    kinds: dict[int, tuple] = {}
    for kind, cls in hyperframe_frame.FRAMES.items():
        assert kind is not None  # only ExtensionFrame has no type
        association = cls.stream_association
        # Any stream id __init__ accepts: the defaults do not depend on it.
        model = cls(stream_id=0 if association == "no-stream" else 1)
        defaults = {k: v for k, v in vars(model).items() if k not in ("stream_id", "flags")}
        if not all(type(v) in _IMMUTABLE for v in defaults.values()):
            continue  # shared defaults must not be (SETTINGS' dict): hyperframe's own
        named = [(flag.name, flag.bit) for flag in cls.defined_flags]
        by_byte = [tuple(name for name, bit in named if byte & bit) for byte in range(256)]
        takes = (association != "has-stream", association != "no-stream")  # (0, another)
        kinds[kind] = (cls, defaults, {name for name, _ in named}, by_byte, takes)
    return kinds


_KINDS = _frame_kinds()


def frame_header(header: bytes | bytearray | memoryview) -> tuple[hyperframe_frame.Frame, int]:
    """hyperframe's ``Frame.parse_frame_header`` for the 9 bytes at the start of
    ``header``: the frame (flags set, body not parsed yet) and its body's length.

    hyperframe makes the frame through its class's ``__init__`` chain and adds
    each flag through ``Flags.add``: about 10 µs a frame, two or three frames a
    unary call. Here the frame gets the same attributes directly (each class's
    defaults are taken from a frame its own ``__init__`` made, so they follow
    hyperframe). A stream id the frame type does not take, or an unknown type,
    is hyperframe's own (which raises, or makes an ExtensionFrame).
    """
    high, low, kind, flag_byte, stream_id = _FRAME_HEADER.unpack_from(header)
    stream_id &= 0x7FFFFFFF
    known = _KINDS.get(kind)
    if known is None or not known[4][stream_id != 0]:
        return hyperframe_frame.Frame.parse_frame_header(memoryview(header)[:9])
    cls, defaults, valid, by_byte, _ = known
    frame = object.__new__(cls)
    frame.__dict__.update(defaults)
    frame.stream_id = stream_id
    flags = object.__new__(Flags)
    flags._valid_flags = valid
    flags._flags = set(by_byte[flag_byte])
    frame.flags = flags
    return frame, (high << 8) + low


class FrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's buffer of received bytes, with each frame's payload copied once.

    h2 cuts each frame out of its buffer as a new bytearray (a copy) and hyperframe
    copies the payload out of that again (``tobytes``): for megabyte messages that
    was two copies of every byte on the event loop. Here the frame is parsed from
    a view of the buffer, so hyperframe's copy is the only one. A frame's length
    is checked against SETTINGS_MAX_FRAME_SIZE as soon as its 9-byte header is
    in, so an oversized frame is refused before its payload is buffered. Every frame type's
    ``parse_body`` copies or unpacks what it keeps and holds no view, so the buffer
    can be cut after it.
    """

    def __next__(self) -> hyperframe_frame.Frame:
        data = self._data
        while len(data) >= 9:
            try:
                frame, length = frame_header(data)
            except (
                hyperframe_frame.InvalidDataError,
                hyperframe_frame.InvalidFrameError,
            ) as err:  # pragma: no cover  (as h2's own)
                raise h2.exceptions.ProtocolError(
                    f"Received frame with invalid header: {err!s}"
                ) from err
            # Checked on the header, before any payload is waited for: a frame
            # announced past SETTINGS_MAX_FRAME_SIZE is refused (FRAME_SIZE_ERROR)
            # instead of buffered whole first, as h2's own FrameBuffer does.
            if length > self.max_frame_size:
                self._validate_frame_length(length)
            if len(data) < length + 9:
                break
            try:
                frame.parse_body(memoryview(data)[9 : 9 + length])
            except hyperframe_frame.InvalidDataError as err:
                raise h2.exceptions.ProtocolError("Received frame with non-compliant data") from err
            except hyperframe_frame.InvalidFrameError as err:
                raise h2.exceptions.FrameDataMissingError("Frame data missing or invalid") from err
            del data[: 9 + length]
            if not self._headers_buffer and not isinstance(frame, _HEADER_BLOCKS):
                return frame  # h2's _update_header_buffer would return it as it is
            complete = self._update_header_buffer(frame)
            if complete is not None:
                return complete
        raise StopIteration


_SERVER_OPEN = h2.connection.ConnectionState.SERVER_OPEN


def between_frames(connection: H2Connection) -> bool:
    """Whether the next byte ``connection`` receives starts a frame its
    ``receive`` takes itself: no frame taken in part, none buffered in part."""
    buffer: Any = connection.incoming_buffer
    return not (
        connection.partial is not None
        or buffer._data
        or buffer._headers_buffer
        or buffer._preamble_len
        or connection.state_machine.state is not _SERVER_OPEN
    )


def receive_window(connection: H2Connection, stream_id: int) -> int:
    """The DATA bytes the client may send on ``connection``'s held stream
    ``stream_id`` now, within its window and the connection's (0 for a stream
    not held)."""
    unary = connection.unary.get(stream_id)
    if unary is None:
        return 0
    window = connection._inbound_flow_control_window_manager.current_window_size
    return min(unary.inbound.current_window_size, window)


_MAX_WINDOW = 2**31 - 1
# In open_whole's window updates: the new stream's own.
NEW_STREAM = -1
_INITIAL_WINDOW_SIZE = h2.settings.SettingCodes.INITIAL_WINDOW_SIZE


def new_call_window(connection: H2Connection) -> int:
    """The DATA bytes the client may send on a new stream of ``connection``
    now, within its initial window and the connection's."""
    c: Any = connection
    window = c._inbound_flow_control_window_manager.current_window_size
    return min(connection.local_settings._settings[_INITIAL_WINDOW_SIZE][0], window)


def open_whole(
    connection: H2Connection,
    stream_id: int,
    block: bytes,
    size: int,
    windows: list[tuple[int, int]],
    largest: int,
) -> Sequence | None:
    """A new unary call received whole, moved at once as ``connection.receive``
    moves h2 for its frames one by one: its HEADERS (``block``, END_HEADERS
    alone, the client's last block again: ``CachingDecoder.repeated``), its
    message's DATA frames (``size`` flow-controlled bytes in all, unpadded,
    END_STREAM on the last, none over ``largest`` bytes, the HEADERS frame
    included) and, after its HEADERS, the client's WINDOW_UPDATE frames
    (``windows``: stream and increment, each the connection's, the new
    stream's, NEW_STREAM, or a closed stream's). Its headers (``receive``'s REQUEST), or
    None where ``receive`` would not take those frames so: then nothing moved,
    for ``receive`` to take them. Held to ``receive`` by
    tests/unit/test_grpc_whole_call.py."""
    c: Any = connection
    if largest > c._max_inbound_frame_size or not between_frames(connection):
        return None
    inbound = c._inbound_flow_control_window_manager
    if (
        size > inbound.current_window_size
        or size > connection.local_settings._settings[_INITIAL_WINDOW_SIZE][0]
    ):
        return None  # (receive breaks: h2 raises FLOW_CONTROL_ERROR)
    outbound = connection.outbound_flow_control_window
    own = connection.remote_settings._settings[_INITIAL_WINDOW_SIZE][0]  # the new stream's
    for window_stream, increment in windows:
        if not 0 < increment <= _MAX_WINDOW:
            return None
        if not window_stream:
            outbound += increment
            if outbound > _MAX_WINDOW:
                return None
        elif window_stream == NEW_STREAM:
            own += increment
            if own > _MAX_WINDOW:
                return None
        elif not (
            window_stream % 2
            and window_stream < stream_id
            and window_stream <= connection.highest_inbound_stream_id
            and window_stream not in connection.streams
            and window_stream not in connection.unary
        ):
            return None
    decoder = c._caching_decoder  # (a block to decode is the frame loop's)
    repeated = decoder.repeated
    if repeated is None or repeated[0] != block or repeated[2] != decoder.max_header_list_size:
        return None
    headers = c._unary_open(stream_id, False, block)  # (None: nothing moved)
    if headers is None:
        return None
    connection.outbound_flow_control_window = outbound
    inbound.current_window_size -= size
    unary = connection.unary[stream_id]
    unary.inbound.current_window_size -= size
    unary.outbound = own
    unary.remote_ended = True
    return headers


def processed(window: Any, size: int) -> int:
    """h2's ``WindowManager.process_bytes(size)`` (with its _maybe_update_window)
    in one call: the window increment to send now, 0 for none."""
    processed = window._bytes_processed + size
    current, largest = window.current_window_size, window.max_window_size
    if processed and (
        (current == 0 and processed > min(1024, largest // 4)) or processed >= largest // 2
    ):
        increment = min(processed, largest - current)
        window._bytes_processed = 0
        window.current_window_size = current + increment
        return increment
    window._bytes_processed = processed
    return 0
