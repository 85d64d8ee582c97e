"""The private parts of h2, hpack, hyperframe and protobuf we rely on are still there.

Each test here fails when an upstream release changes something
``trionserve/protocol/grpc/upstream.py`` or ``trionserve/_generated/protopool.py``
relies on: then adapt that module and raise the version bound in pyproject.toml.
"""

from __future__ import annotations

import inspect
import struct

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.stream
import h2.windows
import hpack
import numpy as np
import pytest
from google.protobuf.internal import api_implementation, builder
from h2.stream import StreamState
from hyperframe import frame as hyperframe_frame
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trionserve.protocol.grpc import h2frames, hpackcache, upstream

HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


def test_hyperframe_frame_repr_is_replaced():
    assert hyperframe_frame.Frame.__repr__ is h2frames._frame_repr
    assert repr(hyperframe_frame.DataFrame(5, data=bytes(200))) == "DataFrame(stream_id=5)"
    # h2 still formats each received frame (what the short repr is for).
    assert "repr(frame)" in inspect.getsource(h2.connection.H2Connection._receive_frame)


def test_hpack_header_table_attributes():
    encoder = hpack.Encoder()
    assert encoder.header_table.resized is False
    assert len(encoder.header_table.dynamic_entries) == 0
    encoder.header_table_size = 1024
    assert encoder.header_table.resized is True


def test_hpack_decoder_table_attributes():
    decoder = hpack.Decoder()
    table = decoder.header_table
    assert len(table.dynamic_entries) == 0 and isinstance(table.maxsize, int)
    assert isinstance(decoder.max_allowed_table_size, int)
    assert isinstance(decoder.max_header_list_size, int)
    decoder.decode(hpack.Encoder().encode([(b"x-a", b"1")]))
    assert list(table.dynamic_entries) == [(b"x-a", b"1")]  # newest first


def test_kept_header_lists_follow_the_dynamic_table():
    encoder, decoder = hpack.Encoder(), upstream.CachingDecoder()
    decoder.decode(encoder.encode([(b"x-a", b"1")]), raw=True)  # inserted at index 62
    indexed = encoder.encode([(b"x-a", b"1")])
    assert indexed == b"\xbe"
    assert decoder.decode(indexed, raw=True) == [(b"x-a", b"1")]
    assert decoder.decode(indexed, raw=True) == [(b"x-a", b"1")]  # kept
    assert (indexed, True) in decoder._kept
    # A new entry takes index 62: the same block now means the new header.
    decoder.decode(encoder.encode([(b"x-b", b"2")]), raw=True)
    assert decoder.decode(indexed, raw=True) == [(b"x-b", b"2")]
    older = b"\xbf"  # index 63: x-a, moved down
    assert decoder.decode(older, raw=True) == [(b"x-a", b"1")]
    # A smaller table evicts x-a without inserting anything: index 63 is gone.
    decoder.header_table_size = 40
    assert [bytes(name) for name, _ in decoder.header_table.dynamic_entries] == [b"x-b"]
    with pytest.raises(hpack.HPACKDecodingError):
        decoder.decode(older, raw=True)
    assert decoder.decode(indexed, raw=True) == [(b"x-b", b"2")]


def test_the_repeated_block_is_forgotten_whenever_the_table_may_change():
    encoder, decoder = hpack.Encoder(), upstream.CachingDecoder()
    decoder.decode(encoder.encode([(b"x-a", b"1")]), raw=True)  # inserted at index 62
    assert decoder.repeated is None  # (a literal: the table changed)
    indexed = encoder.encode([(b"x-a", b"1")])
    assert decoder.decode(indexed, raw=True) == [(b"x-a", b"1")]
    assert decoder.repeated == (indexed, ((b"x-a", b"1"),), decoder.max_header_list_size)
    decoder.decode(indexed, raw=True)  # kept: still the one
    assert decoder.repeated is not None and decoder.repeated[0] == indexed
    # Any other block forgets it, even one that fails half-way.
    with pytest.raises(hpack.HPACKDecodingError):
        decoder.decode(b"\xff\xff\xff\xff", raw=True)
    assert decoder.repeated is None
    decoder.decode(indexed, raw=False)  # (not raw: never the repeated one)
    assert decoder.repeated is None
    decoder.decode(indexed, raw=True)
    decoder.header_table_size = 0  # evicts: the block means nothing any more
    assert decoder.repeated is None
    assert decoder.header_table_size == 0  # (hpack's getter kept)


