"""A call read whole as predicted, taken in one step (inflow.py's _take_whole,
h2frames.open_whole): h2 is moved as its frame loop (H2Connection.receive)
moves it for the same frames, and anything that loop would not take so is left
to it, with nothing moved; on a connection, a call that comes as the last one
did is taken without the frame loop, any other goes through it, and every
message and answer is the same."""

from __future__ import annotations

import hashlib
import struct
from contextlib import asynccontextmanager

import h2.events
import pytest
import trio
import trio.testing

from tests.unit.test_grpc_inflow import _digests, _ThroughFrames
from tests.unit.test_grpc_parked import Report
from tests.unit.test_grpc_thread_answer import Client, Infer, response, thread_write
from tests.unit.test_grpc_thread_answer import serving as parked_serving
from tests.unit.test_grpc_unary_stream import (
    STREAMING,
    UNARY,
    Pair,
    _answer_at_once,
    _data,
    _state,
    _window,
)
from trionserve.core.deferred import deferred_jobs
from trionserve.protocol import sockets
from trionserve.protocol.grpc import callhead, h2frames, inflow
from trionserve.protocol.grpc.connection import Connection
from trionserve.protocol.grpc.options import TransportOptions

_HEADER = struct.Struct(">HBBBL")
_IDS = [1, 3, 5, 7]


def _opened() -> Pair:
    """Servers past two calls, answered and closed: the client's HEADERS
    block is now the one it repeats (all indexed)."""
    pair = Pair()
    for stream_id in (1, 3):
        pair.feed(pair.headers(stream_id, UNARY, False) + _data(stream_id, 100, True))
        pair.act("acknowledge_received_data", 100, stream_id)
        _answer_at_once(pair, stream_id)
    return pair


def _opened_whole(monkeypatch) -> list[bool]:
    """Whether each call h2frames.open_whole was asked to open was taken whole, in turn."""
    opened: list[bool] = []
    open_whole = h2frames.open_whole

    def counted(*args):
        headers = open_whole(*args)
        opened.append(headers is not None)
        return headers

    monkeypatch.setattr(h2frames, "open_whole", counted)
    return opened


def _block(frame: bytes) -> bytes:
    high, low = _HEADER.unpack_from(frame)[:2]
    return frame[9 : 9 + (high << 8) + low]


@pytest.mark.parametrize(
    ("sizes", "windows"),
    [
        ((500,), []),
        # grpc-core's: the stream's window after HEADERS, the connection's
        # between the two DATA frames
        ((300, 200), [(0, 5, 700), (1, 0, 900)]),
        ((300, 200), [(1, 0, 10), (1, 0, 20), (1, 3, 5)]),  # and a closed stream's
        ((1, 1), [(0, 5, 2**31 - 1 - 65535)]),  # the stream's send window to its largest
        ((1, 1), [(0, 5, 2**31 - 1 - 65535 - 7), (1, 5, 7)]),
    ],
)
def test_a_whole_call_moves_h2_as_its_frame_loop_does(sizes, windows):
    pair = _opened()
    headers = pair.headers(5, UNARY, False)
    data, given = headers, []
    for index, size in enumerate(sizes):
        for after, window_stream, increment in windows:
            if after == index:
                data += _window(window_stream, increment)
                own = h2frames.NEW_STREAM if window_stream == 5 else window_stream
                given.append((own, increment))
        data += _data(5, size, index == len(sizes) - 1)
    pair.reference.receive_data(data)
    events = pair.fast.receive(data)
    largest = max(len(_block(headers)), *sizes)
    taken = h2frames.open_whole(pair.unary, 5, _block(headers), sum(sizes), given, largest)
    assert taken is not None and taken == events[0][2]
    pair.compare()  # the same state as h2's own and as the frame loop's
    # What follows goes the same on every server: the window given back, the
    # answer at once, the client's window updates and the next call.
    pair.act("acknowledge_received_data", sum(sizes), 5)
    assert _answer_at_once(pair, 5) == 2
    pair.feed(_window(0, 100) + _window(5, 100))
    pair.feed(pair.headers(7, UNARY, False) + _data(7, 300, True))
    pair.act("acknowledge_received_data", 300, 7)
    assert _answer_at_once(pair, 7) == 2


