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
order, ARM (Graviton, Grace) and POWER do not, so there a reader could see a
slot's number before its body. A message is therefore read only once the
reader has taken its doorbell's ring: the writer stores the slot, then rings
(``write`` on the eventfd: the kernel adds to the counter under its lock,
whose release orders every store the writer made before it); the reader's
``read`` takes that lock (an acquire) before it returns the counter, so every
store made before the ring is visible to the loads that follow it, on any CPU.
This is the order Triton's queues get from their semaphores: ``Push`` posts
``sem_full`` after the message is in place and ``Pop`` waits on it before it
reads (python_backend message_queue.h:105-137, :192-212; boost's
interprocess semaphores are atomics with acquire and release). A posted
message rings with 1 and every other ring (:meth:`Lane.ring`,
:meth:`Lane.ring_self`) with ``1 << 32``, so the counter the reader takes says
how many messages' rings it took (never more than :data:`SLOTS` at a time:
the low half never carries). A reader that finds the number it expects in the
slot before it took that many rings (it polled: the server between its own
work, the stub when it replied) takes the ring first: the server with a
non-blocking ``read`` of its doorbell (the ring is almost always there: the
writer stores the number and rings right after), the stub by its usual
blocking wait, which then returns at once. Neither side makes more syscalls
than it did: the ring a polling reader used to leave in the counter woke it
for nothing later. The number in the slot is only the cheap check that a
message may be there; a number seen early or half stored costs a look at the
doorbell, never a message read before its body.
"""

from __future__ import annotations

import marshal
import mmap
import os
import sys

import trio

# Bytes of each slot: an execute of a dynamic batch of small requests (tensors
# of up to 1 KiB ride inside it) fits many times over.
SLOT_SIZE = 256 * 1024
# Slots each way: the execute the stub runs and the one posted behind it (pages
# of a slot are only touched as far as its messages reach).
SLOTS = 2
# A slot's fields: the message number, then the body's length.
_NUMBER, _LENGTH, _BODY = 0, 8, 16
_TO_STUB, _TO_SERVER = 0, SLOTS * SLOT_SIZE
_SIZE = 2 * SLOTS * SLOT_SIZE
# An eventfd's counter is a native-endian u64: a posted message adds 1 to it,
# any other ring 1 << 32 (the module's docstring, "Ordering").
_POSTED = (1).to_bytes(8, sys.byteorder)
_NUDGE = (1 << 32).to_bytes(8, sys.byteorder)
_POSTS = (1 << 32) - 1


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
        # The server's doorbell is non-blocking (its waits are Trio's): a poll
        # that found a message takes its ring without blocking; the stub's main
        # thread blocks on its own.
        self._polls_bell = server
        self._ring = os.write  # the doorbell's syscall (a test orders stores around it)
        self._written = 0  # messages this side posted
        self._read = 0  # messages of the peer this side took
        self._rung = 0  # rings of the peer's messages this side took from its doorbell
        self._closed = False

    @classmethod
    def create(cls) -> Lane:
        memory = os.memfd_create("trionserve-python-stub-lane", os.MFD_CLOEXEC)
        os.ftruncate(memory, _SIZE)
        to_stub = os.eventfd(0, os.EFD_CLOEXEC)
        to_server = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
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
        memory[at + _LENGTH : at + _BODY] = length.to_bytes(8, "little")
        memory[at + _BODY : at + _BODY + length] = body
        # Last: on a CPU that keeps stores in order a polling reader then rarely
        # finds the number before the ring (the ring, not this, publishes it).
        memory[at : at + 8] = number.to_bytes(8, "little")
        self._written = number
        self._ring(self._bell_out, _POSTED)
        return True

    def ring(self) -> None:
        """Ring the peer's doorbell with nothing new in the slots (a message that
        went on the socket instead)."""
        self._ring(self._bell_out, _NUDGE)

    def ring_self(self) -> None:
        """Ring this side's own doorbell (another thread has queued work, or the
        server's waiter must look again); nothing once closed."""
        if not self._closed:
            self._ring(self._bell_in, _NUDGE)

    # -- reading -----------------------------------------------------------------

    def take(self) -> tuple | None:
        """The peer's next message, if it is there and its ring was taken (then
        it is taken); Unreadable (and taken) if it does not decode."""
        number = self._read + 1
        memory, at = self._map, self._in + (number % SLOTS) * SLOT_SIZE
        if int.from_bytes(memory[at : at + 8], "little") != number:
            return None
        if self._rung < number and not self._heard_now():
            return None  # not ordered yet: the caller waits on the doorbell
        length = int.from_bytes(memory[at + _LENGTH : at + _BODY], "little")
        body = memory[at + _BODY : at + _BODY + length]
        self._read = number
        try:
            return decode(body)
        except (EOFError, ValueError, TypeError) as exc:
            raise Unreadable(f"message {number} on the lane ({length} bytes): {exc}") from None

    def _heard_now(self) -> bool:
        """Take the doorbell's rings without blocking (the server's side); whether
        the next message's ring was among them."""
        if not self._polls_bell:
            return False
        try:
            self._heard(os.read(self._bell_in, 8))
        except BlockingIOError:
            return False
        return self._rung > self._read

    def _heard(self, counter: bytes) -> None:
        self._rung += int.from_bytes(counter, sys.byteorder) & _POSTS

    def wait_blocking(self) -> None:
        """Block until this side's doorbell rings (the stub's main thread)."""
        self._heard(os.read(self._bell_in, 8))

    async def wait(self) -> None:
        """Wait in Trio until this side's doorbell rings (the server). Only the
        task that reads replies waits here, one at a time."""
        await trio.lowlevel.wait_readable(self._bell_in)
        try:
            self._heard(os.read(self._bell_in, 8))
        except BlockingIOError:
            pass  # taken meanwhile by a poll (take): the caller looks again

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
