"""Triton's ``redis`` response cache (triton-inference-server/redis_cache): the
responses of models with ``response_cache { enable: true }`` kept in a Redis
server, shared by every server that points at it.

Enabled with ``--cache-config redis,host=H --cache-config redis,port=P`` and the
other settings of its source (``src/redis_cache.cc`` ``RedisCache::Create``):
``user``, ``password`` (else ``TRITONCACHE_REDIS_USERNAME`` /
``TRITONCACHE_REDIS_PASSWORD`` from the environment), ``db``,
``connect_timeout``, ``socket_timeout`` and ``wait_timeout`` (ms), ``pool_size``,
and ``tls_enabled`` with ``cert``, ``key``, ``cacert``. Numbers are read as
``std::atoi`` reads them (``port=nonexistent`` is port 0). The server pings Redis
before it loads a model and does not start without it, with the plugin's words
("Failed to initialize RedisCache: ...").

An entry is a Redis hash as the plugin writes one (``src/cache_api.cc``): fields
``0:b`` (the response packed as core packs it, ``src/cache_entry.cc``), ``0:s``
(its size), ``0:t`` and ``0:i`` (memory type and id: CPU, 0). Calls to Redis run in
worker threads (redis-py's client is blocking), so a slow Redis never stalls the
event loop; a lookup or insert that fails is logged and counted a miss.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import trio

from trionserve.core import datatypes
from trionserve.core.bytes_tensor import deserialize_bytes_tensor, serialize_bytes_tensor
from trionserve.core.errors import InternalError, InvalidArgument
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.core.response_cache import ResponseCache

log = structlog.get_logger(__name__)

USERNAME_ENV = "TRITONCACHE_REDIS_USERNAME"
PASSWORD_ENV = "TRITONCACHE_REDIS_PASSWORD"

_ADDRESS_MISSING = (
    "Failed to initialize RedisCache, didn't specify address. Must at a minimum "
    "specify 'host' and 'port' in the configuration - e.g. tritonserver "
    "--cache-config redis,host=redis --cache-config redis,port=6379 "
    "--model-repository=/models ..."
)


def _atoi(value: str) -> int:
    """std::atoi: the leading integer of ``value`` (after spaces), 0 if none."""
    text = value.lstrip()
    end = 1 if text[:1] in ("+", "-") else 0
    while end < len(text) and text[end].isdigit():
        end += 1
    try:
        return int(text[:end])
    except ValueError:
        return 0


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """RedisCache::Create's connection and pool options."""

    host: str
    port: int
    user: str = ""
    password: str = ""
    db: int = 0
    connect_timeout_ms: int = 0  # 0: redis++'s default, no limit
    socket_timeout_ms: int = 0
    pool_size: int = 1
    wait_timeout_ms: int = 1000
    tls: bool = False
    cert: str = ""
    key: str = ""
    cacert: str = ""

    @classmethod
    def parse(cls, settings: dict[str, str]) -> RedisSettings:
        """The ``redis,<key>=<value>`` settings, as RedisCache::Create reads them:
        host and port required, user and password from the environment unless
        given."""
        if "host" not in settings or "port" not in settings:
            raise InvalidArgument(_ADDRESS_MISSING)
        number = {
            k: _atoi(settings[k])
            for k in ("db", "connect_timeout", "socket_timeout", "pool_size", "wait_timeout")
            if k in settings
        }
        return cls(
            host=settings["host"],
            port=_atoi(settings["port"]),
            user=settings.get("user", os.environ.get(USERNAME_ENV, "")),
            password=settings.get("password", os.environ.get(PASSWORD_ENV, "")),
            db=number.get("db", 0),
            connect_timeout_ms=number.get("connect_timeout", 0),
            socket_timeout_ms=number.get("socket_timeout", 0),
            pool_size=number.get("pool_size", 1) or 1,
            wait_timeout_ms=number.get("wait_timeout", 1000),
            tls=settings.get("tls_enabled") == "true",
            cert=settings.get("cert", ""),
            key=settings.get("key", ""),
            cacert=settings.get("cacert", ""),
        )


def pack_response(outputs: list[Tensor]) -> bytes:
    """A response as core's CacheEntry::SerializeResponse packs it: the output
    count (u32), then per output its packed size (u64), name, datatype, shape
    (each after its u32 byte length; dims int64) and data (after its u64 size);
    little-endian, BYTES data as length-prefixed elements."""
    parts = [struct.pack("<I", len(outputs))]
    for tensor in outputs:
        name = tensor.name.encode()
        dtype = tensor.datatype.encode()
        shape = struct.pack(f"<{tensor.data.ndim}q", *tensor.data.shape)
        if tensor.data.dtype == np.object_:
            data = serialize_bytes_tensor(tensor.data)
        else:
            data = np.ascontiguousarray(tensor.data).tobytes()
        body = b"".join(
            (
                struct.pack("<I", len(name)),
                name,
                struct.pack("<I", len(dtype)),
                dtype,
                struct.pack("<I", len(shape)),
                shape,
                struct.pack("<Q", len(data)),
                data,
            )
        )
        parts += [struct.pack("<Q", len(body)), body]
    return b"".join(parts)


