"""Where trionserve leans on private parts of h2, hpack and hyperframe: only here
(and in :mod:`~trionserve.protocol.grpc.hpackcache`, its HPACK part, and
:mod:`~trionserve.protocol.grpc.h2frames`, its frame buffer and frames).

Each use below goes past a library's public API for speed on the gRPC hot path,
and each is checked by ``tests/unit/test_upstream_internals.py``, which fails when an
upstream release changes what it relies on; pyproject.toml bounds these
libraries below their next minor release until that test passes on it.

- hyperframe (h2frames): ``Frame.__repr__`` replaced (a short form, for h2's
  trace log).
- hpack (:mod:`~trionserve.protocol.grpc.hpackcache`): ``Encoder.header_table.resized``
  and ``.dynamic_entries`` read; ``Decoder.header_table.dynamic_entries`` and
  ``.maxsize`` read.
- h2, a unary call's stream held apart (``H2Connection.unary``): the methods
  that find streams, ``_receive_frame`` and the initial window's changes
  overridden; ``_decode_headers`` called; ``highest_inbound_stream_id``,
  ``_closed_streams``, ``state_machine`` (its table's rows in SERVER_OPEN) and
  ``_inbound_flow_control_window_manager`` moved as h2 moves them; an
  ``H2Stream`` made as ``_begin_new_stream`` does, its state set (``_promote``).
- h2: ``Settings._settings`` read (per code, the current value first) for the
  initial window and the stream limit; a ``WindowManager``'s
  ``current_window_size``, ``max_window_size`` and ``_bytes_processed`` moved
  as its ``process_bytes`` moves them (``_processed``, in h2frames), and set
  as its ``__init__`` sets them for a closed held stream's re-armed
  (``_unary_open``).
- h2: ``H2Connection._prepare_for_sending`` overridden and ``_data_to_send`` read
  (large DATA payloads written from their own buffers); ``_data_to_send``
  appended to, ``streams`` read, and the connection's and a stream's
  ``state_machine`` given h2's own inputs (constant HEADERS frames made once);
  ``encoder``, ``decoder`` and ``incoming_buffer`` replaced; a small DATA
  frame made without h2's frame object (``send_whole``: the state machines
  given h2's inputs, the connection's and the stream's
  ``outbound_flow_control_window`` lowered as h2 lowers them);
  (h2frames) ``FrameBuffer.__next__`` overridden, reading its ``_data``,
  ``max_frame_size``, ``_validate_frame_length`` and ``_update_header_buffer``;
  hyperframe's frames made from their header without their ``__init__``
  (``frame_header``: each class's attributes as its ``__init__`` leaves them,
  ``Flags`` with its ``_valid_flags`` and ``_flags``);
  ``max_inbound_frame_size`` made a property that keeps the frame buffer's
  limit in step with it.

protobuf's private symbol database (``builder._sym_db``) is used in one place
too: :mod:`trionserve._generated.protopool`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
import h2.stream
import h2.windows
import numpy as np
from hpack.struct import HeaderWeaklyTyped
from hyperframe import frame as hyperframe_frame

from trionserve.protocol.grpc.h2frames import FrameBuffer, frame_header
from trionserve.protocol.grpc.h2frames import processed as _processed
from trionserve.protocol.grpc.hpackcache import CachingDecoder, CachingEncoder
from trionserve.protocol.grpc.unarystream import SPARE_STREAMS, UnaryStream, unary_call

__all__ = [
    "CachingDecoder",
    "CachingEncoder",
    "FrameBuffer",
    "H2Connection",
    "frame_header",
]


_FRAME_HEADER = struct.Struct(">HBBBL")
_WINDOW_UPDATE = struct.Struct(">HBBBLL")
_DATA_FRAME = 0x0
_HEADERS_FRAME = 0x1
_WINDOW_UPDATE_FRAME = 0x8
_MAX_WINDOW = 2**31 - 1
_Data, _Window = hyperframe_frame.DataFrame, hyperframe_frame.WindowUpdateFrame
_RECV_HEADERS = h2.connection.ConnectionInputs.RECV_HEADERS
_RECV_DATA = h2.connection.ConnectionInputs.RECV_DATA
_RECV_WINDOW_UPDATE = h2.connection.ConnectionInputs.RECV_WINDOW_UPDATE
_SEND_HEADERS = h2.connection.ConnectionInputs.SEND_HEADERS
_SEND_DATA = h2.connection.ConnectionInputs.SEND_DATA
_SERVER_OPEN = h2.connection.ConnectionState.SERVER_OPEN
_END_STREAM = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_PRIORITY = 0x20
_INCREMENT = struct.Struct(">L")

# Settings read from h2's Settings._settings (a value per code, the current one
# first: what its properties return, without two calls each).
_INITIAL_WINDOW_SIZE = h2.settings.SettingCodes.INITIAL_WINDOW_SIZE
_MAX_CONCURRENT_STREAMS = h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS

# What H2Connection.receive gives for a frame it took from its bytes.
REQUEST, DATA, WINDOW = 0, 1, 2


class H2Connection(h2.connection.H2Connection):
    """h2's state machine, with large DATA payloads written from their own buffers
    and a unary call's stream held apart while it goes the common way.

    h2 serializes every frame into one bytearray and hands out a copy of it: a
    4 MB message would be copied four times before the socket. A payload passed
    to ``send_data`` as a uint8 array (a view of the message) skips that: h2 still
    does the stream state and flow-control accounting, and the frame goes out as
    its 9-byte header and the view, in order with h2's other output. Read the
    output with ``buffers_to_send``.

    The stream of a call to one of ``unary_paths`` is held apart as a
    :class:`~.unarystream.UnaryStream` (in ``unary``), without h2's stream,
    state machine and frame objects, while it goes the common way: HEADERS
    (decoded by the same HPACK decoder), DATA and WINDOW_UPDATE in; response
    headers, one DATA frame within the windows and the OK trailers out, the
    headers as blocks made once that leave the encoder as it is. It gives h2's
    events, and moves the connection's state machine, windows, highest stream
    id and record of closed streams as h2 does. Anything else on it first makes
    it h2's stream, as h2's would be (``_promote``).
    tests/unit/test_grpc_unary_stream.py holds it to h2's, frame for frame.
    """

    # h2 records how each closed stream closed, in one ordered dict per connection
    # of up to 2**16 entries: about 10 MB of malloc'd memory per connection that
    # has made that many calls, freed only when it closes (qa/L0_response_cache's
    # massif step saw each perf_analyzer run's connection swing the heap by it).
    # The record only changes the answer to a HEADERS frame on a closed stream (a
    # stream error after a reset, else a connection error): grpc core's chttp2,
    # which Triton serves on, records nothing and skips such frames (parsing.cc
    # init_header_frame_parser). One entry per stream the default
    # SETTINGS_MAX_CONCURRENT_STREAMS allows is kept.
    MAX_CLOSED_STREAMS = 1024

    def __init__(
        self,
        constant_headers: Sequence[Sequence[tuple[bytes, bytes]]],
        config: h2.config.H2Configuration,
        unary_paths: Iterable[bytes] = (),
    ) -> None:
        self.unary: dict[int, UnaryStream] = {}
        # Closed held streams, re-armed for new ones (_unary_open); the last
        # header list _unary_open found a unary call's (checked once).
        self.spare: list[UnaryStream] = []
        self._unary_checked: tuple | None = None
        # A held stream's DATA frame that ``receive`` takes in pieces as its
        # bytes come: (stream id, bytes still to come, its END_STREAM).
        self.partial: tuple[int, int, bool] | None = None
        self.unary_paths = frozenset(unary_paths)
        super().__init__(config)
        self.encoder = self._caching_encoder = CachingEncoder(constant_headers)
        decoder = self._caching_decoder = CachingDecoder()
        decoder.max_header_list_size = self.decoder.max_header_list_size
        decoder.max_allowed_table_size = self.decoder.max_allowed_table_size
        self.decoder = decoder
        self.incoming_buffer = FrameBuffer(server=not config.client_side)
        self.incoming_buffer.max_frame_size = self.max_inbound_frame_size
        self._buffers: list = []

    # h2 sets max_inbound_frame_size when the peer acknowledges our SETTINGS, and
    # copies it into the frame buffer only when the next bytes are received: with
    # frames checked on their header (FrameBuffer), a large frame right behind the
    # acknowledgement, in the same bytes, must meet the new limit, so the buffer
    # follows the setting at once (RFC 9113 section 6.5.3: in effect on the ack).
    @property
    def max_inbound_frame_size(self) -> int:
        return self._max_inbound_frame_size

    @max_inbound_frame_size.setter
    def max_inbound_frame_size(self, value: int) -> None:
        self._max_inbound_frame_size = value
        buffer = getattr(self, "incoming_buffer", None)  # None while h2's __init__ runs
        if buffer is not None:
            buffer.max_frame_size = value

    # -- unary streams: in -----------------------------------------------------------

    def _moved(self, given: h2.connection.ConnectionInputs) -> list[h2.events.Event]:
        # h2's table, for every input given here: in SERVER_OPEN, no action and no move.
        machine = self.state_machine
        return [] if machine.state is _SERVER_OPEN else machine.process_input(given)

    @property
    def open_inbound_streams(self) -> int:
        return super().open_inbound_streams + len(self.unary)

    def _receive_frame(self, frame: hyperframe_frame.Frame) -> list[h2.events.Event]:
        f: Any = frame  # its kind's attributes, without a cast() call per frame
        stream_id, kind = f.stream_id, type(f)
        unary = self.unary.get(stream_id) if stream_id else None
        if unary is not None:
            if kind is _Data and not unary.remote_ended:
                return self._unary_data(stream_id, unary, f)
            if kind is _Window and unary.outbound + f.window_increment <= _MAX_WINDOW:
                events = self._moved(_RECV_WINDOW_UPDATE)
                unary.outbound += f.window_increment
                events.append(
                    h2.events.WindowUpdated(stream_id=stream_id, delta=f.window_increment)
                )
                return events
            self._promote(stream_id)
        elif (
            kind is _Window
            and stream_id % 2
            and stream_id <= self.highest_inbound_stream_id
            and stream_id not in self.streams
        ):  # a closed stream's (the client's, for an answer it read): h2 drops it
            return self._moved(_RECV_WINDOW_UPDATE)
        elif kind is hyperframe_frame.HeadersFrame and stream_id and self.unary_paths:
            opened = self._unary_headers(f)
            if opened is not None:
                return opened
            try:
                return super()._receive_frame(frame)
            finally:
                self._caching_decoder.predecoded = None
        return super()._receive_frame(frame)

    def _unary_open(self, stream_id: int, end: bool, block: object) -> Sequence | None:
        """A new stream's HEADERS (without a priority): its headers when the call
        is to a unary path and goes the common way (the stream is then held
        apart, moved as h2 would move it), else None (h2 takes the frame, and
        the headers if they were decoded here)."""
        local = self.local_settings._settings
        if (
            stream_id in self.streams
            or stream_id % 2 == 0
            or stream_id <= self.highest_inbound_stream_id
            # h2's own check, with h2's own cleanup of closed streams (none
            # without streams of h2's)
            or (self.open_inbound_streams if self.streams else len(self.unary))
            >= local[_MAX_CONCURRENT_STREAMS][0]
        ):
            return None
        decoder = self._caching_decoder
        repeated = decoder.repeated  # (the client's last block again: not decoded)
        if repeated and repeated[0] == block and repeated[2] == decoder.max_header_list_size:
            headers: Any = repeated[1]
        else:
            headers = h2.connection._decode_headers(self.decoder, block)  # type: ignore[arg-type]
        if headers is not self._unary_checked and not unary_call(headers, self.unary_paths):
            decoder.predecoded = (block, list(headers))
            return None
        if repeated and headers is repeated[1]:  # (a repeated list is checked once)
            self._unary_checked = headers
        if self.state_machine.state is not _SERVER_OPEN:
            self.state_machine.process_input(_RECV_HEADERS)
        self.highest_inbound_stream_id = stream_id
        inbound = local[_INITIAL_WINDOW_SIZE][0]
        outbound = self.remote_settings._settings[_INITIAL_WINDOW_SIZE][0]
        spare = self.spare  # (a closed one's, re-armed: no UnaryStream and WindowManager made)
        if spare:
            unary = spare.pop()
            window = unary.inbound
            window.max_window_size = window.current_window_size = inbound
            window._bytes_processed = 0
            unary.outbound, unary.remote_ended, unary.sending = outbound, end, False
        else:
            unary = UnaryStream(inbound, outbound, end)
        self.unary[stream_id] = unary
        return headers  # (the repeated list itself: _on_request knows it by identity)

    def _unary_headers(self, frame: hyperframe_frame.HeadersFrame) -> list[h2.events.Event] | None:
        """h2's events for a new stream's HEADERS frame held apart (_unary_open)."""
        flags = frame.flags._flags
        if "PRIORITY" in flags:
            return None
        stream_id = frame.stream_id
        end = "END_STREAM" in flags
        headers = self._unary_open(stream_id, end, frame.data)
        if headers is None:
            return None
        request = h2.events.RequestReceived(stream_id=stream_id, headers=list(headers))
        if not end:
            return [request]
        request.stream_ended = ended = h2.events.StreamEnded(stream_id=stream_id)
        return [request, ended]

    def receive(self, data: bytes | bytearray | memoryview) -> list:
        """``receive_data``, with the frames of unary calls going the common way
        taken here from their bytes, without h2's frame and event objects.

        Each frame taken gives a tuple: ``(REQUEST, stream_id, headers, ended)``
        for a new unary call's HEADERS, ``(DATA, stream_id, payload, ended)`` for
        its DATA (unpadded: the payload is all the flow-controlled bytes, a
        view of ``data``; a frame not whole in ``data`` is given in pieces as its
        bytes come, ``ended`` with the last, its windows taken on its header:
        ``partial`` holds what is still to come),
        ``(WINDOW, stream_id, increment)`` for a WINDOW_UPDATE of the connection
        or of a held stream (none for a closed stream's); the state moves as h2's
        ``receive_data`` moves it (tests/unit/test_grpc_unary_stream.py). The first
        frame that is anything else (another type, flags, a stream of h2's, a
        window past its bounds, a frame past SETTINGS_MAX_FRAME_SIZE, a frame
        other than DATA not whole) and every byte after it are h2's, its events
        after the tuples.
        """
        out: list = []
        if self.partial is not None:  # the rest of a DATA frame taken in pieces first
            stream_id, left, ended = self.partial
            take = min(left, len(data))
            left -= take
            self.partial = None if not left else (stream_id, left, ended)
            if take:
                out.append((DATA, stream_id, memoryview(data)[:take], ended and not left))
            if take == len(data):
                return out
            data = memoryview(data)[take:]
        buffer: Any = self.incoming_buffer
        if (
            buffer._data
            or buffer._headers_buffer
            or buffer._preamble_len
            or self.state_machine.state is not _SERVER_OPEN
        ):
            out.extend(self.receive_data(bytes(data)))
            return out
        size, pos = len(data), 0
        held = self.unary
        limit = self._max_inbound_frame_size
        while size - pos >= 9:
            high, low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(data, pos)
            length = (high << 8) + low
            start, end = pos + 9, pos + 9 + length
            if length > limit or (end > size and kind != _DATA_FRAME):
                break
            stream_id &= 0x7FFFFFFF
            if kind == _DATA_FRAME:
                unary = held.get(stream_id)
                if unary is None or unary.remote_ended or flags & _PADDED:
                    break
                connection = self._inbound_flow_control_window_manager
                stream = unary.inbound
                if length > connection.current_window_size or length > stream.current_window_size:
                    break  # h2 raises FLOW_CONTROL_ERROR
                connection.current_window_size -= length
                stream.current_window_size -= length
                ended = unary.remote_ended = bool(flags & _END_STREAM)
                if end > size:  # the rest comes in the next reads (self.partial)
                    self.partial = (stream_id, end - size, ended)
                    if size > start:
                        out.append((DATA, stream_id, memoryview(data)[start:], False))
                    return out
                out.append((DATA, stream_id, memoryview(data)[start:end], ended))
            elif kind == _HEADERS_FRAME:
                if flags & (_PADDED | _PRIORITY) or not flags & _END_HEADERS:
                    break
                ended = bool(flags & _END_STREAM)
                try:
                    headers = self._unary_open(stream_id, ended, bytes(data[start:end]))
                except h2.exceptions.ProtocolError as exc:  # as h2's receive_data
                    self._terminate_connection(exc.error_code)
                    raise
                if headers is None:
                    break
                out.append((REQUEST, stream_id, headers, ended))
            elif kind == _WINDOW_UPDATE_FRAME and length == 4:
                increment = _INCREMENT.unpack_from(data, start)[0]
                if not 0 < increment <= _MAX_WINDOW:
                    break  # h2 raises PROTOCOL_ERROR
                if not stream_id:
                    if self.outbound_flow_control_window + increment > _MAX_WINDOW:
                        break  # h2 raises FLOW_CONTROL_ERROR
                    self.outbound_flow_control_window += increment
                    out.append((WINDOW, 0, increment))
                elif (unary := held.get(stream_id)) is not None:
                    if unary.outbound + increment > _MAX_WINDOW:
                        break  # h2 resets the stream
                    unary.outbound += increment
                    out.append((WINDOW, stream_id, increment))
                elif not (
                    stream_id % 2
                    and stream_id <= self.highest_inbound_stream_id
                    and stream_id not in self.streams
                ):
                    break  # a closed stream's (the client's, for an answer it read) is dropped
            else:
                break
            pos = end
        if pos < size:
            out.extend(self.receive_data(bytes(data[pos:])))
        return out

    def took(self, size: int) -> tuple[int, bool]:
        """``size`` bytes of the ``partial`` DATA frame's payload were taken
        straight from the socket (as ``receive`` would give them): its stream
        id, and whether they end the stream."""
        assert self.partial is not None and 0 < size <= self.partial[1]
        stream_id, left, ended = self.partial
        left -= size
        self.partial = (stream_id, left, ended) if left else None
        return stream_id, ended and not left

    def _unary_data(
        self, stream_id: int, unary: UnaryStream, frame: hyperframe_frame.DataFrame
    ) -> list[h2.events.Event]:
        # h2's _receive_data_frame and H2Stream.receive_data, in their order.
        flow = frame.flow_controlled_length
        events = self._moved(_RECV_DATA)
        self._inbound_flow_control_window_manager.window_consumed(flow)
        unary.inbound.window_consumed(flow)
        data = h2.events.DataReceived(
            stream_id=stream_id, data=frame.data, flow_controlled_length=flow
        )
        events.append(data)
        if "END_STREAM" in frame.flags._flags:
            unary.remote_ended = True
            data.stream_ended = ended = h2.events.StreamEnded(stream_id=stream_id)
            events.append(ended)
        return events

    def _promote(self, stream_id: int) -> None:
        """Make a unary stream h2's, in the state h2's own would be in now
        (h2's _begin_new_stream, then its state machine's inputs so far)."""
        unary = self.unary.pop(stream_id)
        stream = h2.stream.H2Stream(
            stream_id,
            config=self.config,
            inbound_window_size=unary.inbound.max_window_size,
            outbound_window_size=unary.outbound,
        )
        stream.max_outbound_frame_size = self.max_outbound_frame_size
        stream._inbound_window_manager = unary.inbound
        machine = stream.state_machine
        machine.client = False
        machine.headers_received = True
        if unary.sending:
            machine.headers_sent = True
        states = h2.stream.StreamState
        machine.state = states.HALF_CLOSED_REMOTE if unary.remote_ended else states.OPEN
        self.streams[stream_id] = stream

    # Every h2 call that looks a stream up finds h2's own.
    def _get_stream_by_id(self, stream_id: int | None) -> h2.stream.H2Stream:
        if stream_id in self.unary:
            self._promote(stream_id)
        return super()._get_stream_by_id(stream_id)

    def _get_or_create_stream(
        self, stream_id: int, allowed_ids: h2.connection.AllowedStreamIDs
    ) -> h2.stream.H2Stream:
        if stream_id in self.unary:
            self._promote(stream_id)
        return super()._get_or_create_stream(stream_id, allowed_ids)

    def increment_flow_control_window(self, increment: int, stream_id: int | None = None) -> None:
        if stream_id in self.unary:
            self._promote(stream_id)
        super().increment_flow_control_window(increment, stream_id)

    def send_data(self, stream_id: int, *args: Any, **kwargs: Any) -> None:
        if stream_id in self.unary:
            self._promote(stream_id)
        super().send_data(stream_id, *args, **kwargs)

    # A new initial window changes every stream's: h2 changes its own.
    def _flow_control_change_from_settings(self, old_value: int | None, new_value: int) -> None:
        for stream_id in list(self.unary):
            self._promote(stream_id)
        super()._flow_control_change_from_settings(old_value, new_value)

    def _inbound_flow_control_change_from_settings(self, old: int | None, new: int) -> None:
        for stream_id in list(self.unary):
            self._promote(stream_id)
        super()._inbound_flow_control_change_from_settings(old, new)

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        unary = self.unary.get(stream_id)
        if unary is None or acknowledged_size < 0:
            super().acknowledge_received_data(acknowledged_size, stream_id)
            return
        # h2's: the connection's WINDOW_UPDATE, then the stream's, as its window
        # managers decide them.
        increment = _processed(self._inbound_flow_control_window_manager, acknowledged_size)
        if increment:
            self._data_to_send += _WINDOW_UPDATE.pack(0, 4, _WINDOW_UPDATE_FRAME, 0, 0, increment)
        increment = _processed(unary.inbound, acknowledged_size)
        if increment:
            self._data_to_send += _WINDOW_UPDATE.pack(
                0, 4, _WINDOW_UPDATE_FRAME, 0, stream_id, increment
            )

    # -- unary streams: out ----------------------------------------------------------

    def _unary_headers_out(
        self, stream_id: int, unary: UnaryStream, headers: Iterable[HeaderWeaklyTyped], end: bool
    ) -> bool:
        """The response headers (``end`` False) or OK trailers (True) of a unary
        stream whose client has ended, as their constant block: False when not
        that (the stream is then h2's)."""
        if unary.remote_ended and unary.sending is end:
            block = self._caching_encoder.constant_block(headers)
            size = len(block) if block is not None else 0
            if block is not None and size <= self.max_outbound_frame_size:
                if self.state_machine.state is not _SERVER_OPEN:
                    self.state_machine.process_input(_SEND_HEADERS)
                self._data_to_send += _FRAME_HEADER.pack(
                    size >> 8, size & 0xFF, _HEADERS_FRAME, _END_HEADERS | end, stream_id
                )
                self._data_to_send += block
                if end:  # closed: as h2 records a stream it cleans up
                    spare = self.spare
                    if len(spare) < SPARE_STREAMS:  # (nothing else holds it: re-armed)
                        spare.append(self.unary.pop(stream_id))
                    else:
                        del self.unary[stream_id]
                    self._closed_streams[stream_id] = h2.stream.StreamClosedBy.SEND_END_STREAM
                else:
                    unary.sending = True
                return True
        self._promote(stream_id)
        return False

    def send_headers(
        self,
        stream_id: int,
        headers: Iterable[HeaderWeaklyTyped],
        end_stream: bool = False,
        priority_weight: int | None = None,
        priority_depends_on: int | None = None,
        priority_exclusive: bool | None = None,
    ) -> None:
        """h2's ``send_headers``; a constant header list (the response headers,
        the OK trailers) on an open stream goes out as its frame, made once.

        h2 builds, validates, encodes and serializes a HEADERS frame per call:
        about a tenth of a unary call's time on the event loop. Here the state
        machines take the same inputs h2's own ``send_headers`` gives them (the
        connection's SEND_HEADERS, the stream's SEND_HEADERS and, ending the
        stream, SEND_END_STREAM: they raise as they do for h2), and the frame's
        bytes are appended to h2's output. Anything else, or a pending HPACK
        table size update, or a frame past the peer's frame size, is h2's.
        """
        if priority_weight is None and priority_depends_on is None and priority_exclusive is None:
            unary = self.unary.get(stream_id)
            if unary is not None and self._unary_headers_out(stream_id, unary, headers, end_stream):
                return
            stream = self.streams.get(stream_id)
            block = self._caching_encoder.constant_block(headers)
            if (
                stream is not None
                and block is not None
                and len(block) <= self.max_outbound_frame_size
            ):
                self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_HEADERS)
                machine = stream.state_machine
                machine.process_input(h2.stream.StreamInputs.SEND_HEADERS)
                flags = _END_HEADERS
                if end_stream:
                    machine.process_input(h2.stream.StreamInputs.SEND_END_STREAM)
                    flags |= _END_STREAM
                size = len(block)
                self._data_to_send += _FRAME_HEADER.pack(
                    (size >> 8) & 0xFFFF, size & 0xFF, _HEADERS_FRAME, flags, stream_id
                )
                self._data_to_send += block
                return
        super().send_headers(
            stream_id,
            headers,
            end_stream,
            priority_weight,
            priority_depends_on,
            priority_exclusive,
        )

    def send_unary(
        self, stream_id: int, headers: Sequence[tuple[bytes, bytes]], data: bytes
    ) -> bool:
        """``send_headers(stream_id, headers)`` then ``send_whole(stream_id,
        data)`` in one: a held unary stream's response headers (a constant list)
        and its whole answer, when its client has ended, the connection is open
        and both fit the windows and the frame size; else False, nothing done
        (the caller sends them those two ways)."""
        unary = self.unary.get(stream_id)
        if (
            unary is None
            or unary.sending
            or not unary.remote_ended
            or self.state_machine.state is not _SERVER_OPEN
        ):
            return False
        block = self._caching_encoder.constant_block(headers)
        size, limit = len(data), self.max_outbound_frame_size
        if (
            block is None
            or len(block) > limit
            or size > limit
            or size > self.outbound_flow_control_window
            or size > unary.outbound
        ):
            return False
        unary.sending = True
        unary.outbound -= size
        self.outbound_flow_control_window -= size
        out = self._data_to_send
        length = len(block)
        out += _FRAME_HEADER.pack(
            length >> 8, length & 0xFF, _HEADERS_FRAME, _END_HEADERS, stream_id
        )
        out += block
        out += _FRAME_HEADER.pack(size >> 8, size & 0xFF, _DATA_FRAME, 0, stream_id)
        out += data
        return True

    def send_whole(self, stream_id: int, data: bytes) -> bool:
        """h2's ``send_data(stream_id, data)`` when ``data`` fits the windows and
        one frame, without h2's frame object: False (nothing done) when it does
        not fit or the stream is unknown, for the caller to send it in pieces.

        A unary call's answer is one small message: h2 built a DataFrame for it,
        serialized it, and copied it into its output. Here the state machines
        and both flow-control windows take what h2's own ``send_data`` gives
        them (the connection's SEND_DATA, the stream's SEND_DATA, both windows
        less the size: a closed or reset stream raises as it does for h2) and
        the frame's header and payload are appended to h2's output, after the
        HEADERS frame queued before it and before the trailers.
        """
        size = len(data)
        unary = self.unary.get(stream_id)
        if unary is not None:
            if not unary.sending:
                self._promote(stream_id)
            elif (
                size > self.max_outbound_frame_size
                or size > self.outbound_flow_control_window
                or size > unary.outbound
            ):
                return False
            else:
                if self.state_machine.state is not _SERVER_OPEN:
                    self.state_machine.process_input(_SEND_DATA)
                unary.outbound -= size
                self.outbound_flow_control_window -= size
                self._data_to_send += _FRAME_HEADER.pack(
                    size >> 8, size & 0xFF, _DATA_FRAME, 0, stream_id
                )
                self._data_to_send += data
                return True
        stream = self.streams.get(stream_id)
        if (
            stream is None
            or size > self.max_outbound_frame_size
            or size > self.outbound_flow_control_window
            or size > stream.outbound_flow_control_window
        ):
            return False
        self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_DATA)
        stream.state_machine.process_input(h2.stream.StreamInputs.SEND_DATA)
        stream.outbound_flow_control_window -= size
        self.outbound_flow_control_window -= size
        self._data_to_send += _FRAME_HEADER.pack(
            (size >> 8) & 0xFFFF, size & 0xFF, _DATA_FRAME, 0, stream_id
        )
        self._data_to_send += data
        return True

    def _prepare_for_sending(self, frames: list[hyperframe_frame.Frame]) -> None:
        for frame in frames:
            if type(frame) is hyperframe_frame.DataFrame and type(frame.data) is np.ndarray:
                break
        else:  # no payload views: h2's own serialization
            super()._prepare_for_sending(frames)
            return
        for frame in frames:
            if type(frame) is hyperframe_frame.DataFrame and type(frame.data) is np.ndarray:
                pending = self.data_to_send()
                if pending:
                    self._buffers.append(pending)
                size = frame.body_len = len(frame.data)  # never padded: we pass no pad_length
                flags = _END_STREAM if "END_STREAM" in frame.flags else 0
                self._buffers.append(
                    _FRAME_HEADER.pack(
                        (size >> 8) & 0xFFFF, size & 0xFF, _DATA_FRAME, flags, frame.stream_id
                    )
                )
                self._buffers.append(frame.data)
            else:
                super()._prepare_for_sending([frame])

    def has_output(self) -> bool:
        return bool(self._buffers or self._data_to_send)

    def buffers_to_send(self) -> list:
        """Everything to write, in order: bytes, and payload views (h2's output
        handed on as it is, not copied as ``data_to_send`` copies it)."""
        buffers, self._buffers = self._buffers, []
        tail = self._data_to_send
        if tail:
            buffers.append(tail)
            self._data_to_send = bytearray()
        return buffers
