"""Model control's pure parts: snapshots, change classification, overrides, parameters."""

from __future__ import annotations

import base64
import json
import os

import pytest

from tests.unit.test_model_control_support import BACKENDS, fake_model
from trionserve.actors.registry_entries import prepare_model
from trionserve.backends.manager import BackendManager
from trionserve.core.errors import InvalidArgument
from trionserve.protocol.http.frontend import load_parameters, unload_parameters
from trionserve.repository.changes import ConfigChange, LoadedSource, config_changes, plan_reload
from trionserve.repository.overrides import is_override_dir, remove_override, write_override
from trionserve.repository.repository import ModelRepository
from trionserve.repository.snapshot import (
    Duplicate,
    file_changes,
    is_ignored,
    snapshot_model,
    snapshot_repository,
)


def test_snapshot_ignores_files_that_are_not_part_of_the_model(tmp_path):
    model = fake_model(tmp_path, "m")
    before = snapshot_model(model)
    # What editors, Python and file managers leave behind never counts as a change.
    (model / "1" / "__pycache__").mkdir()
    (model / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0" * 10)
    (model / ".config.pbtxt.swp").write_bytes(b"swap")
    (model / "config.pbtxt~").write_text("backup")
    (model / "#config.pbtxt#").write_text("autosave")
    (model / "4913").write_text("")  # vim's write probe
    (model / ".DS_Store").write_bytes(b"x")
    assert snapshot_model(model) == before
    assert not is_ignored("4913", is_dir=True)  # a version directory named 4913 counts
    assert not is_ignored("model.onnx") and not is_ignored("labels.txt")


def test_snapshot_sees_sizes_mtimes_and_config_contents(tmp_path):
    model = fake_model(tmp_path, "m")
    first = snapshot_model(model)
    weights = model / "1" / "model.txt"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    touched = snapshot_model(model)
    assert touched != first
    assert file_changes(first, touched).versions == {1}

    config = model / "config.pbtxt"
    stat = config.stat()
    config.write_text(config.read_text().replace("count: 1", "count: 2"))
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime
    edited = snapshot_model(model)
    assert edited.config_hash != touched.config_hash
    changes = file_changes(touched, edited)
    assert changes.config and not changes.shared and not changes.versions

    (model / "labels.txt").write_text("a\nb\n")
    assert file_changes(edited, snapshot_model(model)).shared
    (model / "2").mkdir()
    assert file_changes(edited, snapshot_model(model)).versions == {2}
    assert snapshot_model(tmp_path / "missing") is None


def test_snapshot_repository_marks_duplicates(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    fake_model(one, "shared")
    fake_model(two, "shared")
    fake_model(one, "only_one")
    snapshots = snapshot_repository(ModelRepository([one, two]))
    assert isinstance(snapshots["shared"], Duplicate)
    assert "multiple model repositories" in snapshots["shared"]
    assert not isinstance(snapshots["only_one"], Duplicate)


FAKE_BACKENDS = BackendManager(backends=BACKENDS)


def prepared(tmp_path, name="m", **kwargs):
    model_dir = fake_model(tmp_path, name, **kwargs)
    return model_dir, prepare_model(model_dir, True, None, backends=FAKE_BACKENDS)


def test_config_changes_classifies_instance_count_and_version_policy(tmp_path):
    _, base = prepared(tmp_path / "a")
    _, more = prepared(tmp_path / "b", count=3)
    _, policy = prepared(tmp_path / "c", extra="version_policy: { all {} }")
    _, other = prepared(tmp_path / "d", extra="parameters { key: 'k' value { string_value: 'v' } }")
    assert config_changes(base.config, base.config) == frozenset()
    assert config_changes(base.config, more.config) == {ConfigChange.INSTANCE_COUNT}
    assert config_changes(base.config, policy.config) == {ConfigChange.VERSION_POLICY}
    assert config_changes(base.config, other.config) == {ConfigChange.OTHER}


def test_plan_reload_does_only_what_the_change_needs(tmp_path):
    model_dir, first = prepared(
        tmp_path, versions={1: 1.0, 2: 2.0}, extra="version_policy: { all {} }"
    )
    loaded = LoadedSource(model_dir, snapshot_model(model_dir), first.config, "")

    def plan_now():
        now = prepare_model(model_dir, True, None, backends=FAKE_BACKENDS)
        source = LoadedSource(model_dir, snapshot_model(model_dir), now.config, "")
        return plan_reload(loaded, {1, 2}, source, now.versions)

    assert plan_now().nothing  # nothing changed: no reload at all
    (model_dir / "3").mkdir()
    (model_dir / "3" / "model.txt").write_text("3\n")
    plan = plan_now()
    assert (plan.keep, plan.load, plan.unload) == ((1, 2), (3,), ())

    (model_dir / "config.pbtxt").write_text(
        (model_dir / "config.pbtxt").read_text().replace("count: 1", "count: 4")
    )
    plan = plan_now()
    assert plan.update_instances and plan.keep == (1, 2)

    (model_dir / "labels.txt").write_text("x\n")
    plan = plan_now()
    assert (plan.keep, plan.load, plan.unload) == ((), (1, 2, 3), (1, 2))


def test_write_override_stays_outside_the_repository(tmp_path):
    config = json.dumps({"name": "m", "backend": "mc_fake", "max_batch_size": 8})
    model_dir = write_override("m", config, {"file:1/model.txt": b"5\n"})
    try:
        assert is_override_dir(model_dir)
        assert tmp_path not in model_dir.parents
        assert (model_dir / "1" / "model.txt").read_bytes() == b"5\n"
        assert 'backend: "mc_fake"' in (model_dir / "config.pbtxt").read_text()
    finally:
        remove_override(model_dir)
    assert not model_dir.exists()

    with pytest.raises(InvalidArgument, match="'config' must be specified"):
        write_override("m", None, {"file:1/model.txt": b""})
    with pytest.raises(InvalidArgument, match="invalid model name"):
        write_override("..", config, {"file:1/model.txt": b""})
    for bad in ("file:../escape", "file:/../x", "file:1/../../x", "1/model.txt"):
        with pytest.raises(InvalidArgument, match="file override parameter"):
            write_override("m", config, {bad: b""})
    # A leading '/' is dropped, as Triton does: 'file:/1/model.txt' is '1/model.txt'.
    model_dir = write_override("m", config, {"file:/1/model.txt": b"6\n"})
    try:
        assert (model_dir / "1" / "model.txt").read_bytes() == b"6\n"
    finally:
        remove_override(model_dir)


def test_http_load_and_unload_parameters():
    encoded = base64.b64encode(b"\x00\x01data").decode()
    config, files = load_parameters(
        {"parameters": {"config": '{"name": "m"}', "file:1/model.onnx": encoded}}
    )
    assert config == '{"name": "m"}'
    assert files == {"file:1/model.onnx": b"\x00\x01data"}
    assert load_parameters({}) == (None, {})
    with pytest.raises(InvalidArgument, match="not valid base64"):
        load_parameters({"parameters": {"file:1/x": "***"}})
    with pytest.raises(InvalidArgument, match="'config' must be a JSON string"):
        load_parameters({"parameters": {"config": 5}})
    assert unload_parameters({"parameters": {"unload_dependents": True}}) is True
    assert unload_parameters({}) is False
    with pytest.raises(InvalidArgument, match="unload_dependents"):
        unload_parameters({"parameters": {"unload_dependents": "yes"}})