def unpack_response(buffer: bytes) -> list[Tensor]:
    """The outputs :func:`pack_response` packed (core CacheEntry::DeserializeBuffer)."""
    view = memoryview(buffer)
    (count,) = struct.unpack_from("<I", view, 0)
    offset = 4
    outputs: list[Tensor] = []
    for _ in range(count):
        offset += 8  # the output's packed size
        fields: list[bytes] = []
        for _field in range(3):
            (size,) = struct.unpack_from("<I", view, offset)
            fields.append(bytes(view[offset + 4 : offset + 4 + size]))
            offset += 4 + size
        (size,) = struct.unpack_from("<Q", view, offset)
        data = bytes(view[offset + 8 : offset + 8 + size])
        offset += 8 + size
        name, dtype = fields[0].decode(), fields[1].decode()
        shape = struct.unpack(f"<{len(fields[2]) // 8}q", fields[2])
        if dtype == "BYTES":
            array = deserialize_bytes_tensor(data, None, f"cached output '{name}'").reshape(shape)
        else:
            array = np.frombuffer(data, datatypes.from_wire(dtype).numpy).reshape(shape)
        array.flags.writeable = False
        outputs.append(Tensor(name, dtype, array))
    return outputs


def _reason(exc: BaseException) -> str:
    """A redis-py error in the words of redis++ (what Triton's plugin reports):
    the server's reply with its error code, the OS's reason for a connection."""
    import redis

    if isinstance(exc, redis.AuthenticationError):
        # redis-py strips the reply's code; the server sent NOAUTH when no
        # password was given and WRONGPASS for a wrong one.
        text = str(exc)
        return f"NOAUTH {text}" if "Authentication required" in text else f"WRONGPASS {text}"
    cause = exc.__cause__ or exc.__context__
    strerror = getattr(cause, "strerror", None)
    return strerror or str(exc)


class RedisResponseCache(ResponseCache):
    """The response cache in Redis: :class:`ResponseCache`'s keys and the same
    async ``fetch`` / ``store`` the DataPlane calls, with the entries in Redis."""

    def __init__(self, settings: RedisSettings) -> None:
        super().__init__(0)
        self.settings = settings
        self._client: Any = None
        self._limiter = trio.CapacityLimiter(settings.pool_size)

    def _connect(self) -> Any:
        import redis

        s = self.settings
        options: dict[str, Any] = {
            "host": s.host,
            "port": s.port,
            "db": s.db,
            "username": s.user or None,
            "password": s.password or None,
            "socket_connect_timeout": s.connect_timeout_ms / 1000 or None,
            "socket_timeout": s.socket_timeout_ms / 1000 or None,
            "max_connections": s.pool_size,
            # RESP2, as redis++ speaks it: no HELLO before the first command.
            "protocol": 2,
        }
        if s.tls:
            options.update(
                ssl=True,
                ssl_certfile=s.cert or None,
                ssl_keyfile=s.key or None,
                ssl_ca_certs=s.cacert or None,
            )
        client = redis.Redis(**options)
        try:
            answer = client.ping()
        except redis.AuthenticationError as exc:  # a ConnectionError in redis-py
            client.close()
            raise InternalError(f"Failed to initialize RedisCache: {_reason(exc)}") from None
        except redis.ConnectionError as exc:
            client.close()
            raise InternalError(
                f"Failed to initialize RedisCache: failed to connect to Redis "
                f"({s.host}:{s.port}): {_reason(exc)}"
            ) from None
        except redis.RedisError as exc:
            client.close()
            raise InternalError(f"Failed to initialize RedisCache: {_reason(exc)}") from None
        if answer is not True:
            client.close()
            raise InternalError("Failed to initialize RedisCache: Failed to ping Redis server.")
        log.debug("Successfully connected to Redis")
        return client

    async def connect(self) -> None:
        """Ping the server once, at start (redis_cache.cc init_client)."""
        self._client = await trio.to_thread.run_sync(self._connect)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def fetch(
        self, key: bytes, request: InferenceRequest, model_version: str
    ) -> InferenceResponse | None:
        name = key.hex()
        self.lookups += 1
        try:
            fields = await trio.to_thread.run_sync(
                self._client.hgetall, name, limiter=self._limiter
            )
        except Exception as exc:
            log.error(f"Failed to retrieve key: {name}. {_reason(exc)}")
            fields = {}
        buffer = fields.get(b"0:b")
        if buffer is None or b"0:s" not in fields:
            self.misses += 1
            return None
        self.hits += 1
        outputs = unpack_response(buffer)
        return InferenceResponse(request.model_name, model_version, request.id, outputs, {})

    async def store(self, key: bytes, response: InferenceResponse) -> str | None:
        name = key.hex()
        packed = pack_response(response.outputs)
        entry = {"0:b": packed, "0:s": str(len(packed)), "0:t": "0", "0:i": "0"}
        try:
            await trio.to_thread.run_sync(
                lambda: self._client.hset(name, mapping=entry), limiter=self._limiter
            )
        except Exception as exc:  # logged by the caller, as core logs a failed insert
            return f"Failed to insert key: {name}. {_reason(exc)}"
        return None
