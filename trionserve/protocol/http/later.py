"""A repeated infer request's binary tensors read by the instance's thread, not the loop.

At c=1 the event loop reads a client's next request whole in one ``readv`` (head and body, see
:meth:`~trionserve.protocol.http.h1.H1Connection.take_again`), which costs it the kernel's copy
of the body: ~100 µs of a 602 KB request's ~580 (issue 39). Nothing on the loop reads the binary
tensors' bytes (the codec makes views of the body's buffer), so where the whole request is already
in the socket the loop reads only the head and the JSON header (:func:`read_again`), and the
thread that runs the request's batch reads the rest into the body's buffer before the backend
runs (:meth:`LaterBody.take`, one ``readv`` with the GIL released: the bytes are there, the socket
is non-blocking).

Only where nothing reads the inputs' bytes before the instance's thread (:func:`on_thread`): a
request decoded from its header's plan (every input binary, none BYTES, no shared memory) whose
answer the thread may write, of a model without the response cache, sequence batching or
ensemble scheduling, every instance of it a blocking one run by its instance's thread (ONNX
Runtime, PyTorch, TensorRT; not a Python model, in process or in its stub, whose inputs are read
on the loop) and a body over what a batch run inline on the loop may hold. Anywhere else the loop
reads the rest at once (:meth:`LaterBody.now`), before anything reads the body.

What holds (the mechanism is :mod:`trionserve.protocol.later`'s, shared with gRPC):

- One reader. The body's rest is read exactly once, into the request's own buffer, under
  :class:`LaterBody`'s lock, by the instance's thread before the batch runs or by the loop when
  the request settles without it (failed, rejected, cancelled, timed out, dropped from its batch,
  or a connection that ends): :meth:`LaterBody.settle`, before the connection reads anything more.
  Either way the buffer holds the request's bytes before anyone uses them.
- The connection reads nothing more on its socket while the rest is there: its wait for the
  client's next request (the answer's wait) sets ``SO_RCVLOWAT`` to one byte past the rest, so
  that the rest does not wake it, and the reader sets it back to one as it takes the rest (Linux
  wakes a waiter then if bytes beyond it came). The client's end wakes it whatever the mark.
- A read that fails (the connection reset) fails that request only, with a clear error, and the
  connection closes after its answer (:attr:`LaterBody.broken`).
- The body counts in the client budget from its head to its answer, as any body does.
"""

from __future__ import annotations

import fcntl
import os
import termios
from typing import TYPE_CHECKING

import trio

from trionserve.actors.executor import INLINE_MAX_INPUT_BYTES
from trionserve.protocol.http.state import Server
from trionserve.protocol.later import LaterBody, hung_up, on_thread, queued

if TYPE_CHECKING:
    from trionserve.protocol.http.h1 import H1Connection
    from trionserve.protocol.http.h1_request import LastHead

__all__ = ["LaterBody", "hung_up", "on_thread", "queued", "read_again"]

_FIONREAD, _INQ = termios.FIONREAD, bytes(4)


def read_again(
    later: LaterBody, h1: H1Connection, last: LastHead, head: memoryview, body: memoryview
) -> int | None:
    """Read a request expected to repeat ``last`` (the buffers of
    :meth:`~trionserve.protocol.http.h1.H1Connection.again_buffers`) without its binary tensors
    where the socket holds all of them: the bytes read, the rest counted as read and offered to
    ``later``; else what one ``readv`` read, as that method's caller reads it (None: nothing)."""
    at = last.tensors_at
    fd = later.fd
    try:
        received = os.readv(fd, (head, body[:at]))
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(exc) from exc
    if received < len(head) + at:
        return received
    rest = body[at:]
    size = len(rest)
    if (
        head == last.raw
        and h1.state.server is Server.IDLE
        and last.head_size <= h1.max_header_size
        and int.from_bytes(fcntl.ioctl(fd, _FIONREAD, _INQ), "little") >= size  # (queued)
    ):
        later.view, later.broken = rest, None  # (offer)
        return received + size
    try:
        more = os.readv(fd, (rest,))
    except BlockingIOError:
        more = 0
    except OSError as exc:
        raise trio.BrokenResourceError(exc) from exc
    return received + more


def deferrable(last: LastHead) -> bool:
    """Whether a request made from ``last`` has binary tensors worth leaving to the thread: more
    than a batch run inline on the loop may hold (so no batch of it runs there)."""
    return 0 < last.tensors_at and last.length - last.tensors_at > INLINE_MAX_INPUT_BYTES
