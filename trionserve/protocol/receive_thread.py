"""Large request bodies received by a thread of their listener, off the event loop.

Issue 39's item 4, its first option: the rest of a large body of declared length (HTTP's
Content-Length, its rest past ``--http-receive-thread-bytes``) is read by a thread of the
listener (:class:`ReceiveThread`), not by the event loop. The connection's task hands the thread
the socket and the part of the body's buffer still empty (one ``eventfd`` write) and waits for
the job's own ``eventfd`` to be readable (Trio's ``wait_readable``: one wake-up and one task step
when the body is in). The thread waits on all its sockets at once (``poll``, ``SO_RCVLOWAT`` set
to what each buffer still lacks: one wake-up for a body that arrives in pieces) and reads each
straight into its buffer (``readv``, the GIL released: the kernel's copy of the body is the
thread's CPU, not the loop's).

What it keeps:

- Exactly one outcome: each job is given back once (:meth:`ReceiveThread._finish`), whole or
  with what came and why it stopped. A task cancelled while it waits tells the thread to let go
  and waits for that (shielded: the thread answers at once) before the cancellation goes on, so
  no thread reads into a buffer, or polls a descriptor, that its connection let go. A thread
  that fails (a bug) gives back what it holds as failed reads, and the loop reads every body
  after it.
- Bounded: at most ``max_jobs`` bodies at once (a body past it is read by the loop as before);
  the bodies' bytes count in the server's client budget from their heads, as before.
- The body's timeout: no byte of it for ``timeout`` seconds ends it (the caller answers 408).

Off by default: measured against the loop-only path in benchmarks/README.md ("The loop off the
critical path", issue 39's thirteenth round).
"""

from __future__ import annotations

import os
import select
import socket as _socket
import threading
import time
from typing import TYPE_CHECKING, Any

import structlog
import trio

from trionserve.protocol.http.h1 import ProtocolError

if TYPE_CHECKING:
    from trionserve.protocol.http.h1 import H1Connection, RequestBody
    from trionserve.protocol.http.h1_request import Request

__all__ = ["ReceiveThread", "Received", "body_end"]

log = structlog.get_logger(__name__)

_LOWAT = getattr(_socket, "SO_RCVLOWAT", None)
_POLLIN = select.POLLIN | select.POLLERR | select.POLLHUP
_EFD = os.EFD_NONBLOCK | os.EFD_CLOEXEC


class Received:
    """One body's rest handed to the thread, and how it came back: ``size`` bytes read into
    ``buffer``; ``ended`` the peer ended its side; ``error`` the read failed; ``late`` no byte
    came for the timeout; ``cancelled`` the task stopped waiting."""

    __slots__ = (
        "buffer",
        "cancelled",
        "deadline",
        "ended",
        "error",
        "back",
        "fd",
        "late",
        "size",
        "socket",
        "timeout",
    )

    def __init__(self, socket: Any, buffer: memoryview, timeout: float) -> None:
        self.socket = socket
        self.fd = socket.fileno()
        self.buffer = buffer
        self.timeout = timeout
        self.deadline = 0.0
        self.size = 0
        self.back = -1
        self.ended = self.late = self.cancelled = False
        self.error: OSError | None = None


