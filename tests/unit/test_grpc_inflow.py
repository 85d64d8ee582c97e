"""The rest of a large request message read straight into its buffer across its
DATA frames (protocol/grpc/inflow.py): what grpc-core sends at c=1 (a frame
taken in part, the client's WINDOW_UPDATE, the next frame with END_STREAM)
comes back whole without going through the frame loop, any other layout goes
through it and the message is the same, and a client that resets the stream
between two frames does not leave the reader waiting."""

from __future__ import annotations

import hashlib
import struct

import trio

from tests.unit.test_grpc_parked import Report
from tests.unit.test_grpc_thread_answer import Infer, armed_call, response, thread_write
from tests.unit.test_grpc_thread_answer import serving as parked_serving
from tests.unit.test_grpc_transport import Handlers, RawClient, frame, serving
from trionserve.core.deferred import deferred_jobs
from trionserve.protocol.grpc import inflow, upstream
from trionserve.protocol.grpc.call import GrpcCall
from trionserve.protocol.grpc.status import Status

_HEADER = struct.Struct(">HBBBL")
_END_STREAM = 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload) >> 8, len(payload) & 0xFF, kind, flags, stream) + payload


def _data(stream: int, payload: bytes, end: bool = False) -> bytes:
    return _frame(0x0, _END_STREAM if end else 0, stream, payload)


def _window_update(stream: int, increment: int) -> bytes:
    return _frame(0x8, 0, stream, struct.pack(">L", increment))


class _ThroughFrames:
    """Counts the bytes given to the frame loop (H2Connection.receive), and
    sets ``in_part`` once a DATA frame came in part."""

    def __init__(self, monkeypatch) -> None:
        self.bytes = 0
        self.in_part = trio.Event()
        receive = upstream.H2Connection.receive
        counter = self

        def counted(self, data):
            counter.bytes += len(data)
            taken = receive(self, data)
            if self.partial is not None:
                counter.in_part.set()
            return taken

        monkeypatch.setattr(upstream.H2Connection, "receive", counted)

    def reset(self) -> None:
        self.bytes = 0
        self.in_part = trio.Event()


async def _opened(client: RawClient) -> None:
    """A first call opens the connection (its HEADERS are h2's: SERVER_OPEN)."""
    await client.until(lambda c: c.h2.remote_settings.max_frame_size == 1024 * 1024)
    opening = await client.call("/t.T/Echo", frame(b"hi"))
    await client.until(lambda c: c.ended(opening))


async def _send_in_frames(
    client: RawClient, through: _ThroughFrames, message: bytes, cut: int, between: bytes = b""
) -> int:
    """Send ``message`` in two DATA frames cut at ``cut``, the first frame's
    head alone first (the server reads it, the frame in part), then the rest
    of it, ``between`` and the second frame in one write; the stream id."""
    stream = await client.call("/t.T/Echo", None, end=False)
    first = _data(stream, message[:cut])
    await client.stream.send_all(first[:50_000])
    await through.in_part.wait()
    await client.stream.send_all(first[50_000:] + between + _data(stream, message[cut:], True))
    return stream


async def test_a_message_in_two_frames_is_read_straight_into_its_buffer(monkeypatch):
    through = _ThroughFrames(monkeypatch)
    message = frame(bytes(range(256)) * 2048)  # 512 KiB + 5
    async with serving(Handlers()) as (port, _):
        async with RawClient.connect(port) as client:
            await _opened(client)
            through.reset()
            stream = await _send_in_frames(client, through, message, 400_000)
            await client.until(lambda c: c.ended(stream))
            assert client.status(stream) == (Status.OK.value, "")
            assert client.data[stream] == message
    # the first frame's head went through the frame loop; its rest, the second
    # frame's header and its payload did not
    assert through.bytes < 51_000


async def test_the_frames_between_are_learnt(monkeypatch):
    """A WINDOW_UPDATE between the message's frames: the first time it is not
    the layout read for (the bytes after it go through the frame loop, the
    message the same), the next message's are read straight."""
    through = _ThroughFrames(monkeypatch)
    message = frame(bytes(range(256)) * 2048)
    async with serving(Handlers()) as (port, _):
        async with RawClient.connect(port) as client:
            await _opened(client)
            seen = []
            for _ in range(2):
                through.reset()
                between = _window_update(0, 4096)
                stream = await _send_in_frames(client, through, message, 400_000, between)
                await client.until(lambda c, s=stream: c.ended(s))
                assert client.status(stream) == (Status.OK.value, "")
                assert client.data[stream] == message
                seen.append(through.bytes)
    assert seen[0] >= seen[1]
    assert seen[1] < 51_000


