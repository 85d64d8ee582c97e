"""An answer the instance's thread writes as the connection's last one was
written (trionserve/protocol/http/answer.py's ``Repeat``): the same bytes as the
encoder's, the protocol's state moved as start_response and end_response move
it, and every answer described otherwise encoded as any."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import trio

from trionserve.core.inference import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from trionserve.protocol.http.answer import WRITTEN, ConnectionAnswer
from trionserve.protocol.http.h1 import _KEPT_MOVES, H1Connection
from trionserve.protocol.http.infer import encode_response
from trionserve.protocol.http.sagemaker import encode_invocation
from trionserve.protocol.http.state import SERVER_TRANSITIONS, Server

HEAD = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n"


class Counted:
    """An encoder that counts its calls."""

    def __init__(self, encode=encode_response) -> None:
        self.calls = 0
        self._encode = encode

    def __call__(self, response, request, binary_output):
        self.calls += 1
        return self._encode(response, request, binary_output)


def response(shape=(1, 4), dtype=np.float32, datatype="FP32", response_id="", **fields):
    data = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    return InferenceResponse("m", "1", response_id, [Tensor("OUT", datatype, data)], **fields)


def expected(encode, res, request, binary_output, keep: bool = True) -> bytes:
    """What the loop would write: the encoder's answer under a fresh head."""
    h1 = H1Connection()
    h1.receive_data(HEAD if keep else HEAD.replace(b"Host", b"Connection: close\r\nHost"))
    assert h1.next_request() is not None
    status, headers, chunks = encode(res, request, binary_output)
    head = h1.start_response(status, headers, False, streamed=False)
    return head + b"".join(bytes(chunk) for chunk in chunks)


class Client:
    """One connection on a socket pair, its requests answered by the thread's
    ``write`` in turn (called here: the socket is the thread's to write)."""

    def __init__(self, encode) -> None:
        server_sock, self.client_sock = socket.socketpair()
        self.server_sock = trio.socket.from_stdlib_socket(server_sock)
        self.h1 = H1Connection()
        self.draining = False
        answer = ConnectionAnswer.of(
            self.h1, trio.SocketStream(self.server_sock), lambda: self.draining
        )
        assert answer is not None
        self.answer = answer
        self.encode = encode

    def answers(self, res, request=None, binary_output=True, head=HEAD) -> bytes:
        self.h1.receive_data(head)
        assert self.h1.next_request() is not None
        request = request or InferenceRequest("m")
        self.answer.arm(request, self.encode, binary_output)
        assert self.answer.write(request, res)
        assert self.answer.state == WRITTEN
        kept = self.answer.kept
        self.answer.settle()
        assert kept is (self.h1.state.server is Server.IDLE)
        return self.client_sock.recv(1 << 20)

    def close(self) -> None:
        self.server_sock.close()
        self.client_sock.close()


@pytest.fixture
async def client():
    made = Client(Counted())
    yield made
    made.close()


def test_a_whole_kept_answer_moves_the_server_as_the_tables_do():
    start, events, end = _KEPT_MOVES
    state = start
    for event in events:
        state = SERVER_TRANSITIONS[state][event]
    assert state is end


async def test_an_answer_described_as_the_last_one_is_its_head_and_the_tensor(client):
    first = response()
    assert client.answers(first) == expected(encode_response, first, InferenceRequest("m"), True)
    assert client.encode.calls == 1
    again = response()
    again.outputs[0].data += 1  # other values, the same description
    data = client.answers(again)
    assert client.encode.calls == 1  # not encoded again
    assert data == expected(encode_response, again, InferenceRequest("m"), True)
    assert client.h1.served == 2 and not client.h1.requests and client.h1.current is None


@pytest.mark.parametrize(
    "other",
    [
        lambda: (response(shape=(2, 4)), InferenceRequest("m"), True),
        lambda: (response(dtype=np.int32, datatype="INT32"), InferenceRequest("m"), True),
        lambda: (response(response_id="7"), InferenceRequest("m"), True),
        lambda: (response(), InferenceRequest("m", id="7"), True),
        lambda: (response(parameters={"p": 1}), InferenceRequest("m"), True),
        lambda: (response(), InferenceRequest("m"), False),  # JSON outputs
        lambda: (
            response(),
            InferenceRequest("m", requested_outputs=[RequestedOutput("OUT", {})]),
            True,
        ),
        lambda: (
            InferenceResponse(
                "m", "1", "", [Tensor("OUT", "FP32", np.zeros((4, 1), np.float32).T)]
            ),
            InferenceRequest("m"),
            True,
        ),
        lambda: (InferenceResponse("m", "2", "", response().outputs), InferenceRequest("m"), True),
    ],
)
async def test_an_answer_described_otherwise_is_encoded(client, other):
    client.answers(response())
    res, request, binary_output = other()
    data = client.answers(res, request, binary_output)
    assert client.encode.calls == 2
    assert data == expected(encode_response, res, request, binary_output)
    # ... and the next answer described as this one is its repeat, where it may be.
    res2, request2, _ = other()
    assert client.answers(res2, request2, binary_output) == data


async def test_a_closing_connection_or_a_drain_is_answered_by_the_encoder(client):
    client.answers(response())
    closing = HEAD.replace(b"Host", b"Connection: close\r\nHost")
    data = client.answers(response(), head=closing)
    assert client.encode.calls == 2 and b"connection: close" in data.lower()
    assert data == expected(encode_response, response(), InferenceRequest("m"), True, keep=False)
    assert client.h1.state.server is Server.MUST_CLOSE


async def test_a_drain_closes_the_connection_after_a_repeated_answer(client):
    client.answers(response())
    client.draining = True
    data = client.answers(response())
    assert client.encode.calls == 2 and b"connection: close" in data.lower()


async def test_another_encoder_is_not_given_the_last_ones_head():
    made = Client(Counted(encode_invocation))
    try:
        sagemaker = made.answers(response())
        made.encode = Counted()
        data = made.answers(response())
        assert made.encode.calls == 1 and data != sagemaker
        assert data == expected(encode_response, response(), InferenceRequest("m"), True)
    finally:
        made.close()
