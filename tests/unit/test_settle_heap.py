"""The start-up's heap frozen out of the collector's way (core/memory.py settle_heap)."""

from __future__ import annotations

import gc

import pytest

from trionserve.core.memory import settle_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_process_the_server_owns_has_its_heap_frozen(unfrozen) -> None:
    kept = [object() for _ in range(10)]  # noqa: F841  (alive: frozen with the rest)
    assert gc.get_freeze_count() == 0
    assert settle_heap(True)
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # (the interpreter's and the test run's objects)
    gc.collect()  # (a full collection walks what was made since, not the frozen)
    assert gc.get_freeze_count() == frozen


def test_a_server_inside_another_program_leaves_its_heap_alone(unfrozen) -> None:
    assert not settle_heap(False)
    assert gc.get_freeze_count() == 0
