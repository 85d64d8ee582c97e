"""A request's rest left in the socket for the instance's thread (trionserve/protocol/later.py) as
gRPC's reader meets it (protocol/sockets.py's EagerReceiver with ``later`` attached), on a real TCP
pair: what the loop's whole-call wait wakes for while the rest is there, who reads the rest (the
thread, or the loop when it must read on first), a read that fails, and a peek at an offset."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import types

import pytest
import trio
import trio.testing

from tests.unit.test_grpc_infercache import INT32, client_input, client_wire
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
from trionserve.protocol.later import LaterBody
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
    """One peek copies the bytes after the offered view and says whether the socket holds the
    whole rest (TCP_INQ), reading none of them; a socket holding less than the rest, or fewer
    bytes than the slot past the view, offers nothing; a plain read then reads from the
    start."""
    server, client = pair()
    with client:
        send(client, server, REST)
        slot = memoryview(bytearray(22))
        buffer, view, more = _rest_buffers()
        body = LaterBody(server)
        if later_module.PEEK_OFF is None:  # (before Linux 6.10: never peeked, never deferred)
            assert not body.offer_peeked(view, slot, more, len(REST))
            assert body.view is None
            return
        assert not body.offer_peeked(view, slot, more, len(REST) + 1)  # (less than the rest)
        assert body.view is None
        beyond = memoryview(buffer)[: len(REST) - 10]  # (fewer bytes than the slot past it)
        assert not body.offer_peeked(beyond, slot, more, 0) and body.view is None
        assert body.offer_peeked(view, slot, more, len(REST))
        assert bytes(slot) == REST[1000:1022] and body.view is view and body.size == len(REST)
        assert later_module.queued(server) == len(REST)
        assert body.settle() and bytes(buffer) == REST
        peeker = body._peeker
        del body, peeker  # (the peeks' socket object never closes the descriptor)
        assert server.fileno() >= 0 and later_module.queued(server) == 0
        send(client, server, NEXT)
        assert os.read(server.fileno(), len(NEXT)) == NEXT


class _Counted:
    """A peeker's stand-in that counts its setsockopt calls."""

    def __init__(self, peeker) -> None:
        self.peeker, self.sets = peeker, 0

    def setsockopt(self, *args):
        self.sets += 1
        return self.peeker.setsockopt(*args)

    def recvmsg_into(self, *args):
        return self.peeker.recvmsg_into(*args)


async def test_the_rests_reader_sets_the_next_peek_offset_off_the_loop():
    """The thread that reads a rest sets SO_PEEK_OFF where the next call's peek wants it; the
    loop's whole-call read takes what it read off it (as the kernel does), so the next peek
    finds the bytes after its view with no setsockopt on the loop; a read the loop does not
    count (receive_some) makes the peek set it again, and it still finds the right bytes."""
    if later_module.PEEK_OFF is None:
        return
    server, client = pair()
    with client:
        # The next call: NEXT and REST's first 300 bytes read by the loop, its view to REST's
        # 1000th byte, then the 22 bytes peeked, then the rest.
        head, at = len(NEXT) + 300, 1000
        send(client, server, REST + NEXT + REST)
        receiver = EagerReceiver(trio.SocketStream(server))
        later = LaterBody(server)
        receiver.attach(later)
        slot = memoryview(bytearray(22))
        buffer, view, more = _rest_buffers()
        assert later.offer_peeked(view, slot, more, len(REST))
        later.next_peek = len(NEXT) + at
        later.defer()
        thread = threading.Thread(target=later.take)
        thread.start()
        thread.join()
        assert bytes(buffer) == REST and later.peek_at == len(NEXT) + at
        peeker = later._peeker = _Counted(later._peeker)  # type: ignore[assignment]
        into = bytearray(head)
        assert await receiver.receive_whole((memoryview(into),), head) == head
        assert later.peek_at == at - 300  # (SO_PEEK_OFF, back by what was read)
        part = memoryview(bytearray(at - 300))
        assert later.offer_peeked(part, slot, more, len(REST) - 300)
        assert peeker.sets == 0 and bytes(slot) == REST[at : at + 22]
        assert later.settle() and bytes(part) == REST[300:at] and bytes(buffer) == REST
        send(client, server, NEXT)
        assert await receiver.receive_some(1) == NEXT[:1] and later.peek_at == -1
        assert later.offer_peeked(memoryview(bytearray(100)), slot, more, 0)
        assert peeker.sets == 1 and bytes(slot) == NEXT[101:123]


