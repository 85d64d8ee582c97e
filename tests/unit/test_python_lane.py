"""The stub lane (backends/python/lane.py): the execute path's slots in shared
memory and their doorbells, between two ends in one process."""

from __future__ import annotations

import os
import threading

import pytest
import trio

from tests.helpers import printed_by_new_interpreter
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
    stub.wait_blocking()  # the server rang
    assert stub.take() == execute
    assert stub.take() is None  # taken once
    reply = (7, 0, [], None, [], [([], None, "{}")])
    assert stub.post(encode(reply))
    # Each side reads the other's slots only: the server's own execute is not a reply.
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


def _delivered(reader: Lane) -> tuple | None:
    """What ``reader`` takes once the writer has rung and it waited."""
    os.read(reader._bell_in, 8)
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
        assert seen == messages
    finally:
        server._map, stub._map = real


class ReorderedMemory:
    """A lane's memory as a weakly ordered CPU (ARM, POWER) may show it to the
    reader: the writer's store of a slot's number is seen at once, and so are
    the stores of the fields named in ``early`` (``head``: length and
    checksum; ``body``); the others only when the writer's doorbell syscall
    orders them (``publish``, called by the writer's ring). Until then the
    reader sees what the slot held before: a message taken long ago, or zeros."""

    def __init__(self, real, early: tuple[str, ...]):
        self.data = bytearray(real[:])
        self.early = early
        self.pending: list[tuple[slice, bytes]] = []

    def _field(self, start: int, size: int) -> str:
        offset = start % SLOT_SIZE
        return "number" if offset == 0 and size == 8 else "head" if offset == 8 else "body"

    def __getitem__(self, key):
        return bytes(self.data[key])

    def __setitem__(self, key, value):
        field = self._field(key.start, key.stop - key.start)
        if field == "number" or field in self.early:
            self.data[key] = value  # overtakes the stores made before it
        else:
            self.pending.append((key, bytes(value)))

    def publish(self):
        for key, value in self.pending:
            self.data[key] = value
        self.pending.clear()


@pytest.mark.parametrize("early", [(), ("head",), ("body",)])
@pytest.mark.parametrize("direction", ["execute", "reply"])
def test_a_message_seen_before_it_is_whole_is_not_read(ends, direction, early):
    """On a CPU that lets the reader see a slot's number before its length,
    checksum or body, a reader that polls the slot between the writer's stores
    and its ring gets nothing (not the slot's previous message, nor a cut
    body); after the ring it gets the message whole."""
    server, stub = ends
    writer, reader = (server, stub) if direction == "execute" else (stub, server)
    memory = ReorderedMemory(writer._map, early)
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


def test_a_stub_process_imports_no_trio():
    """The stub's modules (this one among them) leave Trio to the server: importing it
    would cost every stub process's start about 0.2 s of CPU."""
    code = "import sys, trionserve.backends.python.stub; print('trio' in sys.modules)"
    out = printed_by_new_interpreter(code)
    assert out.split() == ["False"], out
