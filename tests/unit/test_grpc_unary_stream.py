"""A unary call's stream held apart from h2 (upstream.H2Connection's ``unary``)
against h2's own stream, frame for frame.

Two server connections, configured as the gRPC transport configures its own, take
the same bytes from one client and the same calls from the server's side: the
reference holds every stream as h2 does (no unary paths), the other holds the
streams of unary paths apart. After every step both must have given the same
events, written the same bytes (window updates, headers, data, resets, GOAWAY)
and raised the same errors with the same codes, and be left in the same state
(stream ids, windows, what h2 records of closed streams). The sequences are those
a gRPC client sends (whole calls, calls in pieces, several at once, the calls of
the fuzz tests' messages), and hostile ones: frames on closed or unknown streams,
window overflows, resets, priorities, padding, CONTINUATION, settings changes
mid-call, garbage.
"""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest
from hyperframe import frame as hf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trionserve.protocol.grpc import upstream
from trionserve.protocol.grpc.framing import (
    CONSTANT_HEADERS,
    GZIP_RESPONSE_HEADERS,
    OK_TRAILERS,
    RESPONSE_HEADERS,
)

UNARY = b"/inference.GRPCInferenceService/ModelInfer"
STREAMING = b"/inference.GRPCInferenceService/ModelStreamInfer"
PATHS = [UNARY, STREAMING, b"/nope"]


def _server(unary: bool) -> upstream.H2Connection:
    server = upstream.H2Connection(
        CONSTANT_HEADERS,
        h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_inbound_headers=False,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        ),
        [UNARY] if unary else (),
    )
    server.local_settings = h2.settings.Settings(
        client=False,
        initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 4,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 64 * 1024,
        },
    )
    server.initiate_connection()
    server.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 32768})
    server.increment_flow_control_window(5000)
    return server


def _outcome(call):
    """What one step did: its result or its error (type and HTTP/2 code)."""
    try:
        return ("ok", _events(call()))
    except Exception as exc:  # whatever h2 raises, the other must raise too
        return ("raised", type(exc).__name__, getattr(exc, "error_code", None))


def _events(result):
    if not isinstance(result, list):
        return result
    out = []
    for event in result:
        fields = {}
        for key, value in sorted(vars(event).items()):
            if isinstance(value, h2.events.Event):
                value = type(value).__name__
            elif isinstance(value, hf.Frame):  # an unknown frame's: as sent
                value = value.serialize()
            elif isinstance(value, list):
                value = [tuple(v) for v in value]
            elif isinstance(value, dict):  # settings: ChangedSetting has no ==
                value = repr(value)
            fields[key] = value
        out.append((type(event).__name__, fields))
    return out


def _state(server: upstream.H2Connection, stream_ids) -> tuple:
    """What h2 holds about the connection and each stream, unary streams as h2's."""
    window = server._inbound_flow_control_window_manager
    connection = (
        server.state_machine.state,
        server.highest_inbound_stream_id,
        server.open_inbound_streams,
        server.outbound_flow_control_window,
        (window.current_window_size, window._bytes_processed),
        len(server.decoder.header_table.dynamic_entries),
    )
    streams = []
    for stream_id in stream_ids:
        closed = server._stream_closed_by(stream_id)
        held = server.unary.get(stream_id)
        stream = server.streams.get(stream_id)
        if held is not None:
            inbound = (held.inbound.current_window_size, held.inbound._bytes_processed)
            streams.append(("open", closed, inbound, held.outbound))
        elif stream is not None:
            machine = stream.state_machine
            inbound = stream._inbound_window_manager
            streams.append(
                (
                    "closed" if stream.closed else "open",
                    closed,
                    (inbound.current_window_size, inbound._bytes_processed),
                    stream.outbound_flow_control_window if stream.open else None,
                    machine.headers_sent if stream.open else None,
                )
            )
        else:
            streams.append(("gone", closed))
    return connection, streams


def _normalize_states(reference, unary):
    # h2 cleans a closed stream up only when the next stream opens; the unary
    # path records it closed at once. Same record, same answers to later frames.
    def norm(streams):
        return [s[:2] if s[0] in ("closed", "gone") else s[:4] for s in streams]

    return (reference[0], norm(reference[1])), (unary[0], norm(unary[1]))


