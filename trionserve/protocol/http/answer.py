"""An infer request's answer written by the instance's thread that computed it.

At c=1 the event loop used to wake twice per request: for the request, and for
the instance thread's report, after which it encoded and wrote the answer; each
wake-up from a sleep of a few milliseconds costs about 0.2 ms of cold caches on
a small machine (benchmarks/README.md, issue 39's third and fourth rounds). An
HTTP/1.1 connection on a plain socket *arms* a :class:`ConnectionAnswer` for
its infer request when nothing else has to happen between the backend's
response and its encoding (no compression, tracing, access log,
classification, shared memory, first-response histogram). The instance's
thread, once the batch is done and nothing else waits for the instance,
encodes the answer and writes it with one non-blocking write
(:meth:`ConnectionAnswer.write`), and leaves its report to the loop's next sweep
(:class:`~trionserve.backends.instance_thread.Deferred`). The connection's task
meanwhile waits for its socket, not for the outcome (:meth:`ConnectionAnswer.wait`):
the client's next request wakes it, it sweeps the deferred reports (statistics,
in-flight counts, the request's outcome) and goes on to read that request. One
wake-up of the loop per request.

What holds:

- The thread writes only while the answer is armed, under the answer's lock;
  the loop disarms it under the same lock before it touches the connection
  itself (the outcome came another way, the socket became readable: pipelined
  bytes or the client's end, the task cancelled), so the two never write to the
  connection at once, and a pipelined request is answered in its turn.
- A write the socket does not take whole (the send buffer full, the client
  gone) leaves the rest (:attr:`ConnectionAnswer.rest`) to the loop, which the
  thread wakes at once; so does an answer the thread declines (over 64 KB, or an
  encoding that raised: the loop encodes it again and answers its error).
- An outcome the loop delivers while the connection's task waits (the thread
  declined: requests waiting for the instance, a model without a dynamic
  batcher, a Python stub's reply) is answered by the loop the same way, as it
  delivers it (:meth:`ConnectionAnswer.finalized`), and the wait goes on until
  the client's next request: ending it with ``notify_closing`` for the
  connection's task to answer cost a wake-up, two exceptions and three
  ``epoll_ctl`` (the registration dropped, then made again for the next read).
- The request gets its one final outcome from the executor's report either way
  (deferred or not), and is counted in flight until then: the HTTP server's
  tick (every 0.25 s) sweeps, so a drain never waits for a client's next request.
- The loop settles an answer the thread is still writing (WRITING: its bytes
  made, the protocol's state moved, the connection kept) without waiting for
  that write, when the client's bytes ended the wait (:meth:`ConnectionAnswer.settle`):
  at c=1 the client's next request wakes the loop before the thread has the GIL
  back to mark its write done, and waiting for it on the answer's lock cost the
  loop two switches (39% of settles under load). Only the socket stays the
  thread's until its write returns (the thread holds the lock through it): the
  connection's task collects it (:meth:`ConnectionAnswer.collect`: the rest a
  full socket left written first) before it writes anything itself or waits
  for more of the client's bytes, and waits for it before the socket closes
  (:meth:`ConnectionAnswer.release`); the thread's next write declines while
  such a rest waits. Who settles a write in progress is decided once, by
  whichever of the two first takes that write's ``_claim`` (a non-blocking
  acquire, atomic); the loop that took it makes the next write a new one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

import trio

from trionserve.core.deferred import Deferred, deferred_jobs, sweep_deferred
from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.core.outputs import Described
from trionserve.protocol.http.h1 import H1Connection, Response
from trionserve.protocol.http.later import LaterBody
from trionserve.protocol.sockets import send_all

if TYPE_CHECKING:
    from trionserve.lifecycle import Lifecycle

# States of a connection's answer.
IDLE = 0  # no request armed
ARMED = 1  # the instance's thread may write the answer
WRITTEN = 2  # the thread wrote it whole (``kept``: the connection is kept)
PARTIAL = 3  # the thread began it: the loop writes ``rest`` (the protocol's state moved on)
DISARMED = 4  # the loop answers
WRITING = 5  # the thread writes it (holding the lock)

# Answers larger than this are left to the loop (written gathered from the
# tensors' buffers and counted in the client budget there).
THREAD_ANSWER_MAX_BYTES = 64 * 1024

# The answer of the connection whose task runs the handler (set by the
# transport for a plain socket, None otherwise).
CONNECTION_ANSWER: ContextVar[ConnectionAnswer | None] = ContextVar(
    "trionserve_http_answer", default=None
)

# What the infer handler returns for an answer the thread wrote (or began):
# the transport finishes it (:meth:`ConnectionAnswer.settle`'s state).
ANSWERED_BODY: list[bytes] = []
ANSWERED: Response = (200, [], ANSWERED_BODY)

# What the infer handler returns for a request it armed and began, not waited for
# (``DataPlane.begin``; the answer's ``carrier`` and ``run`` set): the connection's
# task waits for it in its own frame, then carries the handler on (:class:`Carrier`).
BEGUN_BODY: list[bytes] = []
BEGUN: Response = (200, [], BEGUN_BODY)

# Encodes an infer request's response: (status, headers, body chunks).
Encode = Callable[[InferenceResponse, InferenceRequest, bool], Response]


class Carrier(Protocol):
    """The handler that armed and began a request (``run``, its data plane's
    lifecycle) and returned BEGUN instead of waiting for its outcome: the
    connection's task waits on the answer (:meth:`ConnectionAnswer.wait`, while
    the request is not ``done``), then carries the handler on with exactly one of
    :meth:`carry_on` (the outcome is in), :meth:`finish` (it is not: awaited),
    :meth:`failed` (the wait raised an Exception) or :meth:`drop` (cancelled). Each
    ends the request at the data plane and settles the answer. At c=1 the
    connection's task so resumes two frames of its own at the client's next
    request, not six."""

    def carry_on(self, answer: ConnectionAnswer, run: Lifecycle, binary_output: bool) -> Response:
        """The answer (ANSWERED: the thread wrote it), the request ``done``."""

    async def finish(
        self, answer: ConnectionAnswer, run: Lifecycle, binary_output: bool
    ) -> Response: ...

    def failed(self, answer: ConnectionAnswer, run: Lifecycle, exc: Exception) -> Response: ...

    def drop(self, answer: ConnectionAnswer, run: Lifecycle) -> None: ...


class ConnectionAnswer:
    """One HTTP/1.1 connection's answer to the infer request it handles, which
    the instance's thread may write (see the module docstring). The loop arms it
    (:meth:`arm`), waits (:meth:`wait`), and once the request's outcome is in
    learns who answered (:meth:`settle`); the thread writes (:meth:`write`)."""

    __slots__ = (
        "_binary_output",
        "_claim",
        "_deferred",
        "carrier",
        "run",
        "run_binary_output",
        "_draining",
        "_encode",
        "_h1",
        "_lingers",
        "_lock",
        "_owed",
        "_stolen",
        "_repeat",
        "_request",
        "_ended",
        "_waiting",
        "kept",
        "later",
        "owing",
        "readable",
        "rest",
        "socket",
        "state",
        "unsent",
        "watched",
    )

    def __init__(
        self,
        h1: H1Connection,
        socket: trio.socket.SocketType,
        draining: Callable[[], bool],
    ) -> None:
        self._h1 = h1
        self.socket = socket
        self._draining = draining
        # Whether the slow-request watcher holds the socket (set by transport.py's
        # watch_peer): then the wait may not wait on it too.
        self.watched = False
        self._lock = threading.Lock()  # the thread holds it through its write
        # Taken by whichever of the loop and the thread first settles a write in
        # progress (see the module docstring).
        self._claim = threading.Lock()
        # On the Trio thread: the loop settled the thread's write in progress
        # (stolen: the socket is the thread's until it returns) ...
        self._stolen = False
        # ... and what that write left (its thread's: ``(rest or None,)``) ...
        self._owed: tuple[memoryview | None] | None = None
        # ... is the loop's to write first (unsent), before anything of its own:
        # ``owing`` while either is to be seen to (:meth:`collect`).
        self.unsent: memoryview | None = None
        self.owing = False
        self.state = IDLE
        self.kept = False
        # The wait ended on the socket readable: the next read need not wait.
        self.readable = False
        self.rest: memoryview | None = None
        # The request's binary tensors left in the socket for the instance's thread (later.py).
        self.later = LaterBody(socket)
        self._request: InferenceRequest | None = None
        self._encode: Encode | None = None
        self._binary_output = False
        self._waiting = False  # the connection's task waits on the socket
        self._ended = False  # ... and the outcome ended that wait (_end)
        # Waiting on with its outcome delivered (see finalized).
        self._lingers = False
        # The run's deferred reports, which the wait sweeps (found by the first arm).
        self._deferred: Deferred | None = None
        # The last answer the thread wrote whole, to write one described the same.
        self._repeat: Repeat | None = None
        # A request its handler began and returned BEGUN for, and the handler (the
        # transport takes them: see Carrier).
        self.carrier: Carrier | None = None
        self.run: Lifecycle | None = None
        self.run_binary_output = False

    @classmethod
    def of(
        cls,
        h1: H1Connection,
        stream: trio.abc.Stream,
        draining: Callable[[], bool],
    ) -> ConnectionAnswer | None:
        """The answer of a connection on a plain socket (None under TLS or on a
        stream without a socket of its own: the loop answers there)."""
        if isinstance(stream, trio.SocketStream):
            return cls(h1, stream.socket, draining)
        return None

    # -- on the Trio thread --------------------------------------------------------

    def arm(self, request: InferenceRequest, encode: Encode, binary_output: bool) -> None:
        """Let the thread that computes ``request`` write its answer, encoded by
        ``encode``; before the request is submitted."""
        self._request = request
        self._encode = encode
        self._binary_output = binary_output
        self.rest = None
        self.state = ARMED
        request.answer = self
        if self._deferred is None:
            self._deferred = deferred_jobs()

    @property
    def armed(self) -> bool:
        return self.state == ARMED

    async def wait(self) -> None:
        """Wait, while armed, for the socket to be readable or the request's
        outcome to come (``finalized``), whichever first. Readable: the client's
        next request after the thread's answer (the deferred reports are swept,
        which gives the request its outcome), or bytes before it (pipelined) or
        the client's end: disarmed, the loop answers. An answer the thread took
        before this wait began (a fast model) has its job deferred already:
        swept now, not left for the tick. A request slow to reach its wait (its
        model loaded on demand, a long admission) may have the slow-request
        watcher on the socket already: disarmed, the loop answers (one task
        waits on a socket at a time)."""
        state = self.state
        if state == ARMED and self.watched:
            self._disarm()
            state = self.state
        if state != ARMED:
            if state != DISARMED:  # the thread took it first: its job is deferred
                deferred = self._deferred  # (sweep_deferred: the run's, found as armed)
                assert deferred is not None
                deferred.sweep()
            return
        # The outcome ends the wait with notify_closing (_end), not a cancel
        # scope: entering and leaving one costs more than the rest of the wait
        # (py-spy, issue 39's fifth round), and most waits end readable.
        self._waiting = True
        self._ended = False
        try:
            await trio.lowlevel.wait_readable(self.later.fd)  # (the socket's: no fileno() call)
        except trio.ClosedResourceError:
            if not self._ended:  # (the socket is closing: not the outcome)
                self._disarm()
                raise
        except BaseException:
            self._disarm()
            raise
        finally:
            self._waiting = False
            if self._lingers:
                self._lingers = False
                lingering().discard(self)
        if self._ended:
            return  # the outcome came
        self.readable = True
        if self.state == ARMED:  # (the thread did not take it: the loop answers)
            self._disarm()
        deferred = self._deferred  # (sweep_deferred: the run's, found as armed)
        assert deferred is not None
        deferred.sweep()

    @property
    def waiting(self) -> bool:
        """Whether the connection's task waits on the socket (no other task may)."""
        return self._waiting

    def _end(self) -> None:
        """End the wait (the outcome came): its socket's waiters are woken with
        ClosedResourceError, the socket itself untouched (the next wait on it
        registers it again)."""
        self._ended = True
        trio.lowlevel.notify_closing(self.socket)

    def finalized(self) -> None:
        """The request's final outcome was delivered (on the Trio thread, by
        the executor's report or the stub's reply) while the connection's task
        waits on its socket: an answer still armed is written here, as the
        instance's thread would have (:meth:`write`), if the outcome is one
        response. Written whole (here or by the thread), the wait goes on: the
        client's next request (or its end) ends it, as it would end the wait
        for that request that follows: the connection's task wakes once, not
        twice (its wait ended by ``notify_closing``, then another registered
        for the next request: two or three ``epoll_ctl`` and two exceptions);
        the HTTP server's tick ends the waits left so (:func:`sweep`: a
        drain, an unload, a client that sends nothing more). Otherwise (an
        error, an answer declined or begun, the server draining) the wait
        ends and the connection's task answers."""
        if not self._waiting or self._ended:
            return
        if self._draining():
            self._end()
            return
        request = self._request
        if self.state == ARMED and request is not None:
            response = request.lone_response
            if response is not None:
                self.write(request, response)
        if self.state == WRITTEN:
            self._lingers = True
            lingering().add(self)
            return
        self._end()

    async def finish(self, stream: trio.abc.SendStream) -> bool:
        """After the handler returned ANSWERED, in the connection's task: whether
        the connection is kept; the rest of an answer the thread began is
        written here first."""
        rest, self.rest = self.rest, None
        if rest is not None:
            await send_all(stream, rest)
        return self.kept

    def settle(self) -> int:
        """Once the request's outcome is in: WRITTEN, PARTIAL (the loop writes
        ``rest``) or DISARMED (the loop answers); the
        request lets go of the answer. A write the thread has in progress, the
        client's bytes having ended the wait, is WRITTEN here without waiting
        for it (``owing``: see :meth:`collect`)."""
        state = self.state
        if state == IDLE:  # settled already (the thread never leaves IDLE)
            return DISARMED
        if self._stolen:  # (the last request's: its wait let the thread end it)
            self._resolve()
        if state == WRITING and self.readable and self.kept and not self._draining():
            claim = self._claim
            if claim.acquire(False):
                if self.state == WRITING:  # (taken first: the thread leaves the state alone)
                    self._claim = threading.Lock()  # (the next write's)
                    self._stolen = self.owing = True
                    state = WRITTEN
                else:  # (the thread ended its write between the two reads)
                    claim.release()
                    state = self.state
        if state != WRITTEN:  # (written whole: the thread is done with it)
            with self._lock:  # waits for a write in progress on the thread
                state = self.state
                if state == ARMED:
                    state = DISARMED
        self.state = IDLE
        request, self._request, self._encode = self._request, None, None
        if request is not None:
            request.answer = None
        return state

    async def collect(self, stream: trio.abc.SendStream) -> None:
        """Before the connection's task writes anything itself or waits for the
        client's bytes (``owing``): the write the loop settled in progress has
        returned, and what the socket did not take of it is written now, first.
        At c=1 the next request's settle sees to it (its wait let the thread end
        that write long before); a pipelined request whose answer the thread
        declined for it has that rest written before its own."""
        if self._stolen:
            self._resolve()
        self.owing = False
        unsent, self.unsent = self.unsent, None
        if unsent is not None:
            await send_all(stream, unsent)

    def release(self) -> None:
        """:meth:`collect` without the writing: before the socket closes,
        whatever happens, a write the loop settled in progress has returned."""
        if self._stolen:
            self._resolve()
        self.owing = False
        self.unsent = None

    def _resolve(self) -> None:
        """The write the loop settled in progress has returned (waited for, if
        not yet: the thread holds the lock through it); what it left is
        ``unsent``."""
        self._stolen = False
        owed = self._owed
        if owed is None:
            with self._lock:
                owed = self._owed
        self._owed = None
        self.unsent = None if owed is None else owed[0]  # (None: the write raised)
        self.owing = self.unsent is not None

    def _disarm(self) -> None:
        if self.state == ARMED:  # (once the thread took it, never armed again)
            with self._lock:
                if self.state == ARMED:
                    self.state = DISARMED

    # -- on the instance's thread ------------------------------------------------------

    def write(self, request: InferenceRequest, response: InferenceResponse) -> bool:
        """Encode and write ``request``'s answer, if still armed for it: True
        when the socket took it whole; False leaves it (or its ``rest``) to the
        loop. An answer described as the connection's last one (:class:`Repeat`)
        is that one's head and the outputs' arrays in one ``writev``, the
        protocol moved in one step, no encoder called."""
        with self._lock:
            # (The loop may have answered it and armed the next request's.)
            if self.state != ARMED or self._request is not request:
                return False
            owed = self._owed
            if self.unsent is not None or (owed is not None and owed[0] is not None):
                self.state = DISARMED  # (an earlier write's rest: the loop's to write first)
                return False
            repeat = self._repeat
            if (
                repeat is not None
                and repeat.encode is self._encode
                and repeat.binary_output == self._binary_output
            ):
                try:
                    pieces = repeat.pieces(request, response)
                except Exception:  # (not arrays: encoded as any)
                    pieces = None
                if pieces is not None and not self._draining() and self._h1.answer_kept():
                    self.kept = True
                    return self._send(pieces, repeat.size)
            encode = self._encode
            assert encode is not None
            try:
                status, headers, chunks = encode(response, request, self._binary_output)
                if not isinstance(chunks, list):
                    self.state = DISARMED
                    return False
                size = sum(len(chunk) for chunk in chunks)
                if size > THREAD_ANSWER_MAX_BYTES:
                    self.state = DISARMED
                    return False
                h1 = self._h1
                head = h1.start_response(status, headers, self._draining(), streamed=False)
            except Exception:
                self.state = DISARMED  # the loop encodes it again, and answers its error
                return False
            head_only = h1.head_only
            # The protocol's state moves on before the write, so that the thread
            # holds the GIL for as little as it can once the client has the answer
            # (the loop, woken by the client's next request, waits for it).
            self.kept = h1.end_response()
            if self.kept and status == 200 and not head_only:
                self._remember(request, response, head, chunks)
            if head_only or not size:
                return self._send([head], len(head))
            return self._send([head, *chunks], len(head) + size)

    def _remember(
        self, request: InferenceRequest, response: InferenceResponse, head: bytes, chunks: list
    ) -> None:
        """Keep the answer just made (``head``, then the encoder's ``chunks``) to
        write the next one described the same (:class:`Repeat`), if it is one."""
        repeat = self._repeat = Repeat.of(request, response, [head], chunks)
        if repeat is not None:
            repeat.encode = self._encode
            repeat.binary_output = self._binary_output

    def _send(self, pieces: list, size: int) -> bool:
        """Write the answer's ``pieces`` (``size`` bytes) with one ``writev``:
        WRITTEN, or PARTIAL with the ``rest`` left to the loop."""
        claim = self._claim  # (this write's: see settle)
        self.state = WRITING
        try:
            written = os.writev(self.socket.fileno(), pieces)
        except OSError:
            written = 0  # the loop's write raises what it means (a reset)
        whole = written == size
        rest = None if whole else memoryview(b"".join(pieces))[written:]
        if not claim.acquire(False):  # the loop settled it meanwhile (see _resolve)
            self._owed = (rest,)
            return whole
        if whole:
            self.state = WRITTEN
        else:
            self.rest = rest
            self.state = PARTIAL
        claim.release()  # (after the state: a settle that takes it then reads that)
        return whole


