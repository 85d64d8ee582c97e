"""A model's BLS request run on the server's inference path, for both ways of
running Python models (a stub process's ``bls`` message, an in-process model's
``InferenceRequest.exec``): the same deadline, the same final response and the
same error wording."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from trionserve.core.errors import DeadlineExceeded, TritonError, Unavailable, as_triton_error
from trionserve.core.inference import InferenceRequest, InferenceResponse

if TYPE_CHECKING:
    from trionserve.backends.base import InferenceService

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