_DECLINED = [
    "past the connection's window",
    "past the stream's window",
    "a frame past the frame size",
    "a stream id not above the last",
    "an even stream id",
    "a window update of an open stream",
    "a window update of a stream to come",
    "a window update of zero",
    "the connection's send window past its largest",
    "the stream's send window past its largest",
    "another block",
    "a streaming path",
    "a frame in part",
]


@pytest.mark.parametrize("case", _DECLINED)
def test_what_the_frame_loop_would_not_take_so_is_left_to_it(case):
    pair = _opened()
    stream_id, sizes, windows, path, largest = 5, (300, 200), [], UNARY, 300
    if case == "past the connection's window":
        pair.unary._inbound_flow_control_window_manager.current_window_size = 499
    elif case == "past the stream's window":
        sizes = (600, 401)  # (its initial window: 1000)
    elif case == "a frame past the frame size":
        largest = pair.unary.max_inbound_frame_size + 1
    elif case == "a stream id not above the last":
        stream_id = 3
    elif case == "an even stream id":
        stream_id = 6
    elif case == "a window update of an open stream":
        pair.feed(pair.headers(5, UNARY, False))
        stream_id, windows = 7, [(5, 10)]
    elif case == "a window update of a stream to come":
        windows = [(9, 10)]
    elif case == "a window update of zero":
        windows = [(0, 0)]
    elif case == "the connection's send window past its largest":
        windows = [(0, 2**31 - 1)]
    elif case == "the stream's send window past its largest":
        windows = [(h2frames.NEW_STREAM, 2**31 - 1 - 65535), (h2frames.NEW_STREAM, 1)]
    elif case == "another block":
        path = b"/inference.GRPCInferenceService/Other"
    elif case == "a streaming path":  # (its block repeated, as a unary path's would be)
        for repeat in (5, 7):
            pair.feed(pair.headers(repeat, STREAMING, False))
            pair.act("reset_stream", repeat)
        stream_id, path = 9, STREAMING
    elif case == "a frame in part":
        pair.feed(pair.headers(5, UNARY, False) + _data(5, 300, True)[:100])
        stream_id = 7
    block = _block(pair.headers(stream_id, path, False))
    before = _state(pair.unary, [*_IDS, stream_id])
    output = bytes(pair.unary.data_to_send())
    assert h2frames.open_whole(pair.unary, stream_id, block, sum(sizes), windows, largest) is None
    assert _state(pair.unary, [*_IDS, stream_id]) == before
    assert bytes(pair.unary.data_to_send()) == output == b""


def _send(client, infer: Infer, body: bytes, cut: int, ping: bool = False):
    """A call as grpc-core sends one: HEADERS, the stream's WINDOW_UPDATE, a
    DATA frame of ``cut`` bytes of the message, the connection's
    WINDOW_UPDATE (``ping``: and a PING) and the last DATA frame."""
    h2conn = client.h2
    stream_id = client.open()
    h2conn.increment_flow_control_window(1000, stream_id)
    message = struct.pack(">BI", 0, len(body)) + body
    h2conn.send_data(stream_id, message[:cut])
    h2conn.increment_flow_control_window(1000)
    if ping:
        h2conn.ping(b"12345678")
    h2conn.send_data(stream_id, message[cut:], end_stream=True)
    return stream_id, h2conn.data_to_send()