def _as_h2_events(items: list) -> list:
    """What H2Connection.receive gives, its tuples as h2's events."""
    out = []
    for item in items:
        if type(item) is not tuple:
            out.append(item)
            continue
        kind, stream_id = item[0], item[1]
        if kind == upstream.WINDOW:
            out.append(h2.events.WindowUpdated(stream_id=stream_id, delta=item[2]))
            continue
        if kind == upstream.REQUEST:
            event = h2.events.RequestReceived(stream_id=stream_id, headers=list(item[2]))
        else:
            assert kind == upstream.DATA
            event = h2.events.DataReceived(
                stream_id=stream_id, data=bytes(item[2]), flow_controlled_length=len(item[2])
            )
        out.append(event)
        if item[3]:
            event.stream_ended = ended = h2.events.StreamEnded(stream_id=stream_id)
            out.append(ended)
    return out


class Pair:
    """One client, and the servers fed the same: h2 (the reference), unary
    streams held apart through h2's receive_data, and through the transport's
    own frame loop (receive), the one the connection uses."""

    def __init__(self) -> None:
        self.reference, self.unary = _server(False), _server(True)
        self.fast = _server(True)
        self.pieces: bytes | None = None  # a DATA frame's payload so far (whole)
        self.taken = 0  # frames the frame loop took itself, all steps together
        self.encoder = hpack.Encoder()
        self.ids: list[int] = []
        self.dead = False
        preface = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        preface.initiate_connection()
        self.feed(preface.data_to_send())
        # the client acknowledges the servers' settings
        self.feed(hf.SettingsFrame(0, flags=["ACK"]).serialize())

    def feed(self, data: bytes) -> None:
        if self.dead:
            return
        a = _outcome(lambda: self.reference.receive_data(data))
        b = _outcome(lambda: self.unary.receive_data(data))
        assert a == b
        received = []

        def fast() -> list:
            received.extend(self.fast.receive(data))
            return _as_h2_events(self.whole(received))

        assert _outcome(fast) == a
        self.taken += sum(type(item) is tuple for item in received)
        self.compare()
        if a[0] == "raised":
            self.dead = True

    def whole(self, items: list) -> list:
        """The frame loop's tuples with a DATA frame taken in pieces (its
        ``partial``) as one, given with the read that completes it, as h2 gives
        it: its first pieces are held here until then."""
        out = []
        for index, item in enumerate(items):
            if type(item) is tuple and item[0] == upstream.DATA:
                if self.pieces is not None and index == 0:  # the frame's rest
                    item = (*item[:2], self.pieces + bytes(item[2]), item[3])
                    self.pieces = None
                if index == len(items) - 1 and self.fast.partial is not None:
                    assert not item[3]  # (no END_STREAM before the frame's end)
                    self.pieces = bytes(item[2])  # not whole yet
                    continue
            out.append(item)
        if not items and self.fast.partial is not None and self.pieces is None:
            self.pieces = b""  # a DATA frame's header alone
        return out

    def act(self, name: str, *args) -> None:
        if self.dead:
            return
        a = _outcome(lambda: getattr(self.reference, name)(*args))
        b = _outcome(lambda: getattr(self.unary, name)(*args))
        assert a == b, (name, args)
        assert _outcome(lambda: getattr(self.fast, name)(*args)) == a, (name, args)
        self.compare()

    def compare(self) -> None:
        out_a = b"".join(bytes(b) for b in self.reference.buffers_to_send())
        for server in (self.unary, self.fast):
            assert b"".join(bytes(b) for b in server.buffers_to_send()) == out_a
            if server.partial is not None:
                # A DATA frame not whole yet: its windows are taken already.
                assert server is self.fast
                continue
            reference, unary = _normalize_states(
                _state(self.reference, self.ids), _state(server, self.ids)
            )
            assert reference == unary

    def headers(self, stream_id: int, path: bytes, end: bool, **extra) -> bytes:
        headers = [*_request_headers(path), *extra.get("more", [])]
        if stream_id not in self.ids:
            self.ids.append(stream_id)
        frame = hf.HeadersFrame(stream_id, data=self.encoder.encode(headers))
        frame.flags.add("END_HEADERS")
        if end:
            frame.flags.add("END_STREAM")
        return frame.serialize()


def _request_headers(path: bytes) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", b"localhost"),
        (b"te", b"trailers"),
        (b"content-type", b"application/grpc"),
    ]


def _data(stream_id: int, size: int, end: bool, pad: int = 0) -> bytes:
    frame = hf.DataFrame(stream_id, data=bytes(size), pad_length=pad)
    if pad:
        frame.flags.add("PADDED")
    if end:
        frame.flags.add("END_STREAM")
    return frame.serialize()