def test_a_repeated_request_block_opens_its_stream_without_decoding():
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    server = upstream.H2Connection([HEADERS], config, [b"/m"])
    server.initiate_connection()
    client = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
    client.initiate_connection()
    server.receive_data(client.data_to_send())
    request = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", b"/m"),
        (b":authority", b"a"),
        (b"content-type", b"application/grpc"),
    ]
    decoded: list[bytes] = []
    decode = server.decoder.decode
    server.decoder.decode = lambda data, raw=False: decoded.append(data) or decode(data, raw)

    def opened(stream_id: int, headers: list[tuple[bytes, bytes]]) -> list:
        client.send_headers(stream_id, headers, end_stream=True)
        events = server.receive(client.data_to_send())
        return [
            list(event[2]) if type(event) is tuple else event.headers
            for event in events
            if type(event) is tuple or type(event) is h2.events.RequestReceived
        ]

    assert [opened(stream_id, request) for stream_id in (1, 3, 5, 7)] == [[request]] * 4
    # The literals, then the indexes once: the next ones are not decoded.
    assert len(decoded) == 2
    # A new entry moves the indexes: the same block is decoded again.
    assert opened(9, [*request, (b"x-b", b"2")]) == [[*request, (b"x-b", b"2")]]
    assert opened(11, request) == [request]
    assert len(decoded) == 4


def test_only_small_header_lists_are_kept():
    encoder, decoder = hpack.Encoder(), upstream.CachingDecoder()
    big = [(b"x-a", b"a" * 2000), (b"x-b", b"b" * 2000)]
    decoder.decode(encoder.encode(big), raw=True)
    block = encoder.encode(big + big[:1])  # three indexes: 6 kB of headers
    assert len(block) == 3 and all(byte & 0x80 for byte in block)
    assert decoder.decode(block, raw=True) == big + big[:1]
    assert not decoder._kept


def test_h2_connection_decodes_with_the_caching_decoder_and_h2s_limits():
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    server = upstream.H2Connection([HEADERS], config)
    plain = h2.connection.H2Connection(config)
    assert type(server.decoder) is upstream.CachingDecoder
    assert server.decoder.max_header_list_size == plain.decoder.max_header_list_size
    assert server.decoder.max_allowed_table_size == plain.decoder.max_allowed_table_size
    assert "decoder.decode(" in inspect.getsource(h2.connection._decode_headers)


def test_cached_header_blocks_decode_to_the_headers():
    encoder = upstream.CachingEncoder([HEADERS])
    block = encoder.encode(HEADERS)
    assert block == hpackcache._state_free_block(HEADERS)
    assert hpack.Decoder().decode(block, raw=True) == HEADERS


def _connections(constant=(HEADERS,)):
    """An h2 server and client, past the preface and settings exchange."""
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    server = upstream.H2Connection(constant, config)
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(b"".join(bytes(b) for b in server.buffers_to_send()))
    server.receive_data(client.data_to_send())
    client.send_headers(
        1, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/x"), (b":authority", b"a")]
    )
    server.receive_data(client.data_to_send())
    return server, client


def test_h2_private_send_path_still_exists():
    source = inspect.getsource(h2.connection.H2Connection)
    assert "def _prepare_for_sending(self, frames" in source
    assert "self._data_to_send" in source
    # send_data serializes through _prepare_for_sending (our hook sees every frame).
    assert "_prepare_for_sending" in inspect.getsource(h2.connection.H2Connection.send_data)


TRAILERS = [(b"grpc-status", b"0")]


def test_constant_headers_go_out_as_h2_sends_them():
    """Response headers and trailers of the constant lists, made once as frames,
    reach the client as h2's own would and move both sides' state machines alike."""
    for constant in ((HEADERS, TRAILERS), ()):  # made once, and h2's own path
        server, client = _connections(constant)
        assert (server.encoder.constant_block(HEADERS) is None) == (not constant)
        server.send_headers(1, HEADERS)
        server.send_data(1, b"\x00\x00\x00\x00\x00")
        server.send_headers(1, TRAILERS, end_stream=True)
        events = client.receive_data(b"".join(bytes(b) for b in server.buffers_to_send()))
        kinds = [type(e).__name__ for e in events]
        assert kinds == ["ResponseReceived", "DataReceived", "TrailersReceived", "StreamEnded"]
        assert list(events[0].headers) == HEADERS and list(events[2].headers) == TRAILERS
        # The client has not ended its side: the server's is closed, as h2 closes it.
        assert server.streams[1].state_machine.state is StreamState.HALF_CLOSED_LOCAL
        with pytest.raises(h2.exceptions.ProtocolError):  # refused as h2 refuses it
            server.send_headers(1, HEADERS)


