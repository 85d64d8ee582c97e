"""A connection's last request head (h1_request.LastHead): a request whose head
is the same bytes as the last one the parser read whole is made without the
parser, exactly as the parser makes it; anything else is parsed as before."""

from __future__ import annotations

import pytest

from trionserve.protocol.http.h1 import H1Connection, HttpServerOptions, Request
from trionserve.protocol.http.state import Client, Server

HEAD = (
    b"POST /v2/models/cnn/infer HTTP/1.1\r\nHost: localhost:8000\r\n"
    b"User-Agent: python-requests/2.31\r\nAccept-Encoding: identity\r\n"
    b"Inference-Header-Content-Length: 11\r\nContent-Type: application/octet-stream\r\n"
    b"Content-Length: 19\r\n\r\n"
)


def body(n: int) -> bytes:
    return b'{"inputs":}' + bytes([n]) * 8


class NoParser:
    """Stands for the parser where none may be used."""

    def feed_data(self, data) -> None:
        raise AssertionError("parsed, not made from the last head")


def connection() -> H1Connection:
    return H1Connection(HttpServerOptions(max_request_body=1 << 20))


def served(h1: H1Connection) -> Request:
    request = h1.next_request()
    assert request is not None and request.complete
    h1.start_response(200, [(b"content-length", b"0")], False, streamed=False)
    assert h1.end_response()
    return request


def fields(h1: H1Connection, request: Request) -> tuple:
    return (
        request.method,
        request.target,
        request.version,
        list(request.headers),
        request.head_size,
        request.length,
        request.keep_alive,
        request.expects_continue,
        request.head_done,
        request.complete,
        h1.path(request),
    )


def test_a_repeated_head_is_made_without_the_parser_as_the_parser_makes_it():
    parsed = connection()
    parsed.receive_data(HEAD + body(1))
    first = served(parsed)
    assert parsed._last_head is not None and parsed._last_head.raw == HEAD

    parsed.parser = NoParser()  # the same bytes again: no parser
    parsed.receive_data(HEAD + body(2))
    assert parsed.state.client is Client.IDLE
    again = served(parsed)
    assert fields(parsed, again) == fields(parsed, first)
    assert bytes(parsed.body(again)) == body(2) and not parsed.body(again).readonly
    assert again.headers is not first.headers  # a list of its own

    # ... and as a connection that parses everything makes it.
    fresh = connection()
    fresh.receive_data(HEAD + body(2))
    assert fields(fresh, served(fresh)) == fields(parsed, again)


def test_a_repeated_head_whose_body_comes_later_is_received_into_its_buffer():
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    parser = h1.parser = NoParser()
    h1.receive_data(HEAD + body(3)[:5])
    request = h1.requests[0]
    assert h1.state.client is Client.BODY and not request.complete
    empty = h1.body_pending(request)
    assert empty is not None and len(empty) == 14
    empty[:] = body(3)[5:]
    h1.body_received(request, 14)
    assert request.complete and h1.parser is parser  # it saw nothing of it: kept
    assert bytes(h1.body(served(h1))) == body(3)


