"""A request's rest left in the socket for the instance's thread (trionserve/protocol/later.py) as
gRPC's reader meets it (protocol/sockets.py's EagerReceiver with ``later`` attached), on a real TCP
pair: what the loop's whole-call wait wakes for while the rest is there, who reads the rest (the
thread, or the loop when it must read on first), a read that fails, and a peek at an offset."""

from __future__ import annotations

import hashlib
import socket
import threading

import pytest
import trio
import trio.testing

from tests.unit.test_grpc_parked import Report
from tests.unit.test_grpc_thread_answer import Infer, Run, response, thread_write
from tests.unit.test_grpc_whole_call import _send, _tcp_serving
from tests.unit.test_http_later import pair, send
from trionserve.core.deferred import deferred_jobs
from trionserve.core.inference import InferenceRequest
from trionserve.protocol import later as later_module
from trionserve.protocol import sockets
from trionserve.protocol.grpc import answer as grpc_answer
from trionserve.protocol.grpc import infercache, inflow, laterread
from trionserve.protocol.grpc.call import GrpcCall
from trionserve.protocol.grpc.parkedinfer import ParkedInfer
from trionserve.protocol.grpc.parking import PARKED
from trionserve.protocol.later import LaterBody, peek
from trionserve.protocol.sockets import EagerReceiver

REST = bytes(range(256)) * 1000  # 256,000 bytes
NEXT = b"the next call's bytes" * 10


def _rest_buffers() -> tuple[bytearray, memoryview, tuple[memoryview, ...]]:
    """A buffer for REST, offered as a LaterBody takes it: a first part, then two more views."""
    buffer = bytearray(len(REST))
    view = memoryview(buffer)
    return buffer, view[:1000], (view[1000:1022], view[1022:])


def _deferred(server):
    """A receiver of ``server`` whose socket holds REST, deferred (as ModelInfer leaves it)."""
    receiver = EagerReceiver(trio.SocketStream(server))
    later = LaterBody(server)
    receiver.attach(later)
    buffer, view, more = _rest_buffers()
    later.offer(view, more)
    later.defer()
    return receiver, later, buffer


async def test_the_whole_wait_wakes_for_none_of_the_rest_and_the_thread_reads_it():
    server, client = pair()
    with client:
        send(client, server, REST)
        receiver, later, buffer = _deferred(server)
        into = bytearray(len(NEXT))
        got = []

        async def wait() -> None:
            got.append(await receiver.receive_whole((memoryview(into),), 10))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert not got  # (the rest is far past the mark it wants: raised past it)
            receiver.lower()  # a lowered wait (the watch's, hear) wakes for none of it either
            await trio.testing.wait_all_tasks_blocked()
            assert not got and later.pending
            thread = threading.Thread(target=later.take)
            thread.start()
            thread.join()
            assert bytes(buffer) == REST and not later.pending and later.view is None
            await trio.testing.wait_all_tasks_blocked()
            assert not got  # (the rest read: nothing more came)
            send(client, server, NEXT)
        assert got == [len(NEXT)] and bytes(into) == NEXT
        assert later_module.queued(server) == 0


async def test_a_wait_woken_with_the_rest_there_reads_it_first():
    """The client's next bytes come before the thread took the rest (its request dropped, a
    slow thread): the loop reads the rest into its buffer, then the next bytes; the thread's
    take then reads nothing."""
    server, client = pair()
    with client:
        send(client, server, REST)
        receiver, later, buffer = _deferred(server)
        receiver.lower()  # (wakes for the first byte past the rest)
        into = bytearray(len(NEXT))
        send(client, server, NEXT)
        with trio.fail_after(5):
            received = await receiver.receive_whole((memoryview(into),), 1)
        assert bytes(buffer) == REST and bytes(into[:received]) == NEXT[:received]
        assert later.take() and bytes(buffer) == REST and not later.pending


async def test_a_read_finds_the_rest_read_first():
    """A read that does not wait (the frame loop's, a call's message in part) never reads the
    rest: it is read into its buffer first, on the loop."""
    server, client = pair()
    with client:
        send(client, server, REST + NEXT)
        receiver, later, buffer = _deferred(server)
        data = await receiver.receive_some(len(NEXT))
        assert bytes(buffer) == REST and data == NEXT and later.view is None


async def test_a_failed_read_fails_the_request_and_ends_the_connection():
    server, client = pair()
    send(client, server, REST[:1000])  # (less than the rest: the read cannot finish)
    receiver, later, buffer = _deferred(server)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
    client.close()  # (a reset)
    assert not later.take() and later.broken is not None and "could not be read" in later.broken
    try:
        await receiver.receive_some(100)
    except trio.BrokenResourceError:
        pass
    else:
        raise AssertionError("a read after the rest's failed read must end the connection")


def test_a_peek_at_an_offset_reads_nothing():
    server, client = pair()
    with client:
        send(client, server, REST)
        slot = bytearray(22)
        if later_module.PEEK_OFF is None:  # (before Linux 6.10: never peeked, never deferred)
            assert not peek(server.fileno(), 1000, memoryview(slot))
            return
        assert peek(server.fileno(), 1000, memoryview(slot))
        assert bytes(slot) == REST[1000:1022]
        assert later_module.queued_fd(server.fileno()) == len(REST)
        assert not peek(server.fileno(), len(REST) - 10, memoryview(slot))  # (fewer there)
        assert server.recv  # (a plain read then reads from the start)
        _, view, more = _rest_buffers()
        body = LaterBody(server)
        body.offer(view, more)
        assert body.settle() and bytes(view.obj) == REST


