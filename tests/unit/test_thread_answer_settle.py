"""An answer the instance's thread is still writing, settled by the loop without
waiting for the write (trionserve/protocol/http/answer.py: ``settle``,
``collect``, ``release``), on a real socket pair whose write is paused in the
thread (events, no sleeps): the loop goes on at once, and the socket stays the
thread's until its write returns; what a full socket left is written by the
loop first, before anything else on the connection."""

from __future__ import annotations

import os
import socket
import threading
import types

import trio
import trio.testing

from tests.unit.test_thread_answer import REQUEST, RESPONSE, connection, read_exactly
from trionserve.protocol.http import answer as answer_module
from trionserve.protocol.http.answer import ARMED, DISARMED, IDLE, PARTIAL, WRITING, WRITTEN


class PausedWrite:
    """``os.writev`` for the answer's module that stops, once entered, until the
    test lets it go (``go``); ``late``: it waited in vain (the loop blocked on it)."""

    def __init__(self, monkeypatch) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.late = False
        monkeypatch.setattr(answer_module, "os", types.SimpleNamespace(writev=self.writev))

    def writev(self, fd: int, pieces: list) -> int:
        self.entered.set()
        if not self.go.wait(5):  # (a settle that waited for the write: it never came)
            self.late = True
        return os.writev(fd, pieces)


async def _write_paused(answer, request, paused: PausedWrite, results: list) -> None:
    results.append(await trio.to_thread.run_sync(answer.write, request, RESPONSE))


def _next(answer, request, encode) -> None:
    """The connection's next request (the same), armed."""
    answer._h1.receive_data(REQUEST)
    assert answer._h1.next_request() is not None
    answer.arm(request, encode, False)


def _small_buffers(server_sock, client_sock) -> None:
    server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)


async def _settled_in_progress(answer, request, paused: PausedWrite, results: list) -> None:
    """The thread's write begun and paused; the loop, woken by the client's bytes,
    settles it: at once, WRITTEN, the socket left to the thread."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_write_paused, answer, request, paused, results)
        await trio.to_thread.run_sync(paused.entered.wait)
        assert answer.state == WRITING
        answer.readable = True  # (the client's next request ended the wait)
        assert answer.settle() == WRITTEN and answer.kept and answer.owing
        assert answer.state == IDLE and request.answer is None and answer.rest is None
        paused.go.set()
    assert not paused.late  # (the settle did not wait for the write)
    assert answer.state == IDLE  # (the thread left the state to the loop's settle)


async def test_a_write_in_progress_is_settled_at_once_and_seen_to_at_the_next_settle(
    monkeypatch,
):
    paused = PausedWrite(monkeypatch)
    server_sock, client_sock, answer, request, expected = connection(4096)
    encode = answer._encode
    with server_sock, client_sock:
        results: list[bool] = []
        await _settled_in_progress(answer, request, paused, results)
        assert results == [True]
        assert await read_exactly(client_sock, len(expected)) == expected
        # The next request's answer is the thread's again (the first write's
        # outcome not yet seen by the loop), and its settle sees to the first.
        _next(answer, request, encode)
        assert answer.owing and answer.state == ARMED
        assert await trio.to_thread.run_sync(answer.write, request, RESPONSE)
        assert answer.state == WRITTEN and answer.settle() == WRITTEN
        assert not answer.owing and answer.unsent is None
        assert await read_exactly(client_sock, len(expected)) == expected


async def test_what_a_full_socket_left_of_it_is_written_first(monkeypatch):
    # A client that does not read: the thread's write, settled in progress,
    # leaves a rest the loop writes before anything else, whole and once.
    paused = PausedWrite(monkeypatch)
    server_sock, client_sock, answer, request, expected = connection(60 * 1024)
    _small_buffers(server_sock, client_sock)
    stream = trio.SocketStream(server_sock)
    with server_sock, client_sock:
        results: list[bool] = []
        await _settled_in_progress(answer, request, paused, results)
        assert results == [False]  # (the socket took part of it)
        received: list[bytes] = []
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                received.append(await read_exactly(client_sock, len(expected) + 4))

            nursery.start_soon(read)
            await answer.collect(stream)  # (before the loop writes or waits for bytes)
            await stream.send_all(b"next")  # what the loop writes after it
        assert received == [expected + b"next"]
        assert not answer.owing and answer.unsent is None


async def test_a_pipelined_answer_waits_for_the_rest_of_the_one_before(monkeypatch):
    # The next request's answer, with such a rest not yet written, is declined
    # by the thread: the loop writes the rest, then that answer.
    paused = PausedWrite(monkeypatch)
    server_sock, client_sock, answer, request, expected = connection(60 * 1024)
    _small_buffers(server_sock, client_sock)
    encode = answer._encode
    with server_sock, client_sock:
        results: list[bool] = []
        await _settled_in_progress(answer, request, paused, results)
        assert results == [False]
        _next(answer, request, encode)
        assert not await trio.to_thread.run_sync(answer.write, request, RESPONSE)
        assert answer.state == DISARMED
        assert answer.settle() == DISARMED  # (the loop answers it ...)
        assert answer.owing and answer.unsent is not None  # (... once the rest is written)
        rest = bytes(answer.unsent)
        assert 0 < len(rest) < len(expected)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_exactly, client_sock, len(expected))
            await answer.collect(trio.SocketStream(server_sock))
        assert not answer.owing and answer.unsent is None


async def test_the_socket_is_released_only_once_the_write_returned(monkeypatch):
    # Before the socket closes (release, in the connection's close), the loop
    # waits for the thread's write, whose outcome it reads: never the socket
    # closed under it.
    paused = PausedWrite(monkeypatch)
    server_sock, client_sock, answer, request, expected = connection(60 * 1024)
    _small_buffers(server_sock, client_sock)
    with server_sock, client_sock:
        results: list[bool] = []
        seen: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write_paused, answer, request, paused, results)
            await trio.to_thread.run_sync(paused.entered.wait)
            answer.readable = True
            assert answer.settle() == WRITTEN and answer.owing

            def resolve() -> None:
                answer._resolve()  # (release's wait)
                seen.append(answer.unsent)

            nursery.start_soon(trio.to_thread.run_sync, resolve)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []  # (the write is still paused)
            paused.go.set()
        assert results == [False] and not paused.late
        assert seen[0] is not None and 0 < len(seen[0]) < len(expected)
        answer.release()
        assert not answer.owing and answer.unsent is None


async def test_a_write_settled_as_it_went_when_it_ended_first_or_nothing_woke_the_loop(
    monkeypatch,
):
    # The thread's write returned before the loop looked: the state it left
    # (WRITTEN, PARTIAL) is the settle's, nothing owed.
    for size, state in ((4096, WRITTEN), (60 * 1024, PARTIAL)):
        server_sock, client_sock, answer, request, _ = connection(size)
        _small_buffers(server_sock, client_sock)
        with server_sock, client_sock:
            await trio.to_thread.run_sync(answer.write, request, RESPONSE)
            assert answer.state == state
            answer.readable = True
            assert answer.settle() == state and not answer.owing
            assert not answer._claim.locked()
    # Not woken by the client's bytes (the outcome came another way): the
    # settle waits for the write, as before.
    paused = PausedWrite(monkeypatch)
    server_sock, client_sock, answer, request, _ = connection(4096)
    with server_sock, client_sock:
        results: list[bool] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write_paused, answer, request, paused, results)
            await trio.to_thread.run_sync(paused.entered.wait)
            paused.go.set()
            assert answer.settle() == WRITTEN and not answer.owing
        assert results == [True]
