"""The stub lane (backends/python/lane.py): the execute path's slots in shared
memory and their doorbells, between two ends in one process."""

from __future__ import annotations

import os
import threading

import pytest
import trio

from trionserve.backends.python.lane import SLOT_SIZE, SLOTS, Lane, encode


@pytest.fixture
def ends():
    server = Lane.create()
    # The stub's end opens duplicates, as a child process gets its own descriptors.
    stub = Lane.open(",".join(str(os.dup(fd)) for fd in server.descriptors()))
    yield server, stub
    server.close()
    stub.close()


def test_a_message_crosses_each_way_under_its_number(ends):
    server, stub = ends
    assert stub.take() is None  # nothing posted yet
    execute = (7, 3, [], [(1, "id", 0, 0, "{}", [], ["OUTPUT0"], False)])
    assert server.post(encode(execute))
    assert stub.take() is None  # not before its ring was taken (the ordering)
    stub.wait_blocking()  # the server rang
    assert stub.take() == execute
    assert stub.take() is None  # taken once
    reply = (7, 0, [], None, [], [([], None, "{}")])
    assert stub.post(encode(reply))
    # Each side reads the other's slots only: the server's own execute is not a
    # reply. The server takes the ring itself (its doorbell does not block).
    assert server.take() == reply
    assert server.take() is None


def test_messages_posted_ahead_are_taken_in_order_from_the_slots_in_turn(ends):
    server, stub = ends
    for round_ in range(3):  # past the end of the slots and round again
        numbers = [round_ * SLOTS + n for n in range(SLOTS)]
        for n in numbers:  # the server posts a batch behind the one running
            assert server.post(encode((n,)))
        stub.wait_blocking()  # both rings at once
        assert [stub.take() for _ in numbers] == [(n,) for n in numbers]
        assert stub.take() is None
        for n in numbers:
            assert stub.post(encode((n, "done")))
        assert [server.take() for _ in numbers] == [(n, "done") for n in numbers]
        assert server.take() is None


def test_a_message_being_written_is_not_read(ends):
    server, stub = ends
    server.post(encode((3,)))
    stub.wait_blocking()
    at = (1 % SLOTS) * SLOT_SIZE  # the server's first message's slot
    server._map[at : at + 8] = (0).to_bytes(8, "little")  # its header while it writes
    assert stub.take() is None
    server._map[at : at + 8] = (1).to_bytes(8, "little")  # written
    assert stub.take() == (3,)


def test_a_message_too_large_for_the_slot_is_refused_and_nothing_changes(ends):
    server, stub = ends
    assert not server.post(b"x" * SLOT_SIZE)
    # the doorbell did not ring for the refused one, and no number was used
    os.set_blocking(stub._bell_in, False)
    with pytest.raises(BlockingIOError):
        stub.wait_blocking()
    assert server.post(encode((1, "small")))
    os.set_blocking(stub._bell_in, True)
    stub.wait_blocking()
    assert stub.take() == (1, "small")


def test_the_server_waits_for_its_doorbell_in_trio(ends):
    server, stub = ends

    async def main():
        assert server.take() is None  # nothing posted yet
        thread = threading.Thread(target=lambda: stub.post(encode((9, "done"))))
        thread.start()
        with trio.fail_after(5):
            await server.wait()
        thread.join()
        assert server.take() == (9, "done")

    trio.run(main)


def test_ringing_its_own_doorbell_wakes_the_stub(ends):
    _, stub = ends
    stub.ring_self()  # the reader thread queued an execute that came on the socket
    stub.wait_blocking()
    assert stub.take() is None  # nothing on the lane


def test_a_ring_for_no_message_does_not_count_as_a_message_ring(ends):
    """Rings that carry no message (the stub's reply went on the socket; a wake
    of one's own waiter) never let a reader trust a slot whose ring it has not
    taken."""
    server, stub = ends
    stub.ring()  # a reply sent on the socket
    server.ring_self()  # the instance wakes its own waiter
    at = SLOTS * SLOT_SIZE + (1 % SLOTS) * SLOT_SIZE  # the stub's first reply's slot
    server._map[at : at + 8] = (1).to_bytes(8, "little")  # its number seen early
    assert server.take() is None  # both rings taken: neither was this message's
    server._map[at : at + 8] = bytes(8)
    assert stub.post(encode(("whole",)))
    assert server.take() == ("whole",)


