"""The in-process server for ordinary (blocking) Python code, in the shape of
Triton's ``tritonserver.Server``.

The core runs in a Trio run on a thread of its own (:class:`_LoopThread`); every
call blocks on that run through ``trio.from_thread``, so any number of threads may
call at once. Each request's responses are handed over by a task in that run
through a channel that holds none: what waits for the caller stays in the request
itself, bounded by bytes as for a network client.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import queue
import threading
import weakref
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from contextlib import aclosing
from functools import partial
from typing import Any, Generic, NoReturn, Protocol, Self, TypeVar, TypeVarTuple

import structlog
import trio

from trionserve.api._asyncio import AsyncioResponseIterator
from trionserve.api._errors import InvalidArgumentError, UnavailableError
from trionserve.api._models import ModelDictionary, describe_model
from trionserve.api._options import MetricFormat, ModelBatchFlag, ModelTxnPropertyFlag, Options
from trionserve.api._request import InferenceRequest
from trionserve.api._response import STOPPED, Forwarded, HttpResponse, InferenceResponse, Raised
from trionserve.api._trio import (
    AsyncModel,
    AsyncResponseIterator,
    AsyncServer,
    new_core,
    sole_exception,
)
from trionserve.core.errors import as_triton_error
from trionserve.protocol.grpc.options import GrpcOptions
from trionserve.protocol.http.frontend import HttpOptions
from trionserve.protocol.openai.frontend import OpenAIOptions
from trionserve.server import Server as Core
from trionserve.server import ServerOptions

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)
_Args = TypeVarTuple("_Args")


class _ClosableAsyncIterable(AsyncIterable[_T_co], Protocol[_T_co]):
    """What a handing task takes items from: a request's responses (an async
    generator, an AsyncResponseIterator) or a streamed body's chunks."""

    def aclose(self) -> Awaitable[object]: ...