def _window(stream_id: int, increment: int) -> bytes:
    return struct.pack(">HBBBLL", 0, 4, 0x8, 0, stream_id, increment)


def _answer(pair: Pair, stream_id: int, message: bytes = b"\x00\x00\x00\x00\x02ok") -> None:
    pair.act("send_headers", stream_id, RESPONSE_HEADERS)
    sent = _outcome(lambda: pair.reference.send_whole(stream_id, message))
    assert _outcome(lambda: pair.unary.send_whole(stream_id, message)) == sent
    assert _outcome(lambda: pair.fast.send_whole(stream_id, message)) == sent
    if sent == ("ok", False):
        pair.act("send_data", stream_id, message)
    pair.compare()
    pair.act("send_headers", stream_id, OK_TRAILERS, True)


def _answer_at_once(pair: Pair, stream_id: int, message: bytes = b"\x00\x00\x00\x00\x02ok"):
    """The response headers and the message: ``send_unary`` on the servers that
    hold unary streams, else (and where it declines) ``send_headers`` then
    ``send_whole`` or h2's ``send_data``, as GrpcCall.send does; then the OK
    trailers. How many servers took send_unary."""
    taken = []

    def answer(server: upstream.H2Connection) -> None:
        if server is not pair.reference and server.send_unary(stream_id, RESPONSE_HEADERS, message):
            taken.append(server)
            return
        server.send_headers(stream_id, RESPONSE_HEADERS)
        if not server.send_whole(stream_id, message):
            server.send_data(stream_id, message)

    if pair.dead:
        return 0
    sent = _outcome(lambda: answer(pair.reference))
    for server in (pair.unary, pair.fast):
        assert _outcome(lambda: answer(server)) == sent  # noqa: B023
    pair.compare()
    pair.act("send_headers", stream_id, OK_TRAILERS, True)
    return len(taken)


def test_a_whole_unary_call_is_held_apart_and_goes_as_h2s_would():
    pair = Pair()
    for stream_id in (1, 3, 5, 7, 9):
        pair.feed(pair.headers(stream_id, UNARY, False) + _data(stream_id, 300, True))
        assert stream_id in pair.unary.unary and stream_id not in pair.unary.streams
        pair.act("acknowledge_received_data", 300, stream_id)
        if stream_id % 4 == 1:
            _answer(pair, stream_id)
        else:
            assert _answer_at_once(pair, stream_id) == 2  # both held: at once
        assert stream_id not in pair.unary.unary  # closed, recorded as h2 records it
        pair.feed(_window(stream_id, 50) + _window(0, 50))
    assert not pair.unary.streams and not pair.fast.streams
    # Once the connection is open (h2's SERVER_OPEN, after the first HEADERS,
    # which h2 takes), every frame went through the frame loop without h2:
    # HEADERS, DATA and the connection's WINDOW_UPDATE give a tuple each, the
    # closed stream's WINDOW_UPDATE nothing.
    assert pair.taken == 1 + 4 * 3


def test_a_closed_held_stream_is_rearmed_for_the_next_call_as_h2s_new_one():
    """A held stream closed by its trailers is kept (``spare``) and re-armed for
    the next call: its windows as a new one's, compared with h2's own stream
    after the call's DATA and its window given back."""
    pair = Pair()
    for stream_id in (1, 3, 5):
        pair.feed(pair.headers(stream_id, UNARY, False))
        for server in (pair.unary, pair.fast):
            assert not server.spare  # the closed one re-armed for this call
        pair.feed(_data(stream_id, 700, True))
        pair.act("acknowledge_received_data", 700, stream_id)
        held = pair.fast.unary[stream_id]
        _answer(pair, stream_id)
        assert pair.fast.spare == [held]
    # a stream made h2's is not kept: h2 holds its window
    pair.feed(pair.headers(7, UNARY, False) + _data(7, 10, False))
    pair.act("increment_flow_control_window", 500, 7)
    assert 7 in pair.fast.streams and not pair.fast.spare
    pair.feed(pair.headers(9, UNARY, False) + _data(9, 10, True))
    assert 9 in pair.fast.unary


