"""The per-call path between the server and a stub: a few message slots each
way in shared memory and an eventfd doorbell each way.

Triton's python_backend moves an execute the same way: the model instance's
thread pushes the request batch onto the stub's message queue in shared memory
and waits for the stub's answer on the parent's queue itself, each queue woken
by its semaphore (python_be.cc ModelInstanceState::ProcessRequests,
message_queue.h: a queue of ``shm-message-queue-size`` entries). Logs, response
senders, BLS and the rest travel on queues of their own. Here the rest travels
on the stub's Unix socket (:mod:`.wire`), which also carries start-up, the
arenas' descriptors and liveness (a dead stub closes it); only the executes and
their replies take the lane:

- ``execute`` (server to stub) and ``executed`` (stub to server) are written into
  the writer's next slot as a fixed header (``number``, ``length``) and a body of
  positional tuples (:func:`encode`: marshal of tuples and scalars, no dicts);
  ``number`` counts the writer's messages on the lane (1, 2, ...), so the reader
  knows the next one by the number it expects in the slot it reads next;
- the writer rings the reader's doorbell (an ``eventfd``) after each message:
  the stub's main thread blocks in ``read`` on its own, the server waits for its
  own in Trio;
- each direction has :data:`SLOTS` slots, used in turn: the server has at most
  that many executes unanswered (its instance posts the next batch while the
  stub still runs one, so that a busy stub finds it waiting instead of
  sleeping), and the stub writes a reply only for an execute it took, so
  neither side overwrites a message the other has not read. A message too
  large for a slot goes on the socket.

**Ordering.** Python has no memory fences, and a CPU may make another CPU see
one process's stores in another order than they were made: x86 keeps stores in
order, ARM (Graviton, Grace) and POWER do not, so there a reader polling a
slot could see its number before its length and body, and read the slot's
previous message or a cut body. Triton's queues get their order from their
semaphores: ``Push`` puts the message in place and then posts ``sem_full``,
``Pop`` waits on it before it reads (python_backend message_queue.h:105-137,
:192-212; boost's interprocess semaphores are atomics with acquire and
release). Here the doorbell orders what a reader reads after waiting on it:
the writer rings after its stores (``write`` on the eventfd: the kernel adds
to the counter under the eventfd's lock, whose release orders every store
made before it), and the reader's ``read`` takes that lock before it returns,
so the loads after it see the whole message, on any CPU. A reader that polls
(the server between its other work, the stub when it replied and looks for
the execute posted behind) has no syscall to order its loads, so each slot
also carries a checksum, which the writer stores with the length and body and
the reader checks against its copy: ``crc32`` of the body, seeded with the
message's number. A copy that does not match is a message not yet visible
whole: the reader takes nothing and waits on its doorbell, whose ring comes
after the stores (and then the copy matches). The seed makes the slot's
previous message (another number) fail the check whatever was seen of it; a
cut body passes it only if it collides with the message's crc32 (one chance
in 2**32, on a CPU that let the reader see the number first in the moment
between the writer's stores). Taking the ring of every message instead (a
non-blocking ``read`` of the doorbell for a message found by polling) was
measured first: about one more syscall per request on the server, whose
doorbell reads the lane otherwise coalesces (``stub_call`` at c=16: 0.85-1.0
reads per request against 0.03-0.08). The checksum costs about 1,600
instructions, 0.2-0.3 µs, per message (writer and reader together) for the
``simple`` model's 300-byte messages, and zlib's speed, about 1.6 GB/s, for
larger ones.
"""

from __future__ import annotations

import marshal
import mmap
import os
import struct
import sys
import zlib

# Bytes of each slot: an execute of a dynamic batch of small requests (tensors
# of up to 1 KiB ride inside it) fits many times over.
SLOT_SIZE = 256 * 1024
# Slots each way: the execute the stub runs and the one posted behind it (pages
# of a slot are only touched as far as its messages reach).
SLOTS = 2
# A slot's fields: the message number, the body's length and checksum (32
# bits each, :data:`_HEAD`), then the body.
_NUMBER, _HEAD_AT, _BODY = 0, 8, 16
_HEAD = struct.Struct("<II")
_SEED = 0xFFFFFFFF  # the number's low 32 bits seed the checksum
_TO_STUB, _TO_SERVER = 0, SLOTS * SLOT_SIZE
_SIZE = 2 * SLOTS * SLOT_SIZE
_RING = (1).to_bytes(8, sys.byteorder)  # an eventfd's counter is a native u64


# marshal's format 2: no back-references (format 3 and later look every object
# up in a table of those already written, which costs a third of the time of
# these small messages of tuples, scalars and short bytes on both sides).
_MARSHAL_VERSION = 2


def encode(message: tuple) -> bytes:
    return marshal.dumps(message, _MARSHAL_VERSION)


