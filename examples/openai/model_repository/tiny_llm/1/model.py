"""A tiny character-level language model, decoupled, in TensorRT-LLM's request format,
that generates for every request it holds at once.

The network (``weights.npz``) reads the last ``context`` tokens and gives the
logits of the next; the tokenizer (``tokenizer.json``, Hugging Face
``tokenizers``) has one token per character and the chat markers. Both are made
by examples/openai/make_tiny_llm.py.

Serving several users (the pattern to copy, as Triton's vLLM backend serves:
``execute`` hands each request to the engine and returns, and the engine steps
every running request together, vllm_backend ``src/model.py``):

- ``execute`` is ``async def``. For a decoupled model the stub does not wait for
  it (python_backend ``src/pb_stub.cc`` ProcessRequests: "Do not wait for async
  decoupled execute to return"), so the next requests come in while these
  generate. It turns each request into a :class:`Sequence` and adds it to the
  running batch (at most ``max_batch_sequences``, parameter; more wait their
  turn in arrival order), and starts the stepping task if none runs.
- The stepping task (:meth:`TritonPythonModel.step_all`, on the stub's asyncio
  loop) computes one token for every running sequence with one matrix product
  per layer, sends each sequence's new text, drops the finished ones, and yields
  to the loop between steps so that new requests join at the next step: a new
  user waits one step for its first token, not for the others' whole answers.

Per request: the prompt (``text_input``) is encoded, then tokens are sampled one
at a time (``temperature``, ``top_p``, ``seed``, ``frequency_penalty`` and
``presence_penalty`` as OpenAI defines them; temperature 0 is greedy) until
``max_tokens``, the end token ``<|end|>`` or a stop word (``stop_words``, left out
of the text). With ``stream`` each token's text is one response as soon as it is
sure not to begin a stop word; without it one response carries the whole text.
A cancelled request (``is_cancelled()``) stops at the next step.
"""

import asyncio
import json
import traceback
from collections import deque
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