def test_a_repeated_header_list_is_checked_once_and_only_a_unary_calls():
    """The check of a new stream's headers (a unary path, none left to h2) is
    kept for the client's repeated list; a repeated list that fails it is
    checked again each time (its streams stay h2's)."""
    pair = Pair()
    for stream_id in (1, 3, 5):  # the same block again: the repeated list
        pair.feed(pair.headers(stream_id, b"/nope", True))
        assert stream_id in pair.fast.streams and pair.fast._unary_checked is None
        pair.act("send_headers", stream_id, [(b":status", b"415")], True)
    taken: list = []
    receive = pair.fast.receive
    pair.fast.receive = lambda data: taken.append(receive(data)) or taken[-1]  # type: ignore[method-assign]
    for stream_id in (7, 9, 11):
        pair.feed(pair.headers(stream_id, UNARY, False) + _data(stream_id, 10, True))
        assert stream_id in pair.fast.unary
        if stream_id == 11:  # the block again: the repeated list itself (_on_request: identity)
            assert taken[-1][0][2] is pair.fast._caching_decoder.repeated[1]
        _answer(pair, stream_id)
    assert pair.fast._unary_checked is pair.fast._caching_decoder.repeated[1]
    pair.feed(pair.headers(13, UNARY, False, more=[(b"cookie", b"a")]))
    assert 13 in pair.fast.streams  # another list: checked, h2's


@pytest.mark.parametrize(
    "cuts", [(9,), (10,), (9, 10), (20, 500, 501), (100, 200, 300, 908), (909,)]
)
def test_a_data_frame_cut_across_reads_is_taken_in_pieces_as_h2_takes_it_whole(cuts):
    # A large message's DATA frame comes in several reads: the frame loop takes
    # each piece as it comes (no buffering in h2, no frame object), taking the
    # frame's windows on its header; once whole, everything is as h2's.
    pair = Pair()
    pair.feed(pair.headers(1, UNARY, True))  # the connection opens (h2's SERVER_OPEN)
    frame = hf.DataFrame(3, data=bytes(range(256)) * 3 + bytes(132))
    frame.flags.add("END_STREAM")
    head = pair.headers(3, UNARY, False)
    data = head + frame.serialize() + _window(0, 7) + pair.headers(5, UNARY, True)
    taken, pieces = pair.taken, 0
    for start, stop in zip((0, *cuts), (*cuts, len(data) - len(head))):
        before = pair.fast.partial
        pair.feed(data[len(head) + start if start else 0 : len(head) + stop])
        pieces += before is not None or pair.fast.partial is not None
        assert 3 in pair.fast.unary
    inside = [cut for cut in cuts if cut < 909]  # (909: the frame ends there, whole)
    assert pair.fast.partial is None and pieces == (len(inside) + 1 if inside else 0)
    # headers, the frame (as many tuples as reads that held some of its payload,
    # none for its header alone), the window update, the next call's headers
    payload_reads = sum(stop > max(start, 9) for start, stop in zip((0, *cuts), (*cuts, 909)))
    assert pair.taken - taken == 1 + payload_reads + 2
    pair.act("acknowledge_received_data", 900, 3)
    _answer(pair, 3)


def test_window_updates_of_many_calls_go_out_as_h2s():
    # The connection's window is given back once half of it is processed.
    pair = Pair()
    for stream_id in range(1, 100, 2):
        pair.feed(pair.headers(stream_id, UNARY, False) + _data(stream_id, 600, False))
        pair.feed(_data(stream_id, 400, True))
        pair.act("acknowledge_received_data", 600, stream_id)
        pair.act("acknowledge_received_data", 400, stream_id)
        _answer(pair, stream_id)
    assert pair.reference._inbound_flow_control_window_manager._bytes_processed < 50000


def test_streaming_and_unknown_paths_stay_h2s():
    pair = Pair()
    pair.feed(pair.headers(1, STREAMING, False) + pair.headers(3, b"/nope", True))
    assert not pair.unary.unary and set(pair.unary.streams) == {1, 3}
    pair.feed(pair.headers(5, UNARY, False, more=[(b"cookie", b"a"), (b"cookie", b"b")]))
    assert 5 in pair.unary.streams  # h2 joins cookies: its stream


