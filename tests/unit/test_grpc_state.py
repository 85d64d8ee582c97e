"""The gRPC transport's protocol layers without sockets.

- the call's and the connection's state machines (trionserve.protocol.grpc.state):
  every row of each transition table, and every event a state has no row for
  refused;
- the connection buffer's flow-control decisions (trionserve.protocol.grpc.flow),
  with numbers alone;
- the request-head checks (trionserve.protocol.grpc.request), with header lists;
- the Connection's Trio loop over ``trio.testing.memory_stream_pair()``, an h2
  client on the other end: the state bugs fixed so far, as regression tests.
"""

from __future__ import annotations

import itertools
import struct
from contextlib import asynccontextmanager

import h2.errors
import h2.events
import pytest
import trio
import trio.lowlevel
import trio.testing

from tests.unit.test_grpc_transport import GoAway, Handlers, RawClient, frame
from trionserve.core.client_budget import ClientBudget
from trionserve.protocol.grpc.call import Method
from trionserve.protocol.grpc.connection import Connection
from trionserve.protocol.grpc.flow import ConnectionBuffer, Window
from trionserve.protocol.grpc.options import TransportOptions
from trionserve.protocol.grpc.request import HttpRefusal, RequestHead, read_request_head
from trionserve.protocol.grpc.state import (
    CONNECTION_TRANSITIONS,
    REQUEST_TRANSITIONS,
    RESPONSE_TRANSITIONS,
    CallState,
    Conn,
    ConnectionState,
    ConnEvent,
    LocalProtocolError,
    Request,
    RequestEvent,
    Response,
    ResponseEvent,
)
from trionserve.protocol.grpc.status import GRPCError, Status

# -- state machines ---------------------------------------------------------------

Q, QE, R, RE, C, CE = Request, RequestEvent, Response, ResponseEvent, Conn, ConnEvent

# Every allowed transition, written out: the tables must be exactly these.
REQUEST_ROWS = [
    (Q.OPEN, QE.END_STREAM, Q.ENDED),
    (Q.OPEN, QE.REFUSE, Q.FAILED),
    (Q.OPEN, QE.RESET, Q.RESET),
    (Q.ENDED, QE.RESET, Q.RESET),
    (Q.FAILED, QE.END_STREAM, Q.FAILED),
    (Q.FAILED, QE.RESET, Q.RESET),
]
RESPONSE_ROWS = [
    (R.IDLE, RE.HEADERS, R.SENDING),
    (R.IDLE, RE.FINISH, R.ANSWERED),
    (R.IDLE, RE.ABANDON, R.ABANDONED),
    (R.SENDING, RE.FINISH, R.ANSWERED),
    (R.SENDING, RE.ABANDON, R.ABANDONED),
    (R.ANSWERED, RE.ABANDON, R.ANSWERED),
    (R.ABANDONED, RE.ABANDON, R.ABANDONED),
]
CONNECTION_ROWS = [
    (C.OPEN, CE.DRAIN, C.DRAINING),
    (C.OPEN, CE.CLOSE, C.CLOSING),
    (C.DRAINING, CE.CLOSE, C.DRAINED),
]


def _table_rows(table):
    return sorted((s, e, t) for s, row in table.items() for e, t in row.items())


@pytest.mark.parametrize(
    "table, rows",
    [
        (REQUEST_TRANSITIONS, REQUEST_ROWS),
        (RESPONSE_TRANSITIONS, RESPONSE_ROWS),
        (CONNECTION_TRANSITIONS, CONNECTION_ROWS),
    ],
    ids=["request", "response", "connection"],
)
def test_transition_tables_are_exactly_the_listed_rows(table, rows):
    assert _table_rows(table) == sorted(rows)
    assert set(table) == {s for s, _, _ in rows} | {t for _, _, t in rows} | set(table)


def _request_machine(state: Request) -> CallState:
    machine = CallState()
    machine.request = state
    return machine


def _response_machine(state: Response) -> CallState:
    machine = CallState()
    machine.response = state
    return machine


