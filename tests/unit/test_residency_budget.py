"""The memory budget's pure parts: sizes, limits, declared charges, the budget error."""

from __future__ import annotations

import pytest

from trionserve._generated.model_config_pb2 import ModelConfig
from trionserve.actors.residency_budget import (
    MemoryLimit,
    budget_error,
    declared_charge,
    is_pinned,
    over,
    parse_charge,
    parse_memory_limit,
)
from trionserve.core.errors import InvalidArgument, Status
from trionserve.core.sizes import parse_byte_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1048576", 1048576),
        ("8GiB", 8 << 30),
        ("8Gi", 8 << 30),
        ("8gib", 8 << 30),
        ("8G", 8 << 30),  # powers of 1024 whatever the spelling, as every size flag
        ("500MB", 500 << 20),
        ("512k", 512 << 10),
        ("1.5GiB", 3 << 29),
        (" 20 MiB ", 20 << 20),
    ],
)
def test_sizes_take_the_usual_suffixes(text, size):
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "8XB", "-1GiB", "GiB", "1e9"])
def test_a_size_that_does_not_parse_names_what_came(text):
    with pytest.raises(ValueError, match="expected a number of bytes"):
        parse_byte_size(text)


def test_limits_name_a_device_and_bytes_or_a_fraction():
    assert parse_memory_limit("host:8GiB") == MemoryLimit("host", size=8 << 30)
    assert parse_memory_limit("gpu:0:20GiB") == MemoryLimit("gpu:0", size=20 << 30)
    assert parse_memory_limit("GPU:1:0.8") == MemoryLimit("gpu:1", fraction=0.8)
    assert parse_memory_limit("gpu:0:0.8").resolve(1000) == 800
    with pytest.raises(ValueError, match="unknown here"):
        parse_memory_limit("host:0.5").resolve(None)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("8GiB", "expected host:<bytes> or gpu:<index>"),
        ("gpu:8GiB", "expected host:<bytes> or gpu:<index>"),
        ("disk:8GiB", "expected host:<bytes> or gpu:<index>"),
        ("host:", "expected host:<bytes> or gpu:<index>"),
        ("host:0", "more than 0 bytes"),
        ("gpu:0:1.5", "must be in (0, 1]"),
        ("host:lots", "'lots'"),
    ],
)
def test_a_limit_that_does_not_parse_says_what_was_expected(text, fragment):
    with pytest.raises(ValueError) as info:
        parse_memory_limit(text)
    assert fragment in str(info.value)


def _config(**parameters: str) -> ModelConfig:
    config = ModelConfig(name="m")
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def test_a_config_declares_its_charge_and_pinning():
    assert declared_charge(_config()) is None
    assert declared_charge(_config(model_memory="host:50MiB,gpu:0:2GiB")) == {
        "host": 50 << 20,
        "gpu:0": 2 << 30,
    }
    assert parse_charge("host:1MiB, host:1MiB") == {"host": 2 << 20}
    with pytest.raises(InvalidArgument, match="model 'm': parameter 'model_memory'"):
        declared_charge(_config(model_memory="50MiB"))
    assert is_pinned(_config(model_pinned="true"))
    assert not is_pinned(_config(model_pinned="false"))
    assert not is_pinned(_config())


def test_over_counts_only_budgeted_devices():
    budgets = {"host": 100}
    assert over(budgets, {"host": 60}, {"host": 40}) == {}
    assert over(budgets, {"host": 60}, {"host": 41}) == {"host": 1}
    assert over(budgets, {}, {"gpu:0": 10**12}) == {}


def test_the_budget_error_names_the_budget_the_need_and_the_residents():
    error = budget_error(
        "big",
        {"host": 100 << 20},
        {"host": 60 << 20},
        {"a": {"host": 50 << 20}},
        {"a": "requests in flight"},
    )
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message == (
        "failed to load 'big': it needs host 60.0 MiB and does not fit the memory budget "
        "(--model-memory-limit: host 100.0 MiB); resident: 'a' host 50.0 MiB "
        "(requests in flight)"
    )
    alone = budget_error("huge", {"host": 100 << 20}, {"host": 1 << 30}, {}, {})
    assert alone.message == (
        "failed to load 'huge': it needs host 1.0 GiB, more than the whole memory budget "
        "(--model-memory-limit: host 100.0 MiB)"
    )
