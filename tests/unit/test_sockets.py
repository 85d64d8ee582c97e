"""protocol.sockets: what the socket takes at once goes out without a checkpoint
(send_all, send_pieces gathered), the rest, and every failure, as the stream's
send_all; bytes already there are read without one (receive_into), and a reader
waiting for a whole body wakes once it is whole or the peer ends."""

from __future__ import annotations

import fcntl
import os
import struct
import termios
import threading
import time

import numpy as np
import pytest
import trio
import trio.testing

from trionserve.protocol import sockets
from trionserve.protocol.sockets import (
    EagerReceiver,
    receive_after_wait,
    receive_into,
    receive_now,
    receive_some_now,
    send_all,
    send_pieces,
    send_pieces_now,
)


def _stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    left, right = trio.socket.socketpair()
    return trio.SocketStream(left), trio.SocketStream(right)


async def _read(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some()
        assert chunk
        data += chunk
    return bytes(data)


async def test_a_small_answer_is_written_without_a_checkpoint():
    server, client = _stream_pair()
    with trio.testing.assert_no_checkpoints():
        await send_all(server, b"answer")
    assert await client.receive_some() == b"answer"


async def test_what_the_socket_does_not_take_at_once_follows_in_order():
    server, client = _stream_pair()
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB: past any socket buffer
    async with trio.open_nursery() as nursery:
        received: list[bytes] = []

        async def read() -> None:
            received.append(await _read(client, len(payload)))

        nursery.start_soon(read)
        await send_all(server, memoryview(payload))
    assert received == [payload]


async def test_a_stream_without_a_socket_of_its_own_sends_as_before():
    server, client = trio.testing.memory_stream_pair()
    with trio.testing.assert_checkpoints():
        await send_all(server, b"answer")
    assert await client.receive_some() == b"answer"


async def test_a_closed_or_abandoned_socket_raises_as_send_all_does():
    server, client = _stream_pair()
    await server.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await send_all(server, b"answer")
    server, client = _stream_pair()
    await client.aclose()
    with pytest.raises(trio.BrokenResourceError):
        await send_all(server, b"answer")


# -- receive_into / send_pieces ------------------------------------------------


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """A loopback TCP connection (SO_RCVLOWAT is TCP's: a socketpair ignores it)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    await listeners[0].aclose()
    return server, client


def _queued(stream: trio.SocketStream) -> int:
    """Bytes in the socket's receive queue (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(stream.socket.fileno(), termios.FIONREAD, b"\0" * 4))[0]


async def test_bytes_already_there_are_read_without_a_checkpoint():
    server, client = _stream_pair()
    await client.send_all(b"body")
    await trio.testing.wait_all_tasks_blocked()
    buffer = memoryview(bytearray(16))
    with trio.testing.assert_no_checkpoints():
        assert await receive_into(server, buffer, fill=True) == 4
    assert bytes(buffer[:4]) == b"body"


async def test_a_body_in_pieces_wakes_the_reader_once_it_is_whole():
    server, client = await _tcp_pair()
    buffer = memoryview(bytearray(300_000))
    reads: list[int] = []

    async def read() -> None:
        reads.append(await receive_into(server, buffer, fill=True))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        await client.send_all(b"a" * 100_000)
        # Loopback queues what is sent within the send; a pass of the run loop
        # (epoll) later the reader still sleeps though a third is there.
        assert _queued(server) == 100_000
        await trio.testing.wait_all_tasks_blocked()
        assert reads == []
        await client.send_all(b"b" * 200_000)
    assert reads == [300_000]
    assert bytes(buffer) == b"a" * 100_000 + b"b" * 200_000


async def test_a_reader_waiting_for_a_whole_body_sees_the_peer_end():
    server, client = await _tcp_pair()
    buffer = memoryview(bytearray(300_000))
    async with trio.open_nursery() as nursery:
        got: list[int] = []

        async def read() -> None:
            got.append(await receive_into(server, buffer, fill=True))
            got.append(await receive_into(server, buffer[got[0] :], fill=True))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        await client.send_all(b"x" * 1000)
        await client.aclose()
    assert got == [1000, 0]


async def test_bytes_below_the_mark_can_be_taken_without_waiting():
    server, client = await _tcp_pair()
    buffer = memoryview(bytearray(300_000))
    assert receive_now(server, buffer) is None
    await client.send_all(b"x" * 1000)
    assert _queued(server) == 1000  # loopback queues it within the send
    assert receive_now(server, buffer) == 1000


async def test_pieces_are_written_gathered_in_order_without_a_checkpoint():
    server, client = _stream_pair()
    pieces = [b"head|", memoryview(b"json|"), memoryview(bytearray(b"tensor"))]
    with trio.testing.assert_no_checkpoints():
        await send_pieces(server, pieces)
    assert await _read(client, 16) == b"head|json|tensor"


async def test_pieces_past_the_socket_buffer_follow_in_order():
    server, client = _stream_pair()
    tensor = np.arange(1_000_000, dtype=np.float32)  # 4 MB, a non-byte view
    pieces = [b"head", memoryview(tensor), b"", b"tail"]
    async with trio.open_nursery() as nursery:
        received: list[bytes] = []

        async def read() -> None:
            received.append(await _read(client, 8 + tensor.nbytes))

        nursery.start_soon(read)
        await send_pieces(server, pieces)
    assert received == [b"head" + tensor.tobytes() + b"tail"]


async def test_pieces_written_now_leave_what_the_socket_did_not_take_in_order():
    server, client = _stream_pair()
    small = [b"h", memoryview(b"ead|")] * 700  # past writev's 1024 pieces, all taken
    with trio.testing.assert_no_checkpoints():
        assert send_pieces_now(server.socket, small) == []
    assert await _read(client, 3500) == b"head|" * 700
    tensor = np.arange(1_000_000, dtype=np.float32)  # 4 MB: past the socket's buffer
    pieces = [b"head", memoryview(tensor), b"", b"tail"]
    with trio.testing.assert_no_checkpoints():
        rest = send_pieces_now(server.socket, pieces)
    whole = b"head" + tensor.tobytes() + b"tail"
    left = b"".join(bytes(view) for view in rest)
    assert 0 < len(left) < len(whole) and whole.endswith(left)
    assert await _read(client, len(whole) - len(left)) == whole[: -len(left)]
    await client.aclose()
    with pytest.raises(trio.BrokenResourceError):
        send_pieces_now(server.socket, [b"x" * 1_000_000, b"y"])
    await server.aclose()
    with pytest.raises(trio.ClosedResourceError):
        send_pieces_now(server.socket, [b"head"])


async def test_pieces_to_a_closed_or_abandoned_socket_raise_as_send_all_does():
    server, client = _stream_pair()
    await server.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await send_pieces(server, [b"head", b"body"])
    server, client = _stream_pair()
    await client.aclose()
    with pytest.raises(trio.BrokenResourceError):
        await send_pieces(server, [b"head", b"x" * 1_000_000])


async def test_a_read_after_a_wait_tries_no_read_before_the_bytes_come(monkeypatch):
    """The next request's read waits for readability first: no failed read (and
    no BlockingIOError) before the client sends; then what came, the peer's end
    as b"", and a closed socket as ClosedResourceError."""
    server, client = _stream_pair()
    reads: list[int] = []
    original = os.read

    def counted(fd: int, size: int) -> bytes:
        reads.append(fd)
        return original(fd, size)

    monkeypatch.setattr(os, "read", counted)
    async with trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def read() -> None:
            got.append(await receive_after_wait(server, 1024))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert reads == []  # waiting, not reading
        await client.send_all(b"POST / HTTP/1.1\r\n")
    assert got == [b"POST / HTTP/1.1\r\n"] and len(reads) == 1
    await client.send_eof()
    assert await receive_after_wait(server, 1024) == b""
    await server.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await receive_after_wait(server, 1024)


async def test_receive_some_now_reads_what_is_there_and_never_waits():
    server, client = _stream_pair()
    assert receive_some_now(server, 1024) is None  # nothing there: no wait
    await client.send_all(b"GET / HTTP/1.1\r\n\r\n")
    assert receive_some_now(server, 4) == b"GET "
    assert receive_some_now(server, 1024) == b"/ HTTP/1.1\r\n\r\n"
    await client.send_eof()
    assert receive_some_now(server, 1024) == b""  # the peer ended its side
    memory_server, _ = trio.testing.memory_stream_pair()
    assert receive_some_now(memory_server, 1024) is None  # no socket of its own
    await server.aclose()
    with pytest.raises(trio.ClosedResourceError):
        receive_some_now(server, 1024)


async def test_an_eager_receiver_reads_what_is_there_without_a_checkpoint_a_few_times():
    """Bytes already there: read at once, no checkpoint, at most eager_reads
    times in a row; the next read is a checkpoint (then eager again)."""
    server, client = _stream_pair()
    receiver = EagerReceiver(server, eager_reads=2)
    for _ in range(2):
        for part in (b"a", b"b"):
            await client.send_all(part)
            with trio.testing.assert_no_checkpoints():
                assert await receiver.receive_some(16) == part
        await client.send_all(b"c")
        with trio.testing.assert_checkpoints():
            assert await receiver.receive_some(16) == b"c"
    # Not eager (calls in flight): a checkpoint before every read.
    await client.send_all(b"d")
    with trio.testing.assert_checkpoints():
        assert await receiver.receive_some(16, eager=False) == b"d"


async def test_an_eager_receiver_waits_when_nothing_is_there_and_ends_as_receive_some():
    """No bytes: one failed read, then a wait (a checkpoint) until they come;
    the peer's end is b"", a closed stream ClosedResourceError."""
    server, client = _stream_pair()
    receiver = EagerReceiver(server)
    async with trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def read() -> None:
            got.append(await receiver.receive_some(1024))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        await client.send_all(b"frame")
    assert got == [b"frame"]
    await client.send_eof()
    assert await receiver.receive_some(1024) == b""
    await server.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await receiver.receive_some(1024)


async def test_an_eager_receiver_expecting_a_wait_reads_only_once_readable(monkeypatch):
    """expect_wait: no read before the socket is readable (none that finds
    nothing), a checkpoint even when bytes are there; then eager again."""
    server, client = _stream_pair()
    receiver = EagerReceiver(server, eager_reads=2)
    reads: list[int] = []
    real_read = os.read

    def counted(fd: int, size: int) -> bytes:
        reads.append(size)
        return real_read(fd, size)

    monkeypatch.setattr(os, "read", counted)
    async with trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def read() -> None:
            got.append(await receiver.receive_some(1024, expect_wait=True))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [] and reads == []
        await client.send_all(b"frame")
    assert got == [b"frame"] and reads == [1024]
    await client.send_all(b"more")
    with trio.testing.assert_checkpoints():
        assert await receiver.receive_some(16, expect_wait=True) == b"more"
    await client.send_all(b"eager")
    with trio.testing.assert_no_checkpoints():
        assert await receiver.receive_some(16) == b"eager"


async def test_an_eager_receiver_sees_a_cancellation_though_bytes_keep_coming():
    server, client = _stream_pair()
    receiver = EagerReceiver(server, eager_reads=3)
    await client.send_all(b"x" * 10)
    reads = 0
    with trio.CancelScope() as scope:
        scope.cancel()
        while True:
            await receiver.receive_some(1)
            reads += 1
    assert scope.cancelled_caught and reads == 3


async def test_an_eager_receiver_of_a_stream_without_a_socket_uses_its_receive_some():
    left, right = trio.testing.memory_stream_pair()
    receiver = EagerReceiver(right)
    await left.send_all(b"tls")
    assert await receiver.receive_some(16) == b"tls"


async def test_an_eager_receiver_reads_into_several_buffers_in_turn():
    """receive_into: one readv into the buffers in turn, what the socket holds
    now; with nothing there, one wait with SO_RCVLOWAT at ``least`` (the
    reader wakes once the socket holds that much); a stream without a socket
    of its own reads through receive_some into them the same way."""
    server, client = await _tcp_pair()
    receiver = EagerReceiver(server)
    buffers = [memoryview(bytearray(3)), memoryview(bytearray(2)), memoryview(bytearray(4))]
    await client.send_all(b"abcdef")
    assert await receiver.receive_into(buffers, 9) == 6
    assert [bytes(b) for b in buffers] == [b"abc", b"de", b"f\0\0\0"]
    async with trio.open_nursery() as nursery:
        got: list[int] = []

        async def read() -> None:
            got.append(await receiver.receive_into(buffers, 9))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        await client.send_all(b"1234")
        assert _queued(server) == 4
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # 4 of 9 bytes: still waiting
        await client.send_all(b"56789")
    assert got == [9] and b"".join(bytes(b) for b in buffers) == b"123456789"
    memory_server, memory_client = trio.testing.memory_stream_pair()
    await memory_client.send_all(b"xyzw")
    assert await EagerReceiver(memory_server).receive_into(buffers, 9) == 4
    assert [bytes(b) for b in buffers] == [b"xyz", b"w5", b"6789"]
    for stream in (server, client):
        await stream.aclose()


def _lowat(stream: trio.SocketStream) -> int:
    return stream.socket.getsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVLOWAT)