def test_constant_headers_wait_for_a_table_size_update():
    server, client = _connections()
    server.encoder.header_table_size = 1024  # an update must go out with the next block
    assert server.encoder.constant_block(HEADERS) is None
    server.send_headers(1, HEADERS, end_stream=True)  # h2's own path
    events = client.receive_data(b"".join(bytes(b) for b in server.buffers_to_send()))
    assert list(events[0].headers) == HEADERS


def test_h2_state_machine_inputs_still_exist():
    assert h2.connection.ConnectionInputs.SEND_HEADERS
    assert h2.stream.StreamInputs.SEND_HEADERS and h2.stream.StreamInputs.SEND_END_STREAM
    server, _ = _connections()
    assert isinstance(server.streams, dict)
    assert callable(server.state_machine.process_input)
    assert callable(server.streams[1].state_machine.process_input)
    # h2's send_headers gives the state machines these inputs, in this order.
    source = inspect.getsource(h2.stream.H2Stream.send_headers)
    assert source.index("StreamInputs.SEND_HEADERS") < source.index("StreamInputs.SEND_END_STREAM")
    source = inspect.getsource(h2.connection.H2Connection.send_headers)
    assert "ConnectionInputs.SEND_HEADERS" in source


def test_payload_views_go_out_as_h2_would_write_them():
    server, client = _connections()
    payload = bytes(range(256)) * 64
    server.send_headers(1, HEADERS)
    server.send_data(1, np.frombuffer(payload, np.uint8), end_stream=True)
    wire = b"".join(bytes(b) for b in server.buffers_to_send())
    events = client.receive_data(wire)
    received = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert received == payload
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)
    headers = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert headers and list(headers[0].headers) == HEADERS


def test_a_whole_data_frame_goes_out_as_h2s_own_send_data_writes_it():
    """send_whole and h2's send_data: the same bytes on the wire, the same windows
    and states after; past a window or the frame size it does nothing."""
    payload = b"\x00\x00\x00\x00\x03abc"
    ours, _ = _connections()
    theirs, _ = _connections()
    for server in (ours, theirs):
        server.send_headers(1, HEADERS)
        server.buffers_to_send()
    assert ours.send_whole(1, payload)
    theirs.send_data(1, payload)
    assert ours.buffers_to_send() == theirs.buffers_to_send()
    for a, b in ((ours, theirs), (ours.streams[1], theirs.streams[1])):
        assert a.outbound_flow_control_window == b.outbound_flow_control_window
        assert a.state_machine.state == b.state_machine.state
    window = ours.local_flow_control_window(1)
    assert not ours.send_whole(1, b"x" * (window + 1))  # past the window: the caller's
    assert not ours.send_whole(1, b"x" * (ours.max_outbound_frame_size + 1))
    assert not ours.send_whole(3, payload)  # no such stream
    assert ours.local_flow_control_window(1) == window and not ours.has_output()
    ours.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    with pytest.raises(h2.exceptions.ProtocolError):  # refused as h2 refuses it
        ours.send_whole(1, payload)
    with pytest.raises(h2.exceptions.ProtocolError):
        theirs.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
        theirs.send_data(1, payload)
    source = inspect.getsource(h2.stream.H2Stream.send_data)
    assert "StreamInputs.SEND_DATA" in source and "outbound_flow_control_window -=" in source
    source = inspect.getsource(h2.connection.H2Connection.send_data)
    assert "ConnectionInputs.SEND_DATA" in source and "outbound_flow_control_window -=" in source


def test_protobuf_symbol_database_hook():
    assert hasattr(builder, "_sym_db")
    assert api_implementation.Type() in ("python", "upb", "cpp")
    assert "_sym_db" in inspect.getsource(builder.BuildTopDescriptorsAndMessages)


def test_frame_buffer_internals_still_exist():
    source = inspect.getsource(h2.frame_buffer.FrameBuffer)
    for name in ("self._data", "self.max_frame_size", "_validate_frame_length(self"):
        assert name in source
    assert "_update_header_buffer(self, f" in source
    h2_source = inspect.getsource(h2.connection.H2Connection)
    assert "self.incoming_buffer = FrameBuffer(" in h2_source
    # Set on the SETTINGS ack; upstream.H2Connection's property follows it.
    assert "self.max_inbound_frame_size = setting.new_value" in h2_source
    server, _ = _connections()
    assert type(server.incoming_buffer) is upstream.FrameBuffer


