"""protocol.sockets.send_all: what the socket takes at once goes out without a
checkpoint; the rest, and every failure, through the stream's send_all."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trionserve.protocol.sockets import send_all


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
