"""The sequence batcher's two strategies: which of an instance's ready sequences
make its next batch, and when to look again if none do yet.

- :class:`DirectStrategy` (Triton core
  ``sequence_batch_scheduler/sequence_batch_scheduler.cc`` DirectSequenceBatch):
  every slot up to the highest one with a request ready keeps its batch position,
  an empty slot (or a request whose shapes cannot join) gets a null request; with
  ``max_queue_delay_microseconds`` and ``minimum_slot_utilization`` set, the batch
  waits for enough ready slots until the oldest ready request has waited the delay.
- :class:`OldestStrategy` (OldestSequenceBatch): the oldest next requests of the
  candidate sequences, at most one per sequence, formed like the dynamic batcher's
  (``preferred_batch_size``, ``max_queue_delay_microseconds``).

Both are pure: the scheduler hands them each slot's next request and what must be
equal for two requests to share a batch, and forms the batch they choose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from trionserve.core.inference import InferenceRequest

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelSequenceBatching
    from trionserve.schedulers.sequence_state import Sequence

# slot -> (its sequence, the sequence's next request), in slot order
Ready = dict[int, tuple["Sequence", InferenceRequest]]
# what must be equal for two requests to share a batch
BatchKey = Callable[[InferenceRequest, "Sequence"], tuple]
# the sequences of the batch in batch order (None: a null request), or None and
# when to look again
Choice = tuple[list["Sequence | None"] | None, float]


class DirectStrategy:
    """``sequence_batching.direct``: one slot per batch position."""

    def __init__(self, direct: ModelSequenceBatching.StrategyDirect, max_batch: int) -> None:
        self.slot_count = max_batch
        self._delay = direct.max_queue_delay_microseconds / 1e6
        self._min_utilization = direct.minimum_slot_utilization

    def choose(self, ready: Ready, key_of: BatchKey, now: float, closed: bool) -> Choice:
        if self._delay > 0 and self._min_utilization > 0 and not closed:
            earliest = min(request.arrival_time for _, request in ready.values())
            utilization = len(ready) / self.slot_count
            # ``now < earliest + delay``, not ``now - earliest < delay``: the same sum
            # as the wake-up time, so waking then never finds the delay unpassed by
            # float rounding (which made the batcher spin; found by the simulations).
            if now < earliest + self._delay and utilization < self._min_utilization:
                return None, earliest + self._delay
        key = None
        chosen: list[Sequence | None] = []
        for slot in range(max(ready) + 1):
            entry = ready.get(slot)
            if entry is not None:
                sequence, request = entry
                this_key = key_of(request, sequence)
                if key is None:
                    key = this_key
                if this_key == key:
                    chosen.append(sequence)
                    continue
            chosen.append(None)  # empty, or a shape that cannot join: a null request
        return chosen, now


class OldestStrategy:
    """``sequence_batching.oldest``: ``max_candidate_sequences`` slots, batched by age."""

    def __init__(self, oldest: ModelSequenceBatching.StrategyOldest, max_batch: int) -> None:
        self.slot_count = oldest.max_candidate_sequences or max_batch
        self._max_batch = max_batch
        preferred = sorted(set(oldest.preferred_batch_size))
        self._preferred = preferred
        self._max_preferred = preferred[-1] if preferred else max_batch
        self._delay = oldest.max_queue_delay_microseconds / 1e6

    def choose(self, ready: Ready, key_of: BatchKey, now: float, closed: bool) -> Choice:
        heads = [(request.arrival_time, sequence, request) for sequence, request in ready.values()]
        heads.sort(key=lambda head: head[0])
        oldest = heads[0][0]
        key = key_of(heads[0][2], heads[0][1])
        heads = [h for h in heads if key_of(h[2], h[1]) == key][: self._max_batch]
        count = len(heads)
        best = max((size for size in self._preferred if size <= count), default=0)
        # Compared with the wake-up time's own sum (see DirectStrategy.choose).
        delay_exceeded = self._delay > 0 and now >= oldest + self._delay
        if best and not delay_exceeded:
            heads = heads[:best]
        elif not (self._delay == 0 or delay_exceeded or count >= self._max_preferred or closed):
            return None, oldest + self._delay
        chosen: list[Sequence | None] = [sequence for _, sequence, _ in heads]
        return chosen, now
