"""The gRPC transport on grpcio's C-core server, with the h2 transport's toy handlers.

Same handlers and the same promises as tests/test_grpc_transport.py, seen through
grpcio clients (the HTTP/2 details are grpcio's own and tested there): messages
both ways, statuses and their text, metadata, client streams, cancellation by the
client and by deadlines, message limits, compression, the drain, and that a
second server on a bound port fails unless both share it on purpose.
"""

from __future__ import annotations

import queue
import threading
from contextlib import asynccontextmanager

import grpc
import pytest
import trio
import trio.testing

from tests.test_grpc_transport import Handlers
from trionserve.protocol.grpc.grpcio import GrpcioTransport, grpcio_arguments
from trionserve.protocol.grpc.transport import TransportOptions


@asynccontextmanager
async def serving(handlers: Handlers, graceful: float = 10.0, **options):
    """Serve the toy methods on a free loopback port; yields (port, shutdown event)."""
    shutdown = trio.Event()
    transport = GrpcioTransport(handlers.methods(), TransportOptions(**options))
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(transport.serve, "127.0.0.1", 0, shutdown, graceful)
        yield bound[0][1], shutdown
        shutdown.set()


def channel(port: int) -> grpc.Channel:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=options)


def call(port: int, path: str, payload: bytes, **kwargs):
    with channel(port) as ch:
        return ch.unary_unary(path)(payload, **kwargs)


