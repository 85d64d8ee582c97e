"""``python -m trionserve`` (and the ``trionserve`` / ``tritonserver`` commands) runs
the server.

The ``--log-file`` named on the command line is created before the server's
modules are imported (seconds on a loaded host), as Triton opens it while it reads
its options (server src/command_line_parser.cc, common src/logging.cc): scripts
that start the server and wait a few seconds for its log file find it. The log
is written by :func:`trionserve.observability.logging.configure_logging`, which
opens the same file for appending and reports one that cannot be opened.
"""

import sys


def create_log_file(argv: list[str]) -> None:
    """Create (append to) the file the last ``--log-file`` option names, if any."""
    path = ""
    for index, arg in enumerate(argv):
        if arg.startswith("--log-file="):
            path = arg.partition("=")[2]
        elif arg == "--log-file" and index + 1 < len(argv):
            path = argv[index + 1]
    if path:
        try:
            open(path, "a").close()
        except OSError:
            pass  # configure_logging says why, with the flag


def run() -> int:
    create_log_file(sys.argv[1:])
    from trionserve.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
