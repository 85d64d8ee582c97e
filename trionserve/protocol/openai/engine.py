"""OpenAI requests as inference requests, and inference responses as OpenAI objects.

Sans-I/O, as Triton's frontend engine maps them (server
``python/openai/openai_frontend/engine/triton_engine.py`` and
``engine/utils/triton.py``):

- The request format is chosen from the model's configuration
  (``TritonLLMEngine._determine_request_converter``): ``backend: "vllm"`` takes
  vLLM's inputs (``text_input``, ``stream``, ``sampling_parameters`` as JSON,
  ``exclude_input_in_output``, ``return_num_input_tokens`` /
  ``return_num_output_tokens``); every other model (TensorRT-LLM, an ensemble, a
  Python model) takes TensorRT-LLM's (``text_input``, ``max_tokens``,
  ``stop_words``, ``temperature``, ``top_p``, ``frequency_penalty``,
  ``presence_penalty``, ``seed``, the echo input, ``return_num_*``).
  ``--openai-backend`` forces one, as Triton's ``--backend``.
- Inputs are shaped and typed as the model declares them (one element, or one per
  stop word). An input the client asked for that the model does not declare is a
  400 naming it, as Triton's core answers; the frontend's own inputs (``stream``,
  the default ``max_tokens`` and sampling values, ``return_num_*``) go only to a
  model that declares them (Triton's frontend sends them to every model, which
  fails any model without them), so any text model can be served.
- The answer is the ``text_output`` string; usage comes from ``num_input_tokens``
  and ``num_output_tokens`` when the model answers both (``_get_usage_from_response``),
  summed over a stream's responses (``_StreamingUsageAccumulator``). A request
  that does not stream must get one or two responses, the last final
  (``_validate_triton_responses_non_streaming``); the first one is the answer.
- What Triton's frontend refuses is refused with its words: ``n > 1``,
  ``best_of > 1``, ``logit_bias``, ``suffix``, a prompt that is not one non-empty
  string, logprobs, tools, ``stream_options`` without ``stream``.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from trionserve.core.errors import TritonError
from trionserve.core.inference import InferenceRequest, InferenceResponse, Tensor
from trionserve.core.validation import ModelSignature
from trionserve.protocol.http.generate import input_tensor
from trionserve.protocol.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    OpenAIError,
    Sampling,
    client_error,
)

OWNED_BY = "Triton Inference Server"
# Inputs of TensorRT-LLM's and vLLM's models that turn the prompt's echo off
# (triton_engine.py _build_model_metadata).
ECHO_INPUTS = ("exclude_input_in_output", "sampling_param_exclude_input_from_output")
# Triton's schema defaults, sent when the request leaves them out
# (schemas/openai.py CreateCompletionRequest, CreateChatCompletionRequest).
COMPLETION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "frequency_penalty": 0.0}
COMPLETION_DEFAULTS["presence_penalty"] = 0.0
CHAT_DEFAULTS = {**COMPLETION_DEFAULTS, "temperature": 0.7}


def request_format(backend: str, platform: str, override: str | None) -> str:
    """'vllm' or 'trtllm': the inputs a model takes."""
    if override:
        backend = override
    elif not backend and platform == "ensemble":
        backend = "ensemble"
    return "vllm" if backend == "vllm" else "trtllm"


@dataclass
class Target:
    """The model a request goes to, as the engine needs it."""

    name: str
    signature: ModelSignature
    format: str  # 'vllm' or 'trtllm'
    default_max_tokens: int

    @property
    def echo_input(self) -> str | None:
        for name in ECHO_INPUTS:
            if name in self.signature.inputs:
                return name
        return None


class _Inputs:
    """The inputs of one request, each shaped and typed as the model declares it."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.tensors: dict[str, Tensor] = {}

    def add(self, name: str, value: Any, asked: bool = True) -> None:
        """``asked``: the client asked for it (an input the model lacks is a 400);
        else the frontend adds it where the model declares it."""
        spec = self.target.signature.inputs.get(name)
        if spec is None:
            if asked:
                raise client_error(
                    f"unexpected inference input '{name}' for model '{self.target.name}': "
                    "the model does not take it"
                )
            return
        try:
            self.tensors[name] = input_tensor(
                name, spec.datatype, self.target.signature.full_shape(spec), value
            )
        except TritonError as exc:
            raise client_error(f"model '{self.target.name}': {exc.message}") from None