def _all_pairs(states, events):
    return [(s, e) for s in states for e in events]


@pytest.mark.parametrize("state, event", _all_pairs(Request, RequestEvent))
def test_request_side_moves_only_by_its_rows(state, event):
    machine = _request_machine(state)
    expected = {(s, e): t for s, e, t in REQUEST_ROWS}.get((state, event))
    if expected is None:
        with pytest.raises(LocalProtocolError, match=f"request side.*{event.name}.*{state.name}"):
            machine.request_event(event)
        assert machine.request is state
    else:
        machine.request_event(event)
        assert machine.request is expected


@pytest.mark.parametrize("state, event", _all_pairs(Response, ResponseEvent))
def test_response_side_moves_only_by_its_rows(state, event):
    machine = _response_machine(state)
    expected = {(s, e): t for s, e, t in RESPONSE_ROWS}.get((state, event))
    if expected is None:
        with pytest.raises(LocalProtocolError, match=f"response side.*{event.name}.*{state.name}"):
            machine.response_event(event)
        assert machine.response is state
    else:
        machine.response_event(event)
        assert machine.response is expected


@pytest.mark.parametrize("state, event", _all_pairs(Conn, ConnEvent))
def test_connection_moves_only_by_its_rows(state, event):
    machine = ConnectionState()
    machine.state = state
    expected = {(s, e): t for s, e, t in CONNECTION_ROWS}.get((state, event))
    if expected is None:
        with pytest.raises(LocalProtocolError, match=f"connection.*{event.name}.*{state.name}"):
            machine.event(event)
    else:
        machine.event(event)
        assert machine.state is expected


def test_what_the_states_say():
    call = CallState()
    assert call.answerable and not call.reset and not call.client_done
    call.request_event(RequestEvent.RESET)  # a reset before the call's task started
    call.response_event(ResponseEvent.ABANDON)
    assert call.reset and call.client_done and not call.answerable
    answered = CallState(ended=True)
    assert answered.client_done
    answered.response_event(ResponseEvent.HEADERS)
    answered.response_event(ResponseEvent.FINISH)
    assert not answered.answerable
    with pytest.raises(LocalProtocolError):  # a second final status
        answered.response_event(ResponseEvent.FINISH)
    with pytest.raises(LocalProtocolError):  # a message after the status
        answered.response_event(ResponseEvent.HEADERS)
    conn = ConnectionState()
    assert not conn.draining and not conn.closing
    conn.event(ConnEvent.DRAIN)
    assert conn.draining and not conn.closing
    conn.event(ConnEvent.CLOSE)
    assert conn.draining and conn.closing  # client-streaming calls still stop reading


# -- the connection buffer ------------------------------------------------------------


def test_a_message_within_the_window_gets_its_window_back_at_once():
    buffer = ConnectionBuffer(limit=1000, window=100)
    call = buffer.open(1)
    assert buffer.received(call, 50, 0, [50]) == [Window(1, ack=50)]
    assert buffer.held == 50 and call.queued == 50


def _buffer_in(state: str) -> ConnectionBuffer:
    """A buffer of a connection with another call in ``state``."""
    buffer = ConnectionBuffer(limit=800, window=700, budget=ClientBudget(10_000))
    other = buffer.open(1)
    if state == "held back":  # its queue past its window
        buffer.received(other, 750, 0, [750])
    elif state == "working":
        buffer.received(other, 200, 0, [200])
        buffer.taken(other, 200)
    elif state == "in part":
        buffer.received(other, 100, 100, [])
    return buffer


def _counted(buffer: ConnectionBuffer) -> tuple:
    accounts = [
        (a.queued, a.partial, a.working, a.unacked, a.deferred_ack, a.deferred_stream)
        for a in buffer._accounts.values()
    ]
    budget = buffer.budget
    assert budget is not None
    held_back = [a.stream_id for a in buffer._held_back]
    return buffer.held, buffer.peak, buffer.unacked, held_back, accounts, budget.held


