"""Model namespacing's pure parts: model ids, repository scans and lookups, options.

What a server does with them (routing, ensembles, rebinding) is tested against a
real server in tests/e2e/test_model_namespacing.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from trionserve.api import Options
from trionserve.cli.options import parse_options
from trionserve.core.errors import InvalidArgument, NotFound
from trionserve.repository.repository import ModelId, ModelRepository
from trionserve.repository.snapshot import Duplicate, snapshot_repository


def model(repository: Path, name: str) -> None:
    (repository / name / "1").mkdir(parents=True)


def test_an_id_without_namespace_is_its_name():
    plain = ModelId("", "m")
    assert plain == "m" and hash(plain) == hash("m") and {"m": 1}[plain] == 1
    assert plain.display == "m" and plain.order() == ("", "m")
    spaced = ModelId("/models/a", "m")
    assert spaced != "m" and spaced != ModelId("/models/b", "m")
    assert (spaced.namespace, spaced.name) == ("/models/a", "m")
    assert spaced.display == "/models/a::m"  # Triton's ModelIdentifier::str()
    assert pickle.loads(pickle.dumps(spaced)).display == "/models/a::m"


def test_namespacing_scans_each_repository_as_a_namespace(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for repository in (a, b):
        model(repository, "shared")
    model(a, "only_a")
    spaced = ModelRepository([a, b], namespacing=True)
    scan = spaced.scan()
    assert not scan.duplicates
    assert [m.display for m in scan] == [f"{a}::only_a", f"{a}::shared", f"{b}::shared"]
    found = spaced.find_all("shared")
    assert found == {
        ModelId(str(a), "shared"): a / "shared",
        ModelId(str(b), "shared"): b / "shared",
    }
    assert spaced.find(ModelId(str(b), "shared")) == b / "shared"
    with pytest.raises(NotFound, match=f"not found in model repository '{b}'"):
        spaced.find(ModelId(str(b), "only_a"))
    snapshots = snapshot_repository(spaced)
    assert not any(isinstance(s, Duplicate) for s in snapshots.values())
    assert len(snapshots) == 3

    # Without namespacing the same layout has a duplicate, refused by name.
    plain = ModelRepository([a, b])
    assert plain.scan().duplicates == {"shared": [a / "shared", b / "shared"]}
    with pytest.raises(InvalidArgument, match="appears in multiple model repositories"):
        plain.find_all("shared")
    assert plain.find("only_a") == a / "only_a"


def test_the_flag_and_the_in_process_option_reach_the_server_options(tmp_path):
    options, _ = parse_options([f"--model-repository={tmp_path}", "--model-namespacing=true"])
    assert options.model_namespacing
    options, _ = parse_options([f"--model-repository={tmp_path}"])
    assert not options.model_namespacing
    assert (
        Options(model_repository=tmp_path, model_namespacing=True)
        .server_options()
        .model_namespacing
    )
    assert not Options(model_repository=tmp_path).server_options().model_namespacing
