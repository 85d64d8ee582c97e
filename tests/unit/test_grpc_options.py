"""tritonserver's --grpc-* flags: parsed into GrpcOptions, then transport settings."""

from __future__ import annotations

import pytest

from trionserve.cli.options import options_from_args
from trionserve.protocol.grpc.options import GrpcOptions


def grpc_options(*flags: str) -> GrpcOptions:
    return options_from_args(["--model-repository=/nonexistent", *flags]).grpc


def test_defaults_are_tritons():
    options = grpc_options()
    assert options == GrpcOptions()
    transport = options.transport_options()
    assert transport.keepalive_time == 7200.0
    assert transport.keepalive_timeout == 20.0
    assert transport.keepalive_permit_without_calls is False
    assert transport.response_compression_level is None
    # Limits of ours (Triton has none): 64 MiB messages, as its HTTP body limit.
    assert transport.max_message_size == 64 * 1024 * 1024
    assert transport.max_concurrent_streams == 1024
    assert transport.max_connection_buffer == 256 * 1024 * 1024


def test_limit_flags():
    options = grpc_options(
        "--grpc-max-message-size=1048576",
        "--grpc-max-concurrent-streams=8",
        "--grpc-max-connection-buffer=2097152",
    )
    transport = options.transport_options()
    assert transport.max_message_size == 1048576
    assert transport.max_concurrent_streams == 8
    assert transport.max_connection_buffer == 2097152


def test_flags():
    options = grpc_options(
        "--grpc-port=9001",
        "--grpc-header-forward-pattern=^x-trace",
        "--grpc-infer-allocation-pool-size=16",
        "--grpc-infer-response-compression-level=HIGH",
        "--grpc-keepalive-time=1500",
        "--grpc-keepalive-timeout=250",
        "--grpc-keepalive-permit-without-calls=true",
        "--grpc-http2-max-pings-without-data=0",
        "--grpc-http2-min-recv-ping-interval-without-data=1000",
        "--grpc-http2-max-ping-strikes=5",
    )
    assert options.header_forward_pattern == "(?i)^x-trace"  # case-insensitive, as Triton
    assert options.infer_allocation_pool_size == 16
    assert options.http2_max_ping_strikes == 5
    transport = options.transport_options()
    assert transport.keepalive_time == 1.5
    assert transport.keepalive_timeout == 0.25
    assert transport.keepalive_permit_without_calls is True
    assert transport.response_compression_level == 9


def test_keepalive_time_zero_means_no_pings():
    assert grpc_options("--grpc-keepalive-time=0").transport_options().keepalive_time is None


@pytest.mark.parametrize(
    "flag",
    [
        "--grpc-header-forward-pattern=(unclosed",
        "--grpc-infer-response-compression-level=max",
        "--grpc-keepalive-time=-1",
        "--grpc-infer-allocation-pool-size=many",
    ],
)
def test_bad_flags_are_rejected(flag, capsys):
    with pytest.raises(SystemExit):
        grpc_options(flag)
    assert "error" in capsys.readouterr().err


async def test_stream_budget_bounds_requests_in_flight_by_response_bytes():
    """A stream admits requests while in flight x largest message fits the bytes
    limit (issue 18 item 6): large responses leave room for few requests."""
    import trio
    import trio.testing

    from trionserve.protocol.grpc.streams import StreamBudget

    budget = StreamBudget(count_limit=100, byte_limit=1000)
    admitted = []

    async def admit(name: str, size: int) -> None:
        await budget.acquire(size)
        admitted.append(name)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(admit, f"small{i}", 10)
        await trio.testing.wait_all_tasks_blocked()
        assert len(admitted) == 5  # 5 x 10 bytes: plenty of room
        budget.observe(390)  # a response of 390 bytes: 400 a request with it
        nursery.start_soon(admit, "next", 10)
        await trio.testing.wait_all_tasks_blocked()
        assert len(admitted) == 5  # 6 x 400 > 1000
        for _ in range(3):
            budget.release()
        await trio.testing.wait_all_tasks_blocked()
        assert len(admitted) == 5  # 2 in flight: a third would make 3 x 400 > 1000
        budget.release()
        await trio.testing.wait_all_tasks_blocked()
        assert admitted[-1] == "next" and budget.in_flight == 2  # 2 x 400 <= 1000
        budget.release()
        budget.release()
    # One request is always admitted, however large.
    await budget.acquire(10_000)
    assert budget.in_flight == 1
