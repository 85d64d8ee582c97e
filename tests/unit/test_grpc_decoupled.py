"""ModelStreamInfer with decoupled responses, through tritonclient.grpc's stream API.

The gRPC service runs in-process over a stand-in DataPlane whose ``infer_stream``
plays a decoupled model: it sends as many responses as the request asks for, can
end with a bare final flag or an error, and can wait for another request first, so
the order of responses is set by events, not by timing.
"""

from __future__ import annotations

import queue

import numpy as np
import trio
import tritonclient.grpc as grpcclient

from tests.helpers import decoupled_model
from trionserve.core.errors import InternalError
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.observability.trace.manager import TraceManager
from trionserve.protocol.grpc.service import serve_grpc


class DecoupledDataPlane:
    """Answers request parameters: ``count`` responses, then ``end`` ("bare",
    "last" or "error"); ``after`` names a request whose first response must be
    sent before this one starts."""

    shared_memory = None
    shm_resolver = None
    budget = None
    tracing = TraceManager()  # tracing off

    def request_regions(self):
        return None

    def __init__(self) -> None:
        self.first_sent: dict[str, trio.Event] = {}

    def model(self, name, version, namespace=None):
        return decoupled_model(name)

    def _sent(self, request_id: str) -> trio.Event:
        return self.first_sent.setdefault(request_id, trio.Event())

    async def infer_stream(self, request: InferenceRequest, deliver, *, queued=None) -> None:
        if queued is not None:
            queued.set()  # queued at once, as a real model's scheduler takes it
        params = request.parameters
        after = params.get("after")
        if after:
            await self._sent(after).wait()
        value = request.inputs["INPUT0"].data
        count, end = params["count"], params["end"]
        for i in range(count):
            last = end == "last" and i == count - 1
            out = Tensor("OUTPUT0", "FP32", value + i)
            await deliver(InferenceResponse("decoupled", "1", request.id, [out]), last)
            self._sent(request.id).set()
        if end == "bare":
            await deliver(None, True)
        elif end == "error":
            raise InternalError(f"model gave up on '{request.id}' after {count} responses")


def stream_client(port: int, requests: list[dict]) -> list[tuple]:
    """Send ``requests`` on one stream; return every (result, error) received."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        for spec in requests:
            tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
            tensor.set_data_from_numpy(np.array([spec.pop("value")], dtype=np.float32))
            client.async_stream_infer("decoupled", [tensor], **spec)
    finally:
        client.stop_stream()  # half-close; waits for the server to end the stream
        client.close()
    out = []
    while not received.empty():
        out.append(received.get())
    return out


async def run_stream(requests: list[dict]) -> list[tuple]:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(
            serve_grpc, DecoupledDataPlane(), "127.0.0.1", 0, shutdown, 10.0
        )
        try:
            return await trio.to_thread.run_sync(stream_client, bound[0][1], requests)
        finally:
            shutdown.set()


def summary(received) -> list[tuple]:
    """(id, value, final flag or None) per response; ("error", message) per error."""
    out = []
    for result, error in received:
        if error is not None:
            out.append(("error", error.message()))
            continue
        response = result.get_response()
        final = response.parameters.get("triton_final_response")
        output = result.as_numpy("OUTPUT0")
        out.append(
            (
                response.id,
                None if output is None else float(output[0]),
                None if final is None else final.bool_param,
            )
        )
    return out


async def test_many_responses_per_request():
    received = await run_stream(
        [{"value": 10.0, "request_id": "a", "parameters": {"count": 3, "end": "last"}}]
    )
    assert summary(received) == [("a", 10.0, False), ("a", 11.0, False), ("a", 12.0, True)]


async def test_final_flags_and_empty_final_response_when_enabled():
    received = await run_stream(
        [
            {
                "value": 1.0,
                "request_id": "bare",
                "enable_empty_final_response": True,
                "parameters": {"count": 2, "end": "bare"},
            },
            {
                "value": 5.0,
                "request_id": "last",
                "enable_empty_final_response": True,
                "parameters": {"count": 2, "end": "last", "after": "bare"},
            },
        ]
    )
    got = summary(received)
    bare = [r for r in got if r[0] == "bare"]
    last = [r for r in got if r[0] == "last"]
    assert bare == [("bare", 1.0, False), ("bare", 2.0, False), ("bare", None, True)]
    assert last == [("last", 5.0, False), ("last", 6.0, True)]
    empty = [r for r, e in received if r.get_response().id == "bare"][-1].get_response()
    assert len(empty.outputs) == 0 and empty.model_name == "decoupled"
    assert empty.model_version == ""  # the request's, as in Triton


async def test_bare_final_flag_is_not_sent_unless_asked():
    received = await run_stream(
        [{"value": 1.0, "request_id": "b", "parameters": {"count": 1, "end": "bare"}}]
    )
    assert summary(received) == [("b", 1.0, False)]


async def test_error_after_some_responses_does_not_end_the_stream():
    received = await run_stream(
        [
            {"value": 1.0, "request_id": "x", "parameters": {"count": 2, "end": "error"}},
            {
                "value": 7.0,
                "request_id": "y",
                "parameters": {"count": 1, "end": "last", "after": "x"},
            },
        ]
    )
    got = summary(received)
    assert [r for r in got if r[0] == "x"] == [("x", 1.0, False), ("x", 2.0, False)]
    assert ("error", "model gave up on 'x' after 2 responses") in got
    assert ("y", 7.0, True) in got


async def test_responses_in_the_order_the_model_produces_them():
    """The first request waits for the second's first response: it answers later."""
    received = await run_stream(
        [
            {
                "value": 1.0,
                "request_id": "slow",
                "parameters": {"count": 1, "end": "last", "after": "fast"},
            },
            {"value": 2.0, "request_id": "fast", "parameters": {"count": 1, "end": "last"}},
        ]
    )
    assert [r[0] for r in summary(received)] == ["fast", "slow"]
