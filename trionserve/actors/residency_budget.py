"""Memory budgets of models loaded on demand: sizes, limits and charges, as plain data.

Pure functions and values, no I/O: what ``--model-memory-limit`` and a model's
``model_memory`` parameter mean, what one model is charged, whether a charge fits a
budget, and the error a load gets when it cannot fit. The actor that applies them
is :class:`~trionserve.actors.residency.ResidencyManager`.

A charge maps a *device* to bytes: ``"host"`` (the server's resident memory,
stub processes included) or ``"gpu:<index>"`` (a GPU's used memory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trionserve.core.errors import InvalidArgument
from trionserve.core.sizes import parse_byte_size

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

HOST = "host"

# A model's configuration may declare what it takes; the declaration wins over what
# is measured at load ("host:50MiB" or "host:50MiB,gpu:0:2GiB").
MEMORY_PARAMETER = "model_memory"
# A model whose configuration sets this to true is never evicted nor idle-unloaded.
PINNED_PARAMETER = "model_pinned"

# A charge: device -> bytes.
Charge = dict[str, int]


@dataclass(frozen=True)
class MemoryLimit:
    """One ``--model-memory-limit``: a device's budget in bytes, or a fraction of
    its total memory (resolved at start by :meth:`resolve`)."""

    device: str
    size: int | None = None
    fraction: float | None = None
    source: str = field(default="", compare=False)  # as the flag was written

    def resolve(self, total: int | None) -> int:
        """The budget in bytes; ``total`` is the device's memory (None: unknown)."""
        if self.size is not None:
            return self.size
        assert self.fraction is not None
        if total is None:
            raise ValueError(
                f"--model-memory-limit={self.text()}: the total memory of {self.device} "
                "is unknown here, so a fraction of it cannot be taken; give bytes"
            )
        return int(total * self.fraction)

    def text(self) -> str:
        if self.source:
            return self.source
        value = str(self.size) if self.size is not None else f"{self.fraction:g}"
        return f"{self.device}:{value}"


def parse_memory_limit(text: str) -> MemoryLimit:
    """``host:8GiB``, ``gpu:0:20GiB``, ``gpu:0:0.8`` (a fraction of the device's
    memory, greater than 0 and at most 1); ValueError saying what was expected."""
    device, value = _split_device(text)
    if re.fullmatch(r"\s*\d*\.\d+\s*", value):  # a decimal point and no unit
        fraction = float(value)
        if not 0 < fraction <= 1:
            raise ValueError(f"a fraction of {device}'s memory must be in (0, 1], got {value!r}")
        return MemoryLimit(device, fraction=fraction, source=text.strip())
    size = parse_byte_size(value)
    if size <= 0:
        raise ValueError(f"the budget of {device} must be more than 0 bytes, got {value!r}")
    return MemoryLimit(device, size=size, source=text.strip())


def _split_device(text: str) -> tuple[str, str]:
    kind, _, rest = text.strip().partition(":")
    kind = kind.lower()
    if kind == HOST and rest:
        return HOST, rest
    if kind == "gpu":
        index, _, value = rest.partition(":")
        if index.isdigit() and value:
            return f"gpu:{int(index)}", value
    raise ValueError(
        f"expected host:<bytes> or gpu:<index>:<bytes or fraction> "
        f"(e.g. host:8GiB, gpu:0:20GiB, gpu:0:0.8), got {text!r}"
    )


def parse_charge(text: str) -> Charge:
    """A model's declared ``model_memory``: comma-separated ``host:<bytes>`` and
    ``gpu:<index>:<bytes>``."""
    charge: Charge = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        device, value = _split_device(part)
        charge[device] = charge.get(device, 0) + parse_byte_size(value)
    return charge


def _parameter(config: ModelConfig, key: str) -> str | None:
    if key in config.parameters:
        return config.parameters[key].string_value
    return None


def declared_charge(config: ModelConfig) -> Charge | None:
    """What the model's configuration says it takes (None: not declared);
    InvalidArgument naming the model and the parameter when it does not parse."""
    text = _parameter(config, MEMORY_PARAMETER)
    if text is None:
        return None
    try:
        return parse_charge(text)
    except ValueError as exc:
        raise InvalidArgument(
            f"model '{config.name}': parameter '{MEMORY_PARAMETER}': {exc}"
        ) from None


def is_pinned(config: ModelConfig) -> bool:
    text = _parameter(config, PINNED_PARAMETER)
    return text is not None and text.strip().lower() in ("true", "1", "yes", "on")


def total(charges: list[Charge]) -> Charge:
    """The sum of several charges, by device."""
    summed: Charge = {}
    for charge in charges:
        for device, size in charge.items():
            summed[device] = summed.get(device, 0) + size
    return summed


def over(budgets: Charge, used: Charge, need: Charge) -> dict[str, int]:
    """By how many bytes ``used + need`` passes each budget it passes (devices
    without a budget are not limited)."""
    return {
        device: used.get(device, 0) + need.get(device, 0) - limit
        for device, limit in budgets.items()
        if used.get(device, 0) + need.get(device, 0) > limit
    }


def size_text(size: int) -> str:
    """Bytes for people: 52428800 -> '50.0 MiB'."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"  # pragma: no cover


def charge_text(charge: Charge) -> str:
    return ", ".join(f"{device} {size_text(size)}" for device, size in sorted(charge.items()))


def budget_error(
    name: str,
    budgets: Charge,
    need: Charge,
    resident: dict[str, Charge],
    unevictable: dict[str, str],
) -> InvalidArgument:
    """The error of a load that cannot fit even after every evictable model went:
    the budget, what the model needs, what is resident (and why it stays).

    INVALID_ARGUMENT, as every failed load in Triton's core
    (``model_repository_manager.cc``: ``LoadUnloadModels``): HTTP 400, gRPC
    INVALID_ARGUMENT.
    """
    devices = sorted(set(budgets) & (set(need) | {HOST}))
    budget = ", ".join(f"{d} {size_text(budgets[d])}" for d in devices if d in budgets)
    if resident:
        listed = "; ".join(
            f"'{model}' {charge_text(charge)}"
            + (f" ({unevictable[model]})" if model in unevictable else "")
            for model, charge in sorted(resident.items())
        )
    else:
        listed = "none"
    if over(budgets, {}, need):
        return InvalidArgument(
            f"failed to load '{name}': it needs {charge_text(need)}, more than the whole "
            f"memory budget (--model-memory-limit: {budget})"
        )
    return InvalidArgument(
        f"failed to load '{name}': it needs {charge_text(need) or '0 B'} and does not fit "
        f"the memory budget (--model-memory-limit: {budget}); resident: {listed}"
    )
