"""A unary call's answer written by the instance's thread
(trionserve/protocol/grpc/answer.py): a real Connection on one end of a socket
pair, an h2 client on the other, a handler that arms its call's answer as
ModelInfer's does; the "thread" is a worker thread calling ``write``, and the
report's delivery ``request.respond`` on the loop, each at a point the test
chooses (events, never sleeps). The thread's answer must leave the same frames
on the wire and the same h2 state as the loop's (``test_the_threads_answer_is_
the_loops_frame_for_frame``), and every call one outcome."""

from __future__ import annotations

import struct
import threading
from contextlib import asynccontextmanager

import h2.config
import h2.connection
import h2.events
import numpy as np
import trio
import trio.testing

from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.protocol.grpc import answer as grpc_answer
from trionserve.protocol.grpc import infercache
from trionserve.protocol.grpc.answer import DISARMED, PARTIAL, WRITTEN
from trionserve.protocol.grpc.call import GrpcCall, Method
from trionserve.protocol.grpc.connection import Connection
from trionserve.protocol.grpc.options import TransportOptions
from trionserve.protocol.grpc.parkedinfer import ParkedInfer
from trionserve.protocol.grpc.parking import PARKED
from trionserve.protocol.grpc.state import Response
from trionserve.protocol.sockets import send_pieces_now

PATH = "/inference.GRPCInferenceService/ModelInfer"


def response(floats: int = 16) -> InferenceResponse:
    data = np.arange(floats, dtype=np.float32).reshape(1, floats)
    return InferenceResponse("m", "1", "r", [Tensor("OUTPUT0", "FP32", data)])


def message(answer: InferenceResponse) -> bytes:
    """The answer's gRPC message as the client reads it (prefix stripped)."""
    request = InferenceRequest("m")
    chunks = infercache.encode_response(answer, request)
    assert chunks is not None
    return b"".join(bytes(chunk) for chunk in chunks)


class Run:
    """What ``ParkedInfer`` reads of the data plane's run of a request."""

    def __init__(self, stream_id: int, request: InferenceRequest, answer) -> None:
        self.stream_id = stream_id
        self.request = request
        self.answer = answer
        self.trace = None
        self.plain = True


class Infer:
    """ModelInfer's way with its answer (service.model_infer), on a request the
    test delivers: arm, park (parkedinfer.ParkedInfer) or wait for the outcome,
    take, encode unless taken. It is its own data plane's ``answered`` and
    ``finish``, which record how each call ended."""

    def __init__(self, arming: bool = True) -> None:
        self.arming = arming
        self.calls: list[tuple[GrpcCall, InferenceRequest, grpc_answer.CallAnswer | None]] = []
        self.armed = trio.Event()
        self.ended: list[tuple[int, str]] = []
        self.awaited: list[int] = []  # the calls whose outcome a coroutine awaited

    async def handler(self, call: GrpcCall) -> object:
        data = await call.receive()
        assert data is not None and await call.receive() is None
        request = InferenceRequest("m")
        answer = grpc_answer.arm(call, request, ParkedInfer) if self.arming else None
        self.calls.append((call, request, answer))
        self.armed.set()
        if answer is None:
            outcome = await self.finish(Run(call.stream_id, request, None))
            chunks = infercache.encode_response(outcome, request)
            assert chunks is not None
            await call.send(chunks)
            return None
        answer.dataplane = self  # type: ignore[assignment]
        answer.run = Run(call.stream_id, request, answer)  # type: ignore[assignment]
        if answer.state == grpc_answer.ARMED and call.connection.park(call, request, answer):
            return PARKED
        return await answer.rest(call)

    def answered(self, run: Run) -> None:
        self.ended.append((run.stream_id, "thread"))

    async def finish(self, run: Run) -> InferenceResponse:
        self.awaited.append(run.stream_id)
        try:
            outcome = await run.request.wait()
        except BaseException:
            self.ended.append((run.stream_id, "cancelled"))
            raise
        answer = run.answer
        thread = answer is not None and answer.state in (WRITTEN, PARTIAL)
        self.ended.append((run.stream_id, "thread" if thread else "loop"))
        return outcome

    def methods(self) -> dict[bytes, Method]:
        return {PATH.encode(): Method(self.handler)}