async def test_a_call_as_the_last_is_taken_whole_any_other_through_the_frame_loop(monkeypatch):
    through = _ThroughFrames(monkeypatch)
    digests = _digests(monkeypatch)
    opened = _opened_whole(monkeypatch)
    parsed = []  # the calls whose frames were parsed (not as the last taken whole)
    whole_call = callhead.whole_call

    def parsing(*args):
        parsed.append(True)
        return whole_call(*args)

    monkeypatch.setattr(callhead, "whole_call", parsing)
    body = bytes(range(256)) * 400  # (100 KiB: the socket holds a call whole)
    # The first call opens the connection (h2's own), the next teaches the
    # layout (sent in two writes: the first DATA frame read in part); then
    # calls as the last, sent in two writes (the rest read before any of it
    # is taken), in one, in two as grpc-core sends them at c=1 (the last DATA
    # frame apart); one with a PING between its DATA frames, one of another
    # size (both through the frame loop); one teaches the layout again, and
    # the last comes whole.
    sends = [(body, False, None), (body, False, "in part"), (body, False, "head")]
    sends += [(body, False, None), (body, False, "grpc-core"), (body, True, None)]
    sends += [(body[:-7], False, None), (body, False, "in part"), (body, False, None)]
    infer = Infer()
    seen = []
    async with parked_serving(infer) as (_, client):
        await client.until(lambda: client.h2.remote_settings.max_frame_size == 1024 * 1024)
        outcome = response()
        for sent, ping, split in sends:
            through.reset()
            opened.clear()
            parsed.clear()
            infer.armed = trio.Event()
            stream_id, data = _send(client, infer, sent, 70_000, ping)
            if split is not None:
                cut = len(data) - (9 + len(sent) + 5 - 70_000) if split == "grpc-core" else 10_000
                await client.sock.send_all(data[:cut])
                if split == "in part":
                    await through.in_part.wait()
                else:
                    await trio.testing.wait_all_tasks_blocked()
                data = data[cut:]
            await client.sock.send_all(data)
            await infer.armed.wait()
            await trio.testing.wait_all_tasks_blocked()
            _, request, answer = infer.calls[-1]
            seen.append((through.bytes, opened[:], len(parsed)))
            assert await thread_write(request, answer, outcome)
            await client.until(lambda s=stream_id: client.ended(s))
            deferred_jobs().append(Report(request, outcome))  # swept by the next read
    assert digests == [hashlib.sha256(sent).digest() for sent, _, _ in sends]
    # (the second call's block is the first all indexed: the frame loop
    # decodes it, the third is taken whole, its frames parsed; the next ones'
    # checked against its)
    assert seen[2] == (0, [True], 1)
    assert seen[3] == seen[4] == (0, [True], 0)
    assert seen[5][0] > 20 and True not in seen[5][1]  # a PING between: the frame loop
    assert seen[6][0] > 20 and not seen[6][1]  # another size: not as predicted
    assert seen[8] == (0, [True], 0)


async def test_a_repeated_call_is_waited_for_once_and_a_smaller_one_is_not_left_waiting(
    monkeypatch,
):
    """Once a call was taken whole as predicted, the next one's read waits once,
    for the whole call (SO_RCVLOWAT: grpc-core's first write does not wake the
    reader); a smaller call (the client then waits for its answer) waits for
    the watch's next look and is read and answered as any other, and the
    connection then needs twice as many calls in a row read whole as predicted
    before it waits whole again (a client whose sizes vary pays the look on at
    most one call in that streak). The watch is looked at by the test, and the
    streak needed at first is one (WHOLE_STREAK's place)."""
    monkeypatch.setattr(inflow.MessageReads, "_needed", 1)
    watch = sockets._Watch()
    monkeypatch.setattr(sockets._Watch, "current", classmethod(lambda cls: watch))
    digests = _digests(monkeypatch)
    body = bytes(range(256)) * 400
    # opens, teaches the layout, taken whole (a streak of one), then waited for
    # whole; smaller (a miss: two needed now); teaches, taken whole twice (not
    # waited for whole: a streak of one), then waited for whole again
    sends = [body, body, body, body, body[:1000], body, body, body, body]
    infer = Infer()
    waited = []
    async with _tcp_serving(infer) as (conn, client):
        await client.until(lambda: client.h2.remote_settings.max_frame_size == 1024 * 1024)
        outcome = response()
        for index, sent in enumerate(sends):
            infer.armed = trio.Event()
            stream_id, data = _send(client, infer, sent, 70_000)
            # grpc-core's two writes; a first DATA frame read in part teaches the layout
            cut = len(data) - (9 + len(sent) + 5 - 70_000) if index not in (1, 5) else 10_000
            await trio.testing.wait_all_tasks_blocked()
            whole = bool(watch.waiting)  # the reader waits for the whole call
            await client.sock.send_all(data[:cut])
            await trio.testing.wait_all_tasks_blocked()
            assert bool(watch.waiting) == whole and not infer.armed.is_set()
            await client.sock.send_all(data[cut:] if index != 4 else b"")
            if index == 4:  # (the smaller call came whole in its first write)
                await client.sock.send_all(data[cut:])
                await trio.testing.wait_all_tasks_blocked()
                assert bool(watch.waiting) and not infer.armed.is_set()
                watch.look()
            await infer.armed.wait()
            waited.append(whole)
            _, request, answer = infer.calls[-1]
            assert await thread_write(request, answer, outcome)
            await client.until(lambda s=stream_id: client.ended(s))
            deferred_jobs().append(Report(request, outcome))  # swept by the next read
    assert digests == [hashlib.sha256(sent).digest() for sent in sends]
    assert waited == [False, False, False, True, True, False, False, False, True]
    assert (conn._streak, conn._needed) == (3, 2)