class Sequence:
    """One request being generated: its tokens, its sampling settings, what of its
    text was sent, and its response sender."""

    def __init__(self, model, request, sender):
        prompt = _value(request, "text_input")[0]
        self.sender = sender
        self.stream = bool(_value(request, "stream", False))
        self.limit = _value(request, "max_tokens", 16)
        self.stops = [s for s in (_value(request, "stop_words") or []) if s]
        self.settings = (
            _value(request, "temperature", 1.0),
            _value(request, "top_p", 1.0),
            _value(request, "frequency_penalty", 0.0),
            _value(request, "presence_penalty", 0.0),
        )
        self.rng = np.random.default_rng(_value(request, "seed"))
        self.counted = bool(_value(request, "return_num_input_tokens", False)) and bool(
            _value(request, "return_num_output_tokens", False)
        )
        echo = not _value(request, "exclude_input_in_output", True)
        self.tokens = model.tokenizer.encode(prompt).ids
        self.n_in = len(self.tokens)
        self.counts = np.zeros(len(model.text), dtype=np.float32)
        self.text = prompt if echo else ""
        self.sent = 0  # characters of ``text`` already sent
        self.sent_tokens = 0
        self.generated = 0
        self.done = False

    def window(self, context):
        """The last ``context`` tokens, padded on the left."""
        window = self.tokens[-context:]
        return [0] * (context - len(window)) + window

    def advance(self, model, token):
        """Take one sampled token: send what is sure of the text (streaming), or
        the whole answer once done."""
        self.generated += 1
        stopped = token == model.end
        if not stopped:
            self.tokens.append(token)
            self.counts[token] += 1
            self.text += model.text[token]
            for stop in self.stops:
                at = self.text.find(stop, self.sent)
                if at >= 0:
                    self.text, stopped = self.text[:at], True
            ready = len(self.text) if stopped else _safe_end(self.text, self.sent, self.stops)
            if self.stream and ready > self.sent:
                self._send(self.text[self.sent : ready], self.generated - self.sent_tokens)
                self.sent, self.sent_tokens = ready, self.generated
        if stopped or self.generated >= self.limit:
            self.finish()

    def finish(self):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.done = True
        if not self.stream:
            self._send(self.text, self.generated, final)
            return
        if len(self.text) > self.sent or (self.counted and self.generated > self.sent_tokens):
            self._send(self.text[self.sent :], self.generated - self.sent_tokens)
        self.sender.send(flags=final)

    def _send(self, text, n_out, flags=0):
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
        if self.counted:
            n_in = np.array([self.n_in], dtype=np.int32)
            tensors.append(pb_utils.Tensor("num_input_tokens", n_in))
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([n_out], dtype=np.int32)))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)


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
        parameters = json.loads(args.get("model_config", "{}")).get("parameters", {})
        setting = parameters.get("max_batch_sequences", {}).get("string_value", "32")
        self.max_batch = max(1, int(setting))
        self.running = []  # the sequences the next step computes
        self.waiting = deque()  # admitted when the batch has room
        self.stepping = None  # the task stepping them (on the asyncio loop)
        self.finalizing = False

    async def execute(self, requests):
        """Add the requests to the batch and return (the stub does not wait)."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.waiting.append(Sequence(self, request, sender))
            except Exception as exc:  # a request the model cannot read: its error only
                error = pb_utils.TritonError(f"tiny_llm cannot read the request: {exc}")
                sender.send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        if self.stepping is None or self.stepping.done():
            self.stepping = asyncio.get_running_loop().create_task(self.step_all())

    async def step_all(self):
        """Step every running sequence until none is left; new ones join between
        steps. A failure ends every sequence it held with the error."""
        try:
            while self.running or self.waiting:
                while self.waiting and len(self.running) < self.max_batch:
                    self.running.append(self.waiting.popleft())
                self.step(self.running)
                self.running = [sequence for sequence in self.running if not sequence.done]
                await asyncio.sleep(0)  # requests that came meanwhile join the next step
        except Exception as exc:
            pb_utils.Logger.log_error(f"tiny_llm: generation failed: {traceback.format_exc()}")
            error = pb_utils.TritonError(f"tiny_llm: generation failed: {exc}")
            for sequence in [*self.running, *self.waiting]:
                if not sequence.done:
                    sequence.done = True
                    sequence.sender.send(
                        pb_utils.InferenceResponse(error=error),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                    )
            self.running, self.waiting = [], deque()

    def step(self, batch):
        """One token for each sequence of ``batch``: the network once for all of
        them (a row each), then each samples and sends its own."""
        live = []
        for sequence in batch:
            if (
                self.finalizing
                or sequence.generated >= sequence.limit
                or sequence.sender.is_cancelled()
            ):
                sequence.finish()
            else:
                live.append(sequence)
        if not live:
            return
        windows = np.array([sequence.window(self.context) for sequence in live])
        hidden = np.tanh(self.embed[windows].reshape(len(live), -1) @ self.w1 + self.b1)
        logits = hidden @ self.w2 + self.b2
        for sequence, row in zip(live, logits):
            sequence.advance(self, self._sample(row, sequence))

    def generate(self, request, sender):
        """One request generated to its end on the calling thread (a direct call,
        as benchmarks/openai_stream.py times the model without a server)."""
        sequence = Sequence(self, request, sender)
        while not sequence.done:
            self.step([sequence])

    @staticmethod
    def _sample(logits, sequence):
        temperature, top_p, frequency, presence = sequence.settings
        counts = sequence.counts
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
        return int(sequence.rng.choice(chosen, p=weights))

    def finalize(self):
        # Sequences still running end at the next step (their requests are cancelled).
        self.finalizing = True


def _safe_end(text, sent, stops):
    """How much of ``text`` can be sent: all but a tail that may begin a stop word."""
    end = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, end - sent), 0, -1):
            if stop.startswith(text[end - size :]):
                end = min(end, len(text) - size)
                break
    return max(end, sent)
