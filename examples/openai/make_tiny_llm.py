"""Build the tiny_llm example model: a character-level language model trained here.

Writes into model_repository/tiny_llm/:

- tokenizer.json: a Hugging Face ``tokenizers`` tokenizer, one token per character
  of the training text plus the chat markers (<|system|>, <|user|>,
  <|assistant|>, <|end|>) as special tokens;
- tokenizer_config.json: its chat template (Jinja) and special tokens, which the
  OpenAI frontend renders for /v1/chat/completions;
- 1/weights.npz: the network, float16: an embedding of each of the last CONTEXT
  tokens, one tanh hidden layer, logits over the vocabulary (about 50k numbers).

The training text is PROSE and DIALOGS below; training is plain numpy (Adam,
4000 steps, about a minute and a half of CPU) with a fixed seed. The network
learns the text almost by heart: it writes the sentences it read.

    python examples/openai/make_tiny_llm.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

HERE = Path(__file__).resolve().parent / "model_repository" / "tiny_llm"
CONTEXT = 12  # tokens the network sees
EMBED = 16
HIDDEN = 192
STEPS = 4000
BATCH = 128
SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

PROSE = """\
The server reads a model repository and loads every model it finds. Each model
has a configuration, a version directory and the files its backend needs. A
request names a model, the server routes it to a ready version, the scheduler
queues it, and an instance runs it. The answer goes back to the client that
asked. A decoupled model may answer many times: a language model sends one
token after another, and the client reads them as they come. When the client
hangs up, the request is cancelled and the model stops early. The queue is
bounded, the memory is bounded, and every request gets exactly one outcome.
A small model can still write text. It reads the last few letters and guesses
the next one, again and again, until it meets the end or the limit of tokens.
It knows only what it read in this short text, so it repeats itself, but it
writes word after word, and that is enough to show a stream at work.
"""

DIALOGS = [
    ("Hello!", "Hello! I am a tiny model served by trionserve."),
    ("What are you?", "I am a tiny language model. I write one letter at a time."),
    ("What can you do?", "I can write short text, one token after another."),
    ("How do you work?", "I read the last few letters and guess the next one."),
    ("Tell me about the server.", "The server loads models and answers requests."),
    ("What happens when I hang up?", "The request is cancelled and the model stops."),
    ("Is the queue bounded?", "Yes. The queue is bounded and so is the memory."),
    ("Write a story.", "A request came to the server. The model answered it, token by token."),
    ("Thank you.", "You are welcome."),
    ("Goodbye.", "Goodbye! Come back with another request."),
]


def training_text() -> str:
    parts = [PROSE]
    for question, answer in DIALOGS * 3:
        parts.append(f"<|user|>{question}<|end|>\n<|assistant|>{answer}<|end|>\n")
    return "".join(parts)


def build_tokenizer(text: str) -> Tokenizer:
    plain = text
    for token in SPECIAL:
        plain = plain.replace(token, "")
    vocab = {"<unk>": 0}
    for token in SPECIAL:
        vocab[token] = len(vocab)
    for char in sorted(set(plain)):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<unk>", *SPECIAL])
    return tokenizer


def train(ids: np.ndarray, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    params = {
        "embed": rng.normal(0, 0.3, (vocab, EMBED)),
        "w1": rng.normal(0, (CONTEXT * EMBED) ** -0.5, (CONTEXT * EMBED, HIDDEN)),
        "b1": np.zeros(HIDDEN),
        "w2": rng.normal(0, HIDDEN**-0.5, (HIDDEN, vocab)),
        "b2": np.zeros(vocab),
    }
    moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in params.items()}
    padded = np.concatenate([np.zeros(CONTEXT, dtype=ids.dtype), ids])
    windows = np.lib.stride_tricks.sliding_window_view(padded, CONTEXT + 1)
    for step in range(1, STEPS + 1):
        batch = windows[rng.integers(0, len(windows), BATCH)]
        context, target = batch[:, :CONTEXT], batch[:, CONTEXT]
        x = params["embed"][context].reshape(BATCH, -1)
        h = np.tanh(x @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        loss = -np.log(probs[np.arange(BATCH), target] + 1e-9).mean()
        dlogits = probs
        dlogits[np.arange(BATCH), target] -= 1
        dlogits /= BATCH
        grads = {"w2": h.T @ dlogits, "b2": dlogits.sum(0)}
        dh = dlogits @ params["w2"].T * (1 - h**2)
        grads["w1"] = x.T @ dh
        grads["b1"] = dh.sum(0)
        dx = (dh @ params["w1"].T).reshape(BATCH, CONTEXT, EMBED)
        grads["embed"] = np.zeros_like(params["embed"])
        np.add.at(grads["embed"], context, dx)
        rate = 0.01 * min(1.0, 2.0 - 2.0 * step / STEPS)
        for name, grad in grads.items():
            m, v = moments[name]
            m[:] = 0.9 * m + 0.1 * grad
            v[:] = 0.999 * v + 0.001 * grad**2
            params[name] -= rate * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)
        if step % 1000 == 0:
            print(f"step {step}: loss {loss:.3f}")
    return {k: v.astype(np.float16) for k, v in params.items()}


def main() -> None:
    text = training_text()
    tokenizer = build_tokenizer(text)
    ids = np.array(tokenizer.encode(text).ids, dtype=np.int64)
    (HERE / "1").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(HERE / "tokenizer.json"))
    config = {
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|end|>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = train(ids, tokenizer.get_vocab_size())
    np.savez_compressed(HERE / "1" / "weights.npz", context=np.array(CONTEXT), **weights)
    print(f"vocabulary {tokenizer.get_vocab_size()}, {len(ids)} training tokens -> {HERE}")


if __name__ == "__main__":
    main()