def _max_tokens(request: Sampling, target: Target) -> tuple[int, bool]:
    """The token limit and whether the client set it: ``max_completion_tokens``
    first, then ``max_tokens``, then ``--openai-default-max-tokens``."""
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens, True
    if request.max_tokens is not None:
        return request.max_tokens, True
    return target.default_max_tokens, False


def generate_request(
    target: Target, prompt: str, request: CompletionRequest | ChatRequest
) -> InferenceRequest:
    """The inference request of a completion or chat request (``_create_vllm_generate_request``,
    ``_create_trtllm_generate_request``)."""
    inputs = _Inputs(target)
    defaults = CHAT_DEFAULTS if isinstance(request, ChatRequest) else COMPLETION_DEFAULTS
    max_tokens, max_asked = _max_tokens(request, target)
    echo = request.echo if isinstance(request, CompletionRequest) else None
    inputs.add("text_input", prompt)
    inputs.add("stream", request.stream, asked=False)
    if target.format == "vllm":
        sampling: dict[str, Any] = {}
        for name in ("frequency_penalty", "presence_penalty", "temperature", "top_p"):
            value = getattr(request, name)
            sampling[name] = defaults[name] if value is None else value
        sampling["n"] = request.n or 1
        if request.seed is not None:
            sampling["seed"] = request.seed
        if request.stop is not None:
            sampling["stop"] = request.stop
        for name in ("min_tokens", "ignore_eos"):
            if getattr(request, name) is not None:
                sampling[name] = getattr(request, name)
        sampling["max_tokens"] = max_tokens
        inputs.add("sampling_parameters", json.dumps(sampling), asked=False)
        echo_input = target.echo_input
        if echo_input is not None:
            inputs.add(echo_input, True if echo is None else not echo, asked=False)
        inputs.add("return_logprobs", False, asked=False)
    else:
        inputs.add("max_tokens", max_tokens, asked=max_asked)
        if request.stop:
            inputs.add("stop_words", request.stop)
        for name in ("top_p", "frequency_penalty", "presence_penalty", "temperature"):
            value = getattr(request, name)
            if value is not None:
                inputs.add(name, value)
            else:
                inputs.add(name, defaults[name], asked=False)
        if request.seed is not None:
            inputs.add("seed", request.seed)
        echo_input = target.echo_input
        if echo is not None and echo_input is not None:
            inputs.add(echo_input, not echo)
    inputs.add("return_num_input_tokens", True, asked=False)
    inputs.add("return_num_output_tokens", True, asked=False)
    return InferenceRequest(target.name, None, inputs=inputs.tensors)


def embedding_request(target: Target, request: EmbeddingRequest) -> InferenceRequest:
    """The inference request of an embedding request: vLLM's ``embedding_request``
    JSON (``_create_vllm_embedding_request``) for a vLLM model or any model that
    declares that input; other models refuse it, as Triton's
    ``_create_trtllm_embedding_request``."""
    if target.format != "vllm" and "embedding_request" not in target.signature.inputs:
        raise client_error("TRT-LLM backend and Python backend do not support embedding requests")
    pooling = {} if request.dimensions is None else {"dimensions": [request.dimensions]}
    inputs = _Inputs(target)
    inputs.add("embedding_request", json.dumps({"input": request.input, "pooling_params": pooling}))
    inputs.add("return_num_input_tokens", True, asked=False)
    inputs.add("return_num_output_tokens", True, asked=False)
    return InferenceRequest(target.name, None, inputs=inputs.tensors)


# -- refusals, as Triton's frontend refuses ----------------------------------------


