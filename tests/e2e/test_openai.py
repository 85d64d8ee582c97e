"""The OpenAI-compatible API (--openai-port) against a real server, with the official
``openai`` client: the behaviour Triton's frontend tests check (server
python/openai/tests: test_openai_client.py, test_completions.py,
test_chat_completions.py, test_observability.py, test_request_size.py,
test_openai_restricted_apis.py) that needs no GPU.

One server for the module, on the example models: ``mock_llm`` (an echo model),
``mock_slow`` (the same, a word every 20 ms) and ``tiny_llm`` (a real
character-level model).
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import wait_for
from tests.serverproc import ROOT, ServerProcess, free_port

openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")

MODELS = ROOT / "examples" / "openai" / "model_repository"
KEY = "sk-test-key"
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("openai_models")
    for name in ("mock_llm", "tiny_llm"):
        shutil.copytree(MODELS / name, repository / name)
    shutil.copytree(MODELS / "mock_llm", repository / "mock_slow")
    config = repository / "mock_slow" / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "0"', 'string_value: "0.02"'))
    port = free_port()
    proc = ServerProcess(
        repository,
        args=[
            f"--openai-port={port}",
            "--openai-address=127.0.0.1",
            f"--openai-api-key={KEY}",
            "--openai-restricted-api",
            "metrics",
            "metrics-key",
            "metrics-value",
            f"--http-max-input-size={BODY_LIMIT}",
        ],
    )
    proc.openai_port = port
    try:
        proc.wait_ready()
        wait_for(lambda: _get(proc, "/health/ready")[0] == 200, "the OpenAI port to answer")
        yield proc
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key=KEY, max_retries=0
    ) as client:
        yield client


def _request(server, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", server.openai_port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _get(server, path: str, headers: dict | None = None):
    try:
        return _request(server, "GET", path, headers=headers)
    except OSError:
        return None, b""


def _post(server, path: str, payload: dict, key: str | None = KEY):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return _request(server, "POST", path, json.dumps(payload).encode(), headers)


def _metric(server, name: str, model: str) -> float | None:
    status, body = _get(server, "/metrics", {"metrics-key": "metrics-value"})
    assert status == 200
    match = re.search(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', body.decode(), re.M)
    return float(match.group(1)) if match else None


# -- models and observability ----------------------------------------------------


def test_models_are_listed_and_retrieved(client):
    models = {model.id: model for model in client.models.list()}
    assert set(models) == {"mock_llm", "mock_slow", "tiny_llm"}
    assert models["tiny_llm"].owned_by == "Triton Inference Server"
    assert client.models.retrieve("tiny_llm").id == "tiny_llm"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no_such_model")
    assert caught.value.body["message"] == "Unknown model: no_such_model"


def test_health_and_metrics(server):
    assert _get(server, "/health/ready") == (200, b"")
    status, body = _get(server, "/metrics")
    assert status == 401  # restricted (--openai-restricted-api metrics ...)
    error = json.loads(body)["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_auth"
    assert "expecting header 'metrics-key'" in error["message"]
    status, body = _get(server, "/metrics", {"metrics-key": "metrics-value"})
    assert status == 200 and b"nv_inference_request_success" in body
    status, body = _get(server, "/v1/nothing", {"Authorization": f"Bearer {KEY}"})
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_api_key_is_required_on_v1(server):
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="wrong", max_retries=0
    ) as wrong:
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.models.list()
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"
    status, _ = _post(server, "/v1/completions", {"model": "mock_llm", "prompt": "a"}, key=None)
    assert status == 401


# -- completions --------------------------------------------------------------------


def test_completion_answers_with_usage(client):
    completion = client.completions.create(model="mock_llm", prompt="a b c", max_tokens=5)
    assert completion.object == "text_completion" and completion.model == "mock_llm"
    choice = completion.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == ("a b c a b", "stop", 0)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 5)
    assert completion.usage.total_tokens == 8


def test_completion_default_max_tokens_and_echo(client):
    words = " ".join(str(i) for i in range(20))
    default = client.completions.create(model="mock_llm", prompt=words)
    assert default.choices[0].text.split() == words.split()[:16]  # Triton's default 16
    echoed = client.completions.create(model="mock_llm", prompt="x y", max_tokens=1, echo=True)
    assert echoed.choices[0].text == "x y x"


def test_streamed_completion_is_the_answer_in_pieces(client):
    """tiny_llm really generates: greedy decoding streamed and not agree."""
    args = dict(model="tiny_llm", prompt="The server ", max_tokens=40, temperature=0.0, seed=0)
    whole = client.completions.create(**args).choices[0].text
    assert len(whole) >= 30 and whole.strip()
    chunks, finishes = [], 0
    for chunk in client.completions.create(**args, stream=True):
        chunks.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
        assert chunk.usage is None
    assert finishes == 1 and chunk.choices[0].finish_reason == "stop"
    assert len(chunks) > 10 and "".join(chunks) == whole


def test_completion_stream_usage_chunk(client):
    """test_completion_streaming_usage_option: one more chunk, with empty choices
    and the usage of the same request not streamed."""
    args = dict(model="mock_llm", prompt="a b c", max_tokens=4)
    whole = client.completions.create(**args)
    plain = list(client.completions.create(**args, stream=True))
    counted = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert len(counted) == len(plain) + 1 and all(c.usage is None for c in counted[:-1])
    assert counted[-1].choices == [] and counted[-1].usage == whole.usage
    assert counted[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("stop", ["c", ["zz", "c"]])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_words_reach_the_model(client, stop, stream):
    args = dict(model="mock_llm", prompt="a b c d", max_tokens=4, stop=stop)
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    else:
        text = client.completions.create(**args).choices[0].text
    assert text == "a b"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_sampling_values_and_defaults_reach_the_model(client, kind):
    """Set values reach the model's inputs; unset ones take Triton's schema defaults."""

    def seen(**args):
        if kind == "chat":
            messages = [{"role": "user", "content": "sampling?"}]
            text = client.chat.completions.create(model="mock_llm", messages=messages, **args)
            return json.loads(text.choices[0].message.content)
        return json.loads(
            client.completions.create(model="mock_llm", prompt="sampling?", **args).choices[0].text
        )

    defaults = seen()
    assert defaults["temperature"] == pytest.approx(0.7 if kind == "chat" else 1.0)
    assert (defaults["top_p"], defaults["frequency_penalty"], defaults["seed"]) == (1.0, 0.0, None)
    given = seen(temperature=0.25, top_p=0.5, presence_penalty=-1.5, seed=7)
    assert (given["temperature"], given["top_p"], given["seed"]) == (0.25, 0.5, 7)
    assert given["presence_penalty"] == -1.5


# -- chat ----------------------------------------------------------------------------


def test_chat_without_a_template_uses_the_default_one(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model="mock_llm", messages=messages, max_tokens=4)
    message = answer.choices[0].message
    assert message.role == "assistant" and answer.object == "chat.completion"
    assert message.content == "system: be brief\nuser: hi\nassistant:"
    assert answer.choices[0].finish_reason == "stop"


def test_chat_renders_the_tokenizers_template(client):
    """tiny_llm answers this question only when the prompt is its chat template's."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What are you?"}]}]
    answer = client.chat.completions.create(
        model="tiny_llm", messages=messages, max_completion_tokens=60, temperature=0
    )
    assert answer.choices[0].message.content.startswith("I am a tiny language model.")


