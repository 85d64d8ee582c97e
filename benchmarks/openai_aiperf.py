"""NVIDIA's AIPerf against the OpenAI API of a real server, beside the model called
directly: time to first token, inter-token latency and output tokens per second
of the example language models (examples/openai: ``mock_llm``, an echo that
costs nothing, and ``tiny_llm``, a real model that generates on the CPU).

    python -m benchmarks.openai_aiperf [--requests 100] [--concurrency 1 8]

AIPerf (``pip install aiperf``, best in its own environment: it pins its own
dependencies) runs as a new user would run it: the chat endpoint, streaming, 64
input and 128 output tokens (synthetic prompts), the example model's tokenizer
from its folder, so nothing is downloaded (AIPerf 0.13 with ``HF_HUB_OFFLINE=1``
refuses a folder as a tokenizer name, so that is not set). It is found through
``$TRIONSERVE_AIPERF`` (the ``aiperf`` executable) or on ``PATH``. Each run's
export (``profile_export_aiperf.json``) gives the figures; the server's CPU time
(its process and the stub processes, from /proc) per request comes from the same
run. The direct call is ``benchmarks.openai_stream``'s: ``tiny_llm``'s
``model.py`` in this process, greedy, timed from the call to its first token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.openai_stream import _cpu_seconds, direct_round, load_direct
from tests.serverproc import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "openai" / "model_repository"
TOKENIZER = MODELS / "tiny_llm"
ENV_VAR = "TRIONSERVE_AIPERF"


def find_aiperf() -> str | None:
    """The aiperf executable: ``$TRIONSERVE_AIPERF``, else ``aiperf`` on PATH."""
    given = os.environ.get(ENV_VAR)
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("aiperf")


def run_aiperf(
    aiperf: str,
    port: int,
    model: str,
    concurrency: int,
    requests: int,
    out: Path,
    *,
    input_tokens: int = 64,
    output_tokens: int = 128,
    warmup: int | None = None,
    timeout: float = 600,
) -> dict:
    """One AIPerf profile run; its JSON export. Raises naming the log on failure."""
    warmup = 2 * concurrency if warmup is None else warmup
    command = [
        aiperf,
        "profile",
        "--model",
        model,
        "--url",
        f"http://127.0.0.1:{port}",
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(TOKENIZER),
        "--synthetic-input-tokens-mean",
        str(input_tokens),
        "--output-tokens-mean",
        str(output_tokens),
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--warmup-request-count",
        str(warmup),
        "--output-artifact-dir",
        str(out),
        "--ui",
        "none",
        # The server's CPU per request is measured here: no scrapes of /metrics
        # meanwhile, and no probes for GPU telemetry exporters.
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]
    log = out.with_suffix(".log")
    with log.open("w") as output:
        done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=timeout)
    export = out / "profile_export_aiperf.json"
    if done.returncode != 0 or not export.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"aiperf failed (exit {done.returncode}); its output ends:\n{tail}")
    return json.loads(export.read_text())


def figures(export: dict) -> dict:
    """What a row of the table shows, from AIPerf's export."""
    ttft = export["time_to_first_token"]
    return {
        "requests": int(export["request_count"]["avg"]),
        "errors": sum(int(entry.get("count", 1)) for entry in export.get("error_summary") or []),
        "ttft_ms": {key: round(ttft[key], 2) for key in ("avg", "p50", "p99")},
        "itl_ms": round(export["inter_token_latency"]["avg"], 3),
        "output_tokens_per_s": round(export["output_token_throughput"]["avg"], 1),
    }


def direct_tiny_llm(rounds: int = 20, max_tokens: int = 128) -> dict:
    """tiny_llm's model.py called in this process: median TTFT and tokens/s."""
    model = load_direct()
    direct_round(model, max_tokens)  # warm up
    runs = [direct_round(model, max_tokens) for _ in range(rounds)]
    return {
        "ttft_ms": round(statistics.median(r[0] for r in runs) * 1000, 3),
        "tokens_per_s": round(statistics.median(r[1] for r in runs), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--models", nargs="+", default=["mock_llm", "tiny_llm"])
    parser.add_argument("--rounds", type=int, default=2, help="AIPerf runs per cell, interleaved")
    args = parser.parse_args()
    aiperf = find_aiperf()
    if aiperf is None:
        raise SystemExit(f"aiperf not found: pip install aiperf, or set ${ENV_VAR}")
    port = free_port()
    proc = ServerProcess(MODELS, args=[f"--openai-port={port}", "--allow-grpc=false"])
    cells: dict[str, list[dict]] = {}
    try:
        proc.wait_ready()
        with tempfile.TemporaryDirectory(prefix="aiperf-") as folder:
            for round_ in range(args.rounds):
                for model in args.models:
                    for concurrency in args.concurrency:
                        out = Path(folder) / f"{model}-c{concurrency}-r{round_}"
                        before = _cpu_seconds(proc.process.pid)
                        export = run_aiperf(aiperf, port, model, concurrency, args.requests, out)
                        cpu = _cpu_seconds(proc.process.pid) - before
                        row = figures(export)
                        # Warm-up requests counted too: what the server served in the run.
                        served = row["requests"] + 2 * concurrency
                        row["server_cpu_ms_per_request"] = round(cpu / served * 1000, 2)
                        cells.setdefault(f"{model} c={concurrency}", []).append(row)
    finally:
        proc.stop()
        proc.close()
    result = {"aiperf": cells, "direct": {"tiny_llm": direct_tiny_llm()}}
    print(json.dumps(result, indent=2))
    print("\n| model | c | TTFT avg / p50 / p99 | ITL avg | output tokens/s | server CPU/request |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in cells.items():
        model, concurrency = name.split(" c=")
        for row in rows:
            ttft = row["ttft_ms"]
            print(
                f"| `{model}` | {concurrency} | {ttft['avg']} / {ttft['p50']} / {ttft['p99']} ms"
                f" | {row['itl_ms']} ms | {row['output_tokens_per_s']:,} |"
                f" {row['server_cpu_ms_per_request']} ms |"
            )
    direct = result["direct"]["tiny_llm"]
    print(
        f"| `tiny_llm` called directly | - | {direct['ttft_ms']} ms | - "
        f"| {direct['tokens_per_s']:,} | - |"
    )


if __name__ == "__main__":
    main()