class Repeat(Described):
    """The connection's last answer written whole that kept it (see
    :class:`~trionserve.core.outputs.Described`), with its encoder and the
    request's binary default (an encoder is a function of the response and the
    request's id, requested outputs and binary default, ``Encode``): the same
    head (status line, headers, JSON header) before the same tensors' bytes."""

    __slots__ = ("binary_output", "encode")

    def __init__(
        self,
        request: InferenceRequest,
        response: InferenceResponse,
        heads: list,
        size: int,
    ) -> None:
        super().__init__(request, response, heads, size)
        self.encode: Encode | None = None
        self.binary_output = False


# The answers whose waits go on with their outcomes delivered (see finalized),
# of the current run.
_LINGERING: trio.lowlevel.RunVar[set[ConnectionAnswer]] = trio.lowlevel.RunVar(
    "trionserve_http_lingering"
)


def lingering() -> set[ConnectionAnswer]:
    """The current run's set of waits that go on with their outcomes delivered."""
    try:
        return _LINGERING.get()
    except LookupError:
        waits: set[ConnectionAnswer] = set()
        _LINGERING.set(waits)
        return waits


def sweep() -> None:
    """Deliver the deferred reports, then end every wait that goes on with its
    outcome delivered (on the Trio thread): the HTTP server's tick and its
    stop, so that a drain or an unload waits for no client."""
    sweep_deferred()
    try:
        waits = _LINGERING.get()
    except LookupError:
        return
    for answer in waits:
        answer._lingers = False
        if answer._waiting and not answer._ended:
            answer._end()
    waits.clear()


async def collect(answer: ConnectionAnswer | None, stream: trio.abc.SendStream) -> None:
    """:meth:`ConnectionAnswer.collect` of a connection's answer, if it has one."""
    if answer is not None and answer.owing:
        await answer.collect(stream)


def release(answer: ConnectionAnswer | None) -> None:
    """:meth:`ConnectionAnswer.release` of a connection's answer, if it has one."""
    if answer is not None and answer.owing:
        answer.release()


def waits(answer: ConnectionAnswer | None) -> bool:
    """Whether a connection's task waits on its socket for its answer (then no
    other task may wait on that socket: the slow-request watcher does not)."""
    return answer is not None and answer.waiting
