"""Triton's classification extension: an output as its top-k "score:index:label" strings."""

from __future__ import annotations

import numpy as np

from trionserve.core.errors import InvalidArgument
from trionserve.core.types import Tensor


def classify(tensor: Tensor, k: int, labels: list[str] | None, batched: bool) -> Tensor:
    """Replace a numeric output by its ``k`` highest entries, best first.

    For a batched model each batch item is classified on its own and the result has
    shape [batch, k]; otherwise [k]. An entry reads ``"<score>:<index>"`` followed by
    ``":<label>"`` when the output has a label file, with the score formatted as
    Triton formats it (six decimals).
    """
    data = tensor.data
    if data.dtype == np.object_ or tensor.datatype in ("BYTES", "BF16"):
        raise InvalidArgument(
            f"classification is not supported for output '{tensor.name}' of datatype "
            f"{tensor.datatype}"
        )
    rows = data.reshape(data.shape[0], -1) if batched and data.ndim else data.reshape(1, -1)
    count = min(k, rows.shape[1])
    results = np.empty((rows.shape[0], count), dtype=np.object_)
    for r, row in enumerate(rows):
        # Stable sort on the negated scores keeps lower indices first among ties.
        order = np.argsort(-row.astype(np.float64), kind="stable")[:count]
        for c, index in enumerate(order):
            text = f"{float(row[index]):f}:{int(index)}"
            if labels is not None and index < len(labels):
                text += f":{labels[index]}"
            results[r, c] = text.encode()
    return Tensor(tensor.name, "BYTES", results if batched else results.reshape(count))


def read_labels(path) -> list[str]:
    """One label per line, as Triton reads label files."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\r\n") for line in f]
