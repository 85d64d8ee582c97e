"""structlog setup: console or JSON lines on stderr, one event per line."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "console", verbose: int = 0) -> None:
    """Configure structlog; verbose > 0 enables request-level debug events."""
    level = logging.DEBUG if verbose > 0 else logging.INFO
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