class ReceiveThread:
    """The thread of one listener that receives large bodies (see the module docstring);
    started and stopped by the listener's :meth:`run`, under Trio."""

    def __init__(self, min_bytes: int, max_jobs: int = 64) -> None:
        self.min_bytes = min_bytes
        self.max_jobs = max_jobs
        self.active = 0  # jobs handed over and not given back (the loop's count)
        self.bodies = 0  # jobs handed over in all
        self._new: list[Received] = []  # handed over, not yet taken by the thread
        self._wake = os.eventfd(0, _EFD)
        self._free: list[int] = []  # eventfds a job's end is told by, kept for the next
        self._stopping = False
        self._lock = threading.Lock()  # the hand-over of new jobs, and the thread's failure
        self.failed = False  # the thread failed: the loop reads every body

    def takes(self, rest: memoryview | None, stream: object) -> bool:
        """Whether a body's empty ``rest`` (None: not a declared body's) read from ``stream``
        goes to the thread: large enough, a socket of its own (not TLS), room for a job."""
        return (
            rest is not None
            and len(rest) >= self.min_bytes
            and self.active < self.max_jobs
            and not self.failed
            and getattr(stream, "socket", None) is not None
        )

    async def run(self) -> None:
        """The thread, from its start until this task is cancelled (the listener's end:
        no job is left then, each connection waits for its own)."""
        thread = threading.Thread(target=self._loop, name="trionserve receive", daemon=True)
        thread.start()
        try:
            await trio.sleep_forever()
        finally:
            self._stopping = True
            os.eventfd_write(self._wake, 1)
            thread.join()
            for fd in [self._wake, *self._free]:
                os.close(fd)

    async def receive(self, stream: Any, buffer: memoryview | None, timeout: float) -> Received:
        """``buffer`` filled by the thread from ``stream``'s socket (see :class:`Received` for
        how it may stop short). Raises Cancelled, once the thread let go, when cancelled."""
        assert buffer is not None  # (takes said so)
        job = Received(stream.socket, buffer, timeout)
        self.active += 1
        self.bodies += 1
        job.back = self._free.pop() if self._free else os.eventfd(0, _EFD)
        with self._lock:
            if self.failed:  # (takes said no since; one that came between fails as a read)
                job.error = OSError("the receive thread failed")
                os.eventfd_write(job.back, 1)
            else:
                self._new.append(job)
        os.eventfd_write(self._wake, 1)
        try:
            await trio.lowlevel.wait_readable(job.back)
        except BaseException:
            job.cancelled = True
            os.eventfd_write(self._wake, 1)
            with trio.CancelScope(shield=True):
                await trio.lowlevel.wait_readable(job.back)  # the thread lets go at once
            raise
        finally:
            self.active -= 1
            try:
                os.eventfd_read(job.back)
            except BlockingIOError:
                pass  # (interrupted before it was given back: the thread may still tell it)
            else:
                self._free.append(job.back)
        return job

    # -- the thread -----------------------------------------------------------

    def _loop(self) -> None:
        jobs: dict[int, Received] = {}
        try:
            self._serve(jobs)
        except BaseException:  # a bug: every body it holds fails (the loop reads the next ones)
            log.exception("the receive thread failed")
            with self._lock:
                self.failed = True
                held = [*jobs.values(), *self._new]
                self._new.clear()
            for job in held:
                job.error = OSError("the receive thread failed")
                os.eventfd_write(job.back, 1)

    def _serve(self, jobs: dict[int, Received]) -> None:
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        while not self._stopping:
            wait = None
            if jobs:
                first = min(job.deadline for job in jobs.values())
                wait = max(0, int((first - time.monotonic()) * 1000) + 1)
            events = poller.poll(wait)
            now = time.monotonic()
            for fd, _ in events:
                if fd == self._wake:
                    os.eventfd_read(self._wake)
                    with self._lock:
                        new = [*self._new]
                        self._new.clear()
                    for job in new:
                        job.deadline = now + job.timeout
                        jobs[job.fd] = job
                        self._read(job, now)  # (bytes there: no wait)
                        if not self._done(job, poller, jobs):
                            _set_lowat(job.socket, len(job.buffer) - job.size)
                            poller.register(job.fd, _POLLIN)
                    for job in [job for job in jobs.values() if job.cancelled]:
                        self._finish(job, poller, jobs)
                elif (ready := jobs.get(fd)) is not None:
                    self._read(ready, now)
                    if not self._done(ready, poller, jobs):
                        _set_lowat(ready.socket, len(ready.buffer) - ready.size)
            for job in [job for job in jobs.values() if job.deadline <= now]:
                job.late = True
                self._finish(job, poller, jobs)

    @staticmethod
    def _read(job: Received, now: float) -> None:
        try:
            size = os.readv(job.fd, (job.buffer[job.size :],))
        except BlockingIOError:
            return
        except OSError as exc:
            job.error = exc
            return
        if size:
            job.size += size
            job.deadline = now + job.timeout
        else:
            job.ended = True

    def _done(self, job: Received, poller: select.poll, jobs: dict[int, Received]) -> bool:
        if job.size < len(job.buffer) and not job.ended and job.error is None:
            return False
        self._finish(job, poller, jobs)
        return True

    def _finish(self, job: Received, poller: select.poll, jobs: dict[int, Received]) -> None:
        """Give ``job`` back to its task: once (it leaves ``jobs``)."""
        if jobs.pop(job.fd, None) is None:
            return
        try:
            poller.unregister(job.fd)
        except KeyError:
            pass  # (given back before it waited)
        _set_lowat(job.socket, 1)
        os.eventfd_write(job.back, 1)


def body_end(h1: H1Connection, request: Request, received: Received) -> RequestBody:
    """The whole body of an HTTP ``request`` whose rest the thread ``received``; raises as the
    loop's read does: PeerGone (the client ended), BrokenResourceError (the read failed), 408 (no
    byte for the timeout)."""
    if received.size:
        h1.body_received(request, received.size)
    if not request.complete:
        if received.error is not None:
            raise trio.BrokenResourceError(received.error) from received.error
        if received.late:
            raise ProtocolError(
                408,
                f"the request body stopped arriving: no byte of it for {received.timeout:g} s "
                "(--http-header-timeout)",
            )
        h1.body_received(request, 0)  # (the client ended: raises PeerGone)
    return h1.body(request)


def _set_lowat(socket: Any, size: int) -> None:
    if _LOWAT is None:
        return
    try:
        socket.setsockopt(_socket.SOL_SOCKET, _LOWAT, max(1, size))
    except OSError:
        pass  # closed or failed: the read that follows says so
