"""Triton's classification extension: an output as its top-k "score:index:label" strings."""

from __future__ import annotations

import os

import numpy as np

from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import Tensor

# What Triton classifies, and how much of it (server src/classification.cc
# TopkClassifications: its datatype switch, kMaxClassificationElements per batch
# item); other outputs are refused with its words.
CLASSIFIED_DATATYPES = frozenset(
    ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64")
)
MAX_CLASSIFICATION_ELEMENTS = 1_000_000


def classify(tensor: Tensor, k: int, labels: list[str] | None, batched: bool) -> Tensor:
    """Replace a numeric output by its ``k`` highest entries, best first.

    For a batched model each batch item is classified on its own and the result has
    shape [batch, k]; otherwise [k]. An entry reads ``"<score>:<index>"`` followed by
    ``":<label>"`` when the output has a label file, with the score formatted as
    Triton formats it (six decimals). Outputs of a datatype Triton does not
    classify, or with more than ``MAX_CLASSIFICATION_ELEMENTS`` per batch item, are
    refused with Triton's words.
    """
    data = tensor.data
    if tensor.datatype not in CLASSIFIED_DATATYPES or data.dtype == np.object_:
        raise InvalidArgument(
            "class result not available for output due to unsupported type "
            f"'{tensor.datatype}' (output '{tensor.name}')"
        )
    rows = data.reshape(data.shape[0], -1) if batched and data.ndim else data.reshape(1, -1)
    if rows.shape[1] > MAX_CLASSIFICATION_ELEMENTS:
        raise InvalidArgument(
            f"classification output tensor too large (output '{tensor.name}' has "
            f"{rows.shape[1]} elements per batch item, at most "
            f"{MAX_CLASSIFICATION_ELEMENTS} are classified)"
        )
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


def read_labels(path: str | os.PathLike[str]) -> list[str]:
    """One label per line, as Triton reads label files."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\r\n") for line in f]
