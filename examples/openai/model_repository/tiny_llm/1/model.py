"""A tiny character-level language model, decoupled, in TensorRT-LLM's request format.

The network (``weights.npz``) reads the last ``context`` tokens and gives the
logits of the next; the tokenizer (``tokenizer.json``, Hugging Face
``tokenizers``) has one token per character and the chat markers. Both are made
by examples/openai/make_tiny_llm.py.

Per request: the prompt (``text_input``) is encoded, then tokens are sampled one
at a time (``temperature``, ``top_p``, ``seed``, ``frequency_penalty`` and
``presence_penalty`` as OpenAI defines them; temperature 0 is greedy) until
``max_tokens``, the end token ``<|end|>`` or a stop word (``stop_words``, left out
of the text). With ``stream`` each token's text is one response as soon as it is
sure not to begin a stop word; without it one response carries the whole text.
A cancelled request (``is_cancelled()``) stops at the next token.
"""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

END = "<|end|>"


def _value(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.dtype == np.object_:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in value]
    return value[0].item()


class TritonPythonModel:
    def initialize(self, args):
        folder = Path(args["model_repository"])
        version = folder / args["model_version"]
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        vocab = self.tokenizer.get_vocab()
        self.text = [""] * len(vocab)
        for token, index in vocab.items():
            self.text[index] = token
        self.end = vocab[END]
        self.text[self.end] = ""
        self.text[vocab["<unk>"]] = ""
        with np.load(version / "weights.npz") as weights:
            self.context = int(weights["context"])
            self.embed = weights["embed"].astype(np.float32)
            self.w1 = weights["w1"].astype(np.float32)
            self.b1 = weights["b1"].astype(np.float32)
            self.w2 = weights["w2"].astype(np.float32)
            self.b2 = weights["b2"].astype(np.float32)

    def execute(self, requests):
        for request in requests:
            self._generate(request, request.get_response_sender())
        return None

    def _logits(self, tokens):
        window = tokens[-self.context :]
        window = [0] * (self.context - len(window)) + window
        hidden = np.tanh(self.embed[window].reshape(-1) @ self.w1 + self.b1)
        return hidden @ self.w2 + self.b2

    def _sample(self, logits, counts, rng, settings):
        temperature, top_p, frequency, presence = settings
        logits = logits - frequency * counts - presence * (counts > 0)
        if temperature <= 0:
            return int(np.argmax(logits))
        logits = (logits - logits.max()) / temperature
        probs = np.exp(logits)
        probs /= probs.sum()
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < top_p
        chosen = order[keep]
        weights = probs[chosen] / probs[chosen].sum()
        return int(rng.choice(chosen, p=weights))

    def _generate(self, request, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        prompt = _value(request, "text_input")[0]
        stream = bool(_value(request, "stream", False))
        limit = _value(request, "max_tokens", 16)
        stops = [s for s in (_value(request, "stop_words") or []) if s]
        settings = (
            _value(request, "temperature", 1.0),
            _value(request, "top_p", 1.0),
            _value(request, "frequency_penalty", 0.0),
            _value(request, "presence_penalty", 0.0),
        )
        rng = np.random.default_rng(_value(request, "seed"))
        counted = bool(_value(request, "return_num_input_tokens", False)) and bool(
            _value(request, "return_num_output_tokens", False)
        )
        echo = not _value(request, "exclude_input_in_output", True)
        tokens = self.tokenizer.encode(prompt).ids
        n_in = len(tokens)
        counts = np.zeros(len(self.text), dtype=np.float32)
        text = prompt if echo else ""
        sent = 0  # characters of ``text`` already sent
        sent_tokens = 0
        generated = 0
        stopped = False
        while generated < limit and not stopped:
            if sender.is_cancelled():
                break
            token = self._sample(self._logits(tokens), counts, rng, settings)
            generated += 1
            if token == self.end:
                break
            tokens.append(token)
            counts[token] += 1
            text += self.text[token]
            for stop in stops:
                at = text.find(stop, sent)
                if at >= 0:
                    text, stopped = text[:at], True
            ready = len(text) if stopped else _safe_end(text, sent, stops)
            if stream and ready > sent:
                sender.send(
                    self._response(text[sent:ready], counted, n_in, generated - sent_tokens)
                )
                sent, sent_tokens = ready, generated
        if not stream:
            sender.send(self._response(text, counted, n_in, generated), flags=final)
            return
        if len(text) > sent or (counted and generated > sent_tokens):
            sender.send(self._response(text[sent:], counted, n_in, generated - sent_tokens))
        sender.send(flags=final)

    @staticmethod
    def _response(text, counted, n_in, n_out):
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
        if counted:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([n_in], dtype=np.int32)))
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([n_out], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)


def _safe_end(text, sent, stops):
    """How much of ``text`` can be sent: all but a tail that may begin a stop word."""
    end = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, end - sent), 0, -1):
            if stop.startswith(text[end - size :]):
                end = min(end, len(text) - size)
                break
    return max(end, sent)