async def test_a_frame_shorter_than_the_rest_of_the_message(monkeypatch):
    """Three frames: what came after the second one (it ended before the
    message) goes through the frame loop; the message is whole."""
    through = _ThroughFrames(monkeypatch)
    message = frame(bytes(range(251)) * 2048)
    async with serving(Handlers()) as (port, _):
        async with RawClient.connect(port) as client:
            await _opened(client)
            through.reset()
            stream = await client.call("/t.T/Echo", None, end=False)
            first = _data(stream, message[:300_000])
            await client.stream.send_all(first[:50_000])
            await through.in_part.wait()
            rest = (
                first[50_000:]
                + _data(stream, message[300_000:400_000])
                + _window_update(0, 1)
                + _data(stream, message[400_000:], True)
            )
            await client.stream.send_all(rest)
            await client.until(lambda c: c.ended(stream))
            assert client.status(stream) == (Status.OK.value, "")
            assert client.data[stream] == message


async def test_a_stream_reset_between_frames_leaves_no_reader_waiting(monkeypatch):
    """The reader waits for the rest of the frame and one frame header more:
    a client that resets the stream after the first frame (RST_STREAM, 13
    bytes) is heard, and its next small call answered."""
    through = _ThroughFrames(monkeypatch)
    message = frame(bytes(range(256)) * 2048)
    async with serving(Handlers()) as (port, _):
        async with RawClient.connect(port) as client:
            await _opened(client)
            through.reset()
            stream = await client.call("/t.T/Echo", None, end=False)
            first = _data(stream, message[:400_000])
            await client.stream.send_all(first[:50_000])
            await through.in_part.wait()
            reset = _frame(0x3, 0, stream, struct.pack(">L", 8))  # CANCEL
            await client.stream.send_all(first[50_000:] + reset)
            with trio.fail_after(5):
                after = await client.call("/t.T/Echo", frame(b"after"))
                await client.until(lambda c: c.ended(after))
            assert client.data[after] == frame(b"after")


async def test_a_read_ending_in_the_next_frames_header(monkeypatch):
    """A read that ends inside the next frame's header (after the client's
    WINDOW_UPDATE): the header's start is kept, not given to the frame loop,
    and the rest of the message is still read straight after it."""
    through = _ThroughFrames(monkeypatch)
    cut_read = trio.Event()
    next_frames = inflow.MessageReads._next_frames

    def noted(self, *args):
        over = next_frames(self, *args)
        if self._kept:
            cut_read.set()
        return over

    monkeypatch.setattr(inflow.MessageReads, "_next_frames", noted)
    message = frame(bytes(range(256)) * 2048)
    async with serving(Handlers()) as (port, _):
        async with RawClient.connect(port) as client:
            await _opened(client)
            through.reset()
            stream = await client.call("/t.T/Echo", None, end=False)
            first = _data(stream, message[:400_000])
            second = _data(stream, message[400_000:], True)
            await client.stream.send_all(first[:50_000])
            await through.in_part.wait()
            await client.stream.send_all(first[50_000:] + _window_update(0, 1) + second[:4])
            await cut_read.wait()
            await client.stream.send_all(second[4:])
            await client.until(lambda c: c.ended(stream))
            assert client.status(stream) == (Status.OK.value, "")
            assert client.data[stream] == message
    assert through.bytes < 51_000


async def test_a_call_like_the_last_is_read_in_one_read_into_its_buffer(monkeypatch):
    """With every call parked (ModelInfer's way, at c=1), a call whose head and
    message come as the last one's did is read into a buffer of its size in
    one read: only its head goes through the frame loop; a call of another
    size goes through it, and every message arrives whole."""
    through = _ThroughFrames(monkeypatch)
    digests = _digests(monkeypatch)
    body = bytes(range(256)) * 2048
    bodies = [body] * 4 + [body[:-1000], body]
    infer = Infer()
    seen = []
    async with parked_serving(infer) as (_, client):
        await client.until(lambda: client.h2.remote_settings.max_frame_size == 1024 * 1024)
        outcome = response()
        for sent in bodies:
            through.reset()
            stream, request, answer = await armed_call(infer, client, sent)
            seen.append(through.bytes)
            assert await thread_write(request, answer, outcome)
            await client.until(lambda s=stream: client.ended(s))
            deferred_jobs().append(Report(request, outcome))  # swept by the next read
    assert digests == [hashlib.sha256(sent).digest() for sent in bodies]
    # (the first call's HEADERS block is longer, HPACK indexes its headers: the
    # second is not as predicted, the third teaches the fourth)
    assert seen[3] < 200  # its head: HEADERS, the DATA header and the prefix
    assert seen[4] > 200  # another size: through the frame loop