class _LoopThread:
    """One core serving in a Trio run on its own thread.

    Owns the thread, the run and a nursery holding the core and the tasks that
    hand responses to blocking callers. The run ends when the core's ``serve``
    ends (after ``stop``'s drain, or a failure); handing tasks still left then
    (their callers stopped reading) are cancelled, their requests with them.
    """

    def __init__(self, core: Core) -> None:
        self.core = core
        self.server = AsyncServer(core)
        self.token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        # Daemon: a program that never calls stop() still exits (atexit stops it).
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="trionserve-core", daemon=True
        )
        self._thread.start()
        try:
            started.result()
        finally:
            if started.exception() is not None:
                self._thread.join()

    def _run(self, started: concurrent.futures.Future) -> None:
        try:
            trio.run(self._main, started)
        except BaseException as exc:  # handed to start(), or logged
            if not started.done():
                started.set_exception(sole_exception(exc))
            else:  # calls from now on get UnavailableError; the cause is logged
                log.error("in-process server failed", exc_info=sole_exception(exc))

    async def _main(self, started: concurrent.futures.Future) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self._serve)
            self.token = trio.lowlevel.current_trio_token()
            started.set_result(None)

    @property
    def started_token(self) -> trio.lowlevel.TrioToken:
        """The run's token; set before ``__init__`` returns (or it raised)."""
        assert self.token is not None
        return self.token

    async def _serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await self.core.serve(task_status=task_status)
        finally:
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()

    def run(self, afn: Callable[[*_Args], Awaitable[_T]], *args: *_Args) -> _T:
        """``await afn(*args)`` in the core's run; blocks until it returns."""
        try:
            return trio.from_thread.run(afn, *args, trio_token=self.token)
        except trio.RunFinishedError:
            raise UnavailableError("the in-process server has stopped") from None

    def run_sync(self, fn: Callable[[*_Args], _T], *args: *_Args) -> _T:
        """``fn(*args)`` in the core's run (it owns the state ``fn`` reads)."""
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self.token)
        except trio.RunFinishedError:
            raise UnavailableError("the in-process server has stopped") from None

    def call_soon(self, fn: Callable[[*_Args], object], *args: *_Args) -> None:
        """``fn(*args)`` in the core's run, without waiting (from any thread)."""
        try:
            self.started_token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def hand(
        self, items: _ClosableAsyncIterable[_T]
    ) -> tuple[trio.CancelScope, trio.MemoryReceiveChannel[_T | Raised]]:
        """Start (without waiting, from any thread) a task that hands ``items``
        (responses, or body chunks) over one at a time; returns its cancel scope
        and the receiving end of its channel, which holds nothing: an item waits
        in its source until taken. Cancelling the scope, even before the task
        began, closes ``items``."""
        send, receive = trio.open_memory_channel[_T | Raised](0)
        scope = trio.CancelScope()
        try:
            self.started_token.run_sync_soon(self._start_handing, items, send, scope)
        except trio.RunFinishedError:
            raise UnavailableError("the in-process server has stopped") from None
        return scope, receive

    def forward(
        self, responses: AsyncResponseIterator, deliver: Callable[[Forwarded], None]
    ) -> trio.CancelScope:
        """Start (without waiting, from any thread) a task that takes every one of
        ``responses`` as it comes and passes it to ``deliver`` (in the core's run;
        it must not block), then ``deliver(STOPPED)`` if they ended before their
        final response. For ``response_queue``: responses are read ahead, as
        Triton's. Cancelling the returned scope cancels the request."""
        scope = trio.CancelScope()

        def start() -> None:
            if not self.start_soon(_forward, responses, deliver, scope):
                deliver(STOPPED)

        try:
            self.started_token.run_sync_soon(start)
        except trio.RunFinishedError:
            raise UnavailableError("the in-process server has stopped") from None
        return scope

    def _start_handing(
        self,
        items: _ClosableAsyncIterable[_T],
        send: trio.MemorySendChannel[_T | Raised],
        scope: trio.CancelScope,
    ) -> None:
        if not self.start_soon(_hand_over, items, send, scope):
            send.close()  # the receiver sees the end, before any final response

    def start_soon(self, afn: Callable[[*_Args], Awaitable[object]], *args: *_Args) -> bool:
        """Run ``afn(*args)`` as a task of the core's run (from the run's thread);
        False once the run is ending and starts nothing more."""
        assert self._nursery is not None
        try:
            self._nursery.start_soon(afn, *args)
        except RuntimeError:  # "Nursery is closed to new arrivals"
            return False
        return True

    def stop(self) -> None:
        """Drain and stop; returns once the run has ended."""
        if self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self.core.shutdown, trio_token=self.token)
            except trio.RunFinishedError:
                pass
        self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


async def _hand_over(
    items: _ClosableAsyncIterable[_T],
    send: trio.MemorySendChannel[_T | Raised],
    scope: trio.CancelScope,
) -> None:
    """Send each of ``items`` (an async iterator with ``aclose``) as the receiver
    takes it, then close; its error is sent as :class:`Raised`. Cancelling
    ``scope`` closes ``items`` (a request: cancelled)."""
    with scope:
        async with send:
            try:
                async with aclosing(items):
                    async for item in items:
                        await send.send(item)
            except Exception as exc:  # noqa: BLE001 (the request's error; others go on)
                await send.send(Raised(as_triton_error(exc, "in-process infer")))


async def _forward(
    responses: AsyncResponseIterator, deliver: Callable[[Forwarded], None], scope: trio.CancelScope
) -> None:
    final = False
    with scope:
        try:
            async with aclosing(responses):
                async for response in responses:
                    final = response.final
                    deliver(response)
        finally:
            if not final:
                deliver(STOPPED)