def decode(body: bytes) -> tuple:
    return marshal.loads(body)


class Unreadable(Exception):
    """A message taken from the lane did not decode: the lane to that stub
    cannot be trusted any more (its server kills the stub, see PythonInstance)."""


class Lane:
    """One side of a stub's lane: its slots' mapping and the two doorbells.

    The server creates the lane (:meth:`create`) and passes its three
    descriptors to the stub (:meth:`descriptors`), which opens its side with
    :meth:`open`.
    """

    def __init__(self, memory_fd: int, to_stub: int, to_server: int, server: bool) -> None:
        self._fds = (memory_fd, to_stub, to_server)
        self._map = mmap.mmap(memory_fd, _SIZE)
        self._out, self._in = (_TO_STUB, _TO_SERVER) if server else (_TO_SERVER, _TO_STUB)
        self._bell_out, self._bell_in = (to_stub, to_server) if server else (to_server, to_stub)
        self._ring = os.write  # the doorbell's syscall (a test orders stores around it)
        self._written = 0  # messages this side posted
        self._read = 0  # messages of the peer this side took
        self._closed = False

    @classmethod
    def create(cls) -> Lane:
        memory = os.memfd_create("trionserve-python-stub-lane", os.MFD_CLOEXEC)
        os.ftruncate(memory, _SIZE)
        to_stub = os.eventfd(0, os.EFD_CLOEXEC)
        to_server = os.eventfd(0, os.EFD_CLOEXEC)
        return cls(memory, to_stub, to_server, server=True)

    @classmethod
    def open(cls, argument: str) -> Lane:
        """The stub's side, from the argument :meth:`argument` made."""
        memory, to_stub, to_server = (int(fd) for fd in argument.split(","))
        return cls(memory, to_stub, to_server, server=False)

    def descriptors(self) -> tuple[int, int, int]:
        return self._fds

    def argument(self) -> str:
        return ",".join(str(fd) for fd in self._fds)

    # -- writing -----------------------------------------------------------------

    def post(self, body: bytes) -> bool:
        """Write a message into this side's next slot and ring the peer; False
        (and nothing written) when it does not fit. The caller knows the slot is
        free (see the module's docstring)."""
        length = len(body)
        if length > SLOT_SIZE - _BODY:
            return False
        number = self._written + 1
        memory, at = self._map, self._out + (number % SLOTS) * SLOT_SIZE
        check = zlib.crc32(body, number & _SEED)
        memory[at + _HEAD_AT : at + _BODY] = _HEAD.pack(length, check)
        memory[at + _BODY : at + _BODY + length] = body
        # Last: a reader that sees the number before the rest fails the checksum.
        memory[at : at + 8] = number.to_bytes(8, "little")
        self._written = number
        self._ring(self._bell_out, _RING)
        return True

    def ring(self) -> None:
        """Ring the peer's doorbell with nothing new in the slots (a message that
        went on the socket instead)."""
        self._ring(self._bell_out, _RING)

    def ring_self(self) -> None:
        """Ring this side's own doorbell (another thread has queued work, or the
        server's waiter must look again); nothing once closed."""
        if not self._closed:
            self._ring(self._bell_in, _RING)

    # -- reading -----------------------------------------------------------------

    def take(self) -> tuple | None:
        """The peer's next message, if it is there whole (then it is taken);
        Unreadable (and taken) if it does not decode."""
        number = self._read + 1
        memory, at = self._map, self._in + (number % SLOTS) * SLOT_SIZE
        if int.from_bytes(memory[at : at + 8], "little") != number:
            return None
        length, check = _HEAD.unpack(memory[at + _HEAD_AT : at + _BODY])
        body = memory[at + _BODY : at + _BODY + min(length, SLOT_SIZE - _BODY)]
        if zlib.crc32(body, number & _SEED) != check:
            return None  # not visible whole yet: its ring comes after it is
        self._read = number
        try:
            return decode(body)
        except (EOFError, ValueError, TypeError) as exc:
            raise Unreadable(f"message {number} on the lane ({length} bytes): {exc}") from None

    def wait_blocking(self) -> None:
        """Block until this side's doorbell rings (the stub's main thread)."""
        os.read(self._bell_in, 8)

    async def wait(self) -> None:
        """Wait in Trio until this side's doorbell rings (the server). Only the
        task that reads replies waits here, one at a time."""
        # Imported here: the stub, which imports this module, never runs Trio, and
        # importing it costs each stub process's start about 0.2 s of CPU.
        import trio

        await trio.lowlevel.wait_readable(self._bell_in)
        os.read(self._bell_in, 8)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._map.close()
        except BufferError:  # pragma: no cover - nothing keeps views of the slots
            pass
        for fd in self._fds:
            os.close(fd)