@asynccontextmanager
async def _tcp_serving(infer: Infer):
    """test_grpc_thread_answer.serving over loopback TCP (SO_RCVLOWAT is TCP's:
    a socket pair's reader wakes for any byte)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client_stream = await trio.open_tcp_stream("127.0.0.1", port)
    server_stream = await listeners[0].accept()
    await listeners[0].aclose()
    conn = Connection(server_stream, infer.methods(), TransportOptions(), trio.Event())
    client = Client(client_stream.socket)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        client.h2.initiate_connection()
        await client.flush()
        await client.until(
            lambda: any(isinstance(e, h2.events.SettingsAcknowledged) for e in client.events)
        )
        try:
            yield conn, client
        finally:
            nursery.cancel_scope.cancel()
            client_stream.socket.close()


def test_only_whole_window_updates_and_pings_read_alone_are_not_a_miss():
    """The whole-call wait's miss rule (inflow._no_call): bytes that are whole
    WINDOW_UPDATE and PING frames only (the last call's window updates,
    grpc-core's bandwidth probe: frames a client sends on its own) are not a
    call that waited for the watch's look; anything else is."""
    update = struct.pack(">HBBBL", 0, 4, 0x8, 0, 0) + (1000).to_bytes(4, "big")
    ping = struct.pack(">HBBBL", 0, 8, 0x6, 0, 0) + bytes(8)
    ack = struct.pack(">HBBBL", 0, 8, 0x6, 0x1, 0) + bytes(8)
    reset = struct.pack(">HBBBL", 0, 4, 0x3, 0, 5) + (8).to_bytes(4, "big")
    assert inflow._no_call(memoryview(update))
    assert inflow._no_call(memoryview(update * 2))
    assert inflow._no_call(memoryview(ping))
    assert inflow._no_call(memoryview(ack))
    assert inflow._no_call(memoryview(update + ping + update))
    assert not inflow._no_call(memoryview(b""))
    assert not inflow._no_call(memoryview(update[:12]))
    assert not inflow._no_call(memoryview(update + update[:5]))
    assert not inflow._no_call(memoryview(ping[:13]))
    assert not inflow._no_call(memoryview(update + ping[:13]))
    assert not inflow._no_call(memoryview(ping + ping[:16]))
    assert not inflow._no_call(memoryview(reset))
    assert not inflow._no_call(memoryview(ping + reset))


async def test_a_ping_alone_in_a_whole_wait_is_answered_at_the_look_and_ends_no_streak(
    monkeypatch,
):
    """A PING read alone while the reader waits for a whole call (grpc-core's
    bandwidth probe after an answer's data) is answered once the watch looks,
    and is no miss: the streak goes on and the streak needed stays, so that
    once a call is in flight again the next is waited for whole. (The PING's
    read swept the last call's outcome: with no call waiting, the call after
    it is read as any.)"""
    monkeypatch.setattr(inflow.MessageReads, "_needed", 1)
    watch = sockets._Watch()
    monkeypatch.setattr(sockets._Watch, "current", classmethod(lambda cls: watch))
    digests = _digests(monkeypatch)
    body = bytes(range(256)) * 400
    sends = [body] * 6
    infer = Infer()
    waited = []
    async with _tcp_serving(infer) as (conn, client):
        await client.until(lambda: client.h2.remote_settings.max_frame_size == 1024 * 1024)
        outcome = response()
        for index, sent in enumerate(sends):
            if index == 4:  # the whole wait holds a PING alone: the look wakes it
                assert watch.waiting
                client.h2.ping(b"probe-01")
                await client.flush()
                await trio.testing.wait_all_tasks_blocked()
                assert watch.waiting  # (below SO_RCVLOWAT: not signalled)
                watch.look()
                await client.until(
                    lambda: any(isinstance(e, h2.events.PingAckReceived) for e in client.events)
                )
                await trio.testing.wait_all_tasks_blocked()
                assert (conn._streak, conn._needed) == (2, 1)
            infer.armed = trio.Event()
            stream_id, data = _send(client, infer, sent, 70_000)
            cut = len(data) - (9 + len(sent) + 5 - 70_000) if index != 1 else 10_000
            await trio.testing.wait_all_tasks_blocked()
            waited.append(bool(watch.waiting))
            await client.sock.send_all(data[:cut])
            await trio.testing.wait_all_tasks_blocked()
            assert not infer.armed.is_set()
            await client.sock.send_all(data[cut:])
            await infer.armed.wait()
            _, request, answer = infer.calls[-1]
            assert await thread_write(request, answer, outcome)
            await client.until(lambda s=stream_id: client.ended(s))
            deferred_jobs().append(Report(request, outcome))  # swept by the next read
    assert digests == [hashlib.sha256(sent).digest() for sent in sends]
    # (opens, teaches the layout, taken whole: a streak of one, waited for
    # whole; the PING; read as any with no call in flight; waited for whole)
    assert waited == [False, False, False, True, False, True]
    assert (conn._streak, conn._needed) == (3, 1)


async def test_a_ping_in_front_of_a_call_keeps_the_prediction_for_the_next(monkeypatch):
    """A PING that came in front of a call waited for whole (grpc-core's
    bandwidth probe and its next call in one read) shifts the call's bytes:
    that call goes through the frame loop, and the prediction stays, so that
    the next call is read as predicted and taken whole, not taught again."""
    monkeypatch.setattr(inflow.MessageReads, "_needed", 1)
    watch = sockets._Watch()
    monkeypatch.setattr(sockets._Watch, "current", classmethod(lambda cls: watch))
    digests = _digests(monkeypatch)
    opened = _opened_whole(monkeypatch)
    body = bytes(range(256)) * 400
    sends = [body] * 6
    infer = Infer()
    seen = []
    async with _tcp_serving(infer) as (conn, client):
        await client.until(lambda: client.h2.remote_settings.max_frame_size == 1024 * 1024)
        outcome = response()
        for index, sent in enumerate(sends):
            opened.clear()
            infer.armed = trio.Event()
            if index == 4:  # a PING, then the call, in one write
                client.h2.ping(b"probe-02")
            stream_id, data = _send(client, infer, sent, 70_000)
            cut = len(data) - (9 + len(sent) + 5 - 70_000) if index != 1 else 10_000
            await trio.testing.wait_all_tasks_blocked()
            waited = bool(watch.waiting)
            await client.sock.send_all(data[:cut])
            await trio.testing.wait_all_tasks_blocked()
            await client.sock.send_all(data[cut:])
            await infer.armed.wait()
            _, request, answer = infer.calls[-1]
            seen.append((waited, opened[:], conn._call is not None))
            assert await thread_write(request, answer, outcome)
            await client.until(lambda s=stream_id: client.ended(s))
            deferred_jobs().append(Report(request, outcome))  # swept by the next read
        assert any(isinstance(e, h2.events.PingAckReceived) for e in client.events)
    assert digests == [hashlib.sha256(sent).digest() for sent in sends]
    # (opens, teaches, taken whole, waited for whole and taken whole; the PING
    # in front: the frame loop, the prediction kept; the next taken whole)
    assert seen[3] == (True, [True], True)
    assert seen[4] == (True, [], True)
    assert seen[5] == (True, [True], True)
