"""A unary call's answer taken by the loop while the instance's thread is still
writing it (trionserve/protocol/grpc/answer.py: ``take``, ``resolve``), on a
real Connection and an h2 client over a socket pair, the thread's write paused
where the test chooses (events, never sleeps): the take does not wait for the
write, the socket stays the thread's until it returns, and what the socket did
not take goes out before anything the loop writes after it."""

from __future__ import annotations

import threading
import types

import h2.events
import trio
import trio.testing

from tests.unit.test_grpc_thread_answer import (
    Infer,
    armed_call,
    message,
    response,
    serving,
    thread_write,
)
from trionserve.protocol.grpc import answer as grpc_answer
from trionserve.protocol.grpc.answer import DISARMED, WRITING, WRITTEN
from trionserve.protocol.sockets import send_pieces_now


class PausedWrite:
    """The thread's write (answer.py's ``_write_now``) stopped, once entered,
    until the test lets it go (``go``), then taking ``takes`` bytes (all when
    None); ``late``: it waited in vain (the loop blocked on it)."""

    def __init__(self, monkeypatch, takes: int | None = None) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.late = False
        self.takes = takes
        monkeypatch.setattr(grpc_answer, "_write_now", self.write)

    def write(self, sock, data) -> list[memoryview]:
        self.entered.set()
        if not self.go.wait(5):  # (a take that waited for the write: it never came)
            self.late = True
        whole = memoryview(bytes(data))
        if self.takes is None:
            return send_pieces_now(sock, [whole])
        send_pieces_now(sock, [whole[: self.takes]])
        return [whole[self.takes :]]


async def _taken_in_progress(conn, request, answer, outcome, paused, results) -> None:
    """The thread's write begun and paused; the report delivered on the loop
    takes the answer at once: WRITTEN, the socket left to the thread."""

    async def write() -> None:
        results.append(await thread_write(request, answer, outcome))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        await trio.to_thread.run_sync(paused.entered.wait)
        assert answer.state == WRITING
        request.respond(outcome)  # the report: the loop takes the answer
        assert answer.state == WRITTEN and conn.stolen is answer and conn.answer is None
        paused.go.set()
    assert not paused.late  # (the take did not wait for the write)


async def test_an_answer_taken_while_the_thread_writes_is_the_loops_at_once(monkeypatch):
    paused = PausedWrite(monkeypatch)
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        stream_id, request, answer = await armed_call(infer, client)
        results: list[bool] = []
        await _taken_in_progress(conn, request, answer, outcome, paused, results)
        assert results == [True]
        await client.until(lambda: client.ended(stream_id))
        assert client.status(stream_id) == b"0" and client.answer(stream_id) == message(outcome)
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "thread")]
        # The next call is the thread's again (the last write seen to by the
        # loop's next write, a window it gives, or by the take).
        second, request, answer = await armed_call(infer, client)
        assert answer.armed
        assert await thread_write(request, answer, outcome)
        request.respond(outcome)
        assert conn.stolen is None and conn.unsent == []
        await client.until(lambda: client.ended(second))
        assert client.answer(second) == message(outcome)


async def test_what_the_socket_did_not_take_the_thread_has_the_loop_write(monkeypatch):
    # The write taken in progress leaves a rest: the thread wakes the loop,
    # which writes it at once (the client sends nothing more meanwhile).
    paused = PausedWrite(monkeypatch, takes=20)
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response(1000)
        stream_id, request, answer = await armed_call(infer, client)
        results: list[bool] = []
        await _taken_in_progress(conn, request, answer, outcome, paused, results)
        assert results == [False]  # (the socket took 20 bytes)
        await client.until(lambda: client.ended(stream_id))
        assert client.status(stream_id) == b"0"
        assert client.answer(stream_id) == message(outcome)
        assert conn.stolen is None and conn.unsent == []


async def test_what_the_socket_did_not_take_goes_before_anything_after_it(monkeypatch):
    # The rest not yet written when the next call is armed (the loop's wake
    # not come): the thread declines that call's answer, and the loop writes
    # the rest first, then that answer; a PING's ack comes after both.
    monkeypatch.setattr(grpc_answer, "_resolve_soon", lambda conn, answer: None)
    paused = PausedWrite(monkeypatch, takes=20)
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response(1000)
        stream_id, request, answer = await armed_call(infer, client)
        results: list[bool] = []
        await _taken_in_progress(conn, request, answer, outcome, paused, results)
        assert results == [False]
        second, request, answer = await armed_call(infer, client)
        assert conn.stolen is not None  # (the loop wrote nothing meanwhile)
        assert not await thread_write(request, answer, outcome)
        assert answer.state == DISARMED
        request.respond(outcome)
        await client.until(lambda: client.ended(second))
        assert client.answer(stream_id) == message(outcome)
        assert client.answer(second) == message(outcome)
        assert conn.stolen is None and conn.unsent == []
        client.h2.ping(b"12345678")
        await client.flush()
        await client.until(lambda: client.pings() == 1)
        ended = client.events.index(client.of(h2.events.StreamEnded)[-1])
        assert ended < client.events.index(client.of(h2.events.PingAckReceived)[0])


async def test_resolve_waits_for_the_write_in_progress(monkeypatch):
    # Before the socket closes (take_answer, at the connection's end) the loop
    # waits for the thread's write: never the socket closed under it. (resolve
    # run in a worker thread on a stand-in of the connection, for the test to
    # see it wait.)
    paused = PausedWrite(monkeypatch, takes=20)
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response(1000)
        stream_id, request, answer = await armed_call(infer, client)
        results: list[bool] = []
        seen: list = []
        flushed: list[bool] = []
        stand_in = types.SimpleNamespace(stolen=None, unsent=[], flush=lambda: flushed.append(True))

        async def write() -> None:
            results.append(await thread_write(request, answer, outcome))

        def resolve() -> None:
            grpc_answer.resolve(stand_in)  # type: ignore[arg-type]
            seen.append(list(stand_in.unsent))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.to_thread.run_sync(paused.entered.wait)
            request.respond(outcome)
            assert conn.stolen is answer
            stand_in.stolen = answer
            nursery.start_soon(trio.to_thread.run_sync, resolve)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []  # (the write is still paused)
            paused.go.set()
        assert results == [False] and not paused.late
        # The rest the write left, first in unsent, the writer told.
        assert len(seen) == 1 and len(seen[0]) == 1 and len(seen[0][0]) > 0 and flushed
        assert stand_in.stolen is None
        await client.until(lambda: client.ended(stream_id))
        assert client.answer(stream_id) == message(outcome)
