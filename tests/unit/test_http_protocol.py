"""The HTTP/1.1 protocol without sockets: the state tables of both sides, and
byte strings in, requests, refusals and answer bytes out (h1.H1Connection).

Each HTTP state bug fixed so far has a case here: keep-alive after an error,
a body received once into its Content-Length buffer and the fresh parser after
it, pipelining, 100-continue, chunked bodies and their chunk count, the head
limit, HTTP versions, Content-Length beside Transfer-Encoding, upgrades, HEAD,
header values as sent, a second answer to one request."""

from __future__ import annotations

import pytest

from trionserve.protocol.http.frontend import refuse_large_body
from trionserve.protocol.http.h1 import (
    MAX_CHUNKED_CHUNKS,
    H1Connection,
    HttpServerOptions,
    PeerGone,
    ProtocolError,
    Request,
)
from trionserve.protocol.http.state import (
    CLIENT_TRANSITIONS,
    SERVER_TRANSITIONS,
    Client,
    ClientEvent,
    ConnectionState,
    LocalProtocolError,
    Server,
    ServerEvent,
)

C, CE, S, SE = Client, ClientEvent, Server, ServerEvent

# The tables as they are meant to be, written out: a row added, dropped or moved
# in state.py fails here.
EXPECTED_CLIENT = {
    (C.IDLE, CE.BEGIN): C.HEAD,
    (C.IDLE, CE.REFUSE): C.REFUSED,
    (C.IDLE, CE.EOF): C.CLOSED,
    (C.HEAD, CE.HEAD_DONE): C.BODY,
    (C.HEAD, CE.REFUSE): C.REFUSED,
    (C.HEAD, CE.EOF): C.CLOSED,
    (C.BODY, CE.MESSAGE_DONE): C.IDLE,
    (C.BODY, CE.REFUSE): C.REFUSED,
    (C.BODY, CE.EOF): C.CLOSED,
    (C.REFUSED, CE.EOF): C.CLOSED,
    (C.CLOSED, CE.EOF): C.CLOSED,
}
EXPECTED_SERVER = {
    (S.IDLE, SE.REQUEST): S.HANDLING,
    (S.IDLE, SE.ERROR_RESPONSE): S.MUST_CLOSE,
    (S.IDLE, SE.CLOSE): S.CLOSED,
    (S.HANDLING, SE.RESPONSE): S.RESPONDING,
    (S.HANDLING, SE.ERROR_RESPONSE): S.MUST_CLOSE,
    (S.HANDLING, SE.CLOSE): S.CLOSED,
    (S.RESPONDING, SE.END): S.IDLE,
    (S.RESPONDING, SE.END_CLOSE): S.MUST_CLOSE,
    (S.RESPONDING, SE.CLOSE): S.CLOSED,
    (S.MUST_CLOSE, SE.CLOSE): S.CLOSED,
    (S.CLOSED, SE.CLOSE): S.CLOSED,
}


def _flat(table: dict) -> dict:
    return {(state, event): to for state, row in table.items() for event, to in row.items()}


def test_the_tables_are_as_written():
    assert _flat(CLIENT_TRANSITIONS) == EXPECTED_CLIENT
    assert _flat(SERVER_TRANSITIONS) == EXPECTED_SERVER


@pytest.mark.parametrize("state", list(Client))
@pytest.mark.parametrize("event", list(ClientEvent))
def test_client_side_moves_by_its_table_or_raises(state, event):
    machine = ConnectionState()
    machine.client = state
    expected = EXPECTED_CLIENT.get((state, event))
    if expected is None:
        with pytest.raises(LocalProtocolError, match=f"{event.name}.*{state.name}"):
            machine.client_event(event)
        assert machine.client is state  # an illegal event changes nothing
    else:
        machine.client_event(event)
        assert machine.client is expected


