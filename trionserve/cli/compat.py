"""tritonserver flags for what trionserve does not have: accepted with a note, or refused.

A script written for ``tritonserver`` must start ``trionserve`` unchanged, so every
flag of tritonserver's command line parses here. The ones in this module configure
parts of Triton that trionserve has no counterpart for (pinned and CUDA memory
pools, shared-library directories, thread pools of Triton's HTTP and gRPC servers,
a Vertex AI endpoint, ...). Each given one costs a log line at start saying it has
no effect. A setting that would change what the user relies on if it were ignored
(a Vertex AI endpoint) is refused with an error naming the flag. (SageMaker's
endpoints are served: protocol/http/sagemaker.py.)
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from trionserve.cli.values import AddFlag

# flag -> why it has no effect here
_NO_EFFECT = {
    "--http-thread-count": "HTTP requests are served by Trio tasks, not a thread pool",
    "--grpc-infer-thread-count": "gRPC calls are served by Trio tasks, not handler threads",
    "--grpc-max-response-pool-size": "gRPC responses are built for each call, not pooled",
    "--pinned-memory-pool-byte-size": "there is no pinned memory pool",
    "--cuda-memory-pool-byte-size": "there is no CUDA memory pool (GPU tensors are "
    "allocated by the frameworks and cupy)",
    "--cuda-virtual-address-size": "implicit state is not kept in growable CUDA memory",
    "--min-supported-compute-capability": "every GPU the frameworks can use is used",
    "--buffer-manager-thread-count": "tensor copies run in the request's own task",
    "--host-policy": "there are no host policies (NUMA placement, CPU pinning)",
    "--model-load-gpu-limit": "GPU memory is not checked before a load",
    "--repoagent-directory": "repository agents are not supported",
    "--cache-directory": "the response cache is built in (--cache-config local,...)",
    "--model-load-retry-count": "a model that fails to load is not retried",
    "--enable-peer-access": "CUDA peer access is left to the frameworks",
    "--sagemaker-thread-count": "SageMaker requests are served by Trio tasks",
    "--vertex-ai-port": "there is no Vertex AI endpoint",
    "--vertex-ai-thread-count": "there is no Vertex AI endpoint",
    "--vertex-ai-default-model": "there is no Vertex AI endpoint",
}
# Repeatable ones (Triton takes them once per device, policy or resource).
_REPEATABLE = (
    "--cuda-memory-pool-byte-size",
    "--cuda-virtual-address-size",
    "--host-policy",
    "--model-load-gpu-limit",
)


def _dest(flag: str) -> str:
    return "compat_" + flag.lstrip("-").replace("-", "_")


def _int_range(low: int, high: int | None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"in the range {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    return parse


def _pair(pattern: str, form: str) -> Callable[[str], str]:
    """A type accepting Triton's ``<a>:<b>``-style values, checked by ``pattern``."""
    compiled = re.compile(pattern)

    def parse(text: str) -> str:
        if not compiled.fullmatch(text):
            raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
        return text

    return parse


def add_compat_flags(add: AddFlag, boolean: Callable[[str], bool]) -> None:
    """Register the flags of this module; ``boolean`` is the CLI's BOOL type."""
    types = {
        "--http-thread-count": _int_range(1, None),
        "--grpc-infer-thread-count": _int_range(2, 128),  # Triton's own check
        "--grpc-max-response-pool-size": _int_range(1, None),
        "--pinned-memory-pool-byte-size": _int_range(0, None),
        "--cuda-memory-pool-byte-size": _pair(r"\d+:\d+", "<device id>:<byte size>"),
        "--cuda-virtual-address-size": _pair(r"\d+:\d+", "<device id>:<byte size>"),
        "--min-supported-compute-capability": float,
        "--buffer-manager-thread-count": _int_range(0, None),
        "--host-policy": _pair(r"[^,]+,[^=]+=.+", "<policy name>,<setting>=<value>"),
        "--model-load-gpu-limit": _pair(r"\d+:[0-9.]+", "<device id>:<fraction>"),
        "--model-load-retry-count": _int_range(0, None),
        "--enable-peer-access": boolean,
        "--sagemaker-thread-count": _int_range(1, None),
        "--vertex-ai-port": _int_range(0, 65535),
        "--vertex-ai-thread-count": _int_range(1, None),
    }
    for flag, reason in _NO_EFFECT.items():
        repeat = {"action": "append"} if flag in _REPEATABLE else {}
        add(
            flag,
            dest=_dest(flag),
            type=types.get(flag, str),
            metavar="VALUE",
            help=f"accepted, no effect: {reason}",
            **repeat,
        )
    add(
        "--allow-vertex-ai",
        dest="compat_allow_vertex_ai",
        type=boolean,
        default=False,
        metavar="BOOL",
        help="false (default); true is refused: there is no Vertex AI endpoint",
    )


def compat_notes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Refuse (``parser.error``) what cannot be honoured; return one note for each
    given flag that has no effect, to be logged once logging is set up."""
    if args.compat_allow_vertex_ai:
        parser.error(
            "--allow-vertex-ai=true is not supported by trionserve: there is no "
            "Vertex AI endpoint; use the KServe v2 HTTP/gRPC endpoints"
        )
    notes = []
    for flag, reason in _NO_EFFECT.items():
        value = getattr(args, _dest(flag))
        if value is None or (flag == "--model-load-retry-count" and value == 0):
            continue
        for one in value if isinstance(value, list) else [value]:
            notes.append(f"{flag}={one} has no effect in trionserve: {reason}")
    return notes