class Client:
    """An h2 client on the socket pair's other end: every byte the server sent
    is kept (``raw``), and h2's events."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = trio.SocketStream(sock)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.raw = bytearray()
        self.events: list = []
        self.data: dict[int, bytes] = {}

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.sock.send_all(data)

    async def call(self, body: bytes = b"\x00" * 64, timeout: bytes | None = None) -> int:
        stream_id = self.open(timeout)
        self.h2.send_data(stream_id, struct.pack(">BI", 0, len(body)) + body, end_stream=True)
        await self.flush()
        return stream_id

    def open(self, timeout: bytes | None = None) -> int:
        """A ModelInfer call's HEADERS, queued with h2 (not sent): its stream id."""
        stream_id = self.h2.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":authority", b"test"),
            (b":path", PATH.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        if timeout is not None:
            headers.append((b"grpc-timeout", timeout))
        self.h2.send_headers(stream_id, headers)
        return stream_id

    async def until(self, done) -> None:
        with trio.fail_after(10):
            while not done():
                data = await self.sock.receive_some(65536)
                assert data, "the server closed the connection"
                self.raw += data
                for event in self.h2.receive_data(data):
                    self.events.append(event)
                    if isinstance(event, h2.events.DataReceived):
                        self.data[event.stream_id] = (
                            self.data.get(event.stream_id, b"") + event.data
                        )
                        self.h2.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )

    def ended(self, stream_id: int) -> bool:
        return any(
            isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset))
            and e.stream_id == stream_id
            for e in self.events
        )

    def status(self, stream_id: int) -> bytes | None:
        for e in self.events:
            if isinstance(e, h2.events.TrailersReceived) and e.stream_id == stream_id:
                return dict(e.headers).get(b"grpc-status")
        return None

    def answer(self, stream_id: int) -> bytes:
        data = self.data.get(stream_id, b"")
        assert data[:1] == b"\x00" and int.from_bytes(data[1:5], "big") == len(data) - 5
        return data[5:]

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def pings(self) -> int:
        return sum(isinstance(e, h2.events.PingAckReceived) for e in self.events)


@asynccontextmanager
async def serving(infer: Infer, report_sweep=None, **options):
    server_sock, client_sock = trio.socket.socketpair()
    conn = Connection(
        trio.SocketStream(server_sock),
        infer.methods(),
        TransportOptions(**options),
        trio.Event(),
        report_sweep=report_sweep,
    )
    client = Client(client_sock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        client.h2.initiate_connection()
        await client.flush()
        # The server's preface and the ack of the client's settings.
        await client.until(
            lambda: any(isinstance(e, h2.events.SettingsAcknowledged) for e in client.events)
        )
        try:
            yield conn, client
        finally:
            nursery.cancel_scope.cancel()
            client_sock.close()


async def armed_call(
    infer: Infer, client: Client, body: bytes = b"\x00" * 64, timeout: bytes | None = None
):
    """Send a call and wait until its handler waits for its outcome, armed."""
    infer.armed = trio.Event()
    stream_id = await client.call(body, timeout)
    await infer.armed.wait()
    await trio.testing.wait_all_tasks_blocked()
    call, request, answer = infer.calls[-1]
    assert call.stream_id == stream_id
    return stream_id, request, answer


def h2_state(conn: Connection) -> dict:
    """What of h2's state an answer moves, and the connection's."""
    h = conn.h2
    window = h._inbound_flow_control_window_manager
    return {
        "machine": h.state_machine.state,
        "unary": sorted(h.unary),
        "streams": {
            sid: (s.state_machine.state, s.outbound_flow_control_window)
            for sid, s in h.streams.items()
        },
        "closed": dict(h._closed_streams),
        "outbound": h.outbound_flow_control_window,
        "inbound": (window.current_window_size, window.max_window_size, window._bytes_processed),
        "highest": h.highest_inbound_stream_id,
        "output": h.has_output(),
        "table": list(h.encoder.header_table.dynamic_entries),
        "calls": sorted(conn.calls),
        "answer": conn.answer,
        "unsent": conn.unsent,
    }


async def thread_write(request: InferenceRequest, answer, outcome: InferenceResponse) -> bool:
    return await trio.to_thread.run_sync(answer.write, request, outcome)


async def test_the_thread_writes_the_whole_answer_and_the_call_ends_once():
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        stream_id, request, answer = await armed_call(infer, client)
        assert answer is not None and answer.armed and request.answer is answer
        assert conn.answer is answer
        assert await thread_write(request, answer, outcome)
        assert answer.state == WRITTEN
        await client.until(lambda: client.ended(stream_id))
        assert client.status(stream_id) == b"0"
        assert client.answer(stream_id) == message(outcome)
        assert infer.ended == []  # the call waits for its report
        request.respond(outcome)  # the report, as the loop's sweep delivers it
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "thread")]
        assert conn.calls == {} and conn.answer is None and request.answer is None
        # The connection goes on: the next call is the thread's again.
        second, request, answer = await armed_call(infer, client)
        assert answer is not None and answer.armed
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(second))
        assert client.answer(second) == message(outcome)