@pytest.mark.parametrize("state", list(Server))
@pytest.mark.parametrize("event", list(ServerEvent))
def test_server_side_moves_by_its_table_or_raises(state, event):
    machine = ConnectionState()
    machine.server = state
    expected = EXPECTED_SERVER.get((state, event))
    if expected is None:
        with pytest.raises(LocalProtocolError, match=f"{event.name}.*{state.name}"):
            machine.server_event(event)
        assert machine.server is state
    else:
        machine.server_event(event)
        assert machine.server is expected


# -- the connection: bytes in, requests out ------------------------------------


def connection(**options) -> H1Connection:
    return H1Connection(HttpServerOptions(**options))


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def serve(h1: H1Connection, request: Request, status: int = 200, draining: bool = False) -> bool:
    """Answer ``request`` (whose body is whole) as the loop does: head, end."""
    assert request.complete
    h1.start_response(status, [(b"content-length", b"0")], draining, streamed=False)
    return h1.end_response()


def test_a_request_in_pieces_moves_the_client_side_through_head_and_body():
    h1 = connection()
    seen = []
    for piece in (b"POST /a HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 3\r\n\r\n", b"ab", b"c"):
        h1.receive_data(piece)
        seen.append(h1.state.client)
    # The body arrived through the parser here (it came in one read with nothing
    # else to read it into): the parser finishes the message itself.
    assert seen == [C.HEAD, C.BODY, C.BODY, C.IDLE]
    request = h1.next_request()
    assert request is not None and h1.state.server is S.HANDLING
    assert (request.method, h1.path(request), bytes(h1.body(request))) == (b"POST", "/a", b"abc")
    assert serve(h1, request) and h1.state.server is S.IDLE and h1.served == 1


def test_keep_alive_after_an_error_answer_is_refused_by_the_table():
    """An error answer closes the connection: the server side cannot take the next
    request (the keep-alive-after-errors bug is a missing row, not a flag)."""
    h1 = connection()
    h1.receive_data(post("/a", b"") + post("/b", b""))
    request = h1.next_request()
    assert request is not None
    answer = h1.error_response(404, "Not Found: POST /a")
    assert answer.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert b"connection: close\r\n" in answer and answer.endswith(b'{"error":"Not Found: POST /a"}')
    assert h1.state.server is S.MUST_CLOSE and not h1.answerable
    with pytest.raises(LocalProtocolError):
        h1.next_request()
    with pytest.raises(LocalProtocolError, match="ERROR_RESPONSE"):
        h1.error_response(500, "a second answer")


def test_a_second_answer_to_one_request_is_refused():
    h1 = connection()
    h1.receive_data(post("/a", b""))
    h1.next_request()
    h1.start_response(200, [(b"content-length", b"0")], draining=False, streamed=False)
    assert not h1.answerable  # the cut (503) after an answer began is not sent
    with pytest.raises(LocalProtocolError, match="RESPONSE"):
        h1.start_response(200, [], draining=False, streamed=False)
    with pytest.raises(LocalProtocolError, match="ERROR_RESPONSE"):
        h1.error_response(503, "cut")


def test_pipelined_requests_are_parsed_ahead_and_taken_in_order():
    h1 = connection()
    h1.receive_data(post("/a", b"1") + post("/b", b"22") + b"POST /c HTTP/1.1\r\nHo")
    assert len(h1.requests) == 3 and h1.state.client is C.HEAD
    first = h1.next_request()
    assert first is not None
    with pytest.raises(LocalProtocolError):
        h1.next_request()  # one request at a time
    assert serve(h1, first)
    second = h1.next_request()
    assert second is not None and bytes(h1.body(second)) == b"22"
    assert serve(h1, second)
    assert h1.next_request() is None and h1.head_begun  # /c: its head is not whole