def _delivered(reader: Lane) -> tuple | None:
    """What ``reader`` takes once the writer has rung, as each side does: the
    stub blocks on its doorbell first, the server takes the ring in ``take``."""
    if not reader._polls_bell:
        reader.wait_blocking()
    return reader.take()


class TornMemory:
    """A lane's memory in which every store is seen half done: a slice store
    zero-fills its range, then writes it one byte at a time (as CPython's
    ``struct.pack_into`` does), and ``between`` runs at every step, where a
    reader polling the slots on another CPU could look."""

    def __init__(self, real, between):
        self.data = bytearray(real[:])
        self.between = between

    def __getitem__(self, key):
        return bytes(self.data[key])

    def __setitem__(self, key, value):
        start, stop, _ = key.indices(len(self.data))
        self.data[start:stop] = bytes(stop - start)
        self.between()
        for offset, byte in enumerate(bytes(value)):
            self.data[start + offset] = byte
            self.between()


@pytest.mark.parametrize("direction", ["execute", "reply"])
def test_a_message_is_never_seen_before_its_length_and_body_are_whole(ends, direction):
    """A reader polling a slot at any instant of a post gets nothing or the
    whole message: never an empty or cut body (a server that read the reply
    ``executed`` as an empty body raised EOFError and failed the model, which
    answered 503 'has no available versions' until reloaded)."""
    server, stub = ends
    writer, reader = (server, stub) if direction == "execute" else (stub, server)
    seen: list[tuple] = []

    def look() -> None:
        message = reader.take()  # raises on a body read before it was whole
        if message is not None:
            seen.append(message)

    real = server._map, stub._map
    memory = TornMemory(writer._map, look)
    writer._map = reader._map = memory
    try:
        # Past the end of the slots twice: each slot is written over a message
        # already taken, with longer and shorter bodies.
        messages = [(n, "x" * (40 * n % 97), [1.5, None]) for n in range(1, 2 * SLOTS + 2)]
        for message in messages:
            assert writer.post(encode(message))
            assert seen == [], "read while it was written"
            assert _delivered(reader) == message
    finally:
        server._map, stub._map = real


class ReorderedMemory:
    """A lane's memory as a weakly ordered CPU (ARM, POWER) may show it to the
    reader: the writer's store of a slot's number is seen at once, its other
    stores (the length, the body) only when the writer's doorbell syscall
    orders them (``publish``, called by the writer's ring). Until then the
    reader sees what the slot held before: a message taken long ago, or zeros."""

    def __init__(self, real):
        self.data = bytearray(real[:])
        self.pending: list[tuple[slice, bytes]] = []

    def __getitem__(self, key):
        return bytes(self.data[key])

    def __setitem__(self, key, value):
        if (key.start % SLOT_SIZE, key.stop - key.start) == (0, 8):
            self.data[key] = value  # a slot's number: overtakes the stores before it
        else:
            self.pending.append((key, bytes(value)))

    def publish(self):
        for key, value in self.pending:
            self.data[key] = value
        self.pending.clear()


@pytest.mark.parametrize("direction", ["execute", "reply"])
def test_a_message_is_not_read_before_its_ring_orders_it(ends, direction):
    """On a CPU that lets the reader see a slot's number before its body, a
    reader that polls the slot between the writer's stores and its ring gets
    nothing (not the slot's previous message, nor a cut body); once the ring
    is taken it gets the message whole."""
    server, stub = ends
    writer, reader = (server, stub) if direction == "execute" else (stub, server)
    memory = ReorderedMemory(writer._map)
    real = server._map, stub._map
    polled: list[tuple | None] = []

    def ring(fd: int, counter: bytes) -> int:
        polled.append(reader.take())  # the number is there, the body is not
        memory.publish()  # the syscall orders the writer's stores (a release)
        return os.write(fd, counter)

    writer._map = reader._map = memory
    writer._ring = ring
    try:
        # Round the slots three times: each later message is written over one
        # taken before, with longer and shorter bodies.
        messages = [(n, "y" * (53 * n % 89), {"k": n}) for n in range(1, 3 * SLOTS + 2)]
        for message in messages:
            assert writer.post(encode(message))
            assert polled[-1] is None, f"read {polled[-1]!r} before its ring"
            assert _delivered(reader) == message
        assert len(polled) == len(messages)
    finally:
        server._map, stub._map = real