async def _layout_call(client, body: bytes, between: str, split: int | None) -> int:
    """Send a ModelInfer call of ``body`` in two DATA frames, ``between`` them
    a WINDOW_UPDATE ("window"), a WINDOW_UPDATE and a PING ("ping") or
    nothing (""); ``split``: the bytes written first, the rest once the
    server waits (its reads end in the first frame), else all in one write."""
    stream = client.open()
    message = struct.pack(">BI", 0, len(body)) + body
    client.h2.send_data(stream, message[:60_000])
    if between:
        client.h2.increment_flow_control_window(4096)
    if between == "ping":
        client.h2.ping(b"8 bytes!")
    client.h2.send_data(stream, message[60_000:], end_stream=True)
    data = client.h2.data_to_send()
    if split is not None:
        await client.sock.send_all(data[:split])
        await trio.testing.wait_all_tasks_blocked()
        data = data[split:]
    await client.sock.send_all(data)
    return stream


async def _answered(infer, client, body: bytes, between: str, split: int | None) -> None:
    """One call at c=1 as the thread answers it (the report swept by the next read)."""
    infer.armed = trio.Event()
    stream = await _layout_call(client, body, between, split)
    with trio.fail_after(5):  # (a call the reader waits on never arms)
        await infer.armed.wait()
    await trio.testing.wait_all_tasks_blocked()
    call, request, answer = infer.calls[-1]
    assert call.stream_id == stream
    outcome = response()
    assert await thread_write(request, answer, outcome)
    await client.until(lambda: client.ended(stream))
    deferred_jobs().append(Report(request, outcome))


async def _taught(infer, conn, client, body: bytes) -> None:
    """Calls of the usual layout until the next one is read whole as predicted."""
    await client.until(lambda: client.h2.remote_settings.max_frame_size == 1024 * 1024)
    for _ in range(4):
        await _answered(infer, client, body, "window", 30_000)
    assert conn._template is not None and conn._gap == 13 + 9


def _digests(monkeypatch) -> list[bytes]:
    """The digest of every request message a call receives, in turn."""
    digests: list[bytes] = []
    receive = GrpcCall.receive

    async def received(self):
        data = await receive(self)
        if data is not None:
            digests.append(hashlib.sha256(data).digest())
        return data

    monkeypatch.setattr(GrpcCall, "receive", received)
    return digests


async def test_a_call_read_whole_with_more_bytes_between_frames_than_it_has(monkeypatch):
    """The bytes between a predicted call's frames were learnt longer (a PING
    came there once) than the next call's (its WINDOW_UPDATE alone): a call
    that came whole before the reader woke is taken, not waited on for bytes
    the client never sends (its template matched the longer slot's start)."""
    digests = _digests(monkeypatch)
    infer = Infer()
    body = bytes(range(256)) * 400  # 102,400 bytes
    async with parked_serving(infer) as (conn, client):
        await _taught(infer, conn, client, body)
        await _answered(infer, client, body, "ping", 30_000)
        assert conn._gap == 13 + 17 + 9
        await _answered(infer, client, body, "window", None)
        await _answered(infer, client, body, "window", None)
    assert digests == [hashlib.sha256(body).digest()] * 7


async def test_a_call_read_whole_with_fewer_bytes_between_frames_than_predicted(monkeypatch):
    """A predicted call without the WINDOW_UPDATE between its frames, come
    whole before the reader woke: taken, not waited on for one byte more."""
    digests = _digests(monkeypatch)
    infer = Infer()
    body = bytes(range(256)) * 400
    async with parked_serving(infer) as (conn, client):
        await _taught(infer, conn, client, body)
        await _answered(infer, client, body, "", None)
        await _answered(infer, client, body, "window", None)
    assert digests == [hashlib.sha256(body).digest()] * 6