def test_body_of_declared_length_is_one_buffer_and_a_fresh_parser_follows():
    """A body is received once into a buffer of its Content-Length: what came with
    the head is copied in, the rest received into the empty part; then the parser is
    replaced, and the fresh one frames a chunked body beside a Content-Length as
    the first one does (ae4d90b)."""
    h1 = connection(max_request_body=1 << 20)
    h1.receive_data(post("/a", b"x" * 10)[:-6])  # the head and 4 bytes of the body
    request = h1.next_request()
    assert request is not None and not request.complete
    empty = h1.body_pending(request)
    assert empty is not None and len(empty) == 6
    empty[:6] = b"yyyyyy"
    parser = h1.parser
    h1.body_received(request, 6)
    assert request.complete and h1.state.client is C.IDLE and h1.parser is not parser
    body = h1.body(request)
    assert isinstance(body, memoryview) and not body.readonly and bytes(body) == b"xxxxyyyyyy"
    assert serve(h1, request)
    h1.receive_data(
        b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n3\r\nabc\r\n0\r\n\r\n"
    )
    second = h1.next_request()
    assert second is not None and bytes(h1.body(second)) == b"abc"
    assert b"content-length" not in dict(second.headers)
    assert not serve(h1, second)  # framed by its chunks, then closed


@pytest.mark.parametrize("tensors_at", [0, 1, 63, 64, 181, 4096])
def test_a_bodys_binary_tensors_begin_on_a_64_byte_boundary(tensors_at):
    """The buffer of a declared body is placed so that its binary tensors, which
    begin Inference-Header-Content-Length bytes in, begin on a 64-byte boundary:
    the codec's views of them are aligned for the framework without a copy
    (issue 39). A value past the body or not a number changes nothing."""
    import numpy as np

    body = b"h" * tensors_at + b"t" * 4000
    h1 = connection(max_request_body=1 << 20)
    h1.receive_data(post("/a", body, f"Inference-Header-Content-Length: {tensors_at}\r\n"))
    request = h1.next_request()
    assert request is not None and request.complete
    received = h1.body(request)
    assert bytes(received) == body and not received.readonly
    assert (np.frombuffer(received, np.uint8).ctypes.data + tensors_at) % 64 == 0
    for header in (
        "Inference-Header-Content-Length: 99999\r\n",
        "Inference-Header-Content-Length: x\r\n",
    ):
        h1 = connection(max_request_body=1 << 20)
        h1.receive_data(post("/a", body, header))
        request = h1.next_request()
        assert request is not None and bytes(h1.body(request)) == body


def test_end_of_stream_in_a_body_is_the_peer_gone():
    h1 = connection()
    h1.receive_data(post("/a", b"abcd")[:-2])
    request = h1.next_request()
    assert request is not None
    with pytest.raises(PeerGone):
        h1.body_received(request, 0)
    assert h1.state.client is C.CLOSED
    with pytest.raises(PeerGone):
        h1.body_pending(request)


def test_expect_100_continue_only_before_any_of_the_body():
    h1 = connection()
    h1.receive_data(post("/a", b"abc", "Expect:  100-Continue \r\n")[:-3])
    request = h1.next_request()
    assert request is not None and h1.continue_needed(request)
    h1 = connection()
    h1.receive_data(post("/a", b"abc", "Expect: 100-continue\r\n"))
    request = h1.next_request()
    assert request is not None and not h1.continue_needed(request)  # the body came with it
    h1 = connection()
    h1.receive_data(b"POST /a HTTP/1.0\r\nContent-Length: 1\r\nExpect: 100-continue\r\n\r\n")
    request = h1.next_request()
    assert request is not None and not h1.continue_needed(request)  # HTTP/1.0 has none


