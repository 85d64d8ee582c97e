"""The response cache (Triton's ``local`` cache): responses of models with
``response_cache { enable: true }`` kept in memory and reused for identical requests.

Triton core's ``TritonCacheManager`` and ``TritonCache`` (src/cache_manager.cc) with
the ``local`` cache implementation, in one :class:`ResponseCache` per server.

Enabled for the server with ``--cache-config local,size=BYTES`` (or Triton's older
``--response-cache-byte-size BYTES``). A request's key hashes the model name and
version, every input (name, datatype, shape, bytes), the outputs it asks for and
its parameters, so a hit returns exactly what the model would have answered.
Only successful responses of non-decoupled models are stored; an entry larger
than the whole cache is not stored; the least recently used entries are evicted
to make room. The cached tensors are copies: the client's buffers (or shared
memory) are never kept. All calls come from the Trio thread.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor

# Request parameters that only say how the answer travels, not what it is.
_TRANSPORT_PARAMETERS = frozenset(
    {
        "binary_data_output",
        "binary_data",
        "binary_data_size",
        "shared_memory_region",
        "shared_memory_offset",
        "shared_memory_byte_size",
        "headers",
        "triton_enable_empty_final_response",
    }
)


def parse_cache_config(settings: list[str], byte_size: int | None) -> int:
    """The cache size in bytes from ``--cache-config`` settings (``local,size=N``)
    and ``--response-cache-byte-size``; 0 when no cache is configured.

    Checked in Triton's order: both flags given is an error (server
    src/command_line_parser.cc), then settings naming more than one cache (core
    src/server.cc InferenceServer::Init), then each setting."""
    if byte_size is not None and settings:
        raise InvalidArgument(
            "Error: Incompatible flags --response-cache-byte-size and --cache-config "
            "both provided. Please provide one or the other."
        )
    if len({setting.partition(",")[0] for setting in settings}) > 1:
        raise InvalidArgument(
            "found multiple cache configurations, but only a single cache is currently supported"
        )
    size = byte_size or 0
    for setting in settings:
        kind, _, rest = setting.partition(",")
        key, _, value = rest.partition("=")
        if kind == "redis":
            continue  # redis_settings reads them
        if kind != "local":
            raise InvalidArgument(f"--cache-config '{setting}': the caches are 'local' and 'redis'")
        if key != "size":
            raise InvalidArgument(f"--cache-config '{setting}': unknown setting '{key}'")
        try:
            size = int(value)
        except ValueError:
            raise InvalidArgument(
                f"--cache-config '{setting}': size must be a number of bytes"
            ) from None
        if size < 0:
            raise InvalidArgument(f"--cache-config '{setting}': size must not be negative")
    return size


def redis_settings(settings: list[str]) -> dict[str, str] | None:
    """The ``redis,<key>=<value>`` settings of ``--cache-config`` as one mapping
    (Triton's cache_config_settings_["redis"]), or None without any."""
    values: dict[str, str] = {}
    found = False
    for setting in settings:
        kind, _, rest = setting.partition(",")
        if kind == "redis":
            found = True
            key, _, value = rest.partition("=")
            values[key] = value
    return values if found else None


@dataclass(slots=True)
class _Entry:
    outputs: list[Tensor]
    parameters: dict
    nbytes: int


class ResponseCache:
    """An LRU cache of responses, bounded by the bytes of their tensors."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self.lookups = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(model: str, version: int, request: InferenceRequest) -> bytes:
        digest = hashlib.blake2b(digest_size=32)
        digest.update(f"{model}\0{version}\0".encode())
        for name in sorted(request.inputs):
            tensor = request.inputs[name]
            data = tensor.data
            digest.update(f"{name}\0{tensor.datatype}\0{data.shape}\0".encode())
            if data.dtype == np.object_:
                for item in data.flat:
                    item = item if isinstance(item, bytes) else str(item).encode()
                    digest.update(struct.pack("<I", len(item)))
                    digest.update(item)
            else:
                digest.update(np.ascontiguousarray(data).data)
        outputs = request.requested_outputs
        names = (
            None
            if outputs is None
            else sorted([o.name, _meaningful(o.parameters)] for o in outputs)
        )
        parameters = _meaningful(request.parameters)
        digest.update(json.dumps([names, parameters], sort_keys=True, default=str).encode())
        return digest.digest()

    def lookup(
        self, key: bytes, request: InferenceRequest, model_version: str
    ) -> InferenceResponse | None:
        """The cached response for ``request``, or None."""
        self.lookups += 1
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return InferenceResponse(
            request.model_name,
            model_version,
            request.id,
            list(entry.outputs),
            dict(entry.parameters),
        )

    def insert(self, key: bytes, response: InferenceResponse) -> str | None:
        """Keep a response; returns why it was not kept (an entry larger than
        the whole cache, in the local cache's words: local_cache
        src/local_cache.cc Allocate), or None."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return None
        outputs = [Tensor(t.name, t.datatype, _owned(t.data)) for t in response.outputs]
        nbytes = entry_byte_size(outputs)
        if nbytes > self.capacity:
            return (
                f"Requested byte_size: {nbytes} is greater than total cache size: {self.capacity}"
            )
        while self.used + nbytes > self.capacity and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self.used -= evicted.nbytes
            self.evictions += 1
        self._entries[key] = _Entry(outputs, dict(response.parameters), nbytes)
        self.used += nbytes
        return None

    # What the DataPlane awaits: the in-memory cache answers at once; the Redis
    # cache (core/redis_cache.py) overrides these with calls to its server.

    async def fetch(
        self, key: bytes, request: InferenceRequest, model_version: str
    ) -> InferenceResponse | None:
        return self.lookup(key, request, model_version)

    async def store(self, key: bytes, response: InferenceResponse) -> str | None:
        return self.insert(key, response)

    async def connect(self) -> None:
        """Reach the cache's storage before any model loads (nothing to reach)."""

    def close(self) -> None:
        return None

    @property
    def utilization(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


def _meaningful(parameters: dict) -> dict:
    return {k: v for k, v in parameters.items() if k not in _TRANSPORT_PARAMETERS}


def _owned(data: np.ndarray) -> np.ndarray:
    """A read-only copy that shares nothing with a client's or a model's buffers."""
    copy = np.array(data, copy=True)
    copy.flags.writeable = False
    return copy


def _nbytes(data: np.ndarray) -> int:
    """The bytes of a tensor's data as Triton holds it: BYTES elements each with
    their 4-byte length."""
    if data.dtype == np.object_:
        return sum(
            4 + (len(x) if isinstance(x, bytes) else len(str(x).encode())) for x in data.flat
        )
    return data.nbytes


def entry_byte_size(outputs: list[Tensor]) -> int:
    """The bytes a response takes in the cache, counted as Triton packs it (core
    src/cache_entry.cc SerializeResponse / SerializeResponseOutput): the output
    count, then per output its packed size, name, datatype and shape each with
    their length, and its data with its byte size."""
    total = 4
    for tensor in outputs:
        total += 8 + 4 + len(tensor.name.encode()) + 4 + len(tensor.datatype.encode())
        total += 4 + 8 * tensor.data.ndim + 8 + _nbytes(tensor.data)
    return total
