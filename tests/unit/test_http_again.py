"""A repeated infer request made in one step: the connection keeps the route its router
marked keepable for the requests it makes from its last head (asked again while the verbose
log is on), and the infer handler decodes a request that repeats the last one's path,
headers and JSON header from what they said (its plan), once found valid; anything else is
read in full, as before."""

from __future__ import annotations

import functools
import gzip
import json
import re
import struct
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from trionserve.core.errors import Unavailable
from trionserve.core.inference import InferenceResponse, Tensor
from trionserve.observability import logging as trion_logging
from trionserve.observability.trace.frontend import HTTP_STAMPS
from trionserve.protocol.http import codec
from trionserve.protocol.http.h1 import keepable
from trionserve.protocol.http.infer import InferHandler
from trionserve.protocol.http.transport import HttpServer, HttpServerOptions

_PATH = re.compile(r"/v2/models/([^/?]+)(?:/versions/([^/?]+))?/infer")


@pytest.fixture(autouse=True)
def no_plans():
    codec._PLANS.clear()
    yield
    codec._PLANS.clear()


class _Plane:
    """A data plane that records each request it is asked to infer; answers OUT = IN * 2, or
    refuses it (503) when ``refuse``."""

    def __init__(self, refuse: bool = True) -> None:
        self.tracing = SimpleNamespace(active=False)
        self.refuse = refuse
        self.seen: list[tuple[str, int | None, list[int], str]] = []

    def request_regions(self) -> None:
        return None

    async def infer(self, request, endpoint):
        (name, tensor), *_ = request.inputs.items()
        data = tensor.data
        values = data.reshape(-1).tolist()
        self.seen.append((request.model_name, request.model_version, values, name))
        if self.refuse:
            raise Unavailable("recorded")
        return InferenceResponse(
            request.model_name, "1", outputs=[Tensor("OUT", "INT32", data * 2)]
        )


def _body(value: int, key: str = "IN", output: bool = False) -> tuple[list, bytes]:
    doc: dict = {
        "inputs": [
            {"name": key, "shape": [1], "datatype": "INT32", "parameters": {"binary_data_size": 4}}
        ]
    }
    if output:
        doc["outputs"] = [{"name": "OUT", "parameters": {"binary_data": False}}]
    header = json.dumps(doc).encode()
    body = header + struct.pack("<i", value)
    return [
        (b"inference-header-content-length", b"%d" % len(header)),
        (b"content-length", b"%d" % len(body)),
    ], body


def _handle(handler: InferHandler, match, headers, body: bytes):
    async def main():
        return await handler.handle(match, list(headers), memoryview(bytearray(body)))

    return trio.run(main)