def check_completion(request: CompletionRequest, target: Target) -> str:
    """The prompt, after Triton's checks (``_validate_completion_request``)."""
    if request.suffix is not None:
        raise client_error("suffix is not currently supported")
    if not request.prompt:
        raise client_error("prompt must be non-empty")
    if not isinstance(request.prompt, str):
        raise client_error("only single string input is supported")
    if "best_of" in request.given and target.format == "vllm":
        raise client_error(
            "best_of is no longer supported in vLLM backend, removed from vLLM V1 engine"
        )
    if request.n and request.n > 1:
        raise client_error(
            f"Received n={request.n}, but only single choice (n=1) is currently supported"
        )
    if request.best_of and request.best_of > 1:
        raise client_error(
            f"Received best_of={request.best_of}, but only single choice (best_of=1) is "
            "currently supported"
        )
    if request.logit_bias is not None:
        raise client_error("logit bias is not supported")
    if request.logprobs is not None and request.logprobs > 0:
        raise _no_logprobs(target)
    if request.include_usage is not None and not request.stream:
        raise client_error("`stream_options` can only be used when `stream` is True")
    return request.prompt


def check_chat(request: ChatRequest, target: Target) -> None:
    """Triton's checks of a chat request (``_validate_chat_request``)."""
    if request.n and request.n > 1:
        raise client_error(
            f"Received n={request.n}, but only single choice (n=1) is currently supported"
        )
    if request.logit_bias is not None:
        raise client_error("logit bias is not currently supported")
    if request.logprobs or request.top_logprobs is not None:
        if not request.logprobs:
            raise client_error("`top_logprobs` can only be used when `logprobs` is True")
        raise _no_logprobs(target)
    choice = request.tool_choice
    if choice == "required" and not request.tools:
        raise client_error(
            '"required" tool choice requires CreateChatCompletionRequest.tools to be provided'
        )
    if isinstance(choice, dict) and not request.tools:
        raise client_error(
            "Named tool choice requires CreateChatCompletionRequest.tools to be provided"
        )
    if choice == "auto":
        raise client_error('"auto" tool choice requires --tool-call-parser to be set')
    if request.tools:
        raise client_error("having tools in the request requires --tool-call-parser to be set")
    if request.include_usage is not None and not request.stream:
        raise client_error("`stream_options` can only be used when `stream` is True")


def _no_logprobs(target: Target) -> OpenAIError:
    if target.format != "vllm":
        return client_error("logprobs are currently available only for the vLLM backend")
    return client_error("logprobs are not supported by trionserve's OpenAI frontend")


# -- responses ------------------------------------------------------------------------


def output_text(response: InferenceResponse | None) -> str:
    """The ``text_output`` string of a response ("" without one: Triton's ``_get_output``)."""
    if response is None:
        return ""
    for tensor in response.outputs:
        if tensor.name == "text_output":
            data = np.asarray(tensor.data)
            if data.size != 1:
                raise OpenAIError(
                    500,
                    f"Expected to find 1 string in the output, found {data.size} instead.",
                    "server_error",
                )
            value = data.reshape(-1)[0]
            if isinstance(value, (bytes, bytearray, np.bytes_)):
                return bytes(value).decode("utf-8", errors="replace")
            return str(value)
    return ""


def response_usage(response: InferenceResponse | None) -> tuple[int, int] | None:
    """(prompt tokens, completion tokens) when the response carries both counts."""
    if response is None:
        return None
    counts = {}
    for tensor in response.outputs:
        if tensor.name in ("num_input_tokens", "num_output_tokens"):
            data = np.asarray(tensor.data).reshape(-1)
            if data.size and data.dtype.kind in "iu":
                counts[tensor.name] = int(data[0])
    if len(counts) != 2:
        return None
    return counts["num_input_tokens"], counts["num_output_tokens"]


