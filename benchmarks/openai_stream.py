"""Time to first token and tokens per second of the example language model
(examples/openai tiny_llm): streamed through the OpenAI API of a real server, and
called directly in this process, interleaved round by round.

    python -m benchmarks.openai_stream [--rounds 10] [--max-tokens 200]

Direct: the model's own ``model.py`` is imported here with a minimal
``triton_python_backend_utils`` (tensors, responses, a sender that records when
each response is sent) and its generation called as the stub would call it.
Served: ``openai`` streams ``/v1/completions`` from ``trionserve --openai-port``
(the model in its stub process, the server's HTTP transport, server-sent events).
Between them, to tell the OpenAI frontend's cost from the decoupled path's: the
same request to ``generate_stream`` and to ``/v1/completions`` on a plain socket.
All decode greedily (temperature 0) from the same prompt, so they generate the
same tokens. Reported: the median time to first token, the median tokens per
second after it and its ratio to the direct call, and the server's CPU time
(server and stub processes) per OpenAI request.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

from trionserve.testing import TrionServe, free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "openai" / "model_repository" / "tiny_llm"
PROMPT = "The server "


def _backend_utils() -> types.ModuleType:
    """The few parts of triton_python_backend_utils the model uses."""
    module = types.ModuleType("triton_python_backend_utils")

    class Tensor:
        def __init__(self, name, data):
            self.name, self.data = name, data

        def as_numpy(self):
            return self.data

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.outputs = output_tensors or []

    module.Tensor = Tensor
    module.InferenceResponse = InferenceResponse
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    module.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    return module


class _Sender:
    def __init__(self):
        self.times: list[float] = []
        self.tokens = 0

    def is_cancelled(self):
        return False

    def send(self, response=None, flags=0):
        if response is not None:
            for tensor in response.outputs:
                if tensor.name == "num_output_tokens":
                    self.tokens += int(tensor.data[0])
            self.times.append(time.perf_counter())


class _Request:
    def __init__(self, inputs):
        utils = sys.modules["triton_python_backend_utils"]
        self.inputs = {name: utils.Tensor(name, value) for name, value in inputs.items()}


def load_direct():
    sys.modules["triton_python_backend_utils"] = _backend_utils()
    spec = importlib.util.spec_from_file_location("tiny_llm_model", MODEL / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_repository": str(MODEL), "model_version": "1"})
    return model


def direct_round(model, max_tokens: int) -> tuple[float, float, int]:
    request = _Request(
        {
            "text_input": np.array([PROMPT.encode()], dtype=np.object_),
            "stream": np.array([True]),
            "max_tokens": np.array([max_tokens], dtype=np.int32),
            "temperature": np.array([0.0], dtype=np.float32),
            "return_num_input_tokens": np.array([True]),
            "return_num_output_tokens": np.array([True]),
        }
    )
    sender = _Sender()
    start = time.perf_counter()
    model.generate(request, sender)
    return _figures(start, sender.times, sender.tokens)


def served_round(client, max_tokens: int) -> tuple[float, float, int]:
    times: list[float] = []
    tokens = 0
    start = time.perf_counter()
    stream = client.completions.create(
        model="tiny_llm",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        elif chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return _figures(start, times, tokens)


def raw_round(port: int, path: str, payload: dict, marker: bytes) -> tuple[float, float, int]:
    """A streamed request on a plain socket: the time each event carrying text
    (``marker``) arrived, without a client library's parsing."""
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    times: list[float] = []
    start = time.perf_counter()
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
    )
    data = b""
    while b"[DONE]" not in data and b"0\r\n\r\n" not in data[-7:]:
        received = sock.recv(65536)
        if not received:
            break
        now = time.perf_counter()
        times += [now] * received.count(marker)
        data += received
    sock.close()
    return _figures(start, times, len(times))


def _figures(start: float, times: list[float], tokens: int) -> tuple[float, float, int]:
    """(time to first token in s, tokens per second after it, tokens)."""
    ttft = times[0] - start
    elapsed = times[-1] - times[0]
    # Tokens that came in one read (written together) arrive at once: no rate.
    rate = (tokens - 1) / elapsed if len(times) > 1 and elapsed > 0 else float("nan")
    return ttft, rate, tokens


def _cpu_seconds(pid: int) -> float:
    """CPU time of a process and its children (the stub), from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc").iterdir():
        if not task.name.isdigit():
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(task.name) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def main() -> None:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    port = free_port()
    proc = TrionServe(MODEL.parent, args=[f"--openai-port={port}", "--allow-grpc=false"])
    try:
        proc.wait_ready()
        model = load_direct()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
        served_round(client, args.max_tokens)  # warm up both
        direct_round(model, args.max_tokens)
        common = {"max_tokens": args.max_tokens, "temperature": 0.0}
        openai_body = {"model": "tiny_llm", "prompt": PROMPT, "stream": True, **common}
        # The inputs the OpenAI frontend sends (the token counts for usage included).
        counts = {"return_num_input_tokens": True, "return_num_output_tokens": True}
        generate_body = {"text_input": PROMPT, "stream": True, **common, **counts}
        runs: dict[str, list] = {"direct": [], "generate_stream": [], "openai": [], "client": []}
        cpu = 0.0
        for _ in range(args.rounds):
            runs["direct"].append(direct_round(model, args.max_tokens))
            runs["generate_stream"].append(
                raw_round(
                    proc.http_port,
                    "/v2/models/tiny_llm/generate_stream",
                    generate_body,
                    b'"text_output":',
                )
            )
            before = _cpu_seconds(proc.process.pid)
            runs["openai"].append(raw_round(port, "/v1/completions", openai_body, b'"text":'))
            cpu += _cpu_seconds(proc.process.pid) - before
            runs["client"].append(served_round(client, args.max_tokens))
        client.close()
    finally:
        proc.stop()
        proc.close()
    result: dict = {}
    for name, rounds in runs.items():
        result[name] = {
            "ttft_ms": round(statistics.median(r[0] for r in rounds) * 1000, 2),
            "tokens_per_s": round(statistics.median(r[1] for r in rounds), 1),
            "tokens": rounds[0][2],
        }
    direct = result["direct"]
    for name in ("generate_stream", "openai", "client"):
        result[name]["tokens_per_s_over_direct"] = round(
            result[name]["tokens_per_s"] / direct["tokens_per_s"], 3
        )
    result["openai_server_cpu_ms_per_request"] = round(cpu / args.rounds * 1000, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
