"""Command line: parse tritonserver's flags into ServerOptions, then run the server.

Triton's ``main`` (server/src/main.cc): set up logging, start the server (or,
with ``--workers N``, the supervisor of N worker processes) and turn what stopped
it into one error line and the exit code.
"""

from __future__ import annotations

import sys
import traceback

import structlog
import trio

from trionserve.cli.options import parse_options
from trionserve.core.errors import TritonError
from trionserve.observability.logging import configure_logging
from trionserve.server import Server, StartupError
from trionserve.workers import run_supervisor, serve_worker

log = structlog.get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    options, args = parse_options(argv)
    try:
        configure_logging(
            options.log_format,
            options.log_verbose,
            log_file=options.log_file,
            log_info=options.log_info,
            log_warning=options.log_warning,
            log_error=options.log_error,
        )
    except OSError as exc:
        print(
            f"error: --log-file: cannot open '{options.log_file}': {exc.strerror}", file=sys.stderr
        )
        return 1
    if args.worker_index is None:  # workers would repeat them
        for note in args.compat_notes:
            log.info(note)
    if args.workers > 1 and args.worker_index is None:
        return run_supervisor(options, args.workers, argv)
    try:
        server = Server(options)
        if args.worker_index is None:
            trio.run(server.serve)
        else:
            structlog.contextvars.bind_contextvars(worker=args.worker_index)
            trio.run(
                serve_worker,
                server,
                args.worker_index,
                args.worker_ready_fd,
                args.worker_supervisor_port,
            )
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:
        error = _triton_error(exc)
        if error is None:
            raise
        # One line; the traceback only when asked for (--log-verbose).
        if options.log_verbose:
            traceback.print_exception(exc)
        summary = error.summary if isinstance(error, StartupError) else error.message
        print(f"error: {summary}", file=sys.stderr)
        return 1
    # 1 when the drain at shutdown did not finish (as Triton's exit timeout).
    return server.exit_code


def _triton_error(exc: BaseException) -> TritonError | None:
    """The error that stopped the server, also from inside Trio's exception groups
    (a StartupError, a repository that cannot be read); None for anything else."""
    if isinstance(exc, TritonError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [_triton_error(inner) for inner in exc.exceptions]
        if len(found) == 1 and found[0] is not None:
            return found[0]
    return None