def usage_object(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class UsageAccumulator:
    """A stream's usage: the prompt tokens of its first counted response, the sum
    of every response's completion tokens (Triton's ``_StreamingUsageAccumulator``)."""

    def __init__(self) -> None:
        self.prompt: int | None = None
        self.completion = 0

    def update(self, response: InferenceResponse | None) -> None:
        usage = response_usage(response)
        if usage is not None:
            if self.prompt is None:
                self.prompt = usage[0]
            self.completion += usage[1]

    def final(self) -> dict[str, int] | None:
        return None if self.prompt is None else usage_object(self.prompt, self.completion)


def check_responses(count: int, last_final: bool) -> None:
    """A request that does not stream gets one or two responses, the last final."""
    if 1 <= count <= 2:
        if not last_final:
            raise OpenAIError(
                500, "Unexpected internal error with incorrect response flags", "server_error"
            )
    else:
        raise OpenAIError(
            500,
            f"Unexpected number of responses: {count}, expected 1 or 2.",
            "server_error",
        )


# Stands for a chunk's text while its event template is made.
_SENTINEL = "\x00text\x00"


class Answer:
    """The identity of one answer: its id, creation time and model name, shared by
    the object or by every chunk of its stream."""

    def __init__(self, model: str, prefix: str = "cmpl") -> None:
        # uuid4, not Triton's uuid1: libuuid's time-based ids ask the uuidd daemon
        # over a socket first (socket, connect, close per call: 170 us here),
        # on the way to every answer's first token.
        self.id = f"{prefix}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.model = model
        self._templates: dict[tuple[str, bool], bytes] = {}

    def completion(
        self, text: str, finish_reason: str | None, usage: dict | None, chunk: bool = False
    ) -> dict[str, Any]:
        choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        return self._object("text_completion", choices, usage, chunk)

    def completion_event(self, text: str, final: bool) -> bytes:
        """One streamed completion chunk as a server-sent event: the same bytes as
        ``completion(text, ...)`` would encode, from a template made once per answer
        (a stream writes one per token)."""
        return self._template("completion", final) % json.dumps(text).encode()

    def chat_event(self, text: str, final: bool) -> bytes:
        """One streamed chat content delta as a server-sent event (as
        :meth:`completion_event`)."""
        return self._template("chat", final) % json.dumps(text).encode()

    def _template(self, kind: str, final: bool) -> bytes:
        key = (kind, final)
        template = self._templates.get(key)
        if template is None:
            reason = "stop" if final else None
            if kind == "chat":
                payload = self.chat_chunk({"content": _SENTINEL}, reason)
            else:
                payload = self.completion(_SENTINEL, reason, None, chunk=True)
            encoded = json.dumps(payload, separators=(",", ":")).encode().replace(b"%", b"%%")
            template = self._templates[key] = (
                b"data: " + encoded.replace(json.dumps(_SENTINEL).encode(), b"%s") + b"\n\n"
            )
        return template

    def completion_usage(self, usage: dict) -> dict[str, Any]:
        return self._object("text_completion", [], usage, True)

    def chat(self, text: str, usage: dict | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "tool_calls": None}
        choices = [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}]
        return self._object("chat.completion", choices, usage, False)

    def chat_chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        return self._object("chat.completion.chunk", choices, None, True)

    def chat_usage(self, usage: dict) -> dict[str, Any]:
        return self._object("chat.completion.chunk", [], usage, True)

    def _object(self, kind: str, choices: list, usage: dict | None, chunk: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage,
        }


def embedding_object(
    model: str, response: InferenceResponse | None, encoding_format: str
) -> dict[str, Any]:
    """The embedding answer: ``text_output`` holds the vector as JSON (Triton's
    ``TritonLLMEngine.embedding``); base64 is the float32 bytes."""
    try:
        vector = json.loads(output_text(response))
    except ValueError as exc:
        raise OpenAIError(
            500, f"the model's embedding is not JSON: {exc}", "server_error"
        ) from None
    if not isinstance(vector, list):
        raise OpenAIError(500, "the model's embedding is not a list of numbers", "server_error")
    embedding: Any = vector
    if encoding_format == "base64":
        embedding = base64.b64encode(np.asarray(vector, dtype=np.float32).tobytes()).decode()
    usage = response_usage(response)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": embedding}],
        "model": model,
        "usage": None if usage is None else {"prompt_tokens": usage[0], "total_tokens": usage[0]},
    }
