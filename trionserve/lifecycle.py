"""One admitted request's lifecycle state in the data plane: its trace, the
outputs the trace records, and what each response passes through before it is
handed on (first-response timing, the classification extension)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from trionserve.core.inference import InferenceRequest, InferenceResponse
from trionserve.observability.metrics import observe_first_response

if TYPE_CHECKING:
    from trionserve.actors.model import ModelVersion
    from trionserve.observability.trace.trace_file import Trace

Classifier = Callable[["ModelVersion", InferenceRequest, InferenceResponse], Awaitable[None]]


class Lifecycle:
    """One admitted request as ``DataPlane._lifecycle`` runs it."""

    __slots__ = (
        "_classifier",
        "_classify",
        "_first",
        "model",
        "plain",
        "request",
        "trace",
        "traced",
    )

    def __init__(
        self,
        model: ModelVersion,
        request: InferenceRequest,
        first_response: bool,
        classifier: Classifier,
    ) -> None:
        # ``first_response``: its first response is timed; ``classifier``
        # applies the classification extension to a response.
        self._classifier = classifier
        self.model = model
        self.request = request
        # The request's trace, if traced, and the outputs of its responses that
        # it records (TENSOR_BACKEND_OUTPUT, before classification).
        self.trace: Trace | None = None
        self.traced: InferenceResponse | None = None
        self._first = first_response
        outputs = request.requested_outputs
        self._classify = outputs is not None and any(
            o.parameters.get("classification") for o in outputs
        )
        # Whether a response of it, untraced, is deliverable as it comes (no
        # first response timed, nothing classified): not awaited then.
        self.plain = not first_response and not self._classify

    async def deliverable(self, response: InferenceResponse | None) -> None:
        """Make a response ready to hand on: a traced request's outputs are kept
        for its trace, the first one is timed
        (nv_inference_first_response_histogram_ms), and the classification
        extension is applied to the outputs that asked for it."""
        if response is None:
            return
        if self.trace is not None:  # the backend's outputs, before classification
            if self.trace.frontend is not None:
                self.trace.frontend.response_complete()
            if self.traced is None:
                self.traced = InferenceResponse(
                    response.model_name, response.model_version, outputs=list(response.outputs)
                )
            else:
                self.traced.outputs += response.outputs
        if self._first:
            self._first = False
            observe_first_response(self.model, trio.current_time() - self.request.arrival_time)
        if self._classify:
            await self._classifier(self.model, self.request, response)