def _frames_of(buffer, wire: bytes, step: int) -> list[tuple]:
    buffer.max_frame_size = 2**24 - 1
    seen = []
    for i in range(0, len(wire), step):
        buffer.add_data(wire[i : i + step])
        for frame in buffer:
            seen.append(
                (
                    type(frame).__name__,
                    frame.stream_id,
                    sorted(frame.flags),
                    bytes(frame.serialize()),
                )
            )
    return seen


def test_frame_buffer_yields_the_frames_h2s_does():
    """The same frames as h2's FrameBuffer, however the bytes are split: DATA with
    and without padding, a header block in CONTINUATION frames, control frames."""
    headers = hyperframe_frame.HeadersFrame(1, b"\x82\x84\x86", flags=["END_HEADERS"])
    opening = hyperframe_frame.HeadersFrame(3, b"\x82\x84")
    continuation = hyperframe_frame.ContinuationFrame(3, b"\x86", flags=["END_HEADERS"])
    padded = hyperframe_frame.DataFrame(1, b"p" * 1000, flags=["PADDED"], pad_length=17)
    frames = [
        hyperframe_frame.SettingsFrame(0, settings={4: 2**20}),
        headers,
        hyperframe_frame.DataFrame(1, bytes(range(256)) * 300),
        opening,
        continuation,
        padded,
        hyperframe_frame.WindowUpdateFrame(0, window_increment=1000),
        hyperframe_frame.DataFrame(3, b"end", flags=["END_STREAM"]),
        hyperframe_frame.PingFrame(0, opaque_data=b"12345678"),
    ]
    wire = b"".join(f.serialize() for f in frames)
    for step in (1, 7, 4096, len(wire)):
        expected = _frames_of(h2.frame_buffer.FrameBuffer(), wire, step)
        assert _frames_of(upstream.FrameBuffer(), wire, step) == expected, step
    assert len(expected) == len(frames) - 1  # the continued header block is one frame


def test_frame_buffer_refuses_an_oversized_frame_on_its_header():
    """A frame announced past max_frame_size raises FRAME_SIZE_ERROR as soon as its
    9-byte header is in, before any of its payload arrives."""
    buffer = upstream.FrameBuffer()
    buffer.max_frame_size = 1 << 20
    buffer.add_data(struct.pack(">HBBBL", 0xFFFF, 0xFF, 0x0, 0, 1))
    with pytest.raises(h2.exceptions.FrameTooLargeError):
        next(buffer)


def _header_outcome(parse, header: bytes) -> tuple:
    """What a frame-header parser makes of ``header``: the frame's class, every
    attribute (the flags as their names and the names allowed) and the body's
    length, or the exception's class."""
    try:
        frame, length = parse(header)
    except Exception as exc:
        return ("raised", type(exc))
    attributes = dict(vars(frame))
    flags = attributes.pop("flags")
    return (
        type(frame),
        attributes,
        sorted(flags),
        sorted(getattr(flags, "_valid_flags", ())),
        length,
    )


def test_frame_header_makes_the_frames_hyperframe_makes():
    """upstream.frame_header against hyperframe's Frame.parse_frame_header on
    every frame type (and unknown ones), every flag byte, stream ids 0, 1, the
    largest and one with the reserved bit set, three lengths: the same frames,
    attribute for attribute, or the same exception. Fails when hyperframe
    changes what a frame's __init__ or Flags hold."""
    for kind in [*range(12), 0x42, 0xFF]:
        for flag_byte in range(256):
            for stream_id in (0, 1, 2**31 - 1, 2**31 + 5):
                for length in (0, 16_384, 2**24 - 1):
                    header = struct.pack(
                        ">HBBBL", length >> 8, length & 0xFF, kind, flag_byte, stream_id
                    )
                    ours = _header_outcome(upstream.frame_header, header)
                    theirs = _header_outcome(
                        lambda h: hyperframe_frame.Frame.parse_frame_header(memoryview(h)), header
                    )
                    assert ours == theirs, (kind, flag_byte, stream_id, length)
    # Frames made here are the frames' own: two never share their flags.
    one, _ = upstream.frame_header(struct.pack(">HBBBL", 0, 0, 0, 1, 1))
    two, _ = upstream.frame_header(struct.pack(">HBBBL", 0, 0, 0, 1, 1))
    two.flags.add("PADDED")
    assert sorted(one.flags) == ["END_STREAM"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from([*range(11), 0x42]),
            st.integers(0, 255),
            st.sampled_from([0, 1, 3, 2**31 - 1]),
            st.binary(max_size=40),
        ),
        max_size=12,
    ),
    st.sampled_from([1, 5, 9, 64, 4096]),
)
def test_frame_buffer_matches_h2s_on_any_frames(frames, step):
    """Differential: any sequence of frames (any type, flags, stream, payload,
    well formed or not) split into pieces of ``step`` bytes: upstream.FrameBuffer
    yields what h2's own FrameBuffer yields, frame for frame, attribute for
    attribute, and raises where it raises (as the same exception class)."""
    wire = b"".join(
        struct.pack(">HBBBL", len(body) >> 8, len(body) & 0xFF, kind, flags, sid) + body
        for kind, flags, sid, body in frames
    )

    def outcome(buffer) -> list:
        buffer.max_frame_size = 16_384
        seen: list = []
        try:
            for i in range(0, len(wire), step):
                buffer.add_data(wire[i : i + step])
                for frame in buffer:
                    attributes = dict(vars(frame))
                    flags = attributes.pop("flags")
                    seen.append((type(frame), attributes, sorted(flags)))
        except Exception as exc:
            seen.append(("raised", type(exc)))
        return seen

    assert outcome(upstream.FrameBuffer()) == outcome(h2.frame_buffer.FrameBuffer())