def test_the_parser_is_replaced_after_a_body_it_saw_the_start_of_and_kept_otherwise():
    h1 = connection()
    first = h1.parser
    h1.receive_data(HEAD + body(1)[:5])  # parsed: the parser saw the body's start
    request = h1.requests[0]
    empty = h1.body_pending(request)
    assert empty is not None
    empty[:] = body(1)[5:]
    h1.body_received(request, 14)
    assert h1.parser is not first  # a fresh one: the next byte starts a request
    served(h1)
    kept = h1.parser
    h1.receive_data(HEAD + body(2)[:5])  # made from the last head: the parser saw none
    request = h1.requests[0]
    empty = h1.body_pending(request)
    assert empty is not None
    empty[:] = body(2)[5:]
    h1.body_received(request, 14)
    assert h1.parser is kept
    assert bytes(h1.body(served(h1))) == body(2)
    # ... and it parses the next request, a different one, from its start.
    h1.receive_data(b"POST /v2/models/cnn/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
    assert bytes(h1.body(served(h1))) == b"ok"


def test_pipelined_requests_after_a_repeated_head_are_parsed_in_turn():
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    other = b"POST /v2/models/cnn/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok"
    h1.receive_data(HEAD + body(4) + HEAD + body(5) + other + HEAD[:10])
    assert [bytes(h1.body(served(h1))) for _ in range(3)] == [body(4), body(5), b"ok"]
    assert h1.state.client is Client.HEAD  # the fourth's head has begun
    h1.receive_data(HEAD[10:] + body(6))
    assert bytes(h1.body(served(h1))) == body(6)


def test_a_head_one_byte_apart_is_parsed():
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    longer = HEAD.replace(b"Content-Length: 19", b"Content-Length: 20")
    h1.receive_data(longer + body(7) + b"!")
    request = served(h1)
    assert request.length == 20 and bytes(h1.body(request)) == body(7) + b"!"
    assert h1._last_head is not None and h1._last_head.raw == longer


@pytest.mark.parametrize(
    "head, refused",
    [
        (HEAD.replace(b"\r\n", b"\n"), True),  # bare LF: llhttp refuses it
        (HEAD.replace(b"Host: localhost:8000\r\n", b"Host: x\r\n\tfolded\r\n"), True),
        (HEAD.replace(b"Host:", b"Expect: 100-continue\r\nHost:"), False),
        (HEAD.replace(b"Host:", b"Expect: something\r\nHost:"), False),
        (HEAD.replace(b"Host:", b"Connection: close\r\nHost:"), False),
        (HEAD.replace(b"HTTP/1.1", b"HTTP/1.0"), False),
        (b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n", False),
        (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n13\r\n" + body(1), False),
    ],
    ids=["bare-lf", "folded", "expect", "expect-other", "close", "http-1.0", "no-body", "chunked"],
)
def test_heads_the_fast_path_would_not_make_exactly_are_not_kept(head, refused):
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    h1.receive_data(head if b"chunked" in head or b"GET" in head else head + body(1))
    assert (h1.refusal is not None) is refused
    if not refused:
        assert h1.requests[0].head_done
    assert h1._last_head is not None and h1._last_head.raw == HEAD  # the last kept stays


def test_bytes_that_go_on_a_head_begun_are_parsed_even_when_they_repeat_the_last_head():
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    h1.receive_data(b"POST /b HTTP/1.1\r\nX-Note: ")  # a head begun ...
    h1.receive_data(HEAD + body(8))  # ... goes on with these bytes: its X-Note's value
    request = served(h1)
    assert h1.path(request) == "/b" and (b"x-note", HEAD.split(b"\r\n")[0]) in request.headers


def read_again(h1: H1Connection, data: bytes) -> None:
    """What the transport does with bytes there: one readv into again_buffers."""
    buffers = h1.again_buffers()
    assert buffers is not None
    head, body = buffers
    assert len(head) == len(HEAD) and len(body) == 19
    size = min(len(data), len(head) + len(body))
    head[: min(size, len(head))] = data[: len(head)][:size]
    if size > len(head):
        body[: size - len(head)] = data[len(head) : size]
    h1.received_again(size, head, body)


def test_no_buffers_to_read_again_into_without_a_kept_head_or_with_bytes_pending():
    h1 = connection()
    assert h1.again_buffers() is None  # no head kept
    h1.receive_data(HEAD + body(1))
    assert h1.again_buffers() is None  # a request waits
    served(h1)
    assert h1.again_buffers() is not None
    h1.receive_data(HEAD[:10])
    assert h1.again_buffers() is None  # a head has begun


def test_a_repeated_head_read_with_its_body_in_one_read_is_made_without_the_parser():
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    first = served(h1)
    parser = h1.parser = NoParser()
    read_again(h1, HEAD + body(2))
    request = h1.requests[0]
    assert request.complete and h1.parser is parser
    again = served(h1)
    assert fields(h1, again) == fields(h1, first)
    assert bytes(h1.body(again)) == body(2) and not h1.body(again).readonly

    read_again(h1, HEAD + body(3)[:4])  # the rest of the body comes later
    request = h1.requests[0]
    assert not request.complete and h1.state.client is Client.BODY
    empty = h1.body_pending(request)
    assert empty is not None and len(empty) == 15
    empty[:] = body(3)[4:]
    h1.body_received(request, 15)
    assert bytes(h1.body(served(h1))) == body(3) and h1.parser is parser


@pytest.mark.parametrize("cut", [0, 5, len(HEAD), len(HEAD) + 19])
def test_other_bytes_read_where_a_repeated_head_was_expected_are_parsed(cut):
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    other = HEAD.replace(b"localhost:8000", b"localhost:8001")
    assert len(other) == len(HEAD)
    read_again(h1, (other + body(4))[:cut] if cut else other + body(4))
    if cut and cut < len(other) + 19:  # the rest comes later, parsed as usual
        h1.receive_data((other + body(4))[cut:])
    request = served(h1)
    assert bytes(h1.body(request)) == body(4)
    assert (b"host", b"localhost:8001") in request.headers
    assert h1._last_head is not None


def test_a_repeated_head_read_short_is_parsed_and_the_end_of_stream_closes():
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    read_again(h1, HEAD[:20])
    h1.receive_data(HEAD[20:] + body(5))
    assert bytes(h1.body(served(h1))) == body(5)
    buffers = h1.again_buffers()
    assert buffers is not None
    h1.received_again(0, *buffers)
    assert h1.state.client is Client.CLOSED and h1.next_request() is None


def take_again(h1: H1Connection, data: bytes) -> Request | None:
    """:meth:`H1Connection.take_again` of ``data`` read into its buffers."""
    buffers = h1.again_buffers()
    assert buffers is not None
    head, body = buffers
    size = len(data)
    head[: min(size, len(head))] = data[: len(head)][:size]
    if size > len(head):
        body[: size - len(head)] = data[len(head) : size]
    return h1.take_again(size, head, body)


def test_the_moves_of_a_request_taken_at_once_are_the_state_tables_moves():
    from trionserve.protocol.http.h1 import _AGAIN_MOVES
    from trionserve.protocol.http.state import CLIENT_TRANSITIONS, SERVER_TRANSITIONS

    for (start, events, end), table in zip(
        _AGAIN_MOVES, (CLIENT_TRANSITIONS, SERVER_TRANSITIONS), strict=True
    ):
        state = start
        for event in events:
            state = table[state][event]  # type: ignore[index]
        assert state is end


def test_a_whole_repeated_request_is_taken_in_one_step_as_the_parser_and_next_request_take_it():
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    first = served(h1)
    parser = h1.parser = NoParser()
    again = take_again(h1, HEAD + body(2))
    assert again is not None and h1.parser is parser
    assert h1.current is again and list(h1.requests) == [again]
    assert h1.state.client is Client.IDLE and h1.state.server is Server.HANDLING
    h1.start_response(200, [(b"content-length", b"0")], False, streamed=False)
    assert h1.end_response() and h1.state.server is Server.IDLE and not h1.requests
    assert fields(h1, again) == fields(h1, first)
    assert bytes(h1.body(again)) == body(2) and not h1.body(again).readonly


@pytest.mark.parametrize("cut", [5, len(HEAD), len(HEAD) + 4])
def test_a_repeated_request_not_whole_in_the_read_is_received_as_any_and_not_taken(cut):
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    assert take_again(h1, (HEAD + body(3))[:cut]) is None
    assert h1.state.server is Server.IDLE and h1.current is None
    if cut < len(HEAD):
        h1.receive_data((HEAD + body(3))[cut:])
    else:  # the request made from the last head, its body's rest read into its buffer
        request = h1.requests[0]
        empty = h1.body_pending(request)
        assert empty is not None and len(empty) == len(HEAD) + 19 - cut
        empty[:] = (HEAD + body(3))[cut:]
        h1.body_received(request, len(empty))
    assert bytes(h1.body(served(h1))) == body(3)


def test_other_bytes_read_where_a_repeated_request_was_expected_are_parsed_and_not_taken():
    h1 = connection()
    h1.receive_data(HEAD + body(1))
    served(h1)
    other = HEAD.replace(b"localhost:8000", b"localhost:8001")
    assert take_again(h1, other + body(4)) is None
    request = served(h1)
    assert (b"host", b"localhost:8001") in request.headers and bytes(h1.body(request)) == body(4)
