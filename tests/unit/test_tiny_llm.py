"""The example language model (examples/openai tiny_llm) generates for every request
it holds at once: its ``async def execute`` adds requests to the running batch
and returns, one stepping task computes a token for all of them per step. Driven
here on an asyncio loop, as the stub runs it, with a stand-in for
triton_python_backend_utils that records what each request's sender sends."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import types

import numpy as np
import pytest

from tests.serverproc import ROOT

pytest.importorskip("tokenizers")

MODEL = ROOT / "examples" / "openai" / "model_repository" / "tiny_llm"
FINAL = 1


def backend_utils(log: list) -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")

    class Tensor:
        def __init__(self, name, data):
            self.name, self.data = name, data

        def as_numpy(self):
            return self.data

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.outputs, self.error = output_tensors or [], error

    class TritonError(Exception):
        pass

    class Logger:
        @staticmethod
        def log_error(message):
            log.append(("log", message))

    module.Tensor = Tensor
    module.InferenceResponse = InferenceResponse
    module.TritonError = TritonError
    module.Logger = Logger
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    module.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    return module


class Sender:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.cancelled = False

    def is_cancelled(self) -> bool:
        return self.cancelled

    def send(self, response=None, flags=0):
        text = None
        if response is not None and response.outputs:
            text = response.outputs[0].data[0].decode()
        self.log.append((self.name, text, flags))


class Request:
    def __init__(self, module, name: str, log: list, prompt: str, max_tokens: int) -> None:
        values = {
            "text_input": np.array([prompt.encode()], dtype=np.object_),
            "stream": np.array([True]),
            "max_tokens": np.array([max_tokens], dtype=np.int32),
            "temperature": np.array([0.0], dtype=np.float32),
        }
        self.inputs = {key: module.Tensor(key, value) for key, value in values.items()}
        self.sender = Sender(name, log)

    def get_response_sender(self):
        return self.sender


@pytest.fixture
def tiny(monkeypatch):
    log: list = []
    utils = backend_utils(log)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", utils)
    spec = importlib.util.spec_from_file_location("tiny_llm_under_test", MODEL / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = {"parameters": {"max_batch_sequences": {"string_value": "2"}}}
    model.initialize(
        {"model_repository": str(MODEL), "model_version": "1", "model_config": json.dumps(config)}
    )
    return model, utils, log


def text_of(log: list, name: str) -> str:
    return "".join(text for who, text, _ in log if who == name and text)


def answered(log: list, name: str) -> bool:
    return any(who == name and flags == FINAL for who, _, flags in log)


def test_requests_held_together_are_stepped_together(tiny):
    model, utils, log = tiny
    alone: dict = {}
    for name, prompt in (("a", "The server "), ("b", "A request ")):
        model.generate(Request(utils, name, log, prompt, 30), Sender(name, alone_log := []))
        alone[name] = text_of(alone_log, name)

    async def run():
        a = Request(utils, "a", log, "The server ", 30)
        b = Request(utils, "b", log, "A request ", 30)
        await model.execute([a, b])  # returns at once: generation is the stepping task's
        assert log == []
        await model.stepping

    asyncio.run(run())
    # One token each per step: their responses alternate, each text as when alone.
    assert [who for who, _, _ in log[:6]] == ["a", "b"] * 3
    assert {name: text_of(log, name) for name in "ab"} == alone and alone["a"] != alone["b"]
    assert answered(log, "a") and answered(log, "b")


def test_a_request_joins_the_running_batch_at_the_next_step(tiny):
    model, utils, log = tiny

    async def run():
        long = Request(utils, "long", log, "The server ", 200)
        await model.execute([long])
        for _ in range(5):
            await asyncio.sleep(0)  # the long one is a few tokens in
        assert 0 < len(log) < 200
        late = Request(utils, "late", log, "A request ", 3)
        await model.execute([late])
        await model.stepping

    asyncio.run(run())
    late_first = next(i for i, (who, _, _) in enumerate(log) if who == "late")
    long_final = next(i for i, entry in enumerate(log) if entry[0] == "long" and entry[2] == FINAL)
    assert late_first < long_final  # it did not wait for the long answer
    assert answered(log, "late")


def test_past_the_batch_limit_requests_wait_their_turn_and_a_cancelled_one_ends(tiny):
    model, utils, log = tiny  # max_batch_sequences 2

    async def run():
        requests = [Request(utils, name, log, "The server ", 20) for name in "xyz"]
        await model.execute(requests)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert {who for who, _, _ in log} == {"x", "y"}  # z waits for room
        requests[0].sender.cancelled = True
        await model.stepping

    asyncio.run(run())
    assert all(answered(log, name) for name in "xyz")
    x_tokens = [text for who, text, flags in log if who == "x" and text]
    assert len(x_tokens) < 20  # cancelled: ended at the next step
    assert len([1 for who, _, flags in log if flags == FINAL]) == 3
