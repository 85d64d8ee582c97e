"""OpenAI request bodies, parsed and checked; OpenAI's error object.

Sans-I/O: JSON bytes in, a :class:`CompletionRequest`, :class:`ChatRequest` or
:class:`EmbeddingRequest` out, or an :class:`OpenAIError`. The fields and their
ranges are those of Triton's frontend schema (server
``python/openai/openai_frontend/schemas/openai.py``: ``CreateCompletionRequest``,
``CreateChatCompletionRequest``, ``CreateEmbeddingRequest``, each
``extra="forbid"``): a body that does not fit them is a 422 naming the field, as
FastAPI answers there. What the fields ask that Triton's frontend refuses
(``n > 1``, ``logit_bias``, ``suffix``, ...) is checked later, by the engine,
with Triton's 400 messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param",
    "code"}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> bytes:
        """OpenAI's error object; ``detail`` repeats the message, as the
        ``{"detail": ...}`` body of Triton's FastAPI frontend carries it."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error, "detail": self.message}).encode()


def client_error(message: str, code: str | None = None) -> OpenAIError:
    """400: Triton's frontend ``ClientError``."""
    return OpenAIError(400, message, code=code)


def unprocessable(message: str, param: str | None = None) -> OpenAIError:
    """422: a body that does not fit the schema (FastAPI's validation error)."""
    return OpenAIError(422, message, code="invalid_value", param=param)


