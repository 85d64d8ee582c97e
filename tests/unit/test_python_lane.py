"""The stub lane (backends/python/lane.py): the execute path's slots in shared
memory and their doorbells, between two ends in one process."""

from __future__ import annotations

import os
import threading

import pytest
import trio

from trionserve.backends.python.lane import SLOT_SIZE, Lane, encode


@pytest.fixture
def ends():
    server = Lane.create()
    # The stub's end opens duplicates, as a child process gets its own descriptors.
    stub = Lane.open(",".join(str(os.dup(fd)) for fd in server.descriptors()))
    yield server, stub
    server.close()
    stub.close()


def test_a_message_crosses_each_way_under_its_sequence(ends):
    server, stub = ends
    assert stub.sequence() == 0 and stub.take(1) is None  # nothing posted yet
    execute = (7, 3, [], [(1, "id", 0, 0, "{}", [], ["OUTPUT0"], False)])
    assert server.post(7, encode(execute))
    stub.wait_blocking()  # the server rang
    assert stub.sequence() == 7
    assert stub.take(6) is None  # not the message asked for
    assert stub.take(7) == execute
    reply = (7, 0, [], None, [], [([], None, "{}")])
    assert stub.post(7, encode(reply))
    assert server.take(7) == reply
    # Each side reads the other's slot only: the server's own execute is not a reply.
    assert server.sequence() == 7 and stub.sequence() == 7


def test_a_message_being_written_is_not_read(ends):
    server, stub = ends
    server.post(3, encode((3,)))
    server._map[0:8] = (0).to_bytes(8, "little")  # the writer's header while it writes
    assert stub.sequence() == 0 and stub.take(3) is None


def test_a_message_too_large_for_the_slot_is_refused_and_nothing_changes(ends):
    server, stub = ends
    assert server.post(1, encode((1, "small")))
    stub.wait_blocking()
    assert not server.post(2, b"x" * SLOT_SIZE)
    assert stub.take(1) == (1, "small")  # the slot still holds the last message
    # and the doorbell did not ring for the refused one
    os.set_blocking(stub._bell_in, False)
    with pytest.raises(BlockingIOError):
        stub.wait_blocking()


def test_the_server_waits_for_its_doorbell_in_trio(ends):
    server, stub = ends

    async def main():
        assert server.take(9) is None  # nothing posted yet
        thread = threading.Thread(target=lambda: stub.post(9, encode((9, "done"))))
        thread.start()
        with trio.fail_after(5):
            await server.wait()
        thread.join()
        assert server.take(9) == (9, "done")

    trio.run(main)


def test_ringing_its_own_doorbell_wakes_the_stub(ends):
    _, stub = ends
    stub.ring_self()  # the reader thread queued an execute that came on the socket
    stub.wait_blocking()
    assert stub.sequence() == 0  # nothing on the lane
