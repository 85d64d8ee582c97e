"""A streamed OpenAI answer's events (``frontend._Events.body``): each written as
soon as it exists, never held back for more, and those ready together written
together (a model faster than the client costs one write per batch, not per
token). Virtual time: a body that waited for anything would let the clock jump."""

from __future__ import annotations

import json

import numpy as np
import trio

from trionserve.core.errors import InternalError
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.protocol.http.h1 import LastChunk
from trionserve.protocol.openai import engine, frontend, schemas

CHAT = b'{"model":"llm","messages":[{"role":"user","content":"hi"}],"stream":true}'


def token(text: str) -> InferenceResponse:
    data = np.array([text.encode()], dtype=np.object_)
    return InferenceResponse("llm", "1", outputs=[Tensor("text_output", "BYTES", data)])


def contents(write: bytes) -> list:
    """The content deltas of the chat events in one write ('[DONE]' for the end)."""
    found = []
    for event in write.split(b"\n\n")[:-1]:
        payload = event.removeprefix(b"data: ")
        if payload == b"[DONE]":
            found.append("[DONE]")
        else:
            found.append(json.loads(payload)["choices"][0]["delta"]["content"])
    return found


async def streamed(request: InferenceRequest):
    """The body of a chat stream over ``request``'s pairs, once its first is there."""
    events = frontend._ChatEvents(engine.Answer("llm"), schemas.parse_chat(CHAT))
    stream = request.stream()
    return events.body(stream, await anext(stream), request)


async def test_the_first_token_is_written_at_once_and_ready_tokens_together(autojump_clock):
    request = InferenceRequest("llm")
    request.send(token("a"), final=False)
    body = await streamed(request)
    with trio.fail_after(1):  # written without waiting for a second token
        assert contents(await anext(body)) == ["", "a"]  # the role, then the token
    for text in "bcd":
        request.send(token(text), final=False)
    with trio.fail_after(1):
        assert contents(await anext(body)) == ["b", "c", "d"]
    request.send(token("e"), final=True)
    with trio.fail_after(1):
        last = await anext(body)
    assert contents(last) == ["e", "[DONE]"]
    assert type(last) is LastChunk  # the transport ends the body in the same write


async def test_a_write_is_bounded_by_bytes(autojump_clock, monkeypatch):
    monkeypatch.setattr(frontend, "COALESCE_BYTES", 1)
    request = InferenceRequest("llm")
    for text in "ab":
        request.send(token(text), final=False)
    request.send(token("c"), final=True)
    body = await streamed(request)
    writes = [contents(write) async for write in body]
    assert writes == [["", "a"], ["b"], ["c", "[DONE]"]]


async def test_an_error_after_ready_tokens_follows_them_in_the_same_write(autojump_clock):
    request = InferenceRequest("llm")
    request.send(token("a"), final=False)
    body = await streamed(request)
    await anext(body)
    request.send(token("b"), final=False)
    request.fail(InternalError("model broke"))
    write = await anext(body)
    events = write.split(b"\n\n")
    assert contents(events[0] + b"\n\n") == ["b"]
    assert b'"message":"model broke"' in events[1] and events[2] == b"data: [DONE]"