@pytest.mark.parametrize(
    "after",
    [
        lambda p: p.feed(hf.RstStreamFrame(1, error_code=8).serialize()),
        lambda p: p.feed(_window(1, 2**31 - 1)),  # overflow: h2 resets the stream
        lambda p: p.feed(hf.PriorityFrame(1, depends_on=1).serialize()),
        lambda p: p.feed(hf.PriorityFrame(1, depends_on=0, stream_weight=9).serialize()),
        lambda p: p.feed(p.headers(1, UNARY, False)),  # trailers without END_STREAM
        lambda p: p.feed(p.headers(1, UNARY, True)),  # trailers
        lambda p: p.feed(_data(1, 2000, False)),  # past the stream's window
        lambda p: p.act("reset_stream", 1, h2.errors.ErrorCodes.CANCEL),
        lambda p: p.act("increment_flow_control_window", 500, 1),
        lambda p: p.act("local_flow_control_window", 1),
        lambda p: p.act("send_headers", 1, [(b":status", b"415")], True),
        lambda p: p.act("send_headers", 1, OK_TRAILERS, True),
        lambda p: p.act("send_whole", 1, b"x"),
        lambda p: p.act("end_stream", 1),
        lambda p: p.feed(
            hf.SettingsFrame(0, settings={hf.SettingsFrame.INITIAL_WINDOW_SIZE: 10}).serialize()
        ),
        lambda p: p.feed(
            hf.SettingsFrame(0, settings={hf.SettingsFrame.HEADER_TABLE_SIZE: 0}).serialize()
        ),
        lambda p: p.feed(hf.GoAwayFrame(0, last_stream_id=0).serialize()),
        lambda p: p.act("close_connection"),
    ],
)
@pytest.mark.parametrize("ended", [False, True])
def test_anything_else_on_a_held_stream_goes_as_on_h2s(after, ended):
    pair = Pair()
    pair.feed(pair.headers(1, UNARY, False) + _data(1, 100, ended))
    after(pair)
    # and the call goes on (or fails) the same way on both
    pair.feed(_data(1, 10, True))
    pair.act("acknowledge_received_data", 110, 1)
    _answer(pair, 1)
    pair.feed(_window(1, 10) + _data(1, 5, False) + hf.RstStreamFrame(1).serialize())
    pair.feed(pair.headers(3, UNARY, True))
    _answer(pair, 3)


@pytest.mark.parametrize(
    "before",
    [
        lambda p: None,
        lambda p: p.feed(
            hf.SettingsFrame(0, settings={hf.SettingsFrame.INITIAL_WINDOW_SIZE: 100}).serialize()
        ),
        lambda p: p.feed(
            hf.SettingsFrame(0, settings={hf.SettingsFrame.MAX_FRAME_SIZE: 16384}).serialize()
        ),
        lambda p: p.feed(
            hf.SettingsFrame(0, settings={hf.SettingsFrame.HEADER_TABLE_SIZE: 100}).serialize()
        ),
        lambda p: p.act("close_connection"),
        lambda p: p.act("reset_stream", 3, h2.errors.ErrorCodes.CANCEL),
        lambda p: p.act("send_headers", 3, RESPONSE_HEADERS),
        lambda p: p.feed(hf.RstStreamFrame(3, error_code=8).serialize()),
    ],
)
@pytest.mark.parametrize("size", [0, 100, 20000])
def test_an_answer_at_once_goes_as_h2s_headers_and_data(before, size):
    pair = Pair()
    pair.feed(pair.headers(1, UNARY, True))
    pair.feed(pair.headers(3, UNARY, True))
    before(pair)
    message = b"\x00" + size.to_bytes(4, "big") + bytes(size)
    _answer_at_once(pair, 3, message)
    _answer_at_once(pair, 1, message)
    pair.feed(_window(0, 50000) + _window(1, 50000) + _window(3, 50000))


def test_a_response_past_the_window_is_sent_by_h2_in_pieces():
    pair = Pair()
    pair.feed(hf.SettingsFrame(0, settings={hf.SettingsFrame.INITIAL_WINDOW_SIZE: 100}).serialize())
    pair.feed(pair.headers(1, UNARY, True))
    assert 1 in pair.unary.unary
    pair.act("send_headers", 1, GZIP_RESPONSE_HEADERS)
    pair.act("send_whole", 1, bytes(500))  # False on both: past the window
    pair.act("local_flow_control_window", 1)
    pair.act("send_data", 1, bytes(100))
    pair.feed(_window(1, 400))
    pair.act("send_data", 1, bytes(400))
    pair.act("send_headers", 1, OK_TRAILERS, True)