def test_max_completion_tokens_wins_over_max_tokens(client):
    messages = [{"role": "user", "content": "a b c d e f g"}]
    answer = client.chat.completions.create(
        model="mock_llm", messages=messages, max_tokens=5, max_completion_tokens=2
    )
    assert answer.usage.completion_tokens == 2


def test_chat_stream_role_first_then_deltas_then_usage(client):
    messages = [{"role": "user", "content": "Hello!"}]
    args = dict(model="tiny_llm", messages=messages, max_tokens=30, temperature=0)
    whole = client.chat.completions.create(**args)
    plain = list(client.chat.completions.create(**args, stream=True))
    counted = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert plain[0].choices[0].delta.role == "assistant"
    assert all(chunk.usage is None for chunk in plain)
    assert [chunk.choices[0].finish_reason for chunk in plain].count("stop") == 1
    text = "".join(chunk.choices[0].delta.content or "" for chunk in plain)
    assert text == whole.choices[0].message.content and len(plain) > 5
    assert len(counted) == len(plain) + 1
    assert counted[-1].choices == [] and counted[-1].usage == whole.usage
    assert all(chunk.usage is None for chunk in counted[:-1])


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "args", "message"),
    [
        ("completion", {"n": 2}, "Received n=2, but only single choice (n=1) is currently"),
        ("completion", {"best_of": 2}, "Received best_of=2, but only single choice (best_of=1)"),
        ("completion", {"logit_bias": {"1": 1}}, "logit bias is not supported"),
        ("completion", {"suffix": "x"}, "suffix is not currently supported"),
        ("completion", {"prompt": ""}, "prompt must be non-empty"),
        ("completion", {"prompt": ["a", "b"]}, "only single string input is supported"),
        ("completion", {"logprobs": 1}, "logprobs are currently available only for the vLLM"),
        (
            "completion",
            {"stream_options": {"include_usage": True}},
            "`stream_options` can only be used when `stream` is True",
        ),
        ("completion", {"model": "no_such_model"}, "Unknown model: no_such_model"),
        ("chat", {"n": 3}, "Received n=3, but only single choice (n=1) is currently"),
        ("chat", {"logit_bias": {"1": 1}}, "logit bias is not currently supported"),
        ("chat", {"logprobs": True}, "logprobs are currently available only for the vLLM"),
        ("chat", {"top_logprobs": 2}, "`top_logprobs` can only be used when `logprobs` is True"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "having tools in the request requires --tool-call-parser to be set",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "only text message is supported, but got image_url",
        ),
    ],
)
def test_refusals_are_triton_s_400s(client, endpoint, args, message):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            args = {"model": "mock_llm", "messages": [{"role": "user", "content": "a"}], **args}
            client.chat.completions.create(**args)
        else:
            client.completions.create(**{"model": "mock_llm", "prompt": "a", **args})
    assert caught.value.status_code == 400
    assert caught.value.body["message"].startswith(message)
    assert caught.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"model": "mock_llm"}, "prompt"),
        ({"prompt": "a"}, "model"),
        ({"model": "mock_llm", "prompt": "a", "temperature": 3}, "temperature"),
        ({"model": "mock_llm", "prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ({"model": "mock_llm", "prompt": "a", "bogus": 1}, "bogus"),
    ],
)
def test_bodies_outside_the_schema_are_422(server, payload, field):
    status, body = _post(server, "/v1/completions", payload)
    assert status == 422
    error = json.loads(body)["error"]
    assert error["param"] == field and f"'{field}'" in error["message"]