@pytest.mark.parametrize("state", ["new", "held back", "working", "in part"])
@pytest.mark.parametrize("length", [1, 250, 600, 650, 700, 701, 900])
def test_a_whole_message_counted_at_once_as_received_counts_it(state, length):
    """ConnectionBuffer.whole (a call taken whole, inflow._take_whole) counts
    what ``received`` counts for the call's one DATA frame when ``received``
    gives its whole window back at once, else counts nothing."""
    by_frame, at_once = _buffer_in(state), _buffer_in(state)
    windows = by_frame.received(by_frame.open(3), length + 5, 0, [length])
    account = at_once.open(3)
    if at_once.whole(account, length):  # (the caller gives the window back)
        assert windows == [Window(3, ack=length + 5)]
    else:
        assert _counted(at_once)[0] == _counted(_buffer_in(state))[0]
        assert at_once.received(account, length + 5, 0, [length]) == windows
    assert _counted(at_once) == _counted(by_frame)


@pytest.mark.parametrize("state", ["new", "held back", "working", "in part"])
@pytest.mark.parametrize("length", [1, 250, 600, 650, 700, 701, 900])
def test_a_message_taken_at_once_as_has_room_then_taken(state, length):
    """ConnectionBuffer.take (a unary call's one message, GrpcCall.take_whole)
    is ``has_room`` then ``taken``: None and nothing counted without room,
    else ``taken``'s windows and counts."""
    apart, at_once = _buffer_in(state), _buffer_in(state)
    for buffer in (apart, at_once):
        buffer.received(buffer.open(3), length + 5, 0, [length])
    before = _counted(at_once)
    taken = at_once.take(at_once._accounts[3], length)
    if not apart.has_room(length):
        assert taken is None and _counted(at_once) == before
    else:
        assert taken == apart.taken(apart._accounts[3], length)
        assert _counted(at_once) == _counted(apart)
        assert list(at_once._accounts[3].taken) == [length]


def test_a_message_s_window_comes_back_once_with_its_end():
    # The reads of an unfinished message give no window; its end gives it all,
    # stream and connection, in one (a WINDOW_UPDATE pair per message, not per read).
    buffer = ConnectionBuffer(limit=1000, window=1000)
    call = buffer.open(1)
    assert buffer.received(call, 100, 100, []) == []
    assert buffer.received(call, 100, 200, []) == []
    assert (buffer.held, buffer.unacked, call.unacked) == (200, 200, 200)
    assert buffer.received(call, 50, 0, [250]) == [Window(1, ack=250)]
    assert (buffer.held, buffer.unacked, call.unacked) == (250, 0, 0)


def test_unacknowledged_bytes_stay_below_a_quarter_of_the_connection_window():
    # All calls together: the client always has window left to reach the next
    # acknowledgement (no call waits on another's unfinished message).
    buffer = ConnectionBuffer(limit=400, window=1000)  # the connection's window: 400
    first, second = buffer.open(1), buffer.open(3)
    assert buffer.received(first, 60, 60, []) == []
    assert buffer.received(second, 30, 30, []) == []
    assert buffer.received(second, 20, 50, []) == [Window(3, ack=50)]  # 110 >= 100
    assert buffer.received(first, 39, 99, []) == []
    assert buffer.unacked == first.unacked == 99
    assert buffer.received(first, 1, 100, []) == [Window(1, ack=100)]
    assert buffer.unacked == 0


def test_unacknowledged_bytes_of_a_refused_or_ended_call_are_given_back():
    buffer = ConnectionBuffer(limit=1000, window=1000)
    refused, ended = buffer.open(1), buffer.open(3)
    buffer.received(refused, 40, 40, [])
    buffer.received(ended, 30, 30, [])
    assert buffer.refused(refused) == [Window(1, ack=40)]
    assert buffer.close(ended) == [Window(3, connection=30)]  # the stream is over
    assert (buffer.held, buffer.unacked) == (0, 0)


