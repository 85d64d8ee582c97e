"""A unary call parked while its request runs (connection.Connection.park,
parkedinfer.ParkedInfer): a call whose request is not whole in one
read starts in the reader's task once it is, and with its answer armed waits
for its outcome in no task; the outcome carries it on (the reader's next sweep,
or a task of its own), a reset or the connection's end in a task whose scope is
cancelled. A real Connection on a socket pair, the handler ModelInfer's way
(tests/unit/test_grpc_thread_answer.py), Trio's tasks counted by an instrument;
events, never sleeps."""

from __future__ import annotations

import struct

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
from tests.unit.test_grpc_thread_answer_take import PausedWrite
from trionserve.core.deferred import deferred_jobs
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.protocol.grpc.answer import DISARMED, WRITING, WRITTEN
from trionserve.protocol.grpc.connection import Connection
from trionserve.protocol.grpc.state import ConnEvent, Response


class Report:
    """An executor's report left for the loop's sweep: it delivers the outcome."""

    def __init__(self, request: InferenceRequest, outcome: InferenceResponse) -> None:
        self.request = request
        self.outcome = outcome

    def finished(self) -> None:
        self.request.respond(self.outcome)


class Tasks(trio.abc.Instrument):
    """Counts the tasks spawned."""

    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


async def counted() -> Tasks:
    tasks = Tasks()
    trio.lowlevel.add_instrument(tasks)
    return tasks


async def test_an_armed_call_parks_and_the_next_calls_read_carries_it_on():
    infer = Infer()
    async with serving(infer) as (conn, client):
        tasks = await counted()
        outcome = response()
        first, request, answer = await armed_call(infer, client)
        assert list(conn._parked) == [infer.calls[-1][0]] and infer.calls[-1][0].scope is None
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(first))
        # The report waits for the loop's sweep: the next call's read delivers
        # it, and the first call ends in the reader's task before the second.
        deferred_jobs().append(Report(request, outcome))
        second, request2, answer2 = await armed_call(infer, client)
        assert infer.ended == [(first, "thread")] and first not in conn.calls
        assert answer2 is not None and answer2.armed
        assert await thread_write(request2, answer2, outcome)
        await client.until(lambda: client.ended(second))
        request2.respond(outcome)  # outside the reader's sweep: a task carries it on
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(first, "thread"), (second, "thread")]
        assert conn.calls == {} and conn._parked == {}
        assert tasks.spawned == 1  # the second's, carried on by a task; none for the first
        assert client.answer(first) == client.answer(second) == message(outcome)


async def test_a_parked_call_the_thread_answered_ends_in_the_reader_with_no_coroutine():
    # Its handler returned as it parked; the next call's read delivers the
    # outcome, and the call ends there with the data plane's end (once), its
    # bytes answered, before the next call starts: no coroutine awaits it.
    infer = Infer()
    async with serving(infer) as (conn, client):
        tasks = await counted()
        outcome = response()
        first, request, answer = await armed_call(infer, client)
        call = infer.calls[-1][0]
        assert call in conn._parked and call.scope is None
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(first))
        deferred_jobs().append(Report(request, outcome))
        second, request2, answer2 = await armed_call(infer, client)
        assert infer.ended == [(first, "thread")] and infer.awaited == []
        assert first not in conn.calls and request.done
        assert tasks.spawned == 0
        assert answer2 is not None and answer2.armed and list(conn._parked) == [infer.calls[-1][0]]
        # The first call's bytes were let go as it ended (Connection._ended,
        # the buffer's close): only the second's message is held, as work.
        held = infer.calls[-1][0].account
        assert call.account.working == 0 and not call.account.taken
        assert conn.buffer.working == conn.buffer.held == held.working > 0
        # Nothing refers to the first's answer any more: it is the second's,
        # armed again (answer.arm), for the second's request alone.
        assert answer2 is answer and conn.spare is None and conn.answer is answer
        assert request2.answer is answer and request.answer is None
        assert answer.run is not None and answer.run.request is request2
        assert not await thread_write(request, answer, outcome)  # (the first's: stale)
        assert answer.armed and not client.ended(second)
        assert await thread_write(request2, answer, outcome)
        await client.until(lambda: client.ended(second))
        assert client.answer(second) == message(outcome)