def parse_json(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The request body as a JSON object, or 422."""
    try:
        doc = json.loads(bytes(body) if isinstance(body, memoryview) else body)
    except RecursionError:
        raise unprocessable("the request JSON is nested too deeply") from None
    except ValueError as exc:
        raise unprocessable(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise unprocessable("the request body must be a JSON object")
    return doc


# -- fields -----------------------------------------------------------------------


class _Fields:
    """Reads one body's fields, each at most once; ``rest`` names the unread ones."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.read: set[str] = set()

    def get(self, name: str) -> Any:
        self.read.add(name)
        return self.doc.get(name)

    def required(self, name: str) -> Any:
        self.read.add(name)
        if name not in self.doc:
            raise unprocessable(f"'{name}': Field required", name)
        return self.doc[name]

    def string(self, name: str, required: bool = False) -> str | None:
        value = self.required(name) if required else self.get(name)
        if value is not None and not isinstance(value, str):
            raise unprocessable(f"'{name}': expected a string, got {json.dumps(value)}", name)
        return value

    def boolean(self, name: str) -> bool | None:
        value = self.get(name)
        if value is not None and not isinstance(value, bool):
            raise unprocessable(f"'{name}': expected a boolean, got {json.dumps(value)}", name)
        return value

    def integer(self, name: str, low: int | None = None, high: int | None = None) -> int | None:
        value = self.get(name)
        if value is None:
            return None
        if type(value) is not int:
            raise unprocessable(f"'{name}': expected an integer, got {json.dumps(value)}", name)
        _check_range(name, value, low, high)
        return value

    def number(self, name: str, low: float, high: float) -> float | None:
        value = self.get(name)
        if value is None:
            return None
        if type(value) not in (int, float):
            raise unprocessable(f"'{name}': expected a number, got {json.dumps(value)}", name)
        _check_range(name, value, low, high)
        return float(value)

    def check_unknown(self) -> None:
        """422 for a field the schema does not have (Triton's ``extra="forbid"``)."""
        for name in self.doc:
            if name not in self.read:
                raise unprocessable(f"'{name}': Extra inputs are not permitted", name)


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        raise unprocessable(f"'{name}': must be greater than or equal to {low}, got {value}", name)
    if high is not None and value > high:
        raise unprocessable(f"'{name}': must be less than or equal to {high}, got {value}", name)


def _stop(fields: _Fields) -> list[str] | None:
    value = fields.get("stop")
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise unprocessable("'stop': expected a string or a list of strings", "stop")


def _stream_options(fields: _Fields) -> bool | None:
    """``stream_options.include_usage``; None when no stream_options were given."""
    value = fields.get("stream_options")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise unprocessable(
            "'stream_options': expected an object with only 'include_usage'", "stream_options"
        )
    include = value.get("include_usage", False)
    if include is not None and not isinstance(include, bool):
        raise unprocessable("'stream_options.include_usage': expected a boolean", "stream_options")
    return bool(include)


@dataclass
class Sampling:
    """What a completion and a chat request share: the sampling fields, each None
    unless the request set it (Triton's schema defaults are applied by the engine)."""

    model: str = ""
    stream: bool = False
    include_usage: bool | None = None  # None: no stream_options
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    n: int | None = None
    logit_bias: dict | None = None
    # vLLM's extensions of the schema (sampling_parameters only)
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # Fields a request set, by name (Triton's ``model_fields_set``).
    given: set[str] = field(default_factory=set)


def _sampling(fields: _Fields, target: Sampling) -> None:
    target.model = fields.string("model", required=True) or ""
    target.stream = bool(fields.boolean("stream"))
    target.include_usage = _stream_options(fields)
    target.max_tokens = fields.integer("max_tokens", 0)
    target.stop = _stop(fields)
    target.temperature = fields.number("temperature", 0.0, 2.0)
    target.top_p = fields.number("top_p", 0.0, 1.0)
    target.frequency_penalty = fields.number("frequency_penalty", -2.0, 2.0)
    target.presence_penalty = fields.number("presence_penalty", -2.0, 2.0)
    target.seed = fields.integer("seed", INT64_MIN, INT64_MAX)
    target.n = fields.integer("n", 1, 128)
    logit_bias = fields.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise unprocessable("'logit_bias': expected an object", "logit_bias")
    target.logit_bias = logit_bias
    target.min_tokens = fields.integer("min_tokens", 0)
    target.ignore_eos = fields.boolean("ignore_eos")
    fields.string("user")
    target.given = {name for name in fields.doc if fields.doc[name] is not None}


@dataclass
class CompletionRequest(Sampling):
    """``POST /v1/completions``."""

    prompt: Any = None  # a string; anything else is refused by the engine (400)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


def parse_completion(body: bytes | bytearray | memoryview) -> CompletionRequest:
    fields = _Fields(parse_json(body))
    request = CompletionRequest()
    _sampling(fields, request)
    prompt = fields.required("prompt")
    if not isinstance(prompt, (str, list)):
        raise unprocessable("'prompt': expected a string or a list", "prompt")
    request.prompt = prompt
    request.echo = fields.boolean("echo")
    request.suffix = fields.string("suffix")
    request.best_of = fields.integer("best_of", 0, 20)
    request.logprobs = fields.integer("logprobs", 0, 5)
    fields.check_unknown()
    return request


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclass
class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None


def _message(index: int, message: Any) -> dict[str, Any]:
    """One chat message: its role, and its content as a string or text parts."""
    where = f"'messages[{index}]'"
    if not isinstance(message, dict):
        raise unprocessable(f"{where}: expected an object", "messages")
    role = message.get("role")
    if role not in ROLES:
        raise unprocessable(
            f"{where}.role: expected one of {', '.join(ROLES)}, got {json.dumps(role)}",
            "messages",
        )
    if "content" not in message and role != "assistant":
        raise unprocessable(f"{where}.content: Field required", "messages")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise unprocessable(f"{where}.content: expected a string or a list of parts", "messages")
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise unprocessable(
                    f"{where}.content: each part must be an object with a 'type'", "messages"
                )
    return message


def parse_chat(body: bytes | bytearray | memoryview) -> ChatRequest:
    fields = _Fields(parse_json(body))
    request = ChatRequest()
    _sampling(fields, request)
    messages = fields.required("messages")
    if not isinstance(messages, list):
        raise unprocessable("'messages': expected a list of messages", "messages")
    if not messages:
        raise unprocessable(
            "'messages': List should have at least 1 item after validation, not 0", "messages"
        )
    request.messages = [_message(index, message) for index, message in enumerate(messages)]
    request.max_completion_tokens = fields.integer("max_completion_tokens", 0)
    request.logprobs = fields.boolean("logprobs")
    request.top_logprobs = fields.integer("top_logprobs", 0, 20)
    tools = fields.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise unprocessable("'tools': expected a list", "tools")
    request.tools = tools
    request.tool_choice = fields.get("tool_choice")
    # Accepted and not used, as Triton's frontend does for a model that is not vLLM.
    for name in ("response_format", "functions", "function_call", "parallel_tool_calls"):
        fields.get(name)
    fields.check_unknown()
    return request


@dataclass
class EmbeddingRequest:
    """``POST /v1/embeddings``."""

    model: str
    input: Any
    dimensions: int | None = None
    encoding_format: str = "float"


def parse_embedding(body: bytes | bytearray | memoryview) -> EmbeddingRequest:
    fields = _Fields(parse_json(body))
    model = fields.string("model", required=True) or ""
    value = fields.required("input")
    if not isinstance(value, str) and not (
        isinstance(value, list) and all(type(item) is int for item in value)
    ):
        raise unprocessable("'input': expected a string or a list of token ids", "input")
    dimensions = fields.integer("dimensions")
    encoding_format = fields.string("encoding_format") or "float"
    if encoding_format not in ("float", "base64"):
        raise unprocessable("'encoding_format': expected 'float' or 'base64'", "encoding_format")
    fields.string("user")
    fields.check_unknown()
    return EmbeddingRequest(model, value, dimensions, encoding_format)