class Server:
    """An in-process server, as Triton's ``tritonserver.Server``.

    ``Server(options)`` or ``Server(**Options fields)``; also takes the command
    line's :class:`~trionserve.server.ServerOptions` (frontends and all). Use as a
    context manager (starts, then stops) or call ``start()`` and ``stop()``.
    """

    def __init__(self, options: Options | ServerOptions | None = None, **kwargs: Any) -> None:
        if options is None:
            options = Options(**kwargs)
        elif kwargs:
            raise InvalidArgumentError("give either options or keyword arguments, not both")
        self.options = options
        self._loop: _LoopThread | None = None
        self._stop_at_exit: Callable[[], None] | None = None
        self._exit_code = 0

    # -- lifecycle ----------------------------------------------------------------

    def start(
        self,
        wait_until_ready: bool = False,
        polling_interval: float = 0.1,
        timeout: float | None = None,
    ) -> Server:
        """Start the core on its own thread and load the startup models; with
        ``wait_until_ready``, also wait (up to ``timeout`` seconds) for readiness.
        Raises InternalError when models failed to load (with ``exit_on_error``),
        UnavailableError when not ready in time, InvalidArgumentError if started."""
        if self._loop is not None:
            raise InvalidArgumentError("Server already started")
        self._loop = _LoopThread(new_core(self.options, {}))
        self._stop_at_exit = _stopper(weakref.ref(self))
        atexit.register(self._stop_at_exit)
        if wait_until_ready:
            try:
                self._loop.run(_ready_within, self._loop.server, polling_interval, timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        """Drain (new requests refused, those in flight finish, up to the exit
        timeout), unload every model and end the core's thread."""
        loop = self._require_started()
        if self._stop_at_exit is not None:
            atexit.unregister(self._stop_at_exit)
            self._stop_at_exit = None
        # Other threads may call meanwhile: new requests get UnavailableError.
        loop.stop()
        self._exit_code = loop.core.exit_code
        self._loop = None

    def __enter__(self) -> Self:
        if self._loop is None:
            self.start(wait_until_ready=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None:
            self.stop()

    def _require_started(self) -> _LoopThread:
        loop = self._loop
        if loop is None:
            raise InvalidArgumentError("Server not started")
        return loop

    @property
    def exit_code(self) -> int:
        """0 once a stop drained completely; 1 when the exit timeout cut it short."""
        loop = self._loop
        return loop.core.exit_code if loop is not None else self._exit_code

    # -- health and metadata -------------------------------------------------------

    def live(self) -> bool:
        loop = self._require_started()
        return loop.run_sync(loop.server.live)

    def ready(self) -> bool:
        loop = self._require_started()
        return loop.run_sync(loop.server.ready)

    def metadata(self) -> dict[str, Any]:
        loop = self._require_started()
        return loop.run_sync(loop.server.metadata)

    def metrics(self, metric_format: MetricFormat = MetricFormat.PROMETHEUS) -> str:
        """The metrics in Prometheus' text format (see :meth:`AsyncServer.metrics`)."""
        loop = self._require_started()
        return loop.run_sync(loop.server.metrics, metric_format)

    # -- models --------------------------------------------------------------------

    def model(self, model_name: str, model_version: int = -1) -> Model:
        loop = self._require_started()
        return Model(loop, loop.server.model(model_name, model_version))

    def models(self, exclude_not_ready: bool = False) -> ModelDictionary[Model]:
        loop = self._require_started()
        rows = loop.run_sync(loop.server.dataplane.repository_index, exclude_not_ready)
        return ModelDictionary(
            lambda name, version, state, reason: Model(
                loop, AsyncModel(loop.server, name, version, state, reason)
            ),
            rows,
        )

    def load(
        self,
        model_name: str,
        parameters: dict[str, Any] | None = None,
        *,
        config: str | dict | None = None,
        files: dict[str, bytes] | None = None,
    ) -> Model:
        """As :meth:`AsyncServer.load`: blocks until the model has loaded."""
        loop = self._require_started()
        model = loop.run(
            partial(loop.server.load, model_name, parameters, config=config, files=files)
        )
        return Model(loop, model)

    def unload(
        self,
        model: str | Model,
        unload_dependents: bool = False,
        wait_until_unloaded: bool = True,
        polling_interval: float = 0.1,
        timeout: float | None = None,
    ) -> None:
        """As :meth:`AsyncServer.unload`: blocks until in-flight requests finished
        and the model unloaded (the polling keywords are Triton's, unused)."""
        loop = self._require_started()
        name = model if isinstance(model, str) else model.name
        loop.run(loop.server.unload, name, unload_dependents)

    # -- network frontends -------------------------------------------------------------

    def attach_http(
        self, address: str = "127.0.0.1", port: int = 8000, options: HttpOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve HTTP/REST from this core (port 0: a free one); the bound addresses."""
        loop = self._require_started()
        return loop.run(loop.server.attach_http, address, port, options)

    def attach_grpc(
        self, address: str = "127.0.0.1", port: int = 8001, options: GrpcOptions | None = None
    ) -> list[tuple[str, int]]:
        loop = self._require_started()
        return loop.run(loop.server.attach_grpc, address, port, options)

    def http_request(
        self,
        method: str,
        path: str,
        headers: Iterable[tuple[str | bytes, str | bytes]] = (),
        body: bytes | str = b"",
    ) -> HttpResponse:
        """As :meth:`AsyncServer.http_request`; a streamed answer's ``stream`` is
        an iterator of chunks here (dropping it early ends its request)."""
        loop = self._require_started()
        answer = loop.run(loop.server.http_request, method, path, headers, body)
        if answer.stream is not None:
            answer.stream = _Chunks(loop, answer.stream)
        return answer

    def attach_metrics(self, address: str = "127.0.0.1", port: int = 8002) -> list[tuple[str, int]]:
        loop = self._require_started()
        return loop.run(loop.server.attach_metrics, address, port)

    def attach_openai(
        self, address: str = "127.0.0.1", port: int = 9000, options: OpenAIOptions | None = None
    ) -> list[tuple[str, int]]:
        """Serve the OpenAI-compatible API from this core (port 0: a free one)."""
        loop = self._require_started()
        return loop.run(loop.server.attach_openai, address, port, options)


def _stopper(server_ref: weakref.ref) -> Callable[[], None]:
    def stop_at_exit() -> None:
        server = server_ref()
        if server is not None and server._loop is not None:
            server.stop()

    return stop_at_exit


async def _ready_within(
    server: AsyncServer, polling_interval: float, timeout: float | None
) -> None:
    with trio.move_on_after(timeout if timeout is not None else float("inf")):
        await server.wait_until_ready(polling_interval)
        return
    raise UnavailableError("Timeout before ready")


class Model:
    """A model of an in-process server, as Triton's ``tritonserver.Model``."""

    def __init__(self, loop: _LoopThread, model: AsyncModel) -> None:
        self._loop = loop
        self._model = model

    @property
    def name(self) -> str:
        return self._model.name

    @property
    def version(self) -> int:
        return self._model.version

    @property
    def state(self) -> str | None:
        """The state the repository index gave when this came from ``models()``."""
        return self._model.state

    @property
    def reason(self) -> str | None:
        return self._model.reason

    def _at_version(self, version: int) -> Model:
        if version == self.version:
            return self
        return Model(self._loop, self._model._at_version(version))

    def create_request(self, **kwargs: Any) -> InferenceRequest:
        return InferenceRequest(model=self, **kwargs)

    def infer(
        self,
        inference_request: InferenceRequest | None = None,
        raise_on_error: bool = True,
        **kwargs: Any,
    ) -> ResponseIterator:
        """Send a request; iterate its responses (see :meth:`AsyncModel.infer`)."""
        responses = self._model._infer(self, inference_request, raise_on_error, kwargs)
        return ResponseIterator(self._loop, responses)

    def async_infer(
        self,
        inference_request: InferenceRequest | None = None,
        raise_on_error: bool = True,
        **kwargs: Any,
    ) -> AsyncioResponseIterator:
        """As :meth:`infer`, for ``async for`` in asyncio code (Triton's
        ``async_infer``): the event loop is never blocked."""
        responses = self._model._infer(self, inference_request, raise_on_error, kwargs)
        return AsyncioResponseIterator(self._loop, responses)

    def metadata(self) -> dict[str, Any]:
        return self._loop.run_sync(self._model.metadata)

    def ready(self) -> bool:
        return self._loop.run_sync(self._model.ready)

    def batch_properties(self) -> ModelBatchFlag:
        return self._loop.run_sync(self._model.batch_properties)

    def transaction_properties(self) -> ModelTxnPropertyFlag:
        return self._loop.run_sync(self._model.transaction_properties)

    def config(self) -> dict[str, Any]:
        return self._loop.run_sync(self._model.config)

    def statistics(self) -> dict[str, Any]:
        return self._loop.run_sync(self._model.statistics)

    def __repr__(self) -> str:
        return describe_model(self.name, self.version, self.state)


class _Handed(Generic[_T]):
    """Items a task in the core's run hands to a blocking caller one at a time
    (see :meth:`_LoopThread.hand`). Dropped or closed before its end, it
    cancels that task, and so the request behind it."""

    def __init__(self, loop: _LoopThread, items: _ClosableAsyncIterable[_T]) -> None:
        self._loop = loop
        self._complete = False
        self._scope, self._receive = loop.hand(items)

    def __iter__(self) -> Self:
        return self

    def _next_item(self) -> _T:
        if self._complete:
            raise StopIteration
        try:
            item = self._loop.run(self._receive.receive)
        except trio.EndOfChannel:
            self._complete = True
            self._ended()
            raise StopIteration from None
        except BaseException:  # the caller interrupted (KeyboardInterrupt), or stopped
            self.close()
            raise
        if isinstance(item, Raised):
            self._complete = True
            raise item.error
        return item

    def _ended(self) -> None:
        """The items ended (a subclass raises if they ended too soon)."""

    def close(self) -> None:
        """Stop early: what is left is dropped and its request cancelled."""
        if not self._complete:
            self._complete = True
            self._loop.call_soon(self._scope.cancel)

    def __del__(self) -> None:
        if not getattr(self, "_complete", True) and self._loop.running:
            self.close()


class ResponseIterator(_Handed[InferenceResponse]):
    """The responses of one request, for a blocking caller (see
    :class:`AsyncResponseIterator`). The request is sent at once. An iterator
    dropped (or closed) before its final response cancels its request, unless
    the request has a ``response_queue``: then every response is also put into
    that queue as it arrives (errors as responses with ``error`` set), read
    ahead whether this iterator is read or not, as Triton's."""

    def __init__(self, loop: _LoopThread, responses: AsyncResponseIterator) -> None:
        self._responses = responses
        self._user_queue = responses.response_queue
        if self._user_queue is None:
            super().__init__(loop, responses)
            return
        self._loop = loop
        self._complete = False
        self._raise_on_error = responses.raise_on_error
        responses.raise_on_error = False  # an error is a response in the queue
        own: queue.SimpleQueue[Forwarded] = queue.SimpleQueue()
        self._own = own
        user_queue = self._user_queue

        def deliver(response: Forwarded) -> None:
            own.put(response)
            if response is not STOPPED:
                user_queue.put_nowait(response)

        self._scope = loop.forward(responses, deliver)

    def __next__(self) -> InferenceResponse:
        if self._user_queue is None:
            item = self._next_item()
            self._complete = item.final
            return item
        if self._complete:
            raise StopIteration
        try:
            queued = self._own.get()
        except BaseException:  # the caller interrupted (KeyboardInterrupt)
            self.close()
            raise
        if queued is STOPPED:
            self._complete = True
            self._ended()
        self._complete = queued.final
        if queued.error is not None and self._raise_on_error:
            raise queued.error
        return queued

    def cancel(self) -> None:
        """End the request with CancelledError (Triton's ``cancel``)."""
        if not self._complete:
            self._loop.call_soon(self._responses.cancel)

    def _ended(self) -> NoReturn:
        # Before the final response: the core stopped and cancelled the request.
        raise UnavailableError("the in-process server stopped before the request ended")

    def __del__(self) -> None:
        # With a response_queue the responses go on into it: the caller reads there.
        if getattr(self, "_user_queue", None) is None:
            super().__del__()


class _Chunks(_Handed[bytes]):
    """A streamed HTTP answer's body chunks, for a blocking caller."""

    def __next__(self) -> bytes:
        return self._next_item()
