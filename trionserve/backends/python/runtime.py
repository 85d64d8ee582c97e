"""What running a model's ``execute`` takes wherever it runs: :class:`ModelRuntime`,
the base of the stub process's runtime (:mod:`.stub`) and of the in-process one
(:mod:`.inprocess_runtime`), with Triton's checks of what ``execute`` returned and
its error wording (pb_stub.cc ProcessRequests).
"""

from __future__ import annotations

import inspect
import threading
import traceback
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures

    from trionserve.backends.python.stubpath import triton_python_backend_utils as pb_utils

    # The requests of one execute, as the model gets them.
    Requests = Sequence[pb_utils.InferenceRequest]


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` and where in the model's code it was raised."""
    text = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {Path(last.filename).name}:{last.lineno} in {last.name})"
    return text


class ModelRuntime:
    """What running a model's ``execute`` takes wherever it runs (this stub
    process, or the server's own thread for an in-process model): Triton's
    checks of what ``execute`` returned, its error wording, and the asyncio loop
    of ``async def execute`` models.

    A subclass sets ``pb`` (its triton_python_backend_utils), ``model`` (the
    TritonPythonModel), ``instance_name``, ``decoupled`` and ``_loop`` (None), and
    provides ``log(level, message)``.
    """

    pb: Any
    model: Any
    instance_name: str
    decoupled: bool
    _loop: Any

    def log(self, level: str, message: str) -> None:
        raise NotImplementedError

    def _check_rescheduled(self, requests: Requests, result: object) -> None:
        """A rescheduled request's entry in the returned list must be None
        (pb_stub.cc ProcessRequests, Triton's wording and spelling)."""
        if not isinstance(result, list):
            return  # _encode_all says what is wrong
        for request, response in zip(requests, result):
            flags = request._release_flags
            if response is not None and flags & self.pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                raise self.pb.TritonModelException(
                    "Expected a None object in the execute function return list for "
                    f"reschduled request, found type '{type(response)}'."
                )

    def execute_error(self, exc: BaseException) -> str:
        """Triton's wording for an exception raised by ``execute`` (pb_stub.cc)."""
        return (
            f"Failed to process the request(s) for model '{self.instance_name}', "
            f"message: {describe_exception(exc)}"
        )

    def call_execute(self, requests: Requests) -> list[pb_utils.InferenceResponse | None] | None:
        """The model's ``execute(requests)``, as pb_stub.cc ProcessRequests calls it:
        an ``async def execute`` is awaited on the asyncio loop, or for a decoupled
        model left running (as Triton: its requests end as it sends); a decoupled
        model must return None. What a model that is not decoupled returned, with
        rescheduled requests checked (the caller checks the rest)."""
        result = self.model.execute(requests)
        if type(result) is not list and inspect.isawaitable(result):
            if self.decoupled:
                self._run_in_background(result, requests)
                return None
            result = self._await_result(result)
        if result is not None:
            if self.decoupled:
                raise self.pb.TritonModelException(
                    f"Python model '{self.instance_name}' is using the decoupled mode "
                    "and the execute function must return None."
                )
            self._check_rescheduled(requests, result)
        return result

    def check_returned(self, requests: Requests, result: object) -> None:
        """What a model that is not decoupled returned from execute must be: one
        InferenceResponse (or None) per request (pb_stub.cc ProcessRequests)."""
        pb = self.pb
        if not isinstance(result, list):
            raise pb.TritonModelException(
                f"Expected a list in the execute return, found type '{type(result)}'."
            )
        if len(result) != len(requests):
            raise pb.TritonModelException(
                f"Number of InferenceResponse objects do not match the number of "
                f"InferenceRequest objects. InferenceRequest(s) size is:{len(requests)}, "
                f"and InferenceResponse(s) size is:{len(result)}\n"
            )
        for response in result:
            if response is not None and not isinstance(response, pb.InferenceResponse):
                raise pb.TritonModelException(
                    "Expected an 'InferenceResponse' object in the execute function "
                    f"return list, found type '{type(response)}'."
                )

    # -- asyncio ------------------------------------------------------------------

    def _await_result(self, coroutine: Awaitable[object]) -> object:
        """What an ``async def execute`` (not decoupled) returned, awaited on the
        asyncio loop while this thread waits."""
        return self._run_coroutine(coroutine).result()

    def check_can_wait(self) -> None:
        """Before a BLS call the calling thread will wait for (``exec``,
        ``async_exec``): raises where nothing could answer it (a stub: never)."""

    def _run_coroutine(self, coroutine: Awaitable[object]) -> concurrent.futures.Future[object]:
        """Schedule a coroutine on the stub's asyncio loop; a concurrent future."""
        import asyncio  # only models with ``async def execute`` pay for it

        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(
                target=self._run_loop, args=(loop,), name="stub-asyncio", daemon=True
            ).start()
            self._loop = loop
        return asyncio.run_coroutine_threadsafe(_awaited(coroutine), self._loop)

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The asyncio loop's thread."""
        loop.run_forever()

    def _run_in_background(self, coroutine: Awaitable[object], requests: Requests) -> None:
        """A decoupled ``async def execute``: requests still open when it fails get the error."""
        future = self._run_coroutine(coroutine)

        def finished(done: concurrent.futures.Future[object]) -> None:
            exc = done.exception()
            if exc is None:
                return
            # As Triton (pb_stub.cc, BackgroundFutureDone): the exception is logged,
            # even when every request already had its final response.
            self.log(
                "ERROR",
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip(),
            )
            message = self.execute_error(exc)
            for request in requests:
                request.get_response_sender()._end_with_error(message)

        future.add_done_callback(finished)


async def _awaited(awaitable: Awaitable[object]) -> object:
    return await awaitable