def test_chat_without_messages_is_422(client):
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="mock_llm", messages=[{"role": "user"}])


def test_a_body_past_the_limit_is_413_in_openai_s_shape(server):
    status, body = _post(
        server, "/v1/completions", {"model": "mock_llm", "prompt": "a" * BODY_LIMIT}
    )
    assert status == 413
    error = json.loads(body)["error"]
    assert error["code"] == "content_too_large" and "--http-max-input-size" in error["message"]


def test_embeddings(client):
    floats = client.embeddings.create(model="mock_llm", input="one two three", dimensions=4)
    assert floats.data[0].embedding == [3.0, 13.0, 4.0] and floats.usage.prompt_tokens == 3
    raw = client.embeddings.create(model="mock_llm", input="a b", encoding_format="base64")
    vector = struct.unpack("<3f", base64.b64decode(raw.data[0].embedding))
    assert vector == (2.0, 3.0, 0.0)  # float32 bytes
    with pytest.raises(openai.BadRequestError, match="do not support embedding requests"):
        client.embeddings.create(model="tiny_llm", input="a")


# -- streams: errors, cancellation and concurrency -------------------------------------


def test_a_model_error_is_the_answer(client, server):
    """Before the stream: the error with its status; after it began: one error
    event, then [DONE] (every request gets exactly one outcome)."""
    with pytest.raises(openai.InternalServerError, match="An Error Occurred"):
        client.completions.create(model="mock_llm", prompt="fail! now", max_tokens=2)
    payload = {"model": "mock_llm", "prompt": "fail! now", "max_tokens": 2, "stream": True}
    status, body = _post(server, "/v1/completions", payload)
    events = [event for event in body.decode().split("\n\n") if event]
    assert status == 200 and len(events) == 3, events
    assert json.loads(events[0][6:])["choices"][0]["text"] == "fail!"
    error = json.loads(events[1][6:])["error"]
    assert error["message"] == "An Error Occurred" and error["type"] == "server_error"
    assert events[2] == "data: [DONE]"
    with pytest.raises(openai.APIError, match="An Error Occurred"):
        for _ in client.completions.create(**payload):
            pass


