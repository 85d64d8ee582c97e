"""Chat templates: the messages of a chat request as one prompt for a text model.

A model's template is the Jinja ``chat_template`` of the Hugging Face tokenizer
files in its folder (``chat_template.jinja``, or the ``chat_template`` entry of
``tokenizer_config.json``; the model's directory first, then its version's), else
the one in ``--openai-tokenizer DIR``, else ``--openai-chat-template FILE``
where given; a template file given by ``--openai-chat-template`` replaces the
tokenizer's for every model, as Triton's ``--chat-template`` does. It is rendered
as ``transformers``' ``apply_chat_template`` renders it (Jinja's sandbox,
``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``tojson``, the
tokenizer's special tokens as variables, ``add_generation_prompt`` true). Files
are read from disk only: nothing is downloaded.

A model with no template (or a server without ``jinja2``, the ``openai`` extra)
gets :data:`DEFAULT_TEMPLATE`'s prompt: each message as ``<role>: <content>`` on
its own line, then ``assistant:`` for the reply, so chat works on any text
model. Triton's frontend has no default: without a tokenizer its chat answers 500
"Unknown tokenizer".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog

from trionserve.protocol.openai.schemas import OpenAIError, client_error

log = structlog.get_logger(__name__)

DEFAULT_TEMPLATE = "<role>: <content>\\n for each message, then 'assistant:'"
# Special tokens of tokenizer_config.json that templates use as variables.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")

Template = Callable[[list[dict[str, Any]]], str]


def message_text(message: dict[str, Any]) -> str:
    """A message's content as text: its string, or its text parts joined; any
    other part is refused as Triton refuses it (``engine/utils/chat.py``)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise client_error(f"only text message is supported, but got {part.get('type')}")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def default_template(messages: list[dict[str, Any]]) -> str:
    """The prompt for a model without a chat template."""
    lines = [f"{message['role']}: {message_text(message)}" for message in messages]
    lines.append("assistant:")
    return "\n".join(lines)


def _conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a template sees them: a content of text parts as one string
    (vLLM's "string" content format), since most templates print the content."""
    conversation = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = message_text(message)  # refuses parts that are not text
        conversation.append({**message, "content": content})
    return conversation


def _raise_exception(message: str) -> None:
    raise client_error(f"the chat template refused the conversation: {message}")


def compile_template(source: str, special_tokens: dict[str, str]) -> Template | None:
    """A Jinja chat template as a function of the messages; None without jinja2."""
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        log.warning("jinja2 is not installed (the openai extra): the default chat template serves")
        return None
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = environment.from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from None

    def render(messages: list[dict[str, Any]]) -> str:
        try:
            return template.render(
                messages=_conversation(messages),
                add_generation_prompt=True,
                tools=None,
                **special_tokens,
            )
        except OpenAIError:
            raise
        except TemplateError as exc:
            raise OpenAIError(500, f"the chat template failed: {exc}", "server_error") from None

    return render


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken as tokenizer_config.json writes it
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def read_template(folder: Path) -> tuple[str, dict[str, str]] | None:
    """The chat template source and special tokens of the tokenizer files in
    ``folder``, or None when it has none."""
    config: dict[str, Any] = {}
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {config_path.name} in {folder.name}: {exc}") from None
    jinja = folder / "chat_template.jinja"
    source: Any = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
    if source is None:
        source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {entry.get("name"): entry.get("template") for entry in source}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    return source, _special_tokens(config)


class ChatTemplates:
    """Each model's chat template, read once per model directory.

    ``tokenizer`` (``--openai-tokenizer``): a folder of tokenizer files for models
    without their own; ``chat_template`` (``--openai-chat-template``): a Jinja
    file that replaces every tokenizer's template. Raises ValueError (or OSError)
    for a folder without a template or a template that does not compile.
    """

    def __init__(self, tokenizer: Path | None = None, chat_template: Path | None = None) -> None:
        self._fallback: tuple[str, dict[str, str]] | None = None
        if tokenizer is not None:
            self._fallback = read_template(tokenizer)
            if self._fallback is None and chat_template is None:
                raise ValueError(f"--openai-tokenizer {tokenizer}: no chat template in it")
        self._override: str | None = None
        if chat_template is not None:
            self._override = chat_template.read_text(encoding="utf-8")
            compile_template(self._override, {})  # a template that does not compile fails now
        self._cache: dict[tuple[str, int], Template] = {}

    def for_model(self, model_dir: Path | None, version: int) -> Template:
        key = (str(model_dir), version)
        template = self._cache.get(key)
        if template is None:
            template = self._cache[key] = self._load(model_dir, version)
        return template

    def _load(self, model_dir: Path | None, version: int) -> Template:
        found = None
        if model_dir is not None:
            for folder in (model_dir, model_dir / str(version)):
                found = read_template(folder)
                if found is not None:
                    break
        if found is None:
            found = self._fallback
        tokens = found[1] if found is not None else {}
        source = self._override if self._override is not None else found and found[0]
        if not source:
            return default_template
        return compile_template(source, tokens) or default_template
