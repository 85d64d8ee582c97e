"""A connection's answer written by the instance's thread
(trionserve/protocol/http/answer.py) and the reports left for the loop's sweep
(trionserve/core/deferred.py), on a real socket pair: what the thread writes,
what it leaves to the loop, and what it declines."""

from __future__ import annotations

import socket

import trio
import trio.testing

from trionserve.core.deferred import deferred_jobs, sweep_deferred
from trionserve.core.errors import InternalError
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.statistics import select_statistics
from trionserve.protocol.http.answer import (
    ARMED,
    DISARMED,
    PARTIAL,
    THREAD_ANSWER_MAX_BYTES,
    WRITTEN,
    ConnectionAnswer,
    lingering,
    sweep,
)
from trionserve.protocol.http.h1 import H1Connection

REQUEST = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n"


def connection(body_size: int, raises: bool = False, draining: bool = False):
    """A server socket, its client, the answer, the request armed, and the
    answer's expected bytes (an encoder answering ``body_size`` bytes)."""
    server_sock, client_sock = trio.socket.socketpair()
    h1 = H1Connection()
    h1.receive_data(REQUEST)
    assert h1.next_request() is not None
    answer = ConnectionAnswer.of(h1, trio.SocketStream(server_sock), lambda: draining)
    assert answer is not None
    body = bytes(range(256)) * (body_size // 256)

    def encode(response, request, binary_output):
        if raises:
            raise RuntimeError("an encoder bug")
        return 200, [(b"content-length", b"%d" % len(body))], [body]

    request = InferenceRequest("m")
    answer.arm(request, encode, False)
    expected = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    return server_sock, client_sock, answer, request, expected


RESPONSE = InferenceResponse("m", "1")


async def read_exactly(sock, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await sock.recv(size - len(data))
        assert chunk
        data += chunk
    return data


async def test_the_thread_writes_a_whole_answer():
    server_sock, client_sock, answer, request, expected = connection(4096)
    with server_sock, client_sock:
        assert answer.armed and request.answer is answer
        assert await trio.to_thread.run_sync(answer.write, request, RESPONSE)
        assert answer.state == WRITTEN and answer.kept
        assert await read_exactly(client_sock, len(expected)) == expected
        assert answer.settle() == WRITTEN and request.answer is None
        assert await answer.finish(trio.SocketStream(server_sock))  # nothing left to write


async def test_what_the_socket_does_not_take_is_written_by_the_loop():
    server_sock, client_sock, answer, request, expected = connection(60 * 1024)
    with server_sock, client_sock:
        server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        assert not await trio.to_thread.run_sync(answer.write, request, RESPONSE)
        assert answer.state == PARTIAL
        assert answer.rest is not None and 0 < len(answer.rest) < len(expected)
        assert answer.settle() == PARTIAL
        async with trio.open_nursery() as nursery:
            received: list[bytes] = []

            async def read() -> None:
                received.append(await read_exactly(client_sock, len(expected)))

            nursery.start_soon(read)
            assert await answer.finish(trio.SocketStream(server_sock))
        assert received == [expected]


async def test_the_thread_declines_what_the_loop_must_answer():
    # Over the size the thread writes, an encoder that raises, an answer the
    # loop took back (or armed for the next request): nothing is written.
    for size, raises in ((THREAD_ANSWER_MAX_BYTES + 256, False), (256, True)):
        server_sock, client_sock, answer, request, _ = connection(size, raises)
        with server_sock, client_sock:
            assert not await trio.to_thread.run_sync(answer.write, request, RESPONSE)
            assert answer.state == DISARMED and answer.rest is None
            assert answer.settle() == DISARMED
            assert _nothing_sent(client_sock)
    server_sock, client_sock, answer, request, _ = connection(256)
    with server_sock, client_sock:
        other = InferenceRequest("m")
        assert not await trio.to_thread.run_sync(answer.write, other, RESPONSE)
        assert answer.state == ARMED
        assert answer.settle() == DISARMED  # the loop answers it
        assert not await trio.to_thread.run_sync(answer.write, request, RESPONSE)
        assert _nothing_sent(client_sock)


def _nothing_sent(sock) -> bool:
    raw = socket.socket(fileno=sock.fileno())
    try:
        raw.recv(1, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    finally:
        raw.detach()
    return False


class _Closings(list):
    """trio.lowlevel.notify_closing, counted: each call ends a wait on a socket
    with an exception and costs the next wait on it two more ``epoll_ctl``."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        real = trio.lowlevel.notify_closing

        def counted(fd) -> None:
            self.append(fd)
            real(fd)

        monkeypatch.setattr(trio.lowlevel, "notify_closing", counted)


async def test_an_outcome_the_loop_delivers_is_answered_there_and_the_wait_goes_on(monkeypatch):
    # A request queued behind a busy instance (or answered by a stub) has its
    # outcome delivered by the loop while its connection's task waits on the
    # socket: the answer is written there, and the wait goes on until the
    # client's next request, with no notify_closing (no epoll churn) between.
    closings = _Closings(monkeypatch)
    server_sock, client_sock, answer, request, expected = connection(256)
    with server_sock, client_sock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer.wait)
            await trio.testing.wait_all_tasks_blocked()
            assert answer.waiting
            request.respond(RESPONSE)  # the loop delivered it
            await trio.testing.wait_all_tasks_blocked()
            assert answer.waiting and answer in lingering() and answer.state == WRITTEN
            assert await read_exactly(client_sock, len(expected)) == expected
            await client_sock.send(b"POST")  # its next request ends the wait
        assert closings == []
        assert not answer.waiting and answer not in lingering() and answer.readable
        assert await request.wait() is RESPONSE
        assert answer.settle() == WRITTEN and answer.kept


async def test_the_wait_ends_with_an_outcome_the_loop_answers_or_the_socket(monkeypatch):
    # An error, an answer the loop must write (over the size written there) or
    # a draining server end the wait (notify_closing): the connection's task
    # answers. Bytes before the answer (pipelined, or the client's end) take
    # it back.
    closings = _Closings(monkeypatch)
    cases = (
        (256, lambda request: request.fail(InternalError("the model failed")), False),
        (THREAD_ANSWER_MAX_BYTES + 256, lambda request: request.respond(RESPONSE), False),
        (256, lambda request: request.respond(RESPONSE), True),
    )
    for size, deliver, draining in cases:
        server_sock, client_sock, answer, request, _ = connection(size, draining=draining)
        with server_sock, client_sock:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer.wait)
                await trio.testing.wait_all_tasks_blocked()
                assert answer.waiting
                deliver(request)
            assert not answer.waiting and answer.settle() == DISARMED
            assert _nothing_sent(client_sock)
    assert len(closings) == len(cases)
    server_sock, client_sock, answer, request, _ = connection(256)
    with server_sock, client_sock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer.wait)
            await trio.testing.wait_all_tasks_blocked()
            await client_sock.send(b"GET")  # bytes before the answer: taken back
        assert answer.state == DISARMED
        request.respond(RESPONSE)  # delivered after: nothing written
        assert _nothing_sent(client_sock)


async def test_a_wait_whose_answer_the_thread_wrote_goes_on_until_the_client_or_the_tick():
    # The outcome delivered after the thread wrote the answer whole does not end
    # the wait: the client's next request does (one wake-up, not two), or the
    # server's tick (answer.sweep) for a client that sends nothing more.
    for ended_by_client in (True, False):
        server_sock, client_sock, answer, request, expected = connection(256)
        with server_sock, client_sock:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer.wait)
                await trio.testing.wait_all_tasks_blocked()
                assert await trio.to_thread.run_sync(answer.write, request, RESPONSE)
                request.respond(RESPONSE)  # the report swept: the outcome is in
                await trio.testing.wait_all_tasks_blocked()
                assert answer.waiting and answer in lingering()
                if ended_by_client:
                    assert await read_exactly(client_sock, len(expected)) == expected
                    await client_sock.send(b"POST")  # its next request
                else:
                    sweep()  # the tick
            assert not answer.waiting and answer not in lingering()
            assert answer.readable is ended_by_client
            assert answer.settle() == WRITTEN


async def test_a_socket_closing_during_the_wait_is_not_taken_for_the_outcome():
    # The outcome ends the wait through notify_closing; a socket that is really
    # closing (another task closes the stream) ends it with the error.
    server_sock, client_sock, answer, request, _ = connection(256)
    with server_sock, client_sock:
        errors: list[BaseException] = []

        async def wait() -> None:
            try:
                await answer.wait()
            except trio.ClosedResourceError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            trio.lowlevel.notify_closing(server_sock)
        assert len(errors) == 1 and answer.state == DISARMED and not answer.waiting


async def test_a_watched_socket_is_left_to_its_watcher():
    # A request slow to reach its wait (its model loaded on demand) may find the
    # slow-request watcher on the socket: the wait leaves it alone and the loop
    # answers, instead of Trio's BusyResourceError for a second waiter.
    server_sock, client_sock, _, request, _ = connection(256)
    with server_sock, client_sock:
        h1 = H1Connection()
        h1.receive_data(REQUEST)
        assert h1.next_request() is not None
        answer = ConnectionAnswer.of(h1, trio.SocketStream(server_sock), lambda: False)
        assert answer is not None
        answer.watched = True  # (the transport's watch_peer sets it)
        answer.arm(request, lambda *_: (200, [], [b""]), False)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.lowlevel.wait_readable, server_sock)  # the watcher
            await trio.testing.wait_all_tasks_blocked()
            await answer.wait()  # returns at once, disarmed
            assert answer.state == DISARMED and not answer.waiting
            assert not answer.write(request, RESPONSE)  # the thread writes nothing
            nursery.cancel_scope.cancel()


async def test_an_answer_written_before_the_wait_is_swept_at_once(autojump_clock):
    # The thread may finish and write before the connection's task waits: the
    # job it deferred is swept as the wait begins (no socket event will come).
    server_sock, client_sock, answer, request, expected = connection(256)
    with server_sock, client_sock:

        class _Report:
            def finished(self) -> None:
                request.respond(RESPONSE)

        deferred_jobs().append(_Report())  # as the thread does, before its write
        assert await trio.to_thread.run_sync(answer.write, request, RESPONSE)
        with trio.fail_after(1):
            assert await request.wait() is RESPONSE
        assert await read_exactly(client_sock, len(expected)) == expected


class _Job:
    def __init__(self) -> None:
        self.done = False

    def finished(self) -> None:
        self.done = True


class _NoModels:
    def entries(self):
        return {}


async def test_reports_are_swept_before_statistics_are_read_and_on_wake():
    job = _Job()
    deferred = deferred_jobs()
    deferred.append(job)
    assert select_statistics(_NoModels(), None, None) == []  # type: ignore[arg-type]
    assert job.done
    woken = _Job()
    await trio.to_thread.run_sync(lambda: (deferred.append(woken), deferred.wake()))
    await trio.testing.wait_all_tasks_blocked()
    assert woken.done
    sweep_deferred()  # nothing left: a no-op
