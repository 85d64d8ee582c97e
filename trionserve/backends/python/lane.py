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
- the writer rings the reader's doorbell (an ``eventfd``): the stub's main thread
  blocks in ``read`` on its own, the server waits for its own in Trio;
- each direction has :data:`SLOTS` slots, used in turn: the server has at most
  that many executes unanswered (its instance posts the next batch while the
  stub still runs one, so that a busy stub finds it waiting instead of
  sleeping), and the stub writes a reply only for an execute it took, so
  neither side overwrites a message the other has not read. A message too
  large for a slot goes on the socket.

A slot is a message number and a body length (8 bytes each), then the body.
The writer stores a number of 0, then the length and the body, and the number
last; a reader that finds the number it expects reads the
length and the body, and checks the number again after copying the body out,
so a message is read whole or not at all. The number is the one field whose
store publishes a message: it is never stored together with the length, since
a store of several bytes may be seen half done (CPython's ``struct.pack_into``
zero-fills its whole range before it writes the fields, so a header of number
and length packed in one call showed the number with a length of 0 for an
instant: a reader polling the slot then read an empty or cut body, and the
undecodable reply failed the model). A number read half stored is
never the one expected: it only goes from 0 to the message's number, and a
value with some of that number's non-zero bytes still 0 is smaller.
"""

from __future__ import annotations

import marshal
import mmap
import os

import trio

# Bytes of each slot: an execute of a dynamic batch of small requests (tensors
# of up to 1 KiB ride inside it) fits many times over.
SLOT_SIZE = 256 * 1024
# Slots each way: the execute the stub runs and the one posted behind it (pages
# of a slot are only touched as far as its messages reach).
SLOTS = 2
# A slot's fields: the message number (0: being written), then the body's length.
_NUMBER, _LENGTH, _BODY = 0, 8, 16
_UNWRITTEN = bytes(8)
_TO_STUB, _TO_SERVER = 0, SLOTS * SLOT_SIZE
_SIZE = 2 * SLOTS * SLOT_SIZE
_RING = (1).to_bytes(8, "little")


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
        memory[at : at + 8] = _UNWRITTEN
        memory[at + _LENGTH : at + _BODY] = length.to_bytes(8, "little")
        memory[at + _BODY : at + _BODY + length] = body
        # Last and alone: the message is there once its number is (the docstring).
        memory[at : at + 8] = number.to_bytes(8, "little")
        self._written = number
        os.write(self._bell_out, _RING)
        return True

    def ring(self) -> None:
        """Ring the peer's doorbell with nothing new in the slots (a message that
        went on the socket instead)."""
        os.write(self._bell_out, _RING)

    def ring_self(self) -> None:
        """Ring this side's own doorbell (another thread has queued work, or the
        server's waiter must look again); nothing once closed."""
        if not self._closed:
            os.write(self._bell_in, _RING)

    # -- reading -----------------------------------------------------------------

    def take(self) -> tuple | None:
        """The peer's next message, if it is there whole (then it is taken);
        Unreadable (and taken) if it does not decode."""
        number = self._read + 1
        memory, at = self._map, self._in + (number % SLOTS) * SLOT_SIZE
        if int.from_bytes(memory[at : at + 8], "little") != number:
            return None
        length = int.from_bytes(memory[at + _LENGTH : at + _BODY], "little")
        body = memory[at + _BODY : at + _BODY + length]
        if int.from_bytes(memory[at : at + 8], "little") != number:
            return None  # overwritten while read: not the message expected
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
