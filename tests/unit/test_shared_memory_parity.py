"""System shared memory registration and windows, checked in Triton's order and words
(server src/shared_memory_manager.cc, src/common.cc ValidateSharedMemoryKey), as
Triton's qa/L0_shared_memory expects them."""

from __future__ import annotations

import os

import pytest

from trionserve.core.errors import AlreadyExists, InvalidArgument, NotFound
from trionserve.core.shared_memory import (
    RESERVED_KEY_PREFIX,
    SIZE_MAX,
    RequestRegions,
    SystemSharedMemory,
)


@pytest.fixture
def key():
    """A real 64-byte POSIX shared memory object."""
    name = f"trionserve_parity_{os.getpid()}"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(bytes(64))
    try:
        yield "/" + name
    finally:
        os.unlink(path)


@pytest.fixture
def regions():
    table = SystemSharedMemory()
    yield table
    table.unregister()


@pytest.mark.parametrize("shm_key", ["/", "///"])
def test_a_key_of_slashes_only_is_invalid(regions, shm_key):
    with pytest.raises(InvalidArgument) as info:
        regions.register("r", shm_key, 0, 8)
    assert (
        info.value.message
        == f"cannot register shared memory region 'r' - invalid shm key '{shm_key}'"
    )


@pytest.mark.parametrize("slashes", ["", "/", "///"])
def test_the_reserved_prefix_is_refused_before_the_key_is_opened(regions, slashes):
    shm_key = f"{slashes}{RESERVED_KEY_PREFIX}_mine"  # no such object: refused first
    with pytest.raises(InvalidArgument) as info:
        regions.register("r", shm_key, 0, 8)
    assert info.value.message == (
        f"cannot register shared memory region 'r' with key '{shm_key}' as the key "
        f"contains the reserved prefix '{RESERVED_KEY_PREFIX}'"
    )


def test_leading_slashes_are_skipped_as_shm_open_skips_them(regions, key):
    regions.register("r", "//" + key, 0, 64)
    assert regions.status("r")[0]["byte_size"] == 64


def test_registering_a_name_twice_is_already_in_manager(regions, key):
    regions.register("r", key, 0, 8)
    with pytest.raises(AlreadyExists, match="shared memory region 'r' already in manager"):
        regions.register("r", key, 0, 8)


@pytest.mark.parametrize(("offset", "byte_size"), [(0, 65), (1, 64), (64, 1), (65, 0)])
def test_a_window_past_the_object_is_invalid_args(regions, key, offset, byte_size):
    with pytest.raises(
        InvalidArgument, match="failed to register shared memory region 'r': invalid args"
    ):
        regions.register("r", key, offset, byte_size)
    assert "r" not in regions


def test_unregistering_an_unknown_name_is_no_error(regions, key):
    regions.register("kept", key, 0, 8)
    regions.unregister("never_registered")
    assert [r["name"] for r in regions.status()] == ["kept"]
    with pytest.raises(NotFound):
        regions.status("never_registered")


def test_windows_are_checked_in_get_memory_info_order(regions, key):
    regions.register("r", key, 0, 64)
    with pytest.raises(InvalidArgument) as info:
        regions.view("r", 2**64 - 32, 64, "output 'OUTPUT0'")
    assert info.value.message.startswith("Invalid offset for shared memory region: 'r'")
    with pytest.raises(InvalidArgument) as info:
        regions.view("r", 64, 0, "output 'OUTPUT0'")  # offset >= size, even for 0 bytes
    assert info.value.message.startswith("Invalid offset for shared memory region: 'r'")
    with pytest.raises(InvalidArgument) as info:
        regions.check("r", 32, 2**64 - 32, "output 'OUTPUT0'")
    assert info.value.message.startswith(
        f"Integer overflow detected: byte_size ({2**64 - 32}) + offset (32) exceeds "
        f"maximum value ({SIZE_MAX}) for region 'r'"
    )
    with pytest.raises(InvalidArgument) as info:
        regions.check("r", 1, 64, "output 'OUTPUT0'")
    assert info.value.message.startswith("Invalid offset + byte size for shared memory region: 'r'")
    assert "output 'OUTPUT0'" in info.value.message
    assert bytes(regions.view("r", 60, 4, "input 'INPUT0'")) == bytes(4)


def test_a_region_unregistered_while_a_request_holds_it_goes_when_the_request_ends(regions, key):
    """Triton's awaiting_unregister_ (shared_memory_manager.cc UnregisterHelper; the
    frontends unregister again when a request ends): the region stays registered and
    listed, requests still use it, and it goes with the last one that named it."""
    regions.register("in", key, 0, 32)
    regions.register("out", key, 32, 32)
    first, second = RequestRegions(regions), RequestRegions(regions)
    assert bytes(first.view("in", 0, 4, "input 'INPUT0'")) == bytes(4)
    first.check("out", 0, 32, "output 'OUTPUT0'")
    regions.unregister()  # all, while the first request is in flight
    assert sorted(r["name"] for r in regions.status()) == ["in", "out"]
    with pytest.raises(AlreadyExists, match="already in manager"):
        regions.register("in", key, 0, 32)
    second.view("in", 0, 4, "input 'INPUT0'")  # a later request may still name it
    assert first.write("out", 0, 32, bytes(range(32)), "output 'OUTPUT0'") == 32
    first.release()
    # "out" was the first request's alone; "in" is still the second's.
    assert [r["name"] for r in regions.status()] == ["in"]
    second.release()
    assert regions.status() == []
    regions.register("in", key, 0, 32)  # the name is free again
    assert "in" in regions


def test_a_region_held_by_no_request_is_unregistered_at_once(regions, key):
    regions.register("r", key, 0, 8)
    request = RequestRegions(regions)
    request.view("r", 0, 8, "input 'INPUT0'")
    request.release()
    regions.unregister("r")
    assert "r" not in regions
    request.release()  # twice: nothing more to release
    with pytest.raises(InvalidArgument, match="'nope' is not registered"):
        RequestRegions(regions).view("nope", 0, 4, "input 'INPUT0'")