async def test_a_call_the_thread_answered_ends_in_its_report_after_h2_saw_the_read(monkeypatch):
    # The report the next call's read delivers ends the first call right in
    # the outcome's callback (ParkedInfer.__call__), during the reader's sweep
    # and after h2 saw that read: the next call is in ``calls`` already, so
    # the connection is never idle between the two, and no entry for the
    # first goes through the read's new calls (_starting).
    infer = Infer()
    seen: list[tuple[int, bool, list[int], list, bool]] = []
    ended = Connection._ended

    def spy(self: Connection, call) -> None:
        starting = [entry[0].stream_id for entry in self._starting]
        ended(self, call)
        seen.append(
            (call.stream_id, self._sweeping, sorted(self.calls), starting, self in self._idle)
        )

    monkeypatch.setattr(Connection, "_ended", spy)
    async with serving(infer) as (conn, client):
        outcome = response()
        first, request, answer = await armed_call(infer, client)
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(first))
        deferred_jobs().append(Report(request, outcome))
        second, request2, answer2 = await armed_call(infer, client)
        assert seen == [(first, True, [second], [second], False)]
        assert infer.ended == [(first, "thread")] and conn._parked == {conn.calls[second]: answer}
        assert answer2 is answer and answer.armed


async def test_a_call_its_report_cannot_end_goes_on_before_the_reads_new_call():
    # The thread never wrote the answer (taken back by the reader: the loop's):
    # the report the next call's read delivers carries the first call on after
    # that read, ahead of the read's new call, as delivered before h2 saw it:
    # the first answers and ends, then the second starts and is armed (no
    # other call may answer by then).
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        first, request, answer = await armed_call(infer, client)
        deferred_jobs().append(Report(request, outcome))
        second, request2, answer2 = await armed_call(infer, client)
        await client.until(lambda: client.ended(first))
        assert infer.ended == [(first, "loop")] and client.answer(first) == message(outcome)
        assert answer2 is not None and answer2.armed and conn.answer is answer2
        assert list(conn.calls) == [second]


async def test_a_draining_connection_closes_as_its_last_parked_call_ends_in_its_report():
    # The server drains (the last GOAWAY sent) while the thread's answer
    # waits for its report: a read (the client's PING) delivers it, the call
    # ends in the outcome's callback, and the connection, with no call left,
    # closes (its final GOAWAY), as a drained connection's last call's end
    # closes it anywhere.
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        first, request, answer = await armed_call(infer, client)
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(first))
        conn.state.event(ConnEvent.DRAIN)
        assert conn.state.draining and not conn.state.closing
        deferred_jobs().append(Report(request, outcome))
        client.h2.ping(b"drained!")
        await client.flush()
        await client.until(lambda: client.of(h2.events.ConnectionTerminated))
        assert infer.ended == [(first, "thread")] and conn.state.closing
        assert conn.calls == {} and conn._parked == {} and conn._starting == []


async def test_an_answer_whose_write_the_reader_took_in_progress_is_not_armed_again(monkeypatch):
    # The connection's spare (answer.arm) is an answer nothing refers to any
    # more: the thread whose write the next call's read took in progress may
    # still hand it what the socket did not take (answer.resolve), so the
    # next call gets a new one, and both answers reach the client whole.
    paused = PausedWrite(monkeypatch)
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        first, request, answer = await armed_call(infer, client)
        results: list[bool] = []

        async def write() -> None:
            results.append(await thread_write(request, answer, outcome))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.to_thread.run_sync(paused.entered.wait)
            assert answer.state == WRITING
            deferred_jobs().append(Report(request, outcome))
            infer.armed = trio.Event()
            second = await client.call()
            await infer.armed.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert infer.ended == [(first, "thread")] and first not in conn.calls
            assert answer.state == WRITTEN and conn.stolen is answer
            answer2 = infer.calls[-1][2]
            assert answer2 is not None and answer2 is not answer and answer2.armed
            assert conn.spare is None
            paused.go.set()
        assert results == [True] and not paused.late
        await client.until(lambda: client.ended(first))
        assert await thread_write(infer.calls[-1][1], answer2, outcome)
        await client.until(lambda: client.ended(second))
        assert client.answer(first) == client.answer(second) == message(outcome)