def test_chunked_body_is_one_writable_bytearray():
    h1 = connection(max_request_body=100)
    h1.receive_data(
        b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    request = h1.next_request()
    assert request is not None and request.complete and request.chunks == 2
    body = h1.body(request)
    assert isinstance(body, bytearray) and body == b"abcde"
    assert serve(h1, request)


def test_chunked_body_over_the_limit_or_the_chunk_count_is_refused_and_parsing_stops():
    h1 = connection(max_request_body=4)
    h1.receive_data(
        b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
        b"3\r\ndef\r\n0\r\n\r\n" + post("/b", b"")
    )
    assert h1.state.client is C.REFUSED and len(h1.requests) == 1  # /b never parsed
    request = h1.next_request()
    assert request is not None
    with pytest.raises(ProtocolError) as refused:
        h1.body_pending(request)
    assert refused.value.status == 413 and "--http-max-input-size" in refused.value.message

    h1 = connection()
    head = b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    h1.receive_data(head + b"1\r\nx\r\n" * (MAX_CHUNKED_CHUNKS + 1))
    request = h1.next_request()
    assert request is not None
    with pytest.raises(ProtocolError, match="exceeds maximum of 65536 non-empty chunks") as e:
        h1.body_pending(request)
    assert e.value.status == 400


def test_declared_body_over_the_limit_is_413_before_any_of_it_is_read():
    h1 = connection(max_request_body=10)
    h1.receive_data(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n")
    request = h1.next_request()
    assert request is not None and request.buffer is None  # nothing allocated
    with pytest.raises(ProtocolError) as refused:
        h1.path(request)
    assert refused.value.status == 413


def test_the_kserve_port_refuses_a_body_over_the_limit_in_tritons_words():
    """The HTTP frontend's body_refusal (infer.body_too_large): the same points of
    refusal, Triton's statuses and words; a chunked body is refused as it passes
    the limit, its size not known yet."""
    h1 = connection(max_request_body=4, body_refusal=refuse_large_body)
    h1.receive_data(
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: 0"
        b"\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n"
    )
    request = h1.next_request()
    assert request is not None
    with pytest.raises(ProtocolError) as refused:
        h1.body_pending(request)
    assert (refused.value.status, refused.value.message) == (
        400,
        "Raw input has a byte_size (more than 4 bytes) that exceeds the maximum allowed "
        "value of 4 bytes. Use --http-max-input-size to increase the limit.",
    )
    h1 = connection(max_request_body=4, body_refusal=refuse_large_body)
    h1.receive_data(b"POST /v2/models/m/infer?x=1 HTTP/1.1\r\nContent-Length: 5\r\n\r\n")
    request = h1.next_request()
    assert request is not None and request.buffer is None
    with pytest.raises(ProtocolError) as refused:
        h1.path(request)
    assert (refused.value.status, refused.value.message) == (
        400,
        "request JSON size of 5 bytes exceeds the maximum allowed input size of 4 bytes. "
        "Use --http-max-input-size to increase the limit.",
    )


@pytest.mark.parametrize(
    "data, status, words",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 2000, 431, "larger than the limit"),
        (b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", 505, "not supported"),
        (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400, "bad request"),
    ],
)
def test_refused_heads_are_answered_with_their_status(data, status, words):
    h1 = connection(max_header_size=1000)
    h1.receive_data(data)
    assert h1.state.client is C.REFUSED
    with pytest.raises(ProtocolError, match=words) as refused:
        h1.next_request()
    assert refused.value.status == status
    assert h1.error_response(status, refused.value.message).startswith(b"HTTP/1.1 %d" % status)


def test_a_head_over_the_limit_delivered_whole_is_431():
    h1 = connection(max_header_size=100)
    h1.receive_data(b"GET / HTTP/1.1\r\nX: " + b"a" * 200 + b"\r\n\r\n")
    with pytest.raises(ProtocolError) as refused:
        h1.next_request()
    assert refused.value.status == 431


def test_http_versions_and_targets_refused_when_served():
    h1 = connection()
    h1.receive_data(b"GET / HTTP/2.0\r\nHost: x\r\n\r\n")
    request = h1.next_request()
    assert request is not None
    with pytest.raises(ProtocolError, match="HTTP version 2.0") as refused:
        h1.path(request)
    assert refused.value.status == 505
    h1 = connection()
    h1.receive_data(b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(ProtocolError) as refused:  # llhttp refuses it before path() could
        h1.next_request()
    assert refused.value.status == 400
    h1 = connection()
    h1.receive_data(b"GET /v2/models/a%20b/ready?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    request = h1.next_request()
    assert request is not None and h1.path(request) == "/v2/models/a b/ready"


def test_a_refused_pipelined_request_leaves_the_one_before_it_served():
    h1 = connection()
    h1.receive_data(post("/a", b"ok") + b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
    assert h1.state.client is C.REFUSED
    request = h1.next_request()
    assert request is not None and bytes(h1.body(request)) == b"ok"
    assert serve(h1, request)
    with pytest.raises(ProtocolError) as refused:
        h1.next_request()
    assert refused.value.status == 400


def test_http_1_0_and_upgrade_requests_are_answered_then_closed():
    h1 = connection()
    h1.receive_data(b"GET /a HTTP/1.0\r\n\r\n")
    request = h1.next_request()
    assert request is not None
    head = h1.start_response(200, [(b"content-length", b"0")], draining=False, streamed=True)
    assert b"connection: close" in head and b"transfer-encoding" not in head  # 1.0: as is
    assert not h1.end_response() and h1.state.server is S.MUST_CLOSE

    h1 = connection()
    h1.receive_data(b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
    assert h1.state.client is C.REFUSED and h1.refusal is not None and h1.refusal.status == 0
    request = h1.next_request()
    assert request is not None and not serve(h1, request)
    assert h1.state.server is S.MUST_CLOSE


def test_draining_and_the_handlers_close_add_connection_close_once():
    h1 = connection()
    h1.receive_data(post("/a", b"") * 2)
    h1.next_request()
    head = h1.start_response(200, [(b"content-length", b"0")], draining=True, streamed=False)
    assert head.count(b"connection: close") == 1 and not h1.end_response()
    h1 = connection()
    h1.receive_data(post("/a", b""))
    h1.next_request()
    headers = [(b"content-length", b"0"), (b"connection", b"close")]
    head = h1.start_response(200, headers, draining=False, streamed=False)
    assert head.count(b"connection: close") == 1 and not h1.end_response()
    assert headers == [(b"content-length", b"0"), (b"connection", b"close")]  # not changed


def test_streamed_answer_over_http_1_1_is_chunked():
    h1 = connection()
    h1.receive_data(post("/a", b""))
    h1.next_request()
    head = h1.start_response(200, [(b"content-type", b"text/plain")], False, streamed=True)
    assert head.endswith(b"transfer-encoding: chunked\r\n\r\n")
    assert h1.end_response()


def test_head_requests_get_no_error_body():
    h1 = connection()
    h1.receive_data(b"HEAD /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
    h1.next_request()
    assert h1.head_only
    assert h1.error_response(404, "Not Found").endswith(b"\r\n\r\n")


def test_header_values_keep_their_trailing_blanks():
    """As libevhtp hands them on, so that a forwarded header reaches the model
    whole (58cc2b8, qa/L0_parameters test_headers)."""
    h1 = connection()
    h1.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\nX-Name:   backslash\\ \r\n\r\n")
    request = h1.next_request()
    assert request is not None and (b"x-name", b"backslash\\ ") in request.headers


def test_end_of_stream_after_a_refusal_is_noted():
    h1 = connection()
    h1.receive_data(b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
    h1.receive_data(b"")
    assert h1.state.client is C.CLOSED and h1.refusal is not None
    with pytest.raises(ProtocolError):
        h1.next_request()  # the refusal is still answered


def test_a_bug_in_a_callback_is_raised_not_answered_as_a_bad_request():
    h1 = connection()
    h1.receive_data(post("/a", b""))
    h1.state.client = C.BODY  # as if the parser's callbacks were called out of order
    with pytest.raises(LocalProtocolError):
        h1.receive_data(post("/b", b""))


def test_error_answers_take_the_shape_the_options_give():
    h1 = connection(error_body=lambda status, message: b'{"code":%d}' % status)
    h1.receive_data(b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
    with pytest.raises(ProtocolError) as refused:
        h1.next_request()
    answer = h1.error_response(refused.value.status, refused.value.message)
    assert answer.endswith(b'\r\ncontent-length: 12\r\nconnection: close\r\n\r\n{"code":400}')