class _Deferring(Infer):
    """test_grpc_thread_answer's Infer, whose calls leave their message's rest to a thread as
    ModelInfer does (grpc/laterread.py: rest_of, then defer; the thread takes it before the
    message is read), and which keeps the digest of each message then."""

    def __init__(self) -> None:
        super().__init__()
        self.left: list[bool] = []
        self.digests: list[bytes] = []

    async def handler(self, call: GrpcCall) -> object:
        data = await call.receive()
        assert data is not None and await call.receive() is None
        later = laterread.rest_of(call, data)
        self.left.append(later is not None)
        request = InferenceRequest("m")
        answer = grpc_answer.arm(call, request, ParkedInfer)
        if later is not None:
            assert answer is not None
            later.defer()
            thread = threading.Thread(target=later.take)  # (the instance's, before its batch)
            thread.start()
            thread.join()
        self.digests.append(hashlib.sha256(data).digest())
        self.calls.append((call, request, answer))
        self.armed.set()
        assert answer is not None
        answer.dataplane = self  # type: ignore[assignment]
        answer.run = Run(call.stream_id, request, answer)  # type: ignore[assignment]
        if answer.state == grpc_answer.ARMED and call.connection.park(call, request, answer):
            return PARKED
        return await answer.rest(call)


@pytest.mark.parametrize("infer", [True, False])
async def test_a_call_read_whole_leaves_its_rest_to_the_thread_unless_its_frames_differ(
    monkeypatch, infer
):
    """Calls waited for whole (_read_call) are read up to their message's last raw contents
    (here at its 100th byte), the rest left in the socket and read by the thread; one with a
    PING between its DATA frames (not as the last one's: peeked, then read by the loop) and one
    of another size go through the frame loop; every message is the one sent. A method other
    than ModelInfer finds every rest read by the loop before its handler runs."""
    if later_module.PEEK_OFF is None:
        return  # (nothing is left to the thread without SO_PEEK_OFF)
    if not infer:
        monkeypatch.setattr(laterread, "MODEL_INFER", "/inference.GRPCInferenceService/Other")
    monkeypatch.setattr(inflow.MessageReads, "_needed", 1)
    watch = sockets._Watch()
    monkeypatch.setattr(sockets._Watch, "current", classmethod(lambda cls: watch))
    monkeypatch.setattr(infercache, "raw_at", lambda length: 100)
    monkeypatch.setattr(infercache, "cut_as_last", lambda data, at: at == 100)
    body = bytes(range(256)) * 400
    other = bytes(range(200, 256)) * 2000  # (112,000 bytes)
    # opens, teaches the layout, taken whole (a streak of one), then waited for whole: left to
    # the thread twice; another size (through the frame loop, a miss: a streak of two needed);
    # teaches, then waited for whole: left again; last a PING between its frames (peeked, not
    # as the last one's: read by the loop)
    sends = [(body, False)] * 5 + [(other, False)] + [(body, False)] * 5 + [(body, True)]
    served = _Deferring()
    async with _tcp_serving(served) as (conn, client):
        await client.until(lambda: client.h2.remote_settings.max_frame_size == 1024 * 1024)
        outcome = response()
        for index, (sent, ping) in enumerate(sends):
            served.armed = trio.Event()
            stream_id, data = _send(client, served, sent, 70_000, ping)
            cut = len(data) - (9 + len(sent) + 5 - 70_000) if index not in (1, 6) else 10_000
            await client.sock.send_all(data[:cut])
            await trio.testing.wait_all_tasks_blocked()
            await client.sock.send_all(data[cut:])
            if ping or len(sent) != len(body):
                await trio.testing.wait_all_tasks_blocked()
                watch.look()  # (woken short of the predicted call: the look)
            with trio.fail_after(5):
                await served.armed.wait()
            _, request, answer = served.calls[-1]
            assert await thread_write(request, answer, outcome)
            await client.until(lambda s=stream_id: client.ended(s))
            deferred_jobs().append(Report(request, outcome))  # swept by the next read
        assert conn.later is not None and conn.later.view is None
    assert served.digests == [hashlib.sha256(sent).digest() for sent, _ in sends]
    left = [False] * 3 + [True] * 2 + [False] * 2 + [True] * 4 + [False]
    assert served.left == (left if infer else [False] * len(sends))


async def test_an_answer_taken_before_the_thread_read_the_rest_reads_it_first(monkeypatch):
    """The loop takes a call's answer (a keepalive PING, a close, the outcome on the loop)
    before the thread staged its batch: the thread finds the rest only through the answer, so
    the take reads it first, and the backend never runs on a message in part."""
    server, client = pair()
    with client:
        send(client, server, REST)
        _, later, buffer = _deferred(server)

        class _Conn:
            pass

        conn = _Conn()
        conn.later = later  # type: ignore[attr-defined]
        conn.stolen = None  # type: ignore[attr-defined]
        conn.answer = None  # type: ignore[attr-defined]
        answer = object.__new__(grpc_answer.CallAnswer)
        answer._conn = conn  # type: ignore[assignment]
        answer.state = grpc_answer.DISARMED
        assert answer.later is later and later.pending
        assert answer.take() == grpc_answer.DISARMED
        assert bytes(buffer) == REST and not later.pending and later.view is None
        assert later.take()  # (the thread, staging after: nothing left to read)
