"""Inference requests, responses and tensors, as every layer sees them.

Frontends decode wire messages into an :class:`InferenceRequest`; the runtime answers
each request exactly once through :meth:`InferenceRequest.respond` or
:meth:`InferenceRequest.fail`; the frontend awaits :meth:`InferenceRequest.wait` and
encodes the :class:`InferenceResponse`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from trionserve.core.errors import TritonError


@dataclass(slots=True)
class Tensor:
    """A named tensor: its wire datatype and a numpy array with its shape and data."""

    name: str
    datatype: str
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for, with its per-output parameters."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    id: str = ""
    outputs: list[Tensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)


class InferenceRequest:
    """One inference request and the place its single final outcome is delivered.

    The request is created by a frontend on the Trio thread and answered on the Trio
    thread; backends running in worker threads return results to the executor, which
    answers. ``respond`` and ``fail`` are idempotent in the sense that only the first
    outcome counts, so a racing cancellation can never produce two answers.
    """

    __slots__ = (
        "model_name",
        "model_version",
        "id",
        "inputs",
        "requested_outputs",
        "parameters",
        "priority",
        "timeout_us",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "batch_size",
        "arrival_time",
        "cancelled",
        "_done",
        "_response",
        "_error",
    )

    def __init__(
        self,
        model_name: str,
        model_version: int | None = None,
        *,
        id: str = "",
        inputs: dict[str, Tensor] | None = None,
        requested_outputs: list[RequestedOutput] | None = None,
        parameters: dict[str, Any] | None = None,
        priority: int = 0,
        timeout_us: int = 0,
        sequence_id: int | str = 0,
        sequence_start: bool = False,
        sequence_end: bool = False,
    ) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.id = id
        self.inputs: dict[str, Tensor] = inputs if inputs is not None else {}
        # None means "every output of the model".
        self.requested_outputs = requested_outputs
        self.parameters: dict[str, Any] = parameters if parameters is not None else {}
        self.priority = priority
        self.timeout_us = timeout_us
        self.sequence_id = sequence_id
        self.sequence_start = sequence_start
        self.sequence_end = sequence_end
        # Filled in by validation: 0 for models without a batch dimension.
        self.batch_size = 0
        self.arrival_time = 0.0
        # Set when the client went away; schedulers drop cancelled requests.
        self.cancelled = False
        self._done = trio.Event()
        self._response: InferenceResponse | None = None
        self._error: TritonError | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def respond(self, response: InferenceResponse) -> bool:
        """Deliver the final response; returns False if an outcome was already set."""
        if self._done.is_set():
            return False
        self._response = response
        self._done.set()
        return True

    def fail(self, error: TritonError) -> bool:
        """Deliver the final error; returns False if an outcome was already set."""
        if self._done.is_set():
            return False
        self._error = error
        self._done.set()
        return True

    async def wait(self) -> InferenceResponse:
        """Wait for the outcome: the response, or the error raised."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._response is not None
        return self._response

    def __repr__(self) -> str:
        return (
            f"InferenceRequest({self.model_name!r}, version={self.model_version}, "
            f"id={self.id!r}, inputs={list(self.inputs)})"
        )