async def exchange(arming: bool, calls: int, between=None) -> tuple[bytes, dict, list]:
    infer = Infer(arming)
    # A small window: the requests' bytes are acknowledged (WINDOW_UPDATE) too.
    async with serving(infer, window_size=65535) as (conn, client):
        for index in range(calls):
            body = bytes(range(256)) * (64 * (index + 1))  # 16, 32, 48 KB requests
            stream_id, request, answer = await armed_call(infer, client, body)
            outcome = response(16 * (index + 1))
            if arming:
                assert answer is not None and await thread_write(request, answer, outcome)
            if between is not None:
                await between(client, index)
            request.respond(outcome)
            await client.until(lambda sid=stream_id: client.ended(sid))
            await trio.testing.wait_all_tasks_blocked()
        return bytes(client.raw), h2_state(conn), infer.ended


async def test_the_threads_answer_is_the_loops_frame_for_frame():
    # The same calls answered by the thread and by the loop: the same bytes on
    # the wire, and the same h2 state after (windows, streams closed, the
    # record of closed streams, the HPACK table, nothing left to write).
    threads, thread_state, thread_ended = await exchange(True, 3)
    loops, loop_state, loop_ended = await exchange(False, 3)
    assert [how for _, how in thread_ended] == ["thread"] * 3
    assert [how for _, how in loop_ended] == ["loop"] * 3
    assert threads == loops
    assert thread_state == loop_state
    assert thread_state["closed"] and not thread_state["unary"] and not thread_state["output"]


async def test_a_ping_after_the_threads_answer_is_acked_and_the_state_is_the_same():
    async def ping(client: Client, index: int) -> None:
        client.h2.ping(b"%8d" % index)
        await client.flush()
        await client.until(lambda: client.pings() == index + 1)

    threads, thread_state, _ = await exchange(True, 2, ping)
    loops, loop_state, _ = await exchange(False, 2, ping)
    assert thread_state == loop_state
    assert len(threads) == len(loops)


async def test_the_loop_disarms_first_when_the_client_sends_a_ping():
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        stream_id, request, answer = await armed_call(infer, client)
        client.h2.ping(b"12345678")
        await client.flush()
        await client.until(lambda: client.pings() == 1)
        assert answer.state == DISARMED and conn.answer is None
        assert not await thread_write(request, answer, outcome)  # declined: nothing written
        assert not client.ended(stream_id)
        request.respond(outcome)
        await client.until(lambda: client.ended(stream_id))
        assert client.status(stream_id) == b"0"
        assert client.answer(stream_id) == message(outcome)
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "loop")]


async def test_a_window_update_while_armed_disarms_and_the_loop_answers():
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        stream_id, request, answer = await armed_call(infer, client)
        client.h2.increment_flow_control_window(1024)  # the connection's
        client.h2.ping(b"12345678")  # (its ack: the reader took both)
        await client.flush()
        await client.until(lambda: client.pings() == 1)
        assert answer.state == DISARMED
        assert not await thread_write(request, answer, outcome)
        request.respond(outcome)
        await client.until(lambda: client.ended(stream_id))
        assert client.answer(stream_id) == message(outcome)
        assert conn.h2.outbound_flow_control_window == 65535 + 1024 - len(message(outcome)) - 5


async def test_what_the_socket_does_not_take_the_loop_writes_first(monkeypatch):
    taken: list[int] = []

    def part(sock, pieces):  # the socket takes 20 bytes of the answer
        whole = b"".join(bytes(piece) for piece in pieces)
        send_pieces_now(sock, [whole[:20]])
        taken.append(len(whole))
        return [memoryview(whole)[20:]]

    monkeypatch.setattr(grpc_answer, "send_pieces_now", part)
    monkeypatch.setattr(grpc_answer, "_write_now", lambda sock, data: part(sock, [data]))
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response(1000)
        stream_id, request, answer = await armed_call(infer, client)
        assert not await thread_write(request, answer, outcome)
        assert answer.state == PARTIAL and taken
        # The thread wakes the loop; its sweep delivers the report.
        request.respond(outcome)
        await client.until(lambda: client.ended(stream_id))
        assert client.status(stream_id) == b"0"
        assert client.answer(stream_id) == message(outcome)
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "thread")]
        assert conn.unsent == [] and not conn.h2.has_output()


async def test_an_answer_past_the_peers_frame_size_is_declined_and_the_loop_writes_it():
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response(8192)  # 32 KB: two DATA frames of the client's 16 KB
        stream_id, request, answer = await armed_call(infer, client)
        state = h2_state(conn)
        assert not await thread_write(request, answer, outcome)
        assert answer.state == DISARMED
        assert h2_state(conn) == state  # nothing done
        request.respond(outcome)
        await client.until(lambda: client.ended(stream_id))
        assert client.answer(stream_id) == message(outcome)
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "loop")]