def failure(port: int, path: str, payload: bytes = b"", **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(port, path, payload, **kwargs)
    return info.value


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


# ------------------------------------------------------------------ ordinary calls


async def test_unary_calls_including_large_messages_and_metadata():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        assert await in_thread(call, port, "/t.T/Echo", b"hi") == b"hi"
        big = bytes(range(256)) * (20 * 4096)  # 20 MiB each way
        assert await in_thread(call, port, "/t.T/Echo", big) == big
        answer = await in_thread(
            lambda: call(port, "/t.T/Metadata", b"", metadata=[("x-key", "value-1")])
        )
        assert answer == b"value-1"


async def test_error_statuses_and_their_text():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        failed = await in_thread(failure, port, "/t.T/Fail")
        assert failed.code() == grpc.StatusCode.NOT_FOUND
        assert failed.details() == "não há ✓ 100%\nend"
        crashed = await in_thread(failure, port, "/t.T/Crash")
        assert crashed.code() == grpc.StatusCode.INTERNAL
        assert crashed.details() == "internal error: RuntimeError: boom"
        missing = await in_thread(failure, port, "/t.T/Nope")
        assert missing.code() == grpc.StatusCode.UNIMPLEMENTED
        assert missing.details() == "Method not found: /t.T/Nope"


async def test_client_streaming_calls_many_at_once():
    handlers = Handlers()

    def chat(words: list[bytes]) -> list[bytes]:
        with channel(port) as ch:
            return list(ch.stream_stream("/t.T/Chat")(iter(words)))

    async with serving(handlers) as (port, _):
        words = [f"word {i}".encode() for i in range(200)]  # more than the read-ahead
        results: list = []

        async def one():
            results.append(await in_thread(chat, words))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
        assert results == [[w.upper() for w in words]] * 8


# ------------------------------------------------------------------- cancellation


async def test_client_cancel_cancels_the_handler():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        with channel(port) as ch:
            future = ch.unary_unary("/t.T/Wait").future(b"")
            await handlers.entered.wait()
            future.cancel()
            with trio.fail_after(10):
                while not handlers.cancelled:
                    await trio.sleep(0.01)
            assert handlers.cancelled == ["/t.T/Wait"]
            assert await in_thread(ch.unary_unary("/t.T/Echo"), b"still here") == b"still here"


async def test_cancelled_stream_cancels_its_handler():
    handlers = Handlers()
    handlers.chat = handlers.wait  # a streaming call that waits
    handlers_methods = handlers.methods()
    assert handlers_methods["/t.T/Chat"].client_streaming
    async with serving(handlers) as (port, _):
        with channel(port) as ch:
            requests: queue.Queue = queue.Queue()
            responses = ch.stream_stream("/t.T/Chat")(iter(requests.get, None))
            requests.put(b"x")
            await handlers.entered.wait()
            responses.cancel()
            with trio.fail_after(10):
                while not handlers.cancelled:
                    await trio.sleep(0.01)
            requests.put(None)
        assert handlers.cancelled == ["/t.T/Chat"]


async def test_deadline_cancels_the_handler_with_deadline_exceeded():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        error = await in_thread(lambda: failure(port, "/t.T/Wait", timeout=0.2))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with trio.fail_after(10):
            while not handlers.cancelled:
                await trio.sleep(0.01)
        assert handlers.cancelled == ["/t.T/Wait"]


# ---------------------------------------------------------- messages and options


async def test_message_size_limit():
    handlers = Handlers()
    async with serving(handlers, max_message_size=1000) as (port, _):
        assert await in_thread(call, port, "/t.T/Echo", b"x" * 1000) == b"x" * 1000
        error = await in_thread(failure, port, "/t.T/Echo", b"x" * 1001)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_responses_compressed_for_clients_that_accept_it():
    handlers = Handlers()
    async with serving(handlers, response_compression_level=6) as (port, _):
        assert await in_thread(call, port, "/t.T/Echo", b"a" * 5000) == b"a" * 5000
    arguments = dict(grpcio_arguments(TransportOptions(response_compression_level=6)))
    assert arguments["grpc.default_compression_algorithm"] == grpc.Compression.Gzip.value
    assert "grpc.default_compression_algorithm" not in dict(grpcio_arguments(TransportOptions()))


def test_grpc_transport_flag(monkeypatch):
    from trionserve.cli import options_from_args

    def transport(*flags: str) -> str:
        return options_from_args(["--model-repository=/nonexistent", *flags]).grpc.transport

    monkeypatch.delenv("TRIONSERVE_GRPC_TRANSPORT", raising=False)
    assert transport() == "h2"
    assert transport("--grpc-transport=grpcio") == "grpcio"
    monkeypatch.setenv("TRIONSERVE_GRPC_TRANSPORT", "grpcio")
    assert transport() == "grpcio"
    assert transport("--grpc-transport=h2") == "h2"


def test_options_map_onto_grpcio_arguments():
    options = TransportOptions(
        max_message_size=1234,
        keepalive_time=10.0,
        keepalive_timeout=2.5,
        keepalive_permit_without_calls=True,
    )
    arguments = dict(grpcio_arguments(options, [("grpc.http2.max_ping_strikes", 3)]))
    assert arguments["grpc.max_receive_message_length"] == 1234
    assert arguments["grpc.keepalive_time_ms"] == 10_000
    assert arguments["grpc.keepalive_timeout_ms"] == 2_500
    assert arguments["grpc.keepalive_permit_without_calls"] == 1
    assert arguments["grpc.so_reuseport"] == 0
    assert arguments["grpc.http2.max_ping_strikes"] == 3
    assert dict(grpcio_arguments(TransportOptions(reuse_port=True)))["grpc.so_reuseport"] == 1
    unlimited = dict(grpcio_arguments(TransportOptions(keepalive_time=None)))
    assert unlimited["grpc.max_receive_message_length"] == -1
    assert unlimited["grpc.keepalive_time_ms"] == 2**31 - 1


async def test_a_bound_port_is_not_shared_unless_asked():
    handlers = Handlers()
    async with serving(handlers) as (port, _):
        other = GrpcioTransport(handlers.methods(), TransportOptions())
        with pytest.raises(OSError, match="cannot listen"):
            await other.serve("127.0.0.1", port, trio.Event(), 1.0)
    async with serving(handlers, reuse_port=True) as (port, _):
        shared = GrpcioTransport(handlers.methods(), TransportOptions(reuse_port=True))
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(shared.serve, "127.0.0.1", port, stop, 1.0)
            stop.set()


# ------------------------------------------------------------------------- drain


async def test_shutdown_drains_in_flight_calls_and_ends_streams():
    handlers = Handlers()
    async with serving(handlers) as (port, shutdown):
        with channel(port) as ch:
            waiting = ch.unary_unary("/t.T/Wait").future(b"")
            requests: queue.Queue = queue.Queue()
            chat = ch.stream_stream("/t.T/Chat")(iter(requests.get, None))
            requests.put(b"x")
            first = await in_thread(next, chat)
            assert first == b"X"
            await handlers.entered.wait()
            shutdown.set()
            # The streaming call stops reading and ends cleanly...
            with pytest.raises(grpc.RpcError) as info:
                await in_thread(next, chat)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == "shutting down"
            requests.put(None)
            # ...new calls are refused...
            fresh = await in_thread(
                lambda: failure(port, "/t.T/Echo", b"late", timeout=5)
            )
            assert fresh.code() == grpc.StatusCode.UNAVAILABLE
            # ...and the unary call in flight is still served.
            assert not waiting.done()
            handlers.release.set()
            assert await in_thread(waiting.result, 10) == b"released"
    assert handlers.cancelled == []


async def test_calls_left_after_the_grace_period_are_cancelled():
    handlers = Handlers()
    async with serving(handlers, graceful=0.2) as (port, shutdown):
        with channel(port) as ch:
            waiting = ch.unary_unary("/t.T/Wait").future(b"")
            await handlers.entered.wait()
            shutdown.set()
            with pytest.raises(grpc.RpcError):
                await in_thread(waiting.result, 10)
    assert handlers.cancelled == ["/t.T/Wait"]


def test_no_thread_is_left_behind():
    """Every grpcio worker thread the transport used has finished its call."""
    before = {t.ident for t in threading.enumerate()}

    async def main():
        handlers = Handlers()
        async with serving(handlers) as (port, _):
            for _ in range(3):
                assert await in_thread(call, port, "/t.T/Echo", b"x") == b"x"

    trio.run(main)
    busy = [
        t for t in threading.enumerate()
        if t.ident not in before and t.name.startswith("grpcio") and t.is_alive()
    ]
    for thread in busy:
        thread.join(5)
    assert not [t for t in busy if t.is_alive()]
