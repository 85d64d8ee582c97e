"""The command line of ``--workers``: the flag, the hidden flags the supervisor gives
its workers, and the settings that cannot be shared by several worker processes."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from trionserve.actors.watcher import ControlMode


def parse_workers(text: str) -> int:
    """``--workers``: a positive integer, or ``auto`` for the number of CPUs."""
    if text.strip().lower() == "auto":
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of workers or 'auto', got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 worker, got {value}")
    return value


def add_worker_flags(add: Callable[..., argparse.Action]) -> None:
    add(
        "--workers",
        type=parse_workers,
        default=1,
        metavar="N|auto",
        help="server processes sharing the HTTP and gRPC ports with SO_REUSEPORT "
        "(default 1; auto: one per CPU)",
    )
    # Set by the supervisor on the processes it starts; not for users.
    add("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    add("--worker-ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    # The supervisor's private loopback port, bound before any worker starts (each
    # worker binds its own and reports it through the pipe of --worker-ready-fd).
    add("--worker-supervisor-port", type=int, default=None, help=argparse.SUPPRESS)


def worker_conflicts(args: argparse.Namespace) -> list[str]:
    """Why these settings cannot run as several workers (empty: they can)."""
    if args.workers <= 1:
        return []
    problems = []
    if ControlMode(args.model_control_mode) is ControlMode.EXPLICIT:
        problems.append(
            "--model-control-mode=explicit cannot be used with --workers > 1: a load "
            "or unload request reaches only the one worker process its connection "
            "lands on; use --model-control-mode=poll or none"
        )
    if args.allow_client_shm:
        problems.append(
            "--allow-client-shm=true cannot be used with --workers > 1: a shared-memory "
            "region is registered in the one worker process its request lands on, and "
            "requests on other connections would not find it"
        )
    for flag, allowed, port in (
        ("--http-port", args.allow_http, args.http_port),
        ("--grpc-port", args.allow_grpc, args.grpc_port),
    ):
        if allowed and port == 0:
            problems.append(
                f"{flag}=0 cannot be used with --workers > 1: each worker would "
                "listen on a different port"
            )
    return problems
