"""A model's BLS request run on the server's inference path, for both ways of
running Python models (a stub process's ``bls`` message, an in-process model's
``InferenceRequest.exec``): the same deadline, the same final response and the
same error wording."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from trionserve.backends.python.messages import bls_request, error_message, response_message
from trionserve.core.errors import DeadlineExceeded, TritonError, Unavailable, as_triton_error
from trionserve.core.inference import InferenceRequest, InferenceResponse

if TYPE_CHECKING:
    from trionserve.backends.base import InferenceService
    from trionserve.backends.python.process import TrioChannel

# What run_bls hands its reply function: a response, an error, or None for the
# final flag alone (a decoupled model that ended without a response).
Outcome = InferenceResponse | TritonError | None


async def run_bls(
    inference: InferenceService | None,
    build: Callable[[], InferenceRequest],
    *,
    decoupled: bool,
    timeout_us: int,
    model_name: str,
    label: str,
    reply: Callable[[Outcome, bool], Awaitable[None]],
    passthrough: tuple[type[BaseException], ...] = (),
) -> None:
    """Build the request and run it; every response goes to ``reply(outcome,
    final)``, in order, and the final one always comes (an error if need be), so
    the model waiting on its iterator is never left waiting.

    A request ``timeout`` (``timeout_us``) ends with DEADLINE_EXCEEDED; an error
    raised before the request was queued is worded as python_backend words it
    (request_executor.cc Infer: "Model <name> - Error when running inference:
    <the server's error>"). Exceptions of ``passthrough`` types (the stub went
    away) are raised, not answered. ``reply`` is never cut short by a
    cancellation.
    """
    sent_final = False

    async def answer(outcome: Outcome, final: bool) -> None:
        nonlocal sent_final
        with trio.CancelScope(shield=True):
            await reply(outcome, final)
        sent_final = final

    queued = trio.Event()
    try:
        request = build()
        if inference is None:
            raise Unavailable(
                f"{label}: BLS requests are not available: the server gave "
                "this backend no inference service"
            )
        with trio.CancelScope() as scope:
            if timeout_us > 0:
                scope.deadline = trio.current_time() + timeout_us / 1e6
            if decoupled:
                await inference.infer_stream(request, answer, queued=queued)
            else:
                response = await inference.infer(request, queued=queued)
                await answer(response, True)
        if scope.cancelled_caught and not sent_final:
            await answer(DeadlineExceeded("Request timeout expired"), True)
    except passthrough:
        raise
    except Exception as exc:
        error = as_triton_error(exc)
        if not queued.is_set():
            error = TritonError(
                f"Model {model_name} - Error when running inference: {error.message}",
                error.status,
            )
        if not sent_final:
            await answer(error, True)


async def serve_stub_bls(
    inference: InferenceService | None,
    channel: TrioChannel,
    message: dict,
    in_flight: dict[int, InferenceRequest],
    label: str,
    gone: tuple[type[BaseException], ...],
    parent_trace: object | None = None,
) -> None:
    """One BLS request of a stub's model: run it, send its responses to the stub.

    The stub's iterator gets every response in order, and the final one
    always (an empty final response when the called model ended with the flag
    alone), so a model waiting on the iterator is never left waiting.
    ``ResponseIterator.cancel()`` cancels the called request as a client
    would (the request is in ``in_flight`` meanwhile): that model's
    ``is_cancelled()`` turns true, its responses still arrive, and one not yet
    executed ends with a CANCELLED error. ``gone``: what sending to a stub that
    is gone raises. ``parent_trace``: the trace of the request the model got the
    trace from (``trace=request.trace()``), which this one's is a child of.
    """
    call = message["call"]
    endpoint = channel.endpoint

    def build() -> InferenceRequest:
        request = bls_request(message, endpoint)
        request.trace_context = parent_trace
        in_flight[call] = request
        return request

    async def reply(outcome: Outcome, final: bool) -> None:
        if outcome is None:
            encoded = None
        elif isinstance(outcome, TritonError):
            encoded = error_message(outcome)
        else:
            encoded = response_message(outcome, endpoint)
        await channel.send(
            {"op": "bls_response", "call": call, "response": encoded, "final": final}
        )

    try:
        await run_bls(
            inference,
            build,
            decoupled=message["decoupled"],
            timeout_us=message["timeout"],
            model_name=message["model_name"],
            label=label,
            reply=reply,
            passthrough=gone,
        )
    except gone:
        pass  # the stub is gone
    finally:
        in_flight.pop(call, None)
