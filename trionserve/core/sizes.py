"""Numbers of bytes as people write them: ``1048576``, ``512K``, ``64MiB``, ``8Gi``, ``1.5G``.

One reading for every flag and setting that takes a size (``--client-buffer-limit``,
``--model-memory-limit``, a model's ``model_memory``): the suffixes K, M, G and T
are powers of 1024 whether written ``K``, ``KB``, ``Ki`` or ``KiB`` (as memory is
counted), case-insensitive.
"""

from __future__ import annotations

import re

# Multipliers of the suffixes.
_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(?:([kmgt])(?:ib?|b)?|b)?\s*", re.IGNORECASE)


def parse_byte_size(text: str) -> int:
    """The bytes ``text`` says; ValueError naming it when it says none."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"expected a number of bytes (an integer, or with a suffix: K, M, G, T), got {text!r}"
        )
    return int(float(match[1]) * _SUFFIXES[(match[2] or "").lower()])
