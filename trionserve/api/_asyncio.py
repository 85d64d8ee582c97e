"""Responses for asyncio code: Triton's ``Model.async_infer``, over the blocking
facade's core thread, without blocking the asyncio event loop.

Each ``__anext__`` asks the core's run for one item; a task there takes it from
the request's handing channel and settles an asyncio future through
``call_soon_threadsafe``. Nothing is read ahead, so what waits for the caller
stays in the request, bounded by bytes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import trio

from trionserve.api._values import InferenceResponse, Raised, UnavailableError

if TYPE_CHECKING:
    from trionserve.api._blocking import _LoopThread

_END = object()


class AsyncioResponseIterator:
    """The responses of one request for ``async for`` in asyncio code (see
    :class:`~trionserve.api.AsyncResponseIterator`). The request is sent when
    first iterated. An ``__anext__`` that is cancelled (its asyncio task was)
    cancels the request, as ``cancel()`` does."""

    def __init__(self, loop: _LoopThread, responses) -> None:
        self._loop = loop
        self._responses = responses
        self._complete = False
        # Set and read in the core's run only.
        self._scope: trio.CancelScope | None = None
        self._receive: trio.MemoryReceiveChannel | None = None
        self._abandoned = False

    def __aiter__(self) -> AsyncioResponseIterator:
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._complete:
            raise StopAsyncIteration
        future = asyncio.get_running_loop().create_future()
        try:
            self._loop.started_token.run_sync_soon(
                self._start_fetch, future, asyncio.get_running_loop()
            )
        except trio.RunFinishedError:
            self._complete = True
            raise UnavailableError("the in-process server has stopped") from None
        try:
            item = await future
        except asyncio.CancelledError:
            self._complete = True
            self._loop.call_soon(self._abandon)
            raise
        except UnavailableError:  # the server stopped meanwhile
            self._complete = True
            raise
        if item is _END:  # before the final response: the core stopped
            self._complete = True
            raise UnavailableError("the in-process server stopped before the request ended")
        if isinstance(item, Raised):
            self._complete = True
            raise item.error
        self._complete = item.final
        return item

    def cancel(self) -> None:
        """End the request with CancelledError (Triton's ``cancel``)."""
        if not self._complete:
            self._loop.call_soon(self._responses.cancel)

    def _start_fetch(self, future: asyncio.Future, aloop: asyncio.AbstractEventLoop) -> None:
        """In the core's run: start fetching, unless the run is ending."""
        if not self._loop.start_soon(self._fetch, future, aloop):
            error = UnavailableError("the in-process server stopped")
            aloop.call_soon_threadsafe(_settle, future, error)

    async def _fetch(self, future: asyncio.Future, aloop: asyncio.AbstractEventLoop) -> None:
        """In the core's run: the next item, handed to ``future``'s loop."""
        item: object = UnavailableError("the in-process server stopped")
        try:
            if self._receive is None:
                self._scope, self._receive = self._loop.hand(self._responses)
                if self._abandoned:
                    self._scope.cancel()
            try:
                item = await self._receive.receive()
            except trio.EndOfChannel:
                item = _END
        finally:
            try:
                aloop.call_soon_threadsafe(_settle, future, item)
            except RuntimeError:  # that event loop is closed: no one waits
                pass

    def _abandon(self) -> None:
        """In the core's run: the caller stopped waiting; cancel the request."""
        self._abandoned = True
        if self._scope is not None:
            self._scope.cancel()

    def __del__(self) -> None:
        if not getattr(self, "_complete", True) and self._loop.running:
            self._loop.call_soon(self._abandon)


def _settle(future: asyncio.Future, item: object) -> None:
    if future.cancelled():  # the waiting task was cancelled; __anext__ abandons
        return
    if isinstance(item, BaseException):
        future.set_exception(item)
    else:
        future.set_result(item)