def test_a_client_that_hangs_up_cancels_its_stream(client, server):
    before = _metric(server, "mock_llm_cancelled", "mock_slow") or 0.0
    stream = client.completions.create(
        model="mock_slow", prompt="a b c", max_tokens=100_000, stream=True
    )
    for _, chunk in zip(range(3), stream, strict=False):
        assert chunk.choices[0].text.strip() in ("a", "b", "c")
    stream.close()
    wait_for(
        lambda: (_metric(server, "mock_llm_cancelled", "mock_slow") or 0.0) > before,
        "the model to see is_cancelled()",
    )
    wait_for(
        lambda: _metric(server, "nv_inference_pending_request_count", "mock_slow") == 0.0,
        "no request left pending",
    )


def test_many_concurrent_streams_each_end_with_done(server):
    def stream(index: int) -> tuple[int, str, bytes]:
        words = " ".join(f"w{index}x{i}" for i in range(5))
        payload = {"model": "mock_llm", "prompt": words, "max_tokens": 5, "stream": True}
        status, body = _post(server, "/v1/completions", payload)
        events = [e for e in body.decode().split("\n\n") if e]
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert text == words, body
        return status, events[-1], body

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(stream, range(32)))
    assert all(status == 200 for status, _, _ in results)
    assert all(last == "data: [DONE]" for _, last, _ in results)
    assert _metric(server, "nv_inference_pending_request_count", "mock_llm") == 0.0


# -- the in-process API ------------------------------------------------------------------


def test_attached_to_an_in_process_server_with_model_control(tmp_path):
    """attach_openai serves a running core; /v1/models/{m}/load and /unload control
    its models in EXPLICIT mode (Triton's routers/model_management.py)."""
    from trionserve import api

    shutil.copytree(MODELS / "mock_llm", tmp_path / "mock_llm")
    shutil.copytree(MODELS / "mock_llm", tmp_path / "other")
    with api.Server(
        model_repository=tmp_path,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        startup_models=["mock_llm"],
    ) as core:
        ((host, port),) = core.attach_openai("127.0.0.1", 0)
        with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="-") as local:
            assert [m.id for m in local.models.list()] == ["mock_llm"]
            answer = local.completions.create(model="mock_llm", prompt="in process", max_tokens=2)
            assert answer.choices[0].text == "in process"
            loaded = local.post("/models/other/load", cast_to=object, body={})
            assert loaded["id"] == "other"
            with pytest.raises(openai.BadRequestError, match="is already loaded"):
                local.post("/models/other/load", cast_to=object, body={})
            assert [m.id for m in local.models.list()] == ["mock_llm", "other"]
            unloaded = local.post("/models/other/unload", cast_to=object, body={})
            assert unloaded == {"status": "success", "model": "other"}
            assert [m.id for m in local.models.list()] == ["mock_llm"]


async def test_a_stream_in_flight_finishes_through_the_drain(tmp_path):
    """The drain contract on the OpenAI port: after shutdown() a stream in flight
    goes on to its [DONE] while a new request is refused with 503 in OpenAI's
    shape; then the server exits 0."""
    import trio

    from trionserve.server import Server, ServerOptions

    shutil.copytree(MODELS / "mock_llm", tmp_path / "mock_slow")
    config = tmp_path / "mock_slow" / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "0"', 'string_value: "0.02"'))
    port = free_port()
    server = Server(
        ServerOptions(
            model_repositories=[tmp_path],
            allow_http=False,
            allow_grpc=False,
            allow_metrics=False,
            openai_port=port,
            openai_address="127.0.0.1",
            exit_timeout_secs=20.0,
            handle_signals=False,
        )
    )
    started = trio.Event()
    body = json.dumps(
        {"model": "mock_slow", "prompt": "a b c", "max_tokens": 25, "stream": True}
    ).encode()

    def stream(first_chunk) -> bytes:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read1()
        trio.from_thread.run_sync(first_chunk.set)
        while chunk := response.read1():
            data += chunk
        connection.close()
        return data

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        results = []

        async def client():
            results.append(await trio.to_thread.run_sync(stream, started))

        nursery.start_soon(client)
        await started.wait()
        server.shutdown()
        status, refused = await trio.to_thread.run_sync(
            lambda: _request(_Port(port), "POST", "/v1/completions", body)
        )
        assert status == 503
        assert json.loads(refused)["error"]["message"].startswith("server is shutting down")
    events = [event for event in results[0].decode().split("\n\n") if event]
    assert events[-1] == "data: [DONE]" and len(events) == 27  # 25 words, the final, DONE
    assert server.exit_code == 0


class _Port:
    def __init__(self, port: int) -> None:
        self.openai_port = port
