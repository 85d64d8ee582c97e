"""Triton's scheduler testing hooks, read from the server's environment.

``TRITONSERVER_DELAY_SCHEDULER=N`` holds a dynamic or sequence batcher until N
requests are queued, and ``TRITONSERVER_BACKLOG_DELAY_SCHEDULER=M`` a sequence
batcher until M more wait in its backlog (core dynamic_batch_scheduler.cc and
sequence_batch_scheduler.cc read them with ``atoi``); Triton's QA suites set them
to see a known batch.
"""

from __future__ import annotations

import os


def count_from_environment(name: str) -> int:
    """A count from a testing variable, 0 when unset or not a number (``atoi``)."""
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0