async def test_a_call_reset_while_armed_is_cancelled_and_the_thread_writes_nothing():
    infer = Infer()
    async with serving(infer) as (conn, client):
        stream_id, request, answer = await armed_call(infer, client)
        client.h2.reset_stream(stream_id)
        client.h2.ping(b"12345678")  # (its ack: the reader took both)
        await client.flush()
        await client.until(lambda: client.pings() == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "cancelled")]
        assert answer.state == DISARMED
        before = len(client.raw)
        assert not await thread_write(request, answer, response())
        # Nothing more on the wire for it: the next call is answered alone.
        second, request, answer = await armed_call(infer, client)
        assert await thread_write(request, answer, response())
        await client.until(lambda: client.ended(second))
        assert not client.data.get(stream_id)
        assert len(client.raw) > before


async def test_a_call_cancelled_after_the_threads_answer_sends_nothing_more():
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        # (with a deadline: the call waits in the reader's task, in its scope)
        stream_id, request, answer = await armed_call(infer, client, timeout=b"100S")
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(stream_id))
        call = infer.calls[-1][0]
        assert call.scope is not None
        call.scope.cancel()  # its deadline, say, before its report came
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "cancelled")]
        assert call.state.response is Response.ANSWERED and conn.calls == {}
        size = len(client.raw)
        second = await client.call()
        await infer.armed.wait()
        _, request2, answer2 = infer.calls[-1]
        request2.respond(outcome)
        await client.until(lambda: client.ended(second))
        # Only the second call's frames came after the first's answer.
        headers = [e for e in client.events if isinstance(e, h2.events.ResponseReceived)]
        assert [e.stream_id for e in headers] == [stream_id, second]
        assert len(client.raw) > size


async def test_no_answer_is_armed_while_another_call_may_answer():
    infer = Infer()
    async with serving(infer) as (conn, client):
        first, request, answer = await armed_call(infer, client)
        # A second call comes: the reader takes the first's answer before h2
        # sees it, and the second is not armed while the first may answer.
        infer.armed = trio.Event()
        second = await client.call()
        await infer.armed.wait()
        assert answer.state == DISARMED
        assert infer.calls[-1][2] is None
        outcome = response()
        for _, req, _ in infer.calls:
            req.respond(outcome)
        await client.until(lambda: client.ended(first) and client.ended(second))
        assert client.answer(first) == client.answer(second) == message(outcome)


async def test_the_next_call_is_armed_while_the_last_ones_report_waits():
    # One call after another (c=1): the thread wrote the first's answer and its
    # report waits for the loop's sweep as the next call comes with a window's
    # worth of bytes. The reader takes the first answer (the call answered)
    # before h2 sees them; the next call is armed although the first's task has
    # not ended, and the window update for its bytes is written with the
    # answer kept armed (SocketWriter._write_armed).
    infer = Infer()
    async with serving(infer, window_size=65535) as (conn, client):
        outcome = response()
        first, request, answer = await armed_call(infer, client)
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(first))
        updates = len(client.of(h2.events.WindowUpdated))
        second, request2, answer2 = await armed_call(infer, client, b"\x01" * 40000)
        assert answer.state == WRITTEN and infer.calls[0][0].state.response is Response.ANSWERED
        assert not infer.calls[0][0].state.answerable
        assert first in conn.calls and infer.ended == []  # its report waits
        assert answer2 is not None and answer2.armed and conn.answer is answer2
        await client.until(lambda: len(client.of(h2.events.WindowUpdated)) > updates)
        assert answer2.armed and not conn.h2.has_output()
        assert await thread_write(request2, answer2, outcome)
        await client.until(lambda: client.ended(second))
        assert client.answer(second) == message(outcome)
        request.respond(outcome)
        request2.respond(outcome)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(infer.ended) == [(first, "thread"), (second, "thread")]
        assert conn.calls == {}


async def test_an_answer_described_as_the_last_one_is_written_from_its_bytes(monkeypatch):
    encoded: list[InferenceResponse] = []
    encode = infercache.encode_response

    def counted(outcome, request):
        if threading.current_thread() is not threading.main_thread():  # the "thread"'s
            encoded.append(outcome)
        return encode(outcome, request)

    monkeypatch.setattr(infercache, "encode_response", counted)
    infer = Infer()
    other_id = InferenceResponse("m", "1", "other", response().outputs)
    outcomes = [response(), response(), response(32), response(32), other_id, response()]
    outcomes[1].outputs[0].data += 1  # other values, the same description
    async with serving(infer) as (conn, client):
        for outcome in outcomes:
            stream_id, request, answer = await armed_call(infer, client)
            assert await thread_write(request, answer, outcome)
            await client.until(lambda sid=stream_id: client.ended(sid))
            assert client.status(stream_id) == b"0"
            assert client.answer(stream_id) == message(outcome)
            request.respond(outcome)
            await trio.testing.wait_all_tasks_blocked()
    assert [[o is e for o in outcomes].index(True) for e in encoded] == [0, 2, 4, 5]
