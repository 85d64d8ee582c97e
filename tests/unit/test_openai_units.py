"""The OpenAI frontend's pure parts: body parsing, chat templates, the mapping of a
request onto a model's inputs (Triton's engine/utils/triton.py), restrictions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.serverproc import ROOT
from trionserve.core.inference import InferenceResponse, Tensor
from trionserve.core.validation import ModelSignature, TensorSpec
from trionserve.protocol.openai import engine, schemas
from trionserve.protocol.openai.chat import ChatTemplates, default_template
from trionserve.protocol.openai.frontend import parse_restricted_apis
from trionserve.protocol.openai.schemas import OpenAIError

TINY = ROOT / "examples" / "openai" / "model_repository" / "tiny_llm"


def signature(*inputs: tuple[str, str, tuple[int, ...]], batch: int = 0) -> ModelSignature:
    specs = {name: TensorSpec(name, dt, dims, optional=True) for name, dt, dims in inputs}
    return ModelSignature("llm", batch, specs, {})


TRTLLM = signature(
    ("text_input", "BYTES", (1,)),
    ("max_tokens", "INT32", (1,)),
    ("stop_words", "BYTES", (-1,)),
    ("temperature", "FP32", (1,)),
    batch=8,
)
VLLM = signature(
    ("text_input", "BYTES", (1,)),
    ("stream", "BOOL", (1,)),
    ("sampling_parameters", "BYTES", (1,)),
    ("exclude_input_in_output", "BOOL", (1,)),
    ("return_num_input_tokens", "BOOL", (1,)),
    ("return_num_output_tokens", "BOOL", (1,)),
)


def completion(**fields) -> schemas.CompletionRequest:
    return schemas.parse_completion(json.dumps({"model": "llm", "prompt": "p", **fields}).encode())


def test_trtllm_inputs_take_the_model_s_shapes_and_types():
    target = engine.Target("llm", TRTLLM, "trtllm", 16)
    request = engine.generate_request(target, "hi", completion(stop=["a", "bc"]))
    inputs = request.inputs
    assert inputs["text_input"].data.shape == (1, 1)  # batch dimension first
    assert inputs["max_tokens"].data.dtype == np.int32 and inputs["max_tokens"].data[0, 0] == 16
    assert inputs["stop_words"].data.tolist() == [[b"a", b"bc"]]
    assert inputs["temperature"].data[0, 0] == 1.0  # Triton's schema default
    assert "stream" not in inputs and "return_num_input_tokens" not in inputs  # not declared


def test_an_asked_input_the_model_lacks_is_a_400():
    target = engine.Target("llm", TRTLLM, "trtllm", 16)
    with pytest.raises(OpenAIError) as caught:
        engine.generate_request(target, "hi", completion(seed=3))
    assert caught.value.status == 400
    assert caught.value.message.startswith("unexpected inference input 'seed' for model 'llm'")


def test_vllm_inputs_carry_the_sampling_parameters_as_json():
    assert engine.request_format("vllm", "", None) == "vllm"
    assert engine.request_format("python", "", None) == "trtllm"
    assert engine.request_format("vllm", "", "tensorrtllm") == "trtllm"
    target = engine.Target("llm", VLLM, "vllm", 16)
    request = engine.generate_request(target, "hi", completion(max_tokens=4, stop="x", echo=True))
    sampling = json.loads(request.inputs["sampling_parameters"].data[0])
    assert sampling == {
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "n": 1,
        "stop": ["x"],
        "max_tokens": 4,
    }
    assert request.inputs["exclude_input_in_output"].data.tolist() == [False]
    assert request.inputs["return_num_output_tokens"].data.tolist() == [True]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[]", "the request body must be a JSON object"),
        (b"{", "the request body is not valid JSON"),
        (b'{"model": "m"}', "'prompt': Field required"),
        (b'{"model": "m", "prompt": "p", "top_p": 2}', "'top_p': must be less than or equal"),
        (b'{"model": "m", "prompt": "p", "stop": [1]}', "'stop': expected a string or a list"),
        (b'{"model": "m", "prompt": "p", "x": 1}', "'x': Extra inputs are not permitted"),
    ],
)
def test_bodies_outside_the_schema(body, message):
    with pytest.raises(OpenAIError) as caught:
        schemas.parse_completion(body)
    assert caught.value.status == 422 and caught.value.message.startswith(message)


def test_chat_templates(tmp_path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    templates = ChatTemplates()
    assert templates.for_model(TINY, 1)(messages) == "<|user|>Hi<|end|>\n<|assistant|>"
    assert templates.for_model(tmp_path, 1) is default_template
    assert default_template(messages) == "user: Hi\nassistant:"
    override = tmp_path / "t.jinja"
    override.write_text("{{ eos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}")
    forced = ChatTemplates(tokenizer=TINY, chat_template=override)
    assert forced.for_model(tmp_path, 1)(messages) == "<|end|>[Hi]"  # tokenizer's tokens
    refuses = tmp_path / "refuses.jinja"
    refuses.write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(OpenAIError, match="no system role"):
        ChatTemplates(chat_template=refuses).for_model(None, 1)(messages)


def test_usage_is_summed_over_a_stream():
    def response(n_in: int, n_out: int) -> InferenceResponse:
        outputs = [
            Tensor("num_input_tokens", "INT32", np.array([n_in], dtype=np.int32)),
            Tensor("num_output_tokens", "UINT32", np.array([n_out], dtype=np.uint32)),
        ]
        return InferenceResponse("m", "1", outputs=outputs)

    usage = engine.UsageAccumulator()
    for item in (response(5, 1), None, response(5, 2)):
        usage.update(item)
    assert usage.final() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert engine.UsageAccumulator().final() is None


def test_non_streaming_answers_have_one_or_two_responses():
    engine.check_responses(2, True)
    with pytest.raises(OpenAIError, match="Unexpected number of responses: 3"):
        engine.check_responses(3, True)
    with pytest.raises(OpenAIError, match="incorrect response flags"):
        engine.check_responses(1, False)


def test_restricted_api_settings():
    assert parse_restricted_apis([["inference,health", "Key", "v"]]) == {
        "inference": ("key", "v"),
        "health": ("key", "v"),
    }
    with pytest.raises(ValueError, match="Unknown API 'shm'"):
        parse_restricted_apis([["shm", "k", "v"]])
    with pytest.raises(ValueError, match="can not be specified in multiple config groups"):
        parse_restricted_apis([["metrics", "k", "v"], ["metrics", "k2", "v"]])


@pytest.mark.parametrize("text", ["x", "", 'a"b\n%s\u00e9\x00', "100%"])
@pytest.mark.parametrize("final", [False, True])
def test_stream_events_from_templates_are_the_encoded_chunks(text, final):
    answer = engine.Answer('odd%"model')
    reason = "stop" if final else None

    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    assert answer.completion_event(text, final) == event(answer.completion(text, reason, None))
    assert answer.chat_event(text, final) == event(answer.chat_chunk({"content": text}, reason))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--openai-restricted-api", "shm", "k", "v"], "--openai-restricted-api: Unknown API"),
        (["--openai-port=9000", "--workers=2"], "--openai-port cannot be combined with"),
        (["--openai-tokenizer=/nonexistent"], "--openai-tokenizer: '/nonexistent' does not"),
        (["--openai-tokenizer={tmp}"], "no chat template in it"),
        (["--openai-chat-template={tmp}/bad.jinja"], "the chat template does not compile"),
    ],
)
def test_openai_flags_refused_at_start(tmp_path, capsys, flags, message):
    from trionserve.cli.options import parse_options

    (tmp_path / "bad.jinja").write_text("{% for %}")
    argv = [f"--model-repository={tmp_path}", *(f.format(tmp=tmp_path) for f in flags)]
    with pytest.raises(SystemExit):
        parse_options(argv)
    assert message in capsys.readouterr().err


def test_openai_flags_make_the_options(tmp_path):
    from trionserve.cli.options import parse_options

    options, _ = parse_options(
        [
            f"--model-repository={tmp_path}",
            "--openai-port=0",
            "--openai-api-key=k",
            f"--openai-tokenizer={TINY}",
            "--openai-default-max-tokens=5",
            "--openai-backend=vllm",
            "--openai-restricted-api",
            "inference",
            "X-Key",
            "v",
        ]
    )
    assert (options.openai_port, options.openai_address) == (0, None)
    assert options.openai.api_key == "k" and options.openai.tokenizer == TINY
    assert (options.openai.default_max_tokens, options.openai.backend) == (5, "vllm")
    assert options.openai.restricted_apis == {"inference": ("x-key", "v")}


# Triton's frontend tests: test_completions.py / test_chat_completions.py
# *_invalid_sampling_parameters, each a 422.
INVALID_SAMPLING = [
    ("temperature", 2.1),
    ("temperature", -0.1),
    ("max_tokens", -1),
    ("top_p", 1.1),
    ("frequency_penalty", 3),
    ("frequency_penalty", -3),
    ("presence_penalty", 2.1),
    ("presence_penalty", -2.1),
    ("min_tokens", -1),
    ("ignore_eos", 123),
]


@pytest.mark.parametrize(("field", "value"), [*INVALID_SAMPLING, ("max_completion_tokens", -1)])
def test_invalid_sampling_values_are_422(field, value):
    messages = [{"role": "user", "content": "hi"}]
    bodies = [{"model": "m", "messages": messages, field: value}]
    if field != "max_completion_tokens":
        bodies.append({"model": "m", "prompt": "p", field: value})
    for body in bodies:
        parse = schemas.parse_chat if "messages" in body else schemas.parse_completion
        with pytest.raises(OpenAIError) as caught:
            parse(json.dumps(body).encode())
        assert caught.value.status == 422 and caught.value.param == field


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "List should have at least 1 item after validation, not 0"),
        ([{}], "'messages[0]'.role: expected one of"),
        ([{"role": "user"}], "'messages[0]'.content: Field required"),
    ],
)
def test_chat_messages_outside_the_schema(messages, message):
    with pytest.raises(OpenAIError) as caught:
        schemas.parse_chat(json.dumps({"model": "m", "messages": messages}).encode())
    assert caught.value.status == 422 and message in caught.value.message


def test_vllm_extensions_reach_the_sampling_parameters():
    target = engine.Target("llm", VLLM, "vllm", 16)
    request = engine.generate_request(target, "hi", completion(min_tokens=2, ignore_eos=True))
    sampling = json.loads(request.inputs["sampling_parameters"].data[0])
    assert (sampling["min_tokens"], sampling["ignore_eos"]) == (2, True)