def test_h2_stream_internals_a_held_unary_stream_becomes():
    # upstream.H2Connection._promote builds h2's stream as _begin_new_stream does
    # and sets what the state machine's inputs so far would have set: a new
    # attribute in either means the promoted stream may not be h2's own.
    config = h2.config.H2Configuration(client_side=False)
    stream = h2.stream.H2Stream(1, config=config, inbound_window_size=10, outbound_window_size=20)
    assert set(vars(stream)) == {
        "state_machine",
        "stream_id",
        "max_outbound_frame_size",
        "request_method",
        "outbound_flow_control_window",
        "_inbound_window_manager",
        "_expected_content_length",
        "_actual_content_length",
        "_authority",
        "config",
    }
    assert set(vars(stream.state_machine)) == {
        "state",
        "stream_id",
        "client",
        "headers_sent",
        "trailers_sent",
        "headers_received",
        "trailers_received",
        "stream_closed_by",
    }
    assert isinstance(stream._inbound_window_manager, h2.windows.WindowManager)
    begin = inspect.getsource(h2.connection.H2Connection._begin_new_stream)
    assert "inbound_window_size=self.local_settings.initial_window_size" in begin
    assert "outbound_window_size=self.remote_settings.initial_window_size" in begin
    assert "s.max_outbound_frame_size = self.max_outbound_frame_size" in begin
    # A request's headers: the only inputs the held stream took from IDLE.
    received = inspect.getsource(h2.stream.H2StreamStateMachine.request_received)
    assert "self.client = False" in received and "self.headers_received = True" in received


def test_h2_receive_internals_the_unary_path_uses():
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    assert isinstance(connection._closed_streams, dict)
    assert isinstance(connection._inbound_flow_control_window_manager, h2.windows.WindowManager)
    assert connection.highest_inbound_stream_id == 0
    # h2 decodes a new stream's block as frame.data (a predecoded block is found
    # by identity, or by its bytes when the frame loop decoded it), after its
    # max-streams check, before its state machine.
    headers = inspect.getsource(h2.connection.H2Connection._receive_headers_frame)
    assert headers.index("open_inbound_streams") < headers.index(
        "_decode_headers(self.decoder, frame.data)"
    )
    assert headers.index("_decode_headers") < headers.index("ConnectionInputs.RECV_HEADERS")
    assert "def _decode_headers(decoder" in inspect.getsource(h2.connection)
    for name in (
        "_receive_frame",
        "_get_stream_by_id",
        "_get_or_create_stream",
        "_flow_control_change_from_settings",
        "_inbound_flow_control_change_from_settings",
    ):
        assert callable(getattr(h2.connection.H2Connection, name))
    # Every other stream lookup h2 makes goes through those, or through
    # self.streams in the methods upstream.H2Connection overrides.
    source = inspect.getsource(h2.connection.H2Connection)
    # (_begin_new_stream's store, the two lookups, send_data, the window, closed_by)
    assert source.count("self.streams[stream_id]") == 6
    close = inspect.getsource(h2.connection.H2Connection._open_streams)
    assert "self._closed_streams[stream_id] = stream.closed_by" in close