def test_unacknowledged_bytes_held_back_with_the_frame_past_the_window():
    buffer = ConnectionBuffer(limit=1000, window=100)
    call = buffer.open(1)
    buffer.received(call, 20, 20, [])
    buffer.received(call, 100, 0, [120])  # 120 queued > window 100: held back
    assert (call.deferred_ack, call.unacked, buffer.unacked) == (120, 0, 0)
    assert buffer.taken(call, 120) == [Window(1, ack=120)]


def test_a_stream_past_its_window_is_held_back_until_its_handler_takes_messages():
    buffer = ConnectionBuffer(limit=1000, window=100)
    call = buffer.open(1)
    assert buffer.received(call, 80, 0, [80]) == [Window(1, ack=80)]
    assert buffer.received(call, 80, 0, [80]) == []  # 160 queued > window 100
    assert buffer.taken(call, 80) == [Window(1, ack=80)]  # 80 queued again
    assert (buffer.held, buffer.working, call.queued) == (160, 80, 80)


def test_partial_messages_count_as_they_arrive():
    buffer = ConnectionBuffer(limit=1000, window=500)
    call = buffer.open(1)
    buffer.received(call, 30, 30, [])
    buffer.received(call, 30, 60, [])
    assert (buffer.held, call.partial, call.queued) == (60, 60, 0)
    buffer.received(call, 40, 0, [100])  # the message completes
    assert (buffer.held, call.partial, call.queued) == (100, 0, 100)


def test_past_the_limit_work_in_hand_holds_every_window_back_until_answered():
    buffer = ConnectionBuffer(limit=100, window=1000)
    first, second = buffer.open(1), buffer.open(3)
    buffer.received(first, 80, 0, [80])
    buffer.taken(first, 80)  # work in hand: it drains by itself
    assert buffer.received(second, 40, 0, [40]) == []  # over: no window, not even connection
    assert not buffer.has_room(40)
    assert buffer.answered(first) == [Window(3, ack=40)]
    assert buffer.has_room(40)


def test_past_the_limit_only_the_oldest_unfinished_message_may_go_on():
    # Two calls each with a partial message past the limit and nothing in hand:
    # the older stream's message must complete, so the connection window is given
    # for it while the younger's stream window stays held (72c9001: else both
    # waited on each other).
    buffer = ConnectionBuffer(limit=100, window=1000)
    older, younger = buffer.open(1), buffer.open(3)
    assert buffer.received(older, 60, 60, []) == [Window(1, ack=60)]
    assert buffer.received(younger, 60, 60, []) == [Window(3, connection=60)]
    assert buffer.received(older, 30, 90, []) == [Window(1, ack=30)]  # the oldest leads
    assert younger.deferred_stream == 60
    # The older completes (no longer unfinished: its last bytes' stream window is
    # held too, the connection's given) and is taken: work in hand now.
    assert buffer.received(older, 10, 0, [100]) == [Window(1, connection=10)]
    assert buffer.taken(older, 100) == []
    # Answered, the buffer is below its limit: every stream window held comes back.
    assert buffer.answered(older) == [Window(3, stream=60), Window(1, stream=10)]
    assert buffer.held == 60


def test_one_message_is_always_taken_when_nothing_is_in_hand():
    # A message larger than the whole buffer still goes (72c9001: queued requests
    # could otherwise wait on themselves).
    buffer = ConnectionBuffer(limit=100, window=1000)
    assert buffer.has_room(10_000)
    buffer.sending(50)
    assert buffer.has_room(50) and not buffer.has_room(51)
    buffer.sending(-50)
    assert buffer.has_room(10_000)


def test_a_unary_answer_turns_its_request_bytes_into_its_response():
    buffer = ConnectionBuffer(limit=1000, window=1000)
    call = buffer.open(1)
    buffer.received(call, 100, 0, [100])
    buffer.taken(call, 100)
    buffer.answered_all(call)
    assert (buffer.held, buffer.working, call.working, list(call.taken)) == (0, 0, 0, [])
    assert buffer.answered_all(call) == []  # nothing left to answer


