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
    kept = [[] for _ in range(10)]  # (alive and tracked: frozen with the rest)
    assert gc.get_freeze_count() == 0
    assert settle_heap(True)
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # (the interpreter's and the test run's objects)
    made = [[] for _ in range(10)]  # (made since: the collector's)
    gc.collect()  # (a full collection walks what was made since, not the frozen)
    # The frozen stay out of the collector's generations (the count itself may drop: a frozen
    # object freed meanwhile, by another thread or by a cycle the collection broke, leaves it).
    walked = {id(o) for o in gc.get_objects(generation=2)}
    assert not any(id(o) in walked for o in kept)
    assert all(id(o) in walked for o in made)
    assert 1000 < gc.get_freeze_count() <= frozen


def test_a_server_inside_another_program_leaves_its_heap_alone(unfrozen) -> None:
    assert not settle_heap(False)
    assert gc.get_freeze_count() == 0