def test_h2_connection_inputs_the_unary_path_skips_in_server_open():
    # upstream.H2Connection._moved gives none of these to h2's state machine in
    # SERVER_OPEN: each is a row there with no action and no move.
    machine = h2.connection.H2ConnectionStateMachine()
    open_ = h2.connection.ConnectionState.SERVER_OPEN
    for name in ("RECV_HEADERS", "RECV_DATA", "RECV_WINDOW_UPDATE", "SEND_HEADERS", "SEND_DATA"):
        row = machine._transitions[(open_, h2.connection.ConnectionInputs[name])]
        assert row == (None, open_)


def test_h2_settings_store_the_current_value_first():
    codes = h2.settings.SettingCodes
    settings = h2.settings.Settings(
        client=False,
        initial_values={codes.INITIAL_WINDOW_SIZE: 1000, codes.MAX_CONCURRENT_STREAMS: 4},
    )
    for code in (codes.INITIAL_WINDOW_SIZE, codes.MAX_CONCURRENT_STREAMS):
        assert settings._settings[code][0] == settings[code]
    settings.update({codes.INITIAL_WINDOW_SIZE: 50})  # in effect once acknowledged
    assert settings._settings[codes.INITIAL_WINDOW_SIZE][0] == settings.initial_window_size
    assert settings.initial_window_size == 1000
    settings.acknowledge()
    assert settings._settings[codes.INITIAL_WINDOW_SIZE][0] == 50 == settings.initial_window_size
    remote = h2.settings.Settings(client=True)  # defaults
    assert remote._settings[codes.INITIAL_WINDOW_SIZE][0] == remote.initial_window_size


@settings(max_examples=300, deadline=None)
@example(100, [(50, 49), (0, 1)])  # half the window processed: exactly at the bound
@example(100, [(100, 25), (0, 1)])  # an empty window and a quarter of it: past the bound
@given(
    st.integers(1, 2**31 - 1),
    st.lists(st.tuples(st.integers(0, 70000), st.integers(0, 70000)), max_size=30),
)
def test_processed_moves_a_window_as_h2s_process_bytes(largest, steps):
    ours, theirs = h2.windows.WindowManager(largest), h2.windows.WindowManager(largest)
    for received, processed in steps:
        if received <= theirs.current_window_size:
            theirs.window_consumed(received)
            ours.window_consumed(received)
        assert upstream._processed(ours, processed) == (theirs.process_bytes(processed) or 0)
        assert vars(ours) == vars(theirs)


def test_a_window_manager_is_its_three_attributes():
    """H2Connection._unary_open re-arms a closed held stream's WindowManager by
    setting the attributes its __init__ sets: those are all it has."""
    fresh = h2.windows.WindowManager(65535)
    assert set(vars(fresh)) == {"max_window_size", "current_window_size", "_bytes_processed"}
    used = h2.windows.WindowManager(10)
    used.window_consumed(7)
    used.process_bytes(3)
    used.max_window_size = used.current_window_size = 65535
    used._bytes_processed = 0
    assert vars(used) == vars(fresh)


def test_where_the_reading_stands_follows_h2s_buffer_and_windows():
    """h2frames.between_frames and receive_window (inflow.py's direct reads)
    read h2's frame buffer and the held stream's and connection's windows."""
    source = inspect.getsource(h2.frame_buffer.FrameBuffer)
    for name in ("self._data", "self._headers_buffer", "self._preamble_len"):
        assert name in source
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    server = upstream.H2Connection((HEADERS,), config, [b"/x"])
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(b"".join(bytes(b) for b in server.buffers_to_send()))
    server.receive_data(client.data_to_send())
    client.send_headers(
        1, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/x"), (b":authority", b"a")]
    )
    server.receive(client.data_to_send())
    assert 1 in server.unary and h2frames.between_frames(server)
    window = h2frames.receive_window(server, 1)
    assert window == min(
        server.unary[1].inbound.current_window_size,
        server._inbound_flow_control_window_manager.current_window_size,
    )
    client.send_data(1, b"x" * 100)
    data = client.data_to_send()
    server.receive(data[:50])  # a DATA frame in part
    assert not h2frames.between_frames(server)
    server.receive(data[50:])
    assert h2frames.between_frames(server)
    assert h2frames.receive_window(server, 1) == window - 100
    client.ping(b"12345678")
    server.receive(client.data_to_send()[:5])  # a header in part: h2's buffer holds it
    assert not h2frames.between_frames(server)
    assert h2frames.receive_window(server, 3) == 0  # not a held stream
