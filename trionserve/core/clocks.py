"""Whether Trio runs on a virtual clock (``trio.testing.MockClock``: the
simulations', the unit tests'), asked without importing ``trio.testing``: that
module imports pytest where pytest is installed (a tenth of a second of CPU at
every start-up of a server in a test environment), and a MockClock can only
exist once it has been imported."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["virtual_clock"]


def virtual_clock(clock: Any) -> bool:
    """True when ``clock`` is a ``trio.testing.MockClock``."""
    testing = sys.modules.get("trio.testing")
    return testing is not None and isinstance(clock, testing.MockClock)
