"""ModelRepository.register / unregister: a repository added at run time with a
name mapping, as Triton's RegisterModelRepository (core
model_repository_manager.cc:1386-1440 Poll, :1209-1225 RepositoryIndex, :1716-1800)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trionserve.core.errors import AlreadyExists, InvalidArgument, NotFound
from trionserve.repository.repository import ModelId, ModelRepository


def _dirs(root: Path, *names: str) -> Path:
    root.mkdir(parents=True)
    for name in names:
        (root / name).mkdir()
    return root


@pytest.mark.parametrize("namespacing", [False, True])
def test_a_mapped_subdirectory_is_the_model_of_its_name(tmp_path, namespacing):
    base = _dirs(tmp_path / "base", "other")
    extra = _dirs(tmp_path / "extra", "model", "step")
    repository = ModelRepository([base], namespacing=namespacing)
    repository.register(extra, {"target": "model"})
    namespace = str(extra) if namespacing else ""
    assert repository.find_all("target") == {ModelId(namespace, "target"): extra / "model"}
    # Its other subdirectories are models of their own names; the mapped one is
    # not found by its directory's name.
    assert repository.find_all("step") == {ModelId(namespace, "step"): extra / "step"}
    with pytest.raises(NotFound):
        repository.find_all("model")
    assert sorted(m.name for m in repository.scan()) == ["other", "step", "target"]

    with pytest.raises(AlreadyExists, match="has already been registered"):
        repository.register(extra, {"x": "step"})
    with pytest.raises(AlreadyExists, match="conflicting mapping for 'target'"):
        repository.register(_dirs(tmp_path / "third", "m"), {"target": "m"})
    with pytest.raises(InvalidArgument, match="repository not found"):
        repository.register(tmp_path / "missing", {"y": "m"})

    repository.unregister(extra)
    with pytest.raises(NotFound):
        repository.find_all("target")
    assert sorted(m.name for m in repository.scan()) == ["other"]
    with pytest.raises(InvalidArgument, match="failed to unregister"):
        repository.unregister(extra)
    repository.register(extra, {"target": "model"})  # again, once unregistered


def test_a_mapped_directory_that_went_away_is_not_found(tmp_path):
    extra = _dirs(tmp_path / "extra", "model")
    repository = ModelRepository([_dirs(tmp_path / "base")])
    repository.register(extra, {"target": "model"})
    (extra / "model").rmdir()
    with pytest.raises(NotFound, match="does not exist for model 'target'"):
        repository.find_all("target")


def test_a_multi_model_url_the_server_cannot_read_is_a_400(tmp_path, monkeypatch):
    """An OSError while the load's directory is read (a directory the server may
    not list) is the load's InvalidArgument (400) naming the url, not an error of
    the transport (500)."""
    import os

    from trionserve.protocol.http import sagemaker_mme

    url = tmp_path / "abc" / "model"
    (url / "simple").mkdir(parents=True)

    def refused(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "scandir", refused)
    with pytest.raises(InvalidArgument, match="cannot be read: .*Permission denied"):
        sagemaker_mme.place_model(str(tmp_path), str(url))
