"""The server-wide budget of bytes held for clients (core/client_budget.py), with
the requests and transports that count in it, on Trio's virtual clock."""

from __future__ import annotations

import argparse
import threading

import numpy as np
import pytest
import trio
import trio.testing

from trionserve.cli.values import byte_size
from trionserve.core.client_budget import ClientBudget, default_limit
from trionserve.core.errors import ResourceExhausted
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.protocol.grpc.flow import ConnectionBuffer


def response(nbytes: int) -> InferenceResponse:
    return InferenceResponse("m", "1", outputs=[Tensor("OUT", "UINT8", np.zeros(nbytes, np.uint8))])


def streaming_request(budget: ClientBudget, request_id: str) -> InferenceRequest:
    request = InferenceRequest("m", id=request_id)
    request.budget = budget
    request.undelivered_limit = 1 << 40
    return request


def test_byte_sizes_with_suffixes():
    parse = byte_size(1024)
    assert parse("1048576") == 1 << 20
    assert parse("64M") == parse("64MiB") == parse("64mi") == parse("64MB") == 64 << 20
    assert parse("1.5G") == parse("1.5Gi") == 3 << 29
    assert parse("2T") == 2 << 40
    assert parse("4k") == 4096
    for bad in ("", "12X", "-1G", "1.2.3M", "M"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a number of bytes"):
            parse(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1024 bytes"):
        parse("1000")


def test_workers_share_the_budget():
    """With --workers N the budget is the whole server's: each worker holds its Nth."""
    from trionserve.cli.options import options_from_args

    def limit(*flags: str) -> int | None:
        return options_from_args(["--model-repository=models", *flags]).client_buffer_limit

    assert limit() is None  # the default, resolved by the budget
    assert limit("--client-buffer-limit=3G") == 3 << 30
    assert limit("--client-buffer-limit=3G", "--workers=3", "--worker-index=1") == 1 << 30
    assert limit("--workers=2", "--worker-index=0") == default_limit() // 2


def test_the_default_is_a_quarter_of_the_memory():
    import os

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < default_limit() <= memory // 4
    assert ClientBudget().limit == default_limit()


def test_new_requests_are_refused_at_the_limit_and_producers_wait_before_it():
    budget = ClientBudget(800)
    assert (budget.high, budget.low) == (700, 600)
    changes: list[bool] = []
    budget.subscribe(changes.append)
    budget.reserve(650)
    budget.admit("a request", 150)  # fits: 800
    assert not budget.full
    budget.reserve(50)  # 700: producers wait
    assert budget.full and changes == [True]
    budget.admit("a request")  # still room for new requests below the limit
    with pytest.raises(ResourceExhausted) as refused:
        budget.admit("a request body", 101)
    message = refused.value.message
    assert "a request body refused" in message and "--client-buffer-limit" in message
    assert "holds 700 bytes" in message and "this one 101 bytes" in message
    assert "budget of 800 bytes" in message
    budget.release(50)  # 650: not low enough yet
    assert budget.full
    budget.release(50)  # 600: room again
    assert not budget.full and changes == [True, False]
    assert budget.refused == 1 and budget.peak == 700
    late: list[bool] = []
    budget.reserve(200)
    budget.subscribe(late.append)  # told at once that it is full
    assert late == [True]


def test_a_request_counts_its_undelivered_responses():
    async def main():
        budget = ClientBudget(10_000)
        request = streaming_request(budget, "r")
        assert request.send(response(100), final=False)
        assert request.send(response(200), final=False)
        assert budget.held == 300 and request.held_bytes == 300
        stream = request.stream()
        await anext(stream)
        # Taken, and still counted while the consumer holds it (encodes, writes).
        assert budget.held == 300 and request.held_bytes == 200
        await anext(stream)  # asking for the next puts the first down
        assert budget.held == 200 and request.held_bytes == 0
        request.discard()  # the consumer is done
        assert budget.held == 0
        # A lone final response is not counted (the one-response path pays nothing).
        single = streaming_request(budget, "s")
        single.respond(response(500))
        assert budget.held == 0
        await single.wait()
        # What nobody takes is released when the consumer is done.
        left = streaming_request(budget, "l")
        left.send(response(300), final=False)
        left.send(response(300), final=True)
        assert budget.held == 600
        left.discard()
        assert budget.held == 0

    trio.run(main)


def test_the_pressure_policy_evicts_the_stalled_request_holding_the_most():
    """While full, a request whose consumer took nothing for stall_secs is evicted,
    the largest first; one still read is left alone; the policy stops once there
    is room again."""

    async def main():
        budget = ClientBudget(800, stall_secs=10.0)
        cancelled: list[str] = []
        small, large, read = (
            streaming_request(budget, name) for name in ("small", "large", "read")
        )
        for request in (small, large, read):
            request.on_cancel(lambda r=request: cancelled.append(r.id))
        async with trio.open_nursery() as nursery:
            await nursery.start(budget.run)
            small.send(response(250), final=False)
            large.send(response(300), final=False)
            large.send(response(150), final=False)
            read.send(response(10), final=False)
            assert budget.full and budget.held == 710
            reader = read.stream()

            async def keep_reading():
                for _ in range(30):
                    await trio.sleep(1)
                    read.send(response(10), final=False)
                    await anext(reader)

            nursery.start_soon(keep_reading)
            await trio.sleep(9.9)
            assert cancelled == []  # nobody stalled for 10 s yet
            await trio.sleep(0.2)
            assert cancelled == ["large"]  # the most, 450 bytes
            assert budget.held == 270 and not budget.full  # small 250, read 10 + 10 in hand
            await trio.sleep(60)
            assert cancelled == ["large"]  # room again: nothing more is evicted
            assert budget.evicted == 1
            nursery.cancel_scope.cancel()
        with pytest.raises(ResourceExhausted) as error:
            async for _ in large.stream():
                pytest.fail("an evicted request's responses were dropped")
        message = error.value.message
        assert message.startswith("request 'large' for model 'm': ")
        assert "--client-buffer-stall-secs" in message and "--client-buffer-limit" in message
        assert "450 bytes" in message
        assert large.cancelled and large.held_bytes == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_evicted_request_fails_even_when_its_model_had_finished():
    async def main():
        budget = ClientBudget(100, stall_secs=1.0)
        request = streaming_request(budget, "done")
        async with trio.open_nursery() as nursery:
            await nursery.start(budget.run)
            request.send(response(60), final=False)
            request.send(response(60), final=True)  # the model is done; never read
            await trio.sleep(1.5)
            nursery.cancel_scope.cancel()
        assert budget.held == 0
        with pytest.raises(ResourceExhausted):
            async for _ in request.stream():
                pass

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_producer_thread_waits_for_room_or_its_cancellation():
    budget = ClientBudget(100)
    budget.reserve(100)
    stop = threading.Event()
    done = threading.Event()

    def producer():
        budget.wait_for_room_blocking(stop.is_set, poll=0.01)
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    assert not done.wait(0.1)
    budget.release(50)  # back to the low mark: room
    assert done.wait(5)
    thread.join()
    done.clear()
    budget.reserve(50)
    thread = threading.Thread(target=producer)
    thread.start()
    assert not done.wait(0.1)
    stop.set()  # cancelled: it stops waiting
    assert done.wait(5)
    thread.join()


def test_a_grpc_connection_buffer_counts_in_the_budget():
    budget = ClientBudget(1 << 20)
    buffer = ConnectionBuffer(limit=1000, window=1000, budget=budget)
    account = buffer.open(1)
    buffer.received(account, 300, 0, [300])
    assert budget.held == 300
    buffer.taken(account, 300)
    buffer.sending(200)
    assert budget.held == 500
    buffer.sending(-200)
    buffer.answered(account)
    assert budget.held == 0
    buffer.received(account, 100, 100, [])  # a partial message, then the end
    buffer.let_go()
    assert budget.held == 0 and buffer.held == 0