def test_too_many_streams_and_stream_ids_going_backwards():
    pair = Pair()
    for stream_id in (1, 3, 5, 7):
        pair.feed(pair.headers(stream_id, UNARY, False))
    pair.feed(pair.headers(9, UNARY, False))  # past MAX_CONCURRENT_STREAMS
    pair = Pair()
    pair.feed(pair.headers(5, UNARY, True))
    pair.feed(pair.headers(3, UNARY, True))  # lower than the highest
    pair = Pair()
    pair.feed(pair.headers(2, UNARY, True))  # even: the server's
    pair = Pair()
    pair.feed(pair.headers(1, UNARY, True))
    _answer(pair, 1)
    pair.feed(_data(1, 10, False))  # DATA on a stream closed by END_STREAM


def test_headers_in_continuations_padding_and_priority():
    pair = Pair()
    block = pair.encoder.encode([(b":method", b"POST"), (b":path", UNARY), (b"x-long", b"v" * 300)])
    pair.ids.append(1)
    head = hf.HeadersFrame(1, data=block[:10])
    tail = hf.ContinuationFrame(1, data=block[10:])
    tail.flags.add("END_HEADERS")
    pair.feed(head.serialize() + tail.serialize() + _data(1, 40, True, pad=7))
    assert 1 in pair.unary.unary
    pair.act("acknowledge_received_data", 48, 1)
    _answer(pair, 1)
    pair.ids.append(3)
    prioritized = hf.HeadersFrame(
        3,
        data=pair.encoder.encode([(b":method", b"POST"), (b":path", UNARY)]),
        depends_on=1,
        stream_weight=3,
    )
    for flag in ("END_HEADERS", "PRIORITY", "END_STREAM"):
        prioritized.flags.add(flag)
    pair.feed(prioritized.serialize())
    _answer(pair, 3)


# -- any sequence ------------------------------------------------------------------

stream_ids = st.sampled_from([1, 3, 5, 7, 9, 11, 2, 0x7FFFFFFF])
client_steps = st.one_of(
    st.tuples(st.just("headers"), stream_ids, st.sampled_from(PATHS), st.booleans()),
    st.tuples(
        st.just("data"),
        stream_ids,
        st.integers(0, 1500),
        st.booleans(),
        st.sampled_from([0, 0, 3]),
    ),
    st.tuples(st.just("window"), st.sampled_from([0, 1, 3, 5]), st.integers(1, 2**31 - 1)),
    st.tuples(st.just("rst"), stream_ids, st.integers(0, 13)),
    st.tuples(st.just("priority"), stream_ids, st.sampled_from([0, 1, 3])),
    st.tuples(st.just("ping"), st.booleans()),
    st.tuples(
        st.just("settings"),
        st.sampled_from([hf.SettingsFrame.INITIAL_WINDOW_SIZE, hf.SettingsFrame.HEADER_TABLE_SIZE]),
        st.sampled_from([0, 10, 4096, 70000, 2**31]),
    ),
    st.tuples(st.just("garbage"), st.binary(min_size=9, max_size=30)),
)
server_steps = st.one_of(
    st.tuples(st.just("answer"), stream_ids, st.integers(0, 800)),
    st.tuples(st.just("at_once"), stream_ids, st.integers(0, 800)),
    st.tuples(st.just("ack"), stream_ids, st.integers(0, 1500)),
    st.tuples(st.just("reset"), stream_ids),
    st.tuples(st.just("refuse"), stream_ids),
    st.tuples(st.just("window"), stream_ids, st.integers(1, 3000)),
)


def _client_bytes(pair: Pair, step: tuple) -> bytes:
    kind = step[0]
    if kind == "headers":
        return pair.headers(step[1], step[2], step[3])
    if kind == "data":
        return _data(step[1], step[2], step[3], step[4])
    if kind == "window":
        return _window(step[1], step[2])
    if kind == "rst":
        return hf.RstStreamFrame(step[1], error_code=step[2]).serialize()
    if kind == "priority":
        return hf.PriorityFrame(step[1], depends_on=step[2]).serialize()
    if kind == "ping":
        return hf.PingFrame(
            0, opaque_data=b"12345678", flags=["ACK"] if step[1] else []
        ).serialize()
    if kind == "settings":
        return struct.pack(">HBBBLHL", 0, 6, 0x4, 0, 0, step[1], step[2])
    return step[1]