def test_a_refused_message_and_an_ended_call_let_everything_go():
    buffer = ConnectionBuffer(limit=1000, window=1000)
    refused, ended = buffer.open(1), buffer.open(3)
    buffer.received(refused, 100, 40, [60])
    buffer.refused(refused)
    assert (refused.queued, refused.partial) == (0, 0)
    buffer.received(ended, 300, 100, [200])
    buffer.taken(ended, 200)
    buffer.close(ended)
    buffer.close(refused)
    assert (buffer.held, buffer.working, buffer.peak) == (0, 0, 300)


def test_finish_from_either_answerable_state_leaves_the_call_unanswerable():
    # CallAnswer.take moves a call the thread answered by the table's FINISH
    # row written out (answer.py), answerable no more, as response_event does.
    for answerable in (Response.IDLE, Response.SENDING):
        state = CallState(ended=True)
        state.response = answerable
        state.response_event(ResponseEvent.FINISH)
        assert state.response is Response.ANSWERED and not state.answerable


def test_an_ended_call_releases_its_bytes_in_the_budget_and_the_windows_held_back():
    # close's two ways: nothing held back (its hold written out: no window comes
    # of it) and others held back (below the limit again, their windows come back).
    budget = ClientBudget(limit=10_000)
    buffer = ConnectionBuffer(limit=1000, window=1000, budget=budget)
    alone = buffer.open(1)
    buffer.whole(alone, 600)
    buffer.take(alone, 600)
    assert (budget.held, buffer.held, buffer.working) == (600, 600, 600)
    assert buffer.close(alone) == []
    assert (budget.held, buffer.held, buffer.working, alone.working) == (0, 0, 0, 0)
    first, second = buffer.open(3), buffer.open(5)
    buffer.received(first, 800, 0, [800])
    buffer.taken(first, 800)
    assert buffer.received(second, 300, 0, [300]) == []  # over the limit: held back
    assert budget.held == 1100
    assert buffer.close(first) == [Window(5, ack=300)]
    assert (budget.held, buffer.held, buffer.working) == (300, 300, 0)


# -- the request head -------------------------------------------------------------------

METHODS = {b"/t.T/Echo": Method(Handlers().echo)}
GRPC_HEAD = [
    (b":method", b"POST"),
    (b":path", b"/t.T/Echo"),
    (b"content-type", b"application/grpc+proto"),
]


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([(b":method", b"GET")], HttpRefusal(b"405")),
        ([(b"content-type", b"text/plain")], HttpRefusal(b"415")),
        ([(b":path", b"/t.T/Nope")], (Status.UNIMPLEMENTED, "Method not found: /t.T/Nope")),
        ([(b"grpc-encoding", b"br")], (Status.UNIMPLEMENTED, "grpc-encoding 'br'")),
        ([(b"grpc-timeout", b"1x")], (Status.INVALID_ARGUMENT, "invalid grpc-timeout")),
    ],
)
def test_request_heads_refused(extra, expected):
    names = {name for name, _ in extra}
    headers = [h for h in GRPC_HEAD if h[0] not in names] + extra
    head = read_request_head(headers, METHODS, TransportOptions())
    if isinstance(expected, HttpRefusal):
        assert head == expected
    else:
        assert isinstance(head, GRPCError) and head.status is expected[0]
        assert expected[1] in (head.message or "")


def test_request_head_served():
    headers = [*GRPC_HEAD, (b"grpc-timeout", b"250m"), (b"grpc-accept-encoding", b"gzip")]
    head = read_request_head(headers, METHODS, TransportOptions(response_compression_level=6))
    assert isinstance(head, RequestHead)
    assert (head.path, head.encoding, head.timeout, head.compress) == (
        "/t.T/Echo",
        b"identity",
        0.25,
        True,
    )
    plain = read_request_head(headers, METHODS, TransportOptions())
    assert isinstance(plain, RequestHead) and not plain.compress