@pytest.mark.skipif(not sockets._WHOLE, reason="Linux: a lowered SO_RCVLOWAT signals at once")
async def test_a_whole_message_is_waited_for_once_and_a_shorter_one_is_woken_by_the_watch():
    """receive_whole: the wait ends once the socket holds the whole message (a
    message sent in two writes: no wake-up for the first), SO_RCVLOWAT left at
    its size for the next; a message shorter than predicted is not left
    waiting: the watch's next look wakes it for what the socket holds
    (``woken``: "held"), and one that held nothing for WATCH_IDLE looks is woken
    for any byte ("idle"). The watch here is looked at by the test, not by its
    thread."""
    server, client = await _tcp_pair()
    receiver = EagerReceiver(server)
    watch = receiver._watch = sockets._Watch()
    buffers = [memoryview(bytearray(10)), memoryview(bytearray(90_000))]
    got: list[int] = []

    async def read(size: int) -> None:
        got.append(await receiver.receive_whole(buffers, size))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, 90_010)
        await trio.testing.wait_all_tasks_blocked()
        await client.send_all(b"h" * 10 + b"a" * 50_000)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [] and list(watch.waiting) == [receiver]
        await client.send_all(b"b" * 40_000)
    assert got == [90_010] and receiver.woken is None and not watch.waiting
    assert bytes(buffers[1][-3:]) == b"bbb" and _lowat(server) == 90_010
    # Smaller than predicted: held until the watch looks, then read as it is.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, 90_010)
        await trio.testing.wait_all_tasks_blocked()
        await client.send_all(b"h" * 10 + b"c" * 1_000)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [90_010]
        watch.look()
    assert got[1:] == [1_010] and receiver.woken == "held" and _lowat(server) == 1
    # Nothing for WATCH_IDLE looks: any byte ends the wait.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, 90_010)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(sockets.WATCH_IDLE - 1):
            watch.look()
        assert list(watch.waiting) == [receiver] and _lowat(server) == 90_010
        watch.look()
        assert not watch.waiting and _lowat(server) == 1
        await client.send_all(b"x")
    assert got[2:] == [1] and receiver.woken == "idle"
    # lower(): the connection needs the peer's next bytes (hear), the same.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, 90_010)
        await trio.testing.wait_all_tasks_blocked()
        await client.send_all(b"y" * 5)
        await trio.testing.wait_all_tasks_blocked()
        receiver.lower()
    assert got[3:] == [5] and receiver.woken is None
    # Another wait on the socket sets its own SO_RCVLOWAT first.
    await client.send_all(b"z")
    assert await receiver.receive_into(buffers, 1) == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, 90_010)
        await trio.testing.wait_all_tasks_blocked()
        assert _lowat(server) == 90_010
        nursery.cancel_scope.cancel()
    assert not watch.waiting  # (a cancelled wait leaves the watch)

    async def some() -> None:
        got.append(len(await receiver.receive_some(16)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(some)
        await trio.testing.wait_all_tasks_blocked()
        assert _lowat(server) == 1
        await client.send_all(b"q")
    assert got[-1] == 1
    for stream in (server, client):
        await stream.aclose()


def test_the_watch_thread_sleeps_while_nothing_waits_and_wakes_for_a_wait():
    """The watch's thread: idle after WATCH_IDLE looks with no wait (no look
    until one is added), looking again once a wait wakes it."""
    watch = sockets._Watch()
    watch.looks = sockets.WATCH_IDLE  # (as many looks found no wait)
    thread = threading.Thread(target=watch._run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not watch.idle:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    looks = watch.looks
    time.sleep(3 * sockets.WATCH_SECS)
    assert watch.looks == looks  # asleep
    waiter = _Waiter()
    watch.waiting[waiter] = watch.looks  # type: ignore[index]
    watch.wake()
    while not waiter.lowered:  # (it holds bytes: woken at the next look)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert watch.looks > looks and not watch.waiting


class _Waiter:
    woken = None
    lowered = False

    def holds(self) -> bool:
        return True

    def lower(self) -> None:
        self.lowered = True


def test_a_forked_child_starts_its_own_watch(monkeypatch):
    """After a fork the child has no watch thread: the next wait starts one
    (os.register_at_fork runs _forget in the child). A kernel before 4.18 (no
    signal when SO_RCVLOWAT is lowered) is told apart."""
    monkeypatch.setattr(sockets._Watch, "_current", sockets._Watch())
    lock = sockets._Watch._starting
    monkeypatch.setattr(sockets._Watch, "_starting", lock)
    sockets._Watch._forget()
    assert sockets._Watch._current is None and sockets._Watch._starting is not lock
    for release, newer in (("4.17.3", False), ("4.18.0-1", True), ("6.1.0", True), ("x", False)):
        monkeypatch.setattr(os, "uname", lambda r=release: os.uname_result(("", "", r, "", "")))
        assert sockets.kernel_at_least(4, 18) is newer