def _server_step(pair: Pair, step: tuple) -> None:
    kind, stream_id = step[0], step[1]
    if kind == "answer":
        message = b"\x00" + step[2].to_bytes(4, "big") + bytes(step[2])
        pair.act("send_headers", stream_id, RESPONSE_HEADERS)
        sent = _outcome(lambda: pair.reference.send_whole(stream_id, message))
        assert _outcome(lambda: pair.unary.send_whole(stream_id, message)) == sent
        assert _outcome(lambda: pair.fast.send_whole(stream_id, message)) == sent
        pair.compare()
        pair.act("send_headers", stream_id, OK_TRAILERS, True)
    elif kind == "at_once":
        _answer_at_once(pair, stream_id, b"\x00" + step[2].to_bytes(4, "big") + bytes(step[2]))
    elif kind == "ack":
        pair.act("acknowledge_received_data", step[2], stream_id)
    elif kind == "reset":
        pair.act("reset_stream", stream_id, h2.errors.ErrorCodes.NO_ERROR)
    elif kind == "refuse":
        pair.act("send_headers", stream_id, [(b":status", b"405")], True)
    else:
        pair.act("increment_flow_control_window", step[2], stream_id)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(client_steps, server_steps.map(lambda s: ("server", s))), max_size=30))
def test_any_sequence_goes_as_on_h2s_streams(steps):
    pair = Pair()
    for step in steps:
        if step[0] == "server":
            _server_step(pair, step[1])
        else:
            pair.feed(_client_bytes(pair, step))
        if pair.dead:
            break


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.lists(client_steps, min_size=1, max_size=5).map(lambda s: ("client", s)),
            server_steps.map(lambda s: ("server", s)),
        ),
        max_size=20,
    ),
    st.lists(st.integers(0, 4000), min_size=1, max_size=20),
)
def test_frames_read_together_and_cut_anywhere_go_as_on_h2s(steps, cuts):
    # What one read of the socket brings: several frames at once (the frame
    # loop takes them one after another, then h2 the rest from the first it
    # does not take), or a frame cut anywhere (h2 buffers it).
    pair = Pair()
    pair.feed(pair.headers(1, UNARY, True))  # the connection opens (h2's SERVER_OPEN)
    for index, step in enumerate(steps):
        if step[0] == "server":
            _server_step(pair, step[1])
        else:
            data = b"".join(_client_bytes(pair, client) for client in step[1])
            cut = cuts[index % len(cuts)]
            pair.feed(data[:cut])
            pair.feed(data[cut:])
        if pair.dead:
            break


def _prioritized(pair: Pair, stream_id: int) -> bytes:
    pair.ids.append(stream_id)
    frame = hf.HeadersFrame(
        stream_id,
        data=pair.encoder.encode([(b":method", b"POST"), (b":path", UNARY)]),
        depends_on=1,
        stream_weight=3,
    )
    frame.flags.add("END_HEADERS")
    frame.flags.add("PRIORITY")
    return frame.serialize()


def _continued(pair: Pair, stream_id: int) -> bytes:
    pair.ids.append(stream_id)
    block = pair.encoder.encode([(b":method", b"POST"), (b":path", UNARY)])
    head = hf.HeadersFrame(stream_id, data=block[:3])
    tail = hf.ContinuationFrame(stream_id, data=block[3:])
    tail.flags.add("END_HEADERS")
    return head.serialize() + tail.serialize()


@pytest.mark.parametrize(
    "frames",
    [
        lambda p: _data(3, 40, True, pad=7),
        lambda p: _data(3, 40, False, pad=0) + _data(3, 40, True, pad=200),
        lambda p: _window(0, 2**31 + 5),  # the reserved bit set: hyperframe refuses it
        lambda p: _window(3, 2**31 + 5),
        lambda p: _window(0, 0),
        lambda p: _window(3, 0),
        lambda p: _window(0, 2**31 - 1),  # past the largest window
        lambda p: _window(2, 5),  # a stream the client cannot have
        lambda p: _window(41, 5),  # a stream not opened yet
        lambda p: struct.pack(">HBBBLL", 0, 5, 0x8, 0, 3, 5) + b"\x00",  # 5 bytes long
        lambda p: _prioritized(p, 5),
        lambda p: _continued(p, 5) + _data(5, 10, True),
        lambda p: p.headers(5, UNARY, True, more=[(b"content-length", b"10")]),
        lambda p: p.headers(5, STREAMING, False) + _data(5, 10, True),
        lambda p: (
            p.headers(5, UNARY, False) + struct.pack(">HBBBL", 0, 0xFF, 0, 0, 5) + b"\x00" * 255
        ),
        lambda p: struct.pack(">HBBBL", 1, 0, 0, 1, 3) + bytes(65536),  # past the frame size
        lambda p: p.headers(5, UNARY, True, more=[(b"x-long", b"v" * 40000)]),  # and whole
        lambda p: struct.pack(">HBBBL", 0, 3, 0xEE, 0, 0) + b"abc",  # an unknown type
        lambda p: struct.pack(">HBBBL", 0, 3, 0x1, 0x5, 7) + b"\xff\xff\xff",  # a bad block
    ],
)
def test_frames_the_loop_leaves_to_h2_go_as_on_h2s(frames):
    pair = Pair()
    pair.feed(pair.headers(1, UNARY, True))  # the connection opens (h2's SERVER_OPEN)
    pair.feed(pair.headers(3, UNARY, False) + frames(pair) + _window(0, 7) + _data(3, 5, True))
    if not pair.dead:
        _answer(pair, 1)
        _answer(pair, 3)


