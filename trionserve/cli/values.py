"""What tritonserver's flags take: the argparse value types of the command line.

Each turns a flag's text into its value or raises ``argparse.ArgumentTypeError``
with what was wrong, as tritonserver's option parser (server/src/command_line_parser.cc,
``ParseOption``) refuses a bad value with a usage error.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from trionserve.actors.rate_limiter import RateLimiterResource, parse_resource
from trionserve.actors.residency_budget import MemoryLimit, parse_memory_limit
from trionserve.core.sizes import parse_byte_size
from trionserve.protocol.restricted import RestrictedCategory
from trionserve.repository.object_store import is_remote

# ``ArgumentParser.add_argument`` (or its argument group's), which the flag groups add to.
AddFlag = Callable[..., argparse.Action]

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def int_bool(text: str) -> int:
    """``--log-verbose``: an integer, or true (1) / false (0) in any case, as
    Triton's ParseIntBoolOption (command_line_parser.cc:198-213); its
    docker/sagemaker/serve passes ``--log-verbose=true``."""
    value = text.strip().lower()
    if value in ("true", "false"):
        return int(value == "true")
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, true or false, got {text!r}"
        ) from None


def memory_limit(text: str) -> MemoryLimit:
    """``--model-memory-limit``: ``host:<bytes>`` or ``gpu:<index>:<bytes or fraction>``."""
    try:
        return parse_memory_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def port_range(text: str) -> tuple[int, int]:
    """``<low>-<high>`` (Triton's ParsePairOption<int, int>(optarg, "-"))."""
    low, sep, high = text.partition("-")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected <integer>-<integer>, got {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def http_max_input_size(text: str) -> int:
    """--http-max-input-size: a byte count above 0, refused in tritonserver's words
    (src/command_line_parser.cc:1411-1417; qa/L0_http greps them)."""
    value = int_at_least(-(2**63))(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("Error: --http-max-input-size must be greater than 0.")
    return value


def byte_size(minimum: int) -> Callable[[str], int]:
    """An argparse type: a number of bytes no smaller than ``minimum``, as an
    integer or with a suffix (:func:`~trionserve.core.sizes.parse_byte_size`:
    ``512K``, ``64MiB``, ``1.5G``, ``8Gi``; powers of 1024)."""

    def parse(text: str) -> int:
        try:
            value = parse_byte_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected at least {minimum} bytes, got {text!r} ({value} bytes)"
            )
        return value

    return parse


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


RESTRICTED_GROUPS = ", ".join(c.value for c in RestrictedCategory)


def repository_location(text: str) -> Path | str:
    """A local repository path, or an object-storage location kept as written."""
    return text if is_remote(text) else Path(text)


def rate_limit_resource(text: str) -> RateLimiterResource:
    try:
        return parse_resource(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"invalid regular expression {text!r}: {exc}") from None
    return text


def header_pattern(text: str) -> str:
    """A header-forwarding pattern as Triton applies it: case-insensitive (header
    names are), unless it begins with ``(?-i)``."""
    if text.startswith("(?-i)"):
        return regex(text[len("(?-i)") :])
    return regex("(?i)" + text)


def compression_level(text: str) -> str:
    level = text.lower()
    return "med" if level == "medium" else level  # Triton spells it "medium"


def config_name(text: str) -> str:
    if not text or any(c.isspace() for c in text) or "/" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(
            f"expected a configuration name without spaces or '/', got {text!r}"
        )
    return text