# -- the Trio loop over memory streams ------------------------------------------------------


@asynccontextmanager
async def connected(handlers: Handlers, **options):
    """A Connection serving the toy methods on one end of an in-memory stream pair,
    a RawClient on the other; yields (client, connection, server draining event)."""
    server_end, client_end = trio.testing.memory_stream_pair()
    draining = trio.Event()
    methods = {path.encode(): method for path, method in handlers.methods().items()}
    connection = Connection(server_end, methods, TransportOptions(**options), draining)
    client = RawClient(client_end)
    client.h2.initiate_connection()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connection.run)
        await client.flush()
        yield client, connection, draining
        nursery.cancel_scope.cancel()


async def test_a_unary_call_over_memory_streams():
    async with connected(Handlers()) as (client, connection, _):
        stream_id = await client.call("/t.T/Echo", frame(b"hello"))
        await client.until(lambda c: c.ended(stream_id))
        assert client.data[stream_id] == frame(b"hello")
        assert client.status(stream_id) == (0, "")
        assert connection.calls == {} and connection.buffer.held == 0


async def test_a_repeated_request_head_is_not_read_again(monkeypatch):
    import trionserve.protocol.grpc.connection as connection_module

    read = []

    def counting(headers, methods, options):
        read.append(dict(headers).get(b":path"))
        return read_request_head(headers, methods, options)

    monkeypatch.setattr(connection_module, "read_request_head", counting)
    async with connected(Handlers()) as (client, connection, _):
        calls = [
            ("/t.T/Echo", ()),
            ("/t.T/Echo", ()),  # the same headers: the last head
            ("/t.T/Nope", ()),  # refused: read, not kept
            ("/t.T/Nope", ()),
            ("/t.T/Echo", ((b"grpc-timeout", b"5S"),)),  # other headers: read
            ("/t.T/Echo", ((b"grpc-timeout", b"5S"),)),
        ]
        for path, headers in calls:
            stream_id = await client.call(path, frame(b"hi"), headers)
            await client.until(lambda c, s=stream_id: c.ended(s))
            if path == "/t.T/Echo":
                assert client.data[stream_id] == frame(b"hi")
                assert client.status(stream_id) == (0, "")
            else:
                assert client.status(stream_id)[0] == Status.UNIMPLEMENTED.value
        assert read == [b"/t.T/Echo", b"/t.T/Nope", b"/t.T/Nope", b"/t.T/Echo"]


@pytest.mark.timeout(20)
async def test_a_stream_reset_before_its_task_started_ends_the_call():
    # f104c84: HEADERS, the message and RST_STREAM in one read. The call's task
    # starts after the reset: receive() spun on the queued message without a
    # checkpoint (the event loop froze), and a handler that never receives waited
    # uncancelled until the connection closed.
    handlers = Handlers()
    async with connected(handlers) as (client, connection, _):
        reset = []
        for path in (b"/t.T/Echo", b"/t.T/Wait"):
            stream_id = client.h2.get_next_available_stream_id()
            client.h2.send_headers(
                stream_id,
                [
                    (b":method", b"POST"),
                    (b":scheme", b"http"),
                    (b":authority", b"test"),
                    (b":path", path),
                    (b"content-type", b"application/grpc"),
                ],
            )
            client.h2.send_data(stream_id, frame(b"never answered"))
            client.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            reset.append(stream_id)
        await client.flush()
        echo = await client.call("/t.T/Echo", frame(b"still here"))
        await client.until(lambda c: c.ended(echo))
        assert client.data[echo] == frame(b"still here")
        assert not any(stream_id in client.data for stream_id in reset)
        assert handlers.cancelled == ["/t.T/Wait"]
        with trio.fail_after(5):
            while connection.calls:
                await trio.lowlevel.checkpoint()
        assert connection.buffer.held == 0


