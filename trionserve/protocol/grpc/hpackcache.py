"""h2's HPACK encoder and decoder with the blocks of repeated header lists kept.

Part of :mod:`~trionserve.protocol.grpc.upstream` (where trionserve leans on the
private parts of h2, hpack and hyperframe), apart for its size: hpack's
``Encoder.header_table.resized`` and ``.dynamic_entries`` are read, and
``Decoder.header_table.dynamic_entries`` and ``.maxsize``, each checked by
``tests/unit/test_upstream_internals.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import hpack
from hpack.struct import HeaderTuple, HeaderWeaklyTyped

__all__ = ["CachingDecoder", "CachingEncoder"]

# What hpack's Encoder.encode takes.
_EncoderHeaders = (
    Iterable[
        HeaderTuple | tuple[bytes | str, bytes | str] | tuple[bytes | str, bytes | str, bool | None]
    ]
    | dict[bytes | str, bytes | str]
)


class CachingEncoder(hpack.Encoder):
    """h2's HPACK encoder, with the blocks of constant header lists encoded once.

    Every successful call answers with the same response headers and the same
    trailers; HPACK-encoding them per call cost more than the rest of sending
    them. The cached blocks use only the static table and literals that are never
    indexed, so they are valid whatever the dynamic table holds and leave it as
    it is. A pending table size update goes out with h2's own encoding first.
    """

    def __init__(self, constant: Sequence[Sequence[tuple[bytes, bytes]]]) -> None:
        super().__init__()
        self._blocks: dict[tuple, bytes] = {
            tuple(headers): _state_free_block(headers) for headers in constant
        }

    def constant_block(self, headers: Iterable[HeaderWeaklyTyped]) -> bytes | None:
        """The block of a constant header list, or None (another list, or a
        table size update pending)."""
        if self.header_table.resized:
            return None
        return self._blocks.get(tuple(headers))

    def encode(self, headers: _EncoderHeaders, huffman: bool = True) -> bytes:
        if isinstance(headers, dict):
            return super().encode(headers, huffman)
        listed = list(headers)  # h2 may pass a generator (normalized headers)
        if not self.header_table.resized:
            block = self._blocks.get(tuple(listed))
            if block is not None:
                return block
        return super().encode(listed, huffman)


def _state_free_block(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    encoder = hpack.Encoder()
    block = encoder.encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in headers])
    assert not encoder.header_table.dynamic_entries  # only the static table is used
    return block


class CachingDecoder(hpack.Decoder):
    """h2's HPACK decoder, with the header lists of repeated all-indexed blocks kept.

    A gRPC client sends the same request headers on every call; once its encoder
    has them in the dynamic table, the block is one byte per header, each an
    index. Decoding such a block reads the table and does not change it, so its
    header list is the same for as long as the table is: it is kept, keyed by
    the block, with the table's newest entry, size and limits it was decoded
    under (an insertion always makes a new newest entry; an eviction without
    one changes the size). Anything else decodes as hpack decodes it. Bounded:
    at most ``_BLOCKS`` lists of at most ``_LIST_BYTES`` each (a gRPC client's
    request headers are a few hundred bytes), each pinning at most one table
    entry (no larger than the table).
    """

    _BLOCKS = 16  # all dropped when full
    _LIST_BYTES = 4096

    def __init__(self) -> None:
        # The last block decoded (raw) that left the table as it was, its
        # headers and the header list limit it was decoded under: the same
        # block decodes to them while nothing changed the table (any other
        # block decoded, or the table's size set, forgets it). A caller checks
        # it before decoding (H2Connection._unary_open: a client's repeated
        # request headers), with no call.
        self.repeated: tuple[bytes, tuple, int] | None = None
        super().__init__()
        self._kept: dict[tuple[bytes, bool], tuple] = {}
        # A block already decoded, and its headers: what h2 gets when it decodes
        # that block next (H2Connection hands it a HEADERS frame it has read).
        self.predecoded: tuple[object, Iterable] | None = None

    @hpack.Decoder.header_table_size.setter  # type: ignore[attr-defined]
    def header_table_size(self, value: int) -> None:
        self.repeated = None  # (evictions)
        hpack.Decoder.header_table_size.fset(self, value)  # type: ignore[attr-defined]

    def decode(self, data: bytes, raw: bool = False) -> Iterable[HeaderTuple]:
        predecoded = self.predecoded
        if predecoded is not None:
            self.predecoded = None
            if predecoded[0] is data or predecoded[0] == data:
                return predecoded[1]
        self.repeated = None  # (set again below for a block that changes nothing)
        table = self.header_table
        entries = table.dynamic_entries
        state = (
            entries[0] if entries else None,
            len(entries),
            table.maxsize,
            self.max_allowed_table_size,
            self.max_header_list_size,
        )
        key = (bytes(data), raw)
        kept = self._kept.get(key)
        # The newest entry by identity: the kept state holds it, so it stays alive.
        if kept is not None and kept[0][0] is state[0] and kept[0][1:] == state[1:]:
            if raw:
                self.repeated = (key[0], kept[1], self.max_header_list_size)
            return list(kept[1])
        headers = super().decode(data, raw)
        # Single-byte indexed fields only (0x80 | index, index 1..126): no literal,
        # no table size update, no multi-byte index.
        if key[0] and 0x81 <= min(key[0]) and max(key[0]) <= 0xFE:
            if sum(len(name) + len(value) for name, value in headers) <= self._LIST_BYTES:
                if len(self._kept) >= self._BLOCKS:
                    self._kept.clear()
                kept = self._kept[key] = (state, tuple(headers))
                if raw:
                    self.repeated = (key[0], kept[1], self.max_header_list_size)
        return headers