async def test_a_request_in_two_reads_starts_in_the_reader_once_whole():
    infer = Infer()
    async with serving(infer) as (conn, client):
        tasks = await counted()
        body = bytes(range(256)) * 128  # 32 KB
        stream_id = client.open()
        payload = struct.pack(">BI", 0, len(body)) + body
        client.h2.send_data(stream_id, payload[:1000])
        await client.flush()
        await trio.testing.wait_all_tasks_blocked()
        assert stream_id in conn._awaiting and infer.calls == []
        infer.armed = trio.Event()
        client.h2.send_data(stream_id, payload[1000:], end_stream=True)
        await client.flush()
        await infer.armed.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert conn._awaiting == {} and infer.calls[-1][0] in conn._parked
        _, request, answer = infer.calls[-1]
        outcome = response()
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(stream_id))
        assert tasks.spawned == 0
        request.respond(outcome)
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "thread")] and conn.calls == {}


async def test_a_call_reset_before_its_request_is_whole_ends_once():
    infer = Infer()
    async with serving(infer) as (conn, client):
        stream_id = client.open()
        client.h2.send_data(stream_id, struct.pack(">BI", 0, 100) + b"\x00" * 10)
        await client.flush()
        await trio.testing.wait_all_tasks_blocked()
        assert stream_id in conn._awaiting
        client.h2.reset_stream(stream_id)
        client.h2.ping(b"12345678")
        await client.flush()
        await client.until(lambda: client.pings() == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert conn._awaiting == {} and conn.calls == {} and infer.calls == []
        # The connection goes on.
        second, request, answer = await armed_call(infer, client)
        assert await thread_write(request, answer, response())
        await client.until(lambda: client.ended(second))


async def test_the_connections_end_cancels_a_parked_call_in_a_task():
    infer = Infer()
    async with serving(infer) as (conn, client):
        stream_id, request, answer = await armed_call(infer, client)
        call = infer.calls[-1][0]
        assert call in conn._parked
        await client.sock.aclose()  # the client goes away
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "cancelled")]
        assert answer.state == DISARMED
        assert conn._parked == {}
        assert not await thread_write(request, answer, response())


async def test_a_parked_call_carried_on_by_a_closing_connections_sweep_ends_once():
    # The connection closes (its answer taken back: the loop's), then a read's
    # sweep delivers the outcome: a closing connection's reads start no call,
    # so the call goes on as the reader ends (the writer ends the connection
    # after the GOAWAY), its request counted out, once.
    infer = Infer()
    async with serving(infer) as (conn, client):
        stream_id, request, answer = await armed_call(infer, client)
        conn.close()
        assert answer.state == DISARMED and conn.state.closing
        deferred_jobs().append(Report(request, response()))
        conn._sweep()  # (the reader's, after a read)
        assert [call.stream_id for call, _ in conn._starting] == [stream_id]
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "loop")] and infer.awaited == [stream_id]
        assert conn.calls == {} and conn._starting == [] and conn._parked == {}


async def test_an_outcome_delivered_before_the_thread_writes_is_the_loops():
    # The thread declined (or the outcome came another way): the loop answers
    # the parked call from a task of its own, once.
    infer = Infer()
    async with serving(infer) as (conn, client):
        stream_id, request, answer = await armed_call(infer, client)
        outcome = response()
        request.respond(outcome)
        await client.until(lambda: client.ended(stream_id))
        await trio.testing.wait_all_tasks_blocked()
        assert infer.ended == [(stream_id, "loop")]
        assert client.answer(stream_id) == message(outcome)
        assert answer.state == DISARMED and conn.calls == {}
        assert answer.state != WRITTEN


