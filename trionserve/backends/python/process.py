"""One stub process as the server sees it: start it, talk to it, stop it.

A :class:`StubProcess` is a child Python process running :mod:`.stub`, one end of a
Unix socket pair, and the two shared-memory arenas (the server's, which the stub
reads; and a view of the stub's). Its blocking methods run in worker threads
(start-up, auto-complete, finalize); while an instance serves, the same socket is
used from the Trio loop through :class:`TrioChannel`.

Stubs run with ``PYTHONDONTWRITEBYTECODE=1``, so importing ``model.py`` never
writes into the model repository, and with ``-P``, so the server's working
directory is not on their import path.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

import structlog
import trio

import trionserve
from trionserve.backends.python.control import ModelControl
from trionserve.backends.python.environment import package_shim
from trionserve.backends.python.lane import Lane
from trionserve.backends.python.settings import StubSettings
from trionserve.backends.python.shm import Arena, ArenaView
from trionserve.backends.python.wire import (
    ANCILLARY_SIZE,
    RECEIVE_SIZE,
    BlockingChannel,
    Endpoint,
    ancillary_for,
    fds_from_ancillary,
)
from trionserve.core.errors import TritonError, Unavailable
from trionserve.observability.custom_metrics import CustomMetrics

log = structlog.get_logger(__name__)

# The stub's bootstrap: find trionserve even when it runs from a source checkout.
_PACKAGE_ROOT = str(Path(trionserve.__file__).resolve().parent.parent)
_BOOT = (
    "import sys; sys.path.append(sys.argv.pop(2)); "
    "from trionserve.backends.python.stub import main; main()"
)
# The first argument names the process as Triton's stub binary is named, so that
# tools finding stubs by name (pgrep -f triton_python_backend_stub, as Triton's
# qa/L0_backend_python does) find these; the instance's name comes last, as in
# Triton's stub command line (stub_launcher.cc).
STUB_PROCESS_NAME = "triton_python_backend_stub"

# How long a stub that was asked to stop may take to exit before it is killed.
EXIT_GRACE_SECONDS = 5.0


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with code {returncode}"


def log_stub_line(label: str, level: str, message: str) -> None:
    """A ``pb_utils.Logger`` line from a stub, in the server's log."""
    method = {"WARNING": log.warning, "ERROR": log.error, "VERBOSE": log.debug}.get(level, log.info)
    method(message, source=label)


