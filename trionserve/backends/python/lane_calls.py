"""How a Python instance's executes travel on its stub's lane (:mod:`.lane`):
posting a call, posting the next batch behind it, and reading the stub's
replies from the task that waits for one.

:class:`LaneCalls` is the part of :class:`.instance.PythonInstance` that owns
the reading of the lane: at most one task reads it at a time (``_pumping``),
the one waiting for a reply, or a task of the instance's nursery once that one
was cancelled; the others wait for their call's ``done``.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from trionserve.backends.base import Ahead
from trionserve.backends.python.calls import Call
from trionserve.backends.python.lane import SLOTS, Unreadable, encode
from trionserve.backends.python.process import StubProcess, TrioChannel
from trionserve.backends.python.settings import StubSettings


class LaneCalls:
    """The calls in flight on a stub's lane and the reading of its replies
    (a base of :class:`.instance.PythonInstance`, which sets the state below
    and handles each reply in ``_executed``)."""

    _settings: StubSettings
    _stub: StubProcess | None
    _channel: TrioChannel | None
    _nursery: trio.Nursery | None
    _hang: str | None
    _calls: dict[int, Call]
    _pumping: bool
    _pump_scope: trio.CancelScope | None
    _quiet: trio.Event | None
    _handed_wait: tuple[int, trio.Event] | None
    _held_reply: tuple | None
    # Defined by PythonInstance: a call started (posted on the lane, or the
    # socket message to send), a reply handled, a message sent from a task.
    _start: Callable[..., tuple[Call, dict | None]]
    _executed: Callable[..., None]
    _send_soon: Callable[[TrioChannel, dict], None]

    async def wait_idle(self) -> None:
        """Until no call is in flight: one whose waiter was cancelled has been
        answered (its reply read from the lane) or failed."""
        while self._calls:
            channel = self._channel
            if channel is None:
                return  # no stub: run() fails its calls
            if self._pumping:
                quiet = self._quiet = trio.Event()
                await quiet.wait()
                continue
            self._pumping = True
            try:
                await self._pump(channel, lambda: not self._calls)
            finally:
                self._pumping = False

    def _settled(self) -> None:
        """The task reading the lane stopped: wake wait_idle."""
        quiet, self._quiet = self._quiet, None
        if quiet is not None:
            quiet.set()

    def _post_ahead(self, channel: TrioChannel, ahead: Ahead) -> None:
        """Post the next batch behind the one the stub runs (python_backend's
        message queue holds more than one): the stub takes it as soon as it is
        done, without sleeping on its doorbell or waiting for the server."""
        taken = ahead()
        if taken is not None:
            call, message = self._start(channel, *taken)
            call.started, call.behind = trio.current_time(), True
            if message is not None:
                self._send_soon(channel, message)

    async def _await_timed(self, channel: TrioChannel, call: Call, ahead: Ahead | None) -> None:
        """Wait for ``call``'s reply, killing a stub that takes longer than
        ``execute-timeout-seconds`` over it."""
        timeout = self._settings.execute_timeout
        if timeout <= 0:
            await self._await_call(channel, call, ahead)
            return
        with trio.move_on_after(timeout) as scope:
            await self._await_call(channel, call, ahead)
        if scope.cancelled_caught and self._stub is not None:
            self._kill(f"did not return from execute within {timeout:g}s (execute-timeout-seconds)")
            await call.done.wait()

    def _kill(self, why: str) -> None:
        """Kill the stub; its calls fail with ``why`` (see _serve) and it restarts."""
        if self._stub is not None:
            self._hang = f"{why} and was killed"
            self._stub.kill()

    # -- the lane ----------------------------------------------------------------------
    def _post(self, channel: TrioChannel, call_id: int, entries: list) -> bool:
        """Send an execute on the lane: False when it must go on the socket (an
        input in a segment the stub has not been told of, or too large)."""
        endpoint = channel.endpoint
        calls = self._calls
        if endpoint.arena.has_announcements() or len(calls) > SLOTS:
            return False
        if len(calls) > 1 and any(call.socket for call in calls.values()):
            return False  # it would overtake an execute sent on the socket
        freed = endpoint.take_released()
        if channel.lane.post(encode((call_id, endpoint.sent, freed, entries))):
            return True
        endpoint.release(freed)  # they go with the socket message instead
        return False

    async def _await_call(
        self, channel: TrioChannel, call: Call, ahead: Ahead | None = None
    ) -> None:
        """Wait for the stub's reply to ``call``, reading the lane from this task
        (as python_be.cc's instance thread waits on the stub's queue itself), or
        for the task already reading it."""
        if self._pumping:
            await call.done.wait()
            return
        self._pumping = True
        handed_on = False
        try:
            await self._pump(channel, call.done.is_set, ahead)
        except BaseException:
            # Cancelled while the stub still has calls: a task of the instance
            # reads their replies, so that their blocks and requests are let go.
            if self._calls and self._nursery is not None and self._channel is channel:
                self._nursery.start_soon(self._pump_rest, channel)
                handed_on = True
            raise
        finally:
            if not handed_on:
                self._pumping = False
                self._settled()
        if not call.done.is_set():
            await call.done.wait()  # set by _fail_everything when the stub went away

    async def _pump_rest(self, channel: TrioChannel) -> None:
        try:
            await self._pump(channel, lambda: not self._calls)
        finally:
            self._pumping = False
            self._settled()

    async def _pump(
        self, channel: TrioChannel, until: Callable[[], bool], ahead: Ahead | None = None
    ) -> None:
        """Handle the stub's replies on the lane until ``until()``, or until the
        stub is gone, posting a batch from ``ahead`` behind a lone call the stub
        runs (at once, so that the stub finds it when it is done). A reply is
        handled only after the messages the stub sent on the socket before it
        (responses from senders, segments)."""
        lane = channel.lane
        calls = self._calls
        while not until():
            if self._channel is not channel:
                return
            if ahead is not None and 0 < len(calls) < SLOTS:
                self._post_ahead(channel, ahead)
            try:
                reply = self._held_reply or lane.take()
            except Unreadable as exc:  # the stub's failure (restarted), not the model's
                self._kill(f"sent a reply that could not be read ({exc})")
                continue  # woken once the stub is gone (_stop_pump)
            if reply is None:
                # Woken by the stub, or by _stop_pump (ringing this side's bell).
                await lane.wait()
                continue
            if channel.handed < reply[1]:
                self._held_reply = reply  # taken from the lane: kept until handled
                event = trio.Event()
                self._handed_wait = (reply[1], event)
                scope = self._pump_scope = trio.CancelScope()
                try:
                    with scope:
                        await event.wait()
                finally:
                    self._handed_wait = self._pump_scope = None
                if scope.cancelled_caught:
                    continue
                self._held_reply = None
            call_id, _, freed, error, rescheduled, responses = reply
            if freed:
                channel.endpoint.arena.free(freed)
            self._executed(call_id, error, rescheduled, responses)
            if channel.endpoint.should_flush():
                self._send_soon(channel, {"op": "free"})

    def _stop_pump(self) -> None:
        """Wake the task reading the lane: what it waits for came another way."""
        if self._pump_scope is not None:
            self._pump_scope.cancel()
        if self._pumping and self._stub is not None:
            self._stub.lane.ring_self()
