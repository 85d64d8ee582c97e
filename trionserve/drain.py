"""The drain before shutdown: which inference requests the server still takes, and
when nothing is left.

Triton's ``InferenceServer::Stop`` (core ``src/server.cc``) waits, within
``--exit-timeout-secs``, for its in-flight requests (``inflight_request_counter_``)
and live models; :class:`Drain` is that count for the DataPlane, with the rule
that decides what a draining server still admits. The server owns one per
:class:`~trionserve.dataplane.DataPlane` (``DataPlane.drain``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import structlog
import trio

from trionserve.core.errors import Unavailable
from trionserve.core.inference import InferenceRequest

if TYPE_CHECKING:
    from trionserve.actors.model import ModelVersion

log = structlog.get_logger(__name__)


class ShuttingDown(Unavailable):
    """A new request refused because the server is draining for shutdown."""


class Drain:
    """The drain contract, the same for every transport.

    ``begin`` (the server calls it on the first SIGTERM/SIGINT) turns readiness
    false at once; liveness stays true until the process exits. From then on the
    DataPlane decides, in one place (its ``_admit``, through
    :meth:`refuse_unless_continuing`), which inference requests it still takes: a
    request that continues a sequence open in its model's sequence batcher (same
    model, same correlation id, no START flag) runs as usual, and its END closes
    the sequence; every other request, a new sequence's START included, is refused
    with :class:`ShuttingDown` (UNAVAILABLE, "server is shutting down"). Requests
    made by models themselves (BLS calls, ensemble steps) belong to a request
    already taken and are never refused. Health, metadata, configuration and
    statistics keep answering. ``await wait_drained()`` returns once the drain
    began and nothing is left: no inference request in flight and no sequence open
    (a sequence its client abandoned ends through ``max_sequence_idle_microseconds``
    as usual). A transport keeps listening and serving until then, so that a client
    gets a clean UNAVAILABLE instead of a refused connection and an open sequence
    can still reach its END; after that it closes its connections (bounded by the
    exit timeout). The caller bounds the wait: ``wait_drained`` has no deadline
    itself.
    """

    def __init__(self) -> None:
        self.draining = False
        # Inference requests between admission and their last response, and the
        # models that were sent sequence requests: what a drain waits for.
        self._inflight = 0
        # Set once no request is in flight; made when a drain waits for it.
        self._settled: trio.Event | None = None
        self._sequence_models: weakref.WeakSet[ModelVersion] = weakref.WeakSet()

    def begin(self) -> None:
        """Readiness false, new requests refused (see the class docstring)."""
        if not self.draining:
            self.draining = True
            log.info(
                "draining: new requests are refused",
                inflight=self._inflight,
                open_sequences=self.open_sequences(),
            )

    def open_sequences(self) -> int:
        """Sequences in progress in the models' sequence batchers."""
        count = 0
        for model in list(self._sequence_models):
            sequences = model.sequences
            if sequences is not None:
                count += len(sequences.open)
        return count

    @property
    def inflight(self) -> int:
        """Inference requests admitted and not yet finished."""
        return self._inflight

    def drained(self) -> bool:
        """True once draining, with nothing in flight and no sequence open."""
        return self.draining and self._inflight == 0 and self.open_sequences() == 0

    async def wait_drained(self) -> None:
        """Return once :meth:`drained` is true (it checks, then waits for whichever
        of in-flight requests and open sequences is not done, and checks again)."""
        while True:
            if not self.draining:
                raise RuntimeError("wait_drained() before begin()")
            if self._inflight:
                if self._settled is None:
                    self._settled = trio.Event()
                await self._settled.wait()
                continue
            waiting = next(
                (
                    model.sequences
                    for model in list(self._sequence_models)
                    if model.sequences is not None and model.sequences.open
                ),
                None,
            )
            if waiting is None:
                return
            await waiting.wait_none_open()

    def refuse_unless_continuing(self, request: InferenceRequest, model: ModelVersion) -> None:
        """Refuse a request during the drain unless it continues an open sequence."""
        sequences = model.sequences
        correlation_id = request.sequence_id
        if (
            sequences is not None
            and not request.sequence_start
            and correlation_id not in (0, "")
            and sequences.is_open(correlation_id, trio.current_time())
        ):
            return
        # Not counted in the model's statistics: like a request refused because
        # its model is not ready, it never reached the model.
        what = (
            "a new sequence" if sequences is not None and request.sequence_start else "new requests"
        )
        raise ShuttingDown(
            f"server is shutting down: request for model '{request.model_name}' refused; "
            f"the server takes no {what} while it finishes the requests and sequences "
            "in progress; send it to another replica"
        )

    def request_began(self, model: ModelVersion, request: InferenceRequest) -> None:
        """An admitted request is queued at its model: counted there (its
        ``inflight``, its ``idle`` event made anew by the next wait) and here."""
        if model._inflight == 0:
            model._idle = None
        model._inflight += 1
        if self._inflight == 0:
            self._settled = None
        self._inflight += 1
        if request.sequence_id not in (0, "") and model.sequences is not None:
            self._sequence_models.add(model)

    def request_ended(self, model: ModelVersion) -> None:
        """An admitted request had its last response (or failed): counted out
        at its model (its ``idle`` set as its last one ends) and here."""
        model._inflight -= 1
        if model._inflight == 0 and model._idle is not None:
            model._idle.set()
        self._inflight -= 1
        if self._inflight == 0 and self._settled is not None:
            self._settled.set()
