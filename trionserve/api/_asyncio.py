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

from trionserve.api._errors import InvalidArgumentError, UnavailableError
from trionserve.api._response import STOPPED, Forwarded, InferenceResponse, Raised

if TYPE_CHECKING:
    from trionserve.api._blocking import _LoopThread
    from trionserve.api._trio import AsyncResponseIterator


_END = object()


class AsyncioResponseIterator:
    """The responses of one request for ``async for`` in asyncio code (see
    :class:`~trionserve.api.AsyncResponseIterator`). The request is sent when
    first iterated. An ``__anext__`` that is cancelled (its asyncio task was)
    cancels the request, as ``cancel()`` does."""

    def __init__(self, loop: _LoopThread, responses: AsyncResponseIterator) -> None:
        self._loop = loop
        self._responses = responses
        self._complete = False
        # Set and read in the core's run only.
        self._scope: trio.CancelScope | None = None
        self._receive: trio.MemoryReceiveChannel | None = None
        self._abandoned = False
        self._own: asyncio.Queue[Forwarded] | None = None
        if responses.response_queue is not None:
            self._forward_to(responses.response_queue)

    def _forward_to(self, user_queue: asyncio.Queue) -> None:
        """With a ``response_queue``: send the request now and put every response
        into that queue and this iterator's own as it arrives (Triton's
        ``AsyncResponseIterator._continue_fetch``)."""
        try:
            aloop = asyncio.get_running_loop()
        except RuntimeError:
            raise InvalidArgumentError(
                "async_infer with a response_queue is called from a running asyncio loop"
            ) from None
        own: asyncio.Queue[Forwarded] = asyncio.Queue()
        self._own = own
        self._raise_on_error = self._responses.raise_on_error
        self._responses.raise_on_error = False  # an error is a response in the queue

        def both(response: Forwarded) -> None:
            own.put_nowait(response)
            if response is not STOPPED:
                user_queue.put_nowait(response)

        def deliver(response: Forwarded) -> None:
            try:
                aloop.call_soon_threadsafe(both, response)
            except RuntimeError:  # that event loop is closed: no one waits
                pass

        self._scope = self._loop.forward(self._responses, deliver)

    def __aiter__(self) -> AsyncioResponseIterator:
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._complete:
            raise StopAsyncIteration
        if self._own is not None:
            return await self._next_queued(self._own)
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

    async def _next_queued(self, own: asyncio.Queue[Forwarded]) -> InferenceResponse:
        item = await own.get()
        if item is STOPPED:
            self._complete = True
            raise UnavailableError("the in-process server stopped before the request ended")
        self._complete = item.final
        if item.error is not None and self._raise_on_error:
            raise item.error
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
        if getattr(self, "_own", None) is not None:
            return  # with a response_queue the responses go on into it
        if not getattr(self, "_complete", True) and self._loop.running:
            self._loop.call_soon(self._abandon)


def _settle(future: asyncio.Future, item: object) -> None:
    if future.cancelled():  # the waiting task was cancelled; __anext__ abandons
        return
    if isinstance(item, BaseException):
        future.set_exception(item)
    else:
        future.set_result(item)