async def test_a_reset_while_the_handler_runs_cancels_it_and_nothing_is_answered():
    handlers = Handlers()
    async with connected(handlers) as (client, connection, _):
        stream_id = await client.call("/t.T/Wait", frame(b"x"))
        await handlers.entered.wait()
        call = connection.calls[stream_id]
        client.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        await client.flush()
        echo = await client.call("/t.T/Echo", frame(b"after"))
        await client.until(lambda c: c.ended(echo))
        assert handlers.cancelled == ["/t.T/Wait"]
        assert call.state.request is Request.RESET and call.state.response is Response.ABANDONED
        assert client.headers(stream_id) == {}


async def test_a_refused_message_ends_the_call_with_its_status_and_resets_the_upload():
    async with connected(Handlers(), max_message_size=10) as (client, connection, _):
        stream_id = await client.call("/t.T/Chat", frame(b"x" * 11), end=False)
        await client.until(lambda c: c.ended(stream_id))
        status, message = client.status(stream_id)
        assert status == Status.RESOURCE_EXHAUSTED and "larger than max (11 vs. 10)" in message
        # The client was still sending: it is told to stop (RST_STREAM NO_ERROR).
        assert any(
            isinstance(e, h2.events.StreamReset) and e.stream_id == stream_id for e in client.events
        )
        assert connection.buffer.held == 0


async def test_a_drain_stops_client_streaming_calls_and_closes_after_the_last():
    async with connected(Handlers(), linger=0.5) as (client, connection, draining):
        chat = await client.call("/t.T/Chat", frame(b"a"), end=False)
        await client.until(lambda c: chat in c.data)
        assert client.data[chat] == frame(b"A")
        draining.set()
        await client.until(lambda c: c.ended(chat))
        assert client.status(chat) == (Status.UNAVAILABLE, "shutting down")
        await client.until(lambda c: False)  # until the server closes
        goaways = [e for e in client.events if isinstance(e, GoAway)]
        # Two-step GOAWAY (the largest stream id, then the last one), then h2's own.
        assert [g.last_stream_id for g in goaways[:2]] == [2**31 - 1, chat]
        assert connection.state.state is Conn.DRAINED


async def test_a_protocol_error_closes_with_goaway_and_later_frames_are_dropped():
    async with connected(Handlers()) as (client, connection, _):
        # A DATA frame on stream 0 is a connection error.
        await client.stream.send_all(struct.pack(">HBBBL", 0, 1, 0x0, 0, 0) + b"x")
        await client.until(lambda c: any(isinstance(e, GoAway) for e in c.events))
        goaway = next(e for e in client.events if isinstance(e, GoAway))
        assert goaway.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
        assert connection.state.state is Conn.CLOSING
        # The closing connection reads and drops what still comes (a PING here).
        await client.stream.send_all(struct.pack(">HBBBL", 0, 8, 0x6, 0, 0) + bytes(8))
        await client.until(lambda c: False)
        assert client.closed


def test_the_states_kept_as_attributes_follow_every_move():
    # reset, client_done, answerable (a call's) and draining, closing (a
    # connection's) are set with each move: they must say what the state says.
    for start in (False, True):
        for events in itertools.product(list(RequestEvent), repeat=2):
            call = CallState(start)
            for event in events:
                try:
                    call.request_event(event)
                except LocalProtocolError:
                    pass
                assert call.reset == (call.request is Request.RESET)
                assert call.client_done == (call.request is not Request.OPEN)
    for events in itertools.product(list(ResponseEvent), repeat=2):
        call = CallState()
        for event in events:
            try:
                call.response_event(event)
            except LocalProtocolError:
                pass
            assert call.answerable == (call.response in (Response.IDLE, Response.SENDING))
    for events in itertools.product(list(ConnEvent), repeat=2):
        connection = ConnectionState()
        for event in events:
            try:
                connection.event(event)
            except LocalProtocolError:
                pass
            assert connection.draining == (connection.state in (Conn.DRAINING, Conn.DRAINED))
            assert connection.closing == (connection.state in (Conn.CLOSING, Conn.DRAINED))