class StubProcess:
    """A started stub process; ``label`` names the model and instance in errors."""

    def __init__(
        self,
        label: str,
        settings: StubSettings,
        control: ModelControl | None = None,
        name: str = "",
        *,
        metrics: CustomMetrics,
    ) -> None:
        self.label = label
        self.settings = settings
        # Answers the model loading API (pb_utils.load_model & co), if offered.
        self.control = control
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The execute path (see .lane); the socket carries the rest.
        self.lane = Lane.create()
        environment = settings.environment
        command = [
            sys.executable if environment is None else str(environment.python),
            "-P",
            "-c",
            _BOOT,
            STUB_PROCESS_NAME,
            _PACKAGE_ROOT if environment is None else package_shim(),
            str(child.fileno()),
            str(settings.shm_default_byte_size),
            str(settings.shm_growth_byte_size),
            self.lane.argument(),
            name,
        ]
        # No bytecode written next to model.py; print() in a model shows at once.
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
        if environment is not None:
            env = environment.variables(env)
        try:
            self.process = subprocess.Popen(
                command, pass_fds=(child.fileno(), *self.lane.descriptors()), env=env
            )
        except OSError as exc:
            parent.close()
            self.lane.close()
            raise Unavailable(f"{label}: cannot start a stub process: {exc}") from None
        finally:
            child.close()
        self.sock = parent
        self.endpoint = Endpoint(
            Arena(settings.shm_default_byte_size, settings.shm_growth_byte_size),
            ArenaView(),
            settings.shm_default_byte_size // 4,
        )
        self.channel = BlockingChannel(parent, self.endpoint)
        self._closed = False
        # Whether the model defines is_ready() (said when it is initialized).
        self.has_is_ready = False
        # The custom metrics this stub's model defines: the server's registry, and
        # the references held in this stub's name (released when it closes).
        self.metrics = metrics
        self.metrics_owner = metrics.new_owner()

    @property
    def pid(self) -> int:
        return self.process.pid

    def request(self, message: dict, reply: str, timeout: float, what: str) -> dict:
        """Send ``message`` and block until the stub answers ``reply``.

        Log lines sent meanwhile are logged; an ``error`` answer, a timeout or the
        stub's death raise Unavailable naming ``what`` was being done.
        """
        self.sock.settimeout(timeout)
        try:
            self.channel.send(message)
            while True:
                answer = self.channel.receive()
                if answer is None:
                    raise Unavailable(
                        f"{self.label}: the stub process {self.wait_exit()} during {what}"
                    )
                op = answer["op"]
                if op == reply:
                    return answer
                if op == "error":
                    raise Unavailable(f"{self.label}: {what} failed: {answer['message']}")
                if op == "log":
                    log_stub_line(self.label, answer["level"], answer["message"])
                elif op == "metric":
                    metric_reply = self.metrics.handle(self.metrics_owner, answer)
                    if metric_reply is not None:
                        self.channel.send(metric_reply)
                elif op == "control":
                    self.channel.send(self._control_blocking(answer))
        except TimeoutError:
            raise Unavailable(
                f"{self.label}: the stub process did not finish {what} within {timeout:g}s"
            ) from None
        except OSError as exc:
            raise Unavailable(f"{self.label}: lost the stub process during {what}: {exc}") from None

    def _control_blocking(self, message: dict) -> dict:
        if self.control is None:
            return {
                "op": "control_reply",
                "call": message["call"],
                "result": None,
                "error": "the model loading API is not available here",
            }
        return self.control.handle_blocking(message)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def wait_exit(self, timeout: float = EXIT_GRACE_SECONDS) -> str:
        """Wait for the process to end (killing it after ``timeout``); how it ended."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return describe_exit(self.process.returncode)

    def stop(self, finalize: bool) -> None:
        """Finalize the model if asked and possible, then end the process (blocking)."""
        if self._closed:
            return
        try:
            if finalize and self.process.poll() is None:
                answer = self.request(
                    {"op": "finalize"}, "finalized", self.settings.stub_timeout, "finalize"
                )
                if answer.get("error"):
                    log.warning("finalize raised", source=self.label, error=answer["error"])
        except TritonError as exc:
            log.warning("finalize failed", source=self.label, error=exc.message)
        finally:
            if not finalize:
                self.kill()
            self.wait_exit()
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.metrics.release(self.metrics_owner)
        self.sock.close()
        self.endpoint.close()
        self.lane.close()


class TrioChannel:
    """A stub's connection on the Trio loop: ``send`` from any task, ``receive``
    from one reader task. ``receive`` returns None once the stub is gone.

    Both try the socket at once and only wait (in Trio) when it is not ready, so
    a small message costs one system call and no scheduler round: ``send``
    completes without yielding when the socket takes the whole message and no
    other send is under way, and ``receive`` yields once per wait for data (or
    once per read that did not have to wait, so a chatty stub never starves the
    loop).
    """

    def __init__(self, stub: StubProcess) -> None:
        self._stub = stub
        self.endpoint = stub.endpoint
        self.metrics = stub.metrics
        self.metrics_owner = stub.metrics_owner
        self.control = stub.control
        self.lane = stub.lane
        # Messages returned by ``receive`` (and those read while the stub started):
        # a reply on the lane is handled once this reaches the count it carries.
        self.handed = stub.endpoint.received
        # A duplicate descriptor, so the blocking socket stays usable afterwards.
        self._raw = stub.sock.dup()
        self._raw.setblocking(False)
        self._sock = trio.socket.from_stdlib_socket(self._raw)
        self._send_lock = trio.StrictFIFOLock()
        self._pending: deque[dict] = deque()
        # Messages of the last read are still pending: yield before the next.
        self._backlog = False

    async def send(self, message: dict) -> None:
        if not self._send_lock.locked():
            # Nothing is being sent: the message goes now, without a scheduler
            # round, unless the socket cannot take all of it.
            data, fds = self.endpoint.outgoing(message)
            try:
                sent = self._raw.sendmsg([data], ancillary_for(fds))
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            self._send_lock.acquire_nowait()
            try:
                await self._send_rest(memoryview(data)[sent:], [] if sent else fds, sent > 0)
            finally:
                self._send_lock.release()
            return
        async with self._send_lock:
            data, fds = self.endpoint.outgoing(message)
            await self._send_rest(memoryview(data), fds, False)

    async def _send_rest(self, view: memoryview, fds: list[int], started: bool) -> None:
        ancillary = ancillary_for(fds)
        try:
            while view:
                sent = await self._sock.sendmsg([view], ancillary)
                started, ancillary = True, []
                view = view[sent:]
        except BaseException:
            if started and view:
                # Half a message is in the socket: the stream cannot be used
                # again, so the stub goes, and is restarted.
                self._stub.kill()
            raise

    async def receive(self) -> dict | None:
        pending = self._pending
        if self._backlog:
            # The rest of a read that brought several messages: the tasks the
            # first one woke (a stream's consumer writing its first token) run
            # before these are handled. Two checkpoints: Trio may run a batch of
            # ready tasks in either order, the woken ones go no later than the
            # batch after this one.
            self._backlog = False
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
        waited = False
        while not pending:
            try:
                data, ancdata, _, _ = self._raw.recvmsg(RECEIVE_SIZE, ANCILLARY_SIZE)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self._raw)
                except (trio.ClosedResourceError, OSError):
                    return None
                waited = True
                continue
            except OSError:
                return None
            if not waited:
                await trio.lowlevel.checkpoint()
            fds = fds_from_ancillary(ancdata)
            if not data:
                for fd in fds:
                    os.close(fd)
                return None
            self.endpoint.feed(data, fds)
            pending.extend(self.endpoint.messages())
            self._backlog = len(pending) > 1
        self.handed += 1
        return pending.popleft()

    def close(self) -> None:
        self._sock.close()