def _no_full_decode(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("decoded in full, not from what the last request said")

    monkeypatch.setattr(codec, "decode_infer_request", refuse)


def test_a_repeated_request_is_decoded_from_what_the_last_one_said(monkeypatch):
    plane = _Plane()
    handler = InferHandler(plane)  # type: ignore[arg-type]
    match = _PATH.match("/v2/models/m/versions/2/infer")
    headers, body = _body(7)
    assert _handle(handler, match, headers, body)[0] == 503
    again = handler._again
    assert again is not None and (again.name, again.version) == ("m", 2)
    _no_full_decode(monkeypatch)
    for value in (8, 9):
        assert _handle(handler, match, headers, _body(value)[1])[0] == 503
    assert handler._again is again
    assert plane.seen == [("m", 2, [7], "IN"), ("m", 2, [8], "IN"), ("m", 2, [9], "IN")]


def test_another_path_headers_json_header_or_size_are_read_in_full():
    plane = _Plane()
    handler = InferHandler(plane)  # type: ignore[arg-type]
    match = _PATH.match("/v2/models/m/infer")
    other = _PATH.match("/v2/models/n/versions/3/infer")
    headers, body = _body(1)
    _handle(handler, match, headers, body)
    _handle(handler, other, headers, _body(2)[1])  # another path
    _handle(handler, match, [*headers, (b"x-more", b"1")], _body(3)[1])  # another header
    # The same length of JSON header, another input's name: its plan, not the last one's.
    renamed_headers, renamed = _body(4, key="IX")
    assert len(renamed) == len(body) and renamed_headers == headers
    _handle(handler, match, headers, renamed)
    longer = body + b"\0\0\0\0"  # a body that is not what the plan says: refused as before
    status, _, chunks = _handle(handler, match, headers, longer)
    assert status == 400 and b"binary" in b"".join(chunks)
    assert plane.seen == [
        ("m", None, [1], "IN"),
        ("n", 3, [2], "IN"),
        ("m", None, [3], "IN"),
        ("m", None, [4], "IX"),
    ]


def test_a_refused_request_is_never_kept():
    plane = _Plane()
    handler = InferHandler(plane)  # type: ignore[arg-type]
    match = _PATH.match("/v2/models/m/infer")
    bad_version = _PATH.match("/v2/models/m/versions/x/infer")
    headers, body = _body(1)
    bad = [(b"inference-header-content-length", b"twelve"), headers[1]]
    for _ in range(2):
        status, _, chunks = _handle(handler, match, bad, body)
        assert status == 400 and b"must be an integer" in b"".join(chunks)
        status, _, chunks = _handle(handler, bad_version, headers, body)
        assert status == 400 and b"model version" in b"".join(chunks)
        assert handler._again is None
    assert _handle(handler, match, headers, body)[0] == 503
    assert handler._again is not None and plane.seen == [("m", None, [1], "IN")]


def test_a_repeated_request_is_answered_as_the_first_compressed_and_traced_alike(monkeypatch):
    plane = _Plane(refuse=False)
    handler = InferHandler(plane)  # type: ignore[arg-type]
    match = _PATH.match("/v2/models/m/infer")
    headers, body = _body(5, output=True)
    headers = [*headers, (b"accept-encoding", b"gzip")]
    first = _handle(handler, match, headers, body)
    assert handler._again is not None and not handler._again.answerable
    _no_full_decode(monkeypatch)
    again = _handle(handler, match, headers, body)
    assert first[0] == again[0] == 200 and first[1] == again[1]
    assert (b"content-encoding", b"gzip") in again[1]
    assert json.loads(gzip.decompress(b"".join(again[2])))["outputs"][0]["data"] == [10]

    seen = []
    stamps = object()
    original = plane.infer

    async def traced(request, endpoint):
        seen.append(request.trace_context)
        return await original(request, endpoint)

    plane.infer = traced  # type: ignore[method-assign]
    plane.tracing.active = True

    async def main():
        HTTP_STAMPS.set(stamps)  # (the transport's, for a traced request)
        return await handler.handle(match, list(headers), memoryview(bytearray(body)))

    assert trio.run(main)[0] == 200
    assert seen == [stamps]


def test_with_the_verbose_log_on_a_repeated_request_is_read_in_full(monkeypatch):
    plane = _Plane()
    handler = InferHandler(plane, verbose=True)  # type: ignore[arg-type]
    match = _PATH.match("/v2/models/m/infer")
    headers, body = _body(1)
    _handle(handler, match, headers, body)
    assert handler._again is None
    handler.verbose = False
    _handle(handler, match, headers, body)
    assert handler._again is not None
    handler.verbose = True
    _no_full_decode(monkeypatch)
    assert _handle(handler, match, headers, body)[0] == 500  # (the full decode, refused here)


class _Router:
    """Counts what it is asked; ``/kept`` is keepable, ``/asked`` is not."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.kept = keepable(functools.partial(self._answer))

    async def _answer(self, headers, body):
        return 200, [(b"content-length", b"2")], [b"ok"]

    def route(self, method: bytes, path: str):
        self.asked.append(path)
        return self.kept if path == "/kept" else self._answer


def _request(path: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi".encode()


async def _served(router: _Router, requests: list[bytes]) -> int:
    """Sends each request in turn on one connection, each once the last was answered; the
    answers' count."""
    server = HttpServer(router.route, HttpServerOptions(linger=0.1))
    client, served = trio.testing.memory_stream_pair()
    answers = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_connection, served)
        for request in requests:
            await client.send_all(request)
            received = b""
            while not received.endswith(b"ok"):
                received += await client.receive_some(65536)
            answers += 1
        await client.aclose()
    return answers


async def test_a_keepable_route_is_kept_for_the_requests_made_from_the_last_head(monkeypatch):
    router = _Router()
    assert await _served(router, [_request("/kept")] * 4) == 4
    # The first parsed, the second made from the last head (its route kept), then kept.
    assert router.asked == ["/kept", "/kept"]

    router.asked.clear()  # a route not marked keepable is asked for each request
    assert await _served(router, [_request("/asked")] * 3) == 3
    assert router.asked == ["/asked"] * 3

    router.asked.clear()  # another head: asked again
    assert await _served(router, [_request("/kept")] * 3 + [_request("/asked")]) == 4
    assert router.asked == ["/kept", "/kept", "/asked"]

    monkeypatch.setattr(trion_logging.SETTINGS, "log_verbose_level", 1)
    router.asked.clear()  # the router logs each request while the verbose log is on
    assert await _served(router, [_request("/kept")] * 3) == 3
    assert router.asked == ["/kept"] * 3