def test_a_message_whose_rest_is_unread_decodes_only_when_cut_as_the_last(monkeypatch):
    """decode_request with ``at`` (laterread.decoded): a message cut as the last one, its last
    raw contents from ``at`` on, decodes reading none of them (its tensor a view that the rest's
    read fills); another ``at``, or a message not cut so, decodes nothing and splits nothing;
    read whole, it decodes as before."""
    first = client_wire([client_input("INPUT0", INT32, "INT32")], request_id="id-1")
    assert infercache.decode_request(bytearray(first)) is not None
    at = infercache.raw_at(len(first))
    assert at == len(first) - INT32.nbytes
    split = infercache._split
    splits: list[int] = []

    def counted(data):
        splits.append(1)
        return split(data)

    monkeypatch.setattr(infercache, "_split", counted)
    again = client_wire([client_input("INPUT0", INT32 + 7, "INT32")], request_id="id-2")
    buffer = bytearray(len(again))
    buffer[:at] = again[:at]  # (its rest still in the socket)
    request = infercache.decode_request(buffer, at)
    assert request is not None and request.id == "id-2" and splits == []
    buffer[at:] = again[at:]  # (the rest read into the message's buffer)
    assert request.inputs["INPUT0"].data.tolist() == (INT32 + 7).tolist()
    assert infercache.decode_request(buffer, at - 4) is None and splits == []
    renamed = bytearray(again.replace(b"simple", b"simplf"))
    assert infercache.decode_request(renamed, at) is None and splits == []
    request = infercache.decode_request(renamed)
    assert request is not None and request.model_name == "simplf" and splits == [1]


def test_a_message_not_cut_as_the_last_has_its_rest_read_first_and_its_layout_found_again():
    """decoded: a call's message whose rest is in the socket but which is not cut as the last
    one (another layout since) has its rest read on the loop before anything decodes it, and
    the connection forgets where its layout's rest began (raw_at finds it for the next call)."""
    server, client = pair()
    with client:
        send(client, server, REST)
        later = LaterBody(server)
        buffer, view, more = _rest_buffers()
        later.offer(view, more)
        conn = types.SimpleNamespace(later=later, later_at=1000, later_call=(1, 2, 3))
        call = types.SimpleNamespace(connection=conn)
        _, left = laterread.decoded(call, memoryview(buffer))  # type: ignore[arg-type]
        assert left is None and later.view is None and bytes(buffer) == REST
        assert conn.later_call is None


class _Deferring(Infer):
    """test_grpc_thread_answer's Infer, whose calls leave their message's rest to a thread as
    ModelInfer does (grpc/laterread.py: decoded, then defer; the thread takes it before the
    message is read), and which keeps the digest of each message then."""

    def __init__(self) -> None:
        super().__init__()
        self.left: list[bool] = []
        self.digests: list[bytes] = []

    async def handler(self, call: GrpcCall) -> object:
        data = await call.receive()
        assert data is not None and await call.receive() is None
        request, later = laterread.decoded(call, data)
        self.left.append(later is not None)
        assert request is not None
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
    found: list[int] = []  # (raw_at's calls: once per layout taught, not once per call)
    monkeypatch.setattr(infercache, "raw_at", lambda length: found.append(length) or 100)
    # (a message whose rest is unread decodes as the last one's when it starts at the 100th
    # byte, reading none of it; read whole, any decodes)
    monkeypatch.setattr(
        infercache,
        "decode_request",
        lambda data, at=0: InferenceRequest("m") if at in (0, 100) else None,
    )
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
    assert found == [len(body)] * 2  # (the layout taught twice: its calls reuse it)


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