async def test_a_call_ended_the_common_way_is_re_armed_as_a_later_call():
    # A call that ended in the reader with its answer the connection's spare
    # (ParkedInfer.ended) is referred to by nothing else: the connection makes a
    # later call from it (Connection._on_request: the next headers it reads),
    # every per-call field as a new call's, its reader let go, instead of a new
    # GrpcCall, CallState and Account.
    infer = Infer()
    async with serving(infer) as (conn, client):
        outcome = response()
        body = bytes(range(256)) * 128  # in two reads: the call's reader is made
        first = client.open()
        payload = struct.pack(">BI", 0, len(body)) + body
        client.h2.send_data(first, payload[:1000])
        await client.flush()
        await trio.testing.wait_all_tasks_blocked()
        infer.armed = trio.Event()
        client.h2.send_data(first, payload[1000:], end_stream=True)
        await client.flush()
        await infer.armed.wait()
        await trio.testing.wait_all_tasks_blocked()
        call, request, answer = infer.calls[-1]
        account = call.account
        assert call._reading and call.stream_id == first
        reader = call.reader
        assert await thread_write(request, answer, outcome)
        await client.until(lambda: client.ended(first))
        deferred_jobs().append(Report(request, outcome))
        # The second's headers come in the read whose sweep ends the first:
        # made new, the first kept for the next.
        second, request2, answer2 = await armed_call(infer, client)
        call2 = infer.calls[-1][0]
        assert call2 is not call and conn.spare_call is call and first not in conn.calls
        assert await thread_write(request2, answer2, outcome)
        await client.until(lambda: client.ended(second))
        deferred_jobs().append(Report(request2, outcome))
        third, request3, answer3 = await armed_call(infer, client)
        assert infer.calls[-1][0] is call and conn.spare_call is call2
        assert conn.calls == {third: call} and call.stream_id == third
        assert call.account is account and account.stream_id == third
        assert conn.buffer._accounts == {third: account}
        assert account.working == conn.buffer.working > 0 and not account.queued
        assert call.reader is not reader  # (the third's own, made as it read)
        assert not call.messages and call._metadata is None
        assert call.error is None and call.scope is None and call.deadline is None
        state = call.state
        assert state.client_done and not state.reset and state.answerable
        assert state.response is Response.IDLE
        assert answer3 is answer and answer._call is call and request3.answer is answer
        assert not await thread_write(request, answer, outcome)  # (the first's: stale)
        assert await thread_write(request3, answer3, outcome)
        await client.until(lambda: client.ended(third))
        deferred_jobs().append(Report(request3, outcome))
        fourth, request4, answer4 = await armed_call(infer, client)
        assert infer.calls[-1][0] is call2  # (the second's, in turn)
        assert infer.ended == [(first, "thread"), (second, "thread"), (third, "thread")]
        assert client.answer(first) == client.answer(third) == message(outcome)
        assert await thread_write(request4, answer4, outcome)
        await client.until(lambda: client.ended(fourth))


async def test_a_call_the_loop_answered_is_never_re_armed():
    # Its answer not the thread's (not armed): the call ended through its
    # handler's coroutine, whose frames may still refer to it; every call is new.
    infer = Infer(arming=False)
    async with serving(infer) as (conn, client):
        outcome = response()
        calls = []
        for _ in range(3):
            stream_id, request, answer = await armed_call(infer, client)
            assert answer is None
            calls.append(infer.calls[-1][0])
            deferred_jobs().append(Report(request, outcome))
            request.respond(outcome)
            await client.until(lambda: client.ended(stream_id))  # noqa: B023
            assert conn.spare_call is None
        assert len({id(call) for call in calls}) == 3


async def test_a_read_that_sweeps_the_threads_reports_puts_the_servers_tick_off():
    """The connection tells the server's tick (reportsweep.py) of each read that
    swept the reports the thread left: each next call's read, after the thread
    wrote the last one's answer and left its report (none before the first)."""

    class Tick:
        swept_reads = 0

        def swept(self) -> None:
            self.swept_reads += 1

    infer, tick = Infer(), Tick()
    async with serving(infer, report_sweep=tick) as (conn, client):
        outcome = response()
        for index in range(3):
            stream_id, request, answer = await armed_call(infer, client)
            assert tick.swept_reads == index
            assert answer is not None and await thread_write(request, answer, outcome)
            await client.until(lambda sid=stream_id: client.ended(sid))
            deferred_jobs().append(Report(request, outcome))  # swept by the next read