def test_data_past_the_connection_window_is_h2s_flow_control_error():
    # Each stream may take 1000 bytes; calls whose data is never acknowledged
    # use the connection's window up (65,535 + 5,000) until a stream's window
    # is larger than what is left of it.
    pair = Pair()
    pair.feed(pair.headers(1, UNARY, True))
    for stream_id in range(3, 145, 2):
        pair.feed(pair.headers(stream_id, UNARY, False) + _data(stream_id, 1000, True))
        if pair.dead:
            break
        _answer(pair, stream_id)
    assert pair.dead


@pytest.mark.parametrize("size", [90, 95, 96, 200])
def test_an_answer_at_once_past_a_held_streams_window_is_h2s(size):
    # The client's initial window (100) applies to the streams it opens after it.
    pair = Pair()
    pair.feed(hf.SettingsFrame(0, settings={hf.SettingsFrame.INITIAL_WINDOW_SIZE: 100}).serialize())
    pair.feed(pair.headers(1, UNARY, True))
    pair.feed(pair.headers(3, UNARY, True))
    assert 3 in pair.fast.unary
    message = b"\x00" + size.to_bytes(4, "big") + bytes(size)
    taken = _answer_at_once(pair, 3, message)
    assert taken == (2 if size + 5 <= 100 else 0)


def test_a_window_change_of_ours_applies_once_the_client_acknowledges_it():
    # Streams opened before the client's ack take the window in effect then.
    pair = Pair()
    pair.feed(pair.headers(1, UNARY, True))
    pair.act("update_settings", {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 500})
    pair.feed(pair.headers(3, UNARY, False) + _data(3, 800, False))
    assert 3 in pair.fast.unary
    pair.feed(hf.SettingsFrame(0, flags=["ACK"]).serialize())
    pair.feed(pair.headers(5, UNARY, False) + _data(5, 400, False) + _data(3, 100, True))
    pair.feed(_data(5, 200, True))  # past the new window


@pytest.mark.parametrize("unary", [False, True])
def test_a_connection_remembers_only_its_latest_closed_streams(unary):
    """How each closed stream closed is kept for the last MAX_CLOSED_STREAMS
    streams only (h2 keeps 2**16 per connection, about 10 MB once a client has
    made that many calls on it), on h2's streams and on held ones alike; the
    forgotten ones are the oldest."""
    limit = 1024  # upstream.H2Connection.MAX_CLOSED_STREAMS
    server = _server(unary)
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    client.initiate_connection()
    server.receive(client.data_to_send() + hf.SettingsFrame(0, flags=["ACK"]).serialize())
    encoder = hpack.Encoder()
    message = b"\x00\x00\x00\x00\x00"
    calls = limit + 100
    for n in range(calls):
        stream_id = 1 + 2 * n
        block = encoder.encode(_request_headers(UNARY))
        headers = hf.HeadersFrame(stream_id, data=block)
        headers.flags.add("END_HEADERS")
        server.receive(headers.serialize() + _data(stream_id, len(message), True))
        if not server.send_unary(stream_id, RESPONSE_HEADERS, message):
            server.send_headers(stream_id, RESPONSE_HEADERS)
            if not server.send_whole(stream_id, message):
                server.send_data(stream_id, message)
        server.send_headers(stream_id, OK_TRAILERS, end_stream=True)
        server.buffers_to_send()
    # h2 files its closed streams as it counts the open ones
    assert server.open_inbound_streams == 0 and not server.unary
    closed = list(server._closed_streams)
    assert len(closed) == limit
    assert closed == [1 + 2 * n for n in range(calls - limit, calls)]
