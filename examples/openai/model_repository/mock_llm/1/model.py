"""An echo "language model": it answers the prompt's words, for tests.

- The answer is the prompt's words (split on spaces), repeated until
  ``max_tokens`` words when that is more; a word is one token. Each word of the
  answer but the first keeps the space before it.
- ``stop_words``: the answer ends before the first word that contains one.
- ``exclude_input_in_output`` false (``echo``): the prompt comes first.
- ``stream`` true: one response per word, then an empty final response; else one
  response with the whole answer. ``num_input_tokens`` / ``num_output_tokens``
  (when asked) count the words of the prompt and of each response.
- ``temperature``, ``top_p``, penalties and ``seed`` are accepted and answered
  in the text when the prompt has ``"sampling?"`` in it.
- ``embedding_request`` (vLLM's JSON): the embedding is
  ``[words, characters, dimensions]`` of its input.
- A prompt with ``fail!`` in it: the answer's first word (streaming), then the
  error "An Error Occurred" as the final response (as Triton's mock_llm's
  ``FAIL_LAST``).
- A request cancelled mid-stream stops; the counter ``mock_llm_cancelled``
  counts them.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _value(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.dtype == np.object_:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in value]
    return value[0].item()


def _response(text, inputs=None, outputs=None):
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
    if inputs is not None:
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array([inputs], dtype=np.int32)))
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array([outputs], dtype=np.int32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        delay = config.get("parameters", {}).get("word_delay_s", {}).get("string_value", "0")
        self.delay = float(delay)
        self.family = pb_utils.MetricFamily(
            name="mock_llm_cancelled",
            description="streams the client cancelled",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.cancelled = self.family.Metric(labels={"model": args["model_name"]})

    def execute(self, requests):
        for request in requests:
            self._answer(request, request.get_response_sender())
        return None

    def _answer(self, request, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        embedding = _value(request, "embedding_request")
        if embedding is not None:
            doc = json.loads(embedding[0])
            text = (
                doc["input"] if isinstance(doc["input"], str) else " ".join(map(str, doc["input"]))
            )
            dims = doc.get("pooling_params", {}).get("dimensions", [0])[0]
            vector = [len(text.split()), len(text), dims]
            sender.send(_response(json.dumps(vector), len(text.split()), 0), flags=final)
            return
        prompt = (_value(request, "text_input") or [""])[0]
        if "sampling?" in prompt:
            names = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed")
            seen = {name: _value(request, name) for name in names}
            sender.send(_response(json.dumps(seen, sort_keys=True)), flags=final)
            return
        words = prompt.split(" ")
        limit = _value(request, "max_tokens", len(words))
        answer = [words[i % len(words)] for i in range(max(limit, 0))]
        if limit < len(words):
            answer = words[:limit]
        for stop in _value(request, "stop_words") or []:
            for index, word in enumerate(answer):
                if stop in word:
                    answer = answer[:index]
                    break
        if not _value(request, "exclude_input_in_output", True):
            answer = words + answer
        counts = bool(_value(request, "return_num_input_tokens", False)) and bool(
            _value(request, "return_num_output_tokens", False)
        )
        n_in = len(words) if counts else None
        failure = pb_utils.InferenceResponse(error=pb_utils.TritonError("An Error Occurred"))
        if not _value(request, "stream", False):
            if "fail!" in prompt:
                sender.send(failure, flags=final)
                return
            sender.send(_response(" ".join(answer), n_in, len(answer)), flags=final)
            return
        if "fail!" in prompt:
            sender.send(_response(answer[0], n_in, 1))
            sender.send(failure, flags=final)
            return
        for index, word in enumerate(answer):
            if sender.is_cancelled():
                self.cancelled.increment(1)
                sender.send(flags=final)
                return
            if self.delay:
                time.sleep(self.delay)
            sender.send(_response(word if index == 0 else " " + word, n_in, 1))
        sender.send(flags=final)
