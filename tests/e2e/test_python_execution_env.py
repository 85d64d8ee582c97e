"""EXECUTION_ENV_PATH: a Python model runs with its own packed environment's
interpreter and packages, on a real server."""

from __future__ import annotations

import json
import os
import sys
import tarfile
import textwrap
import venv
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.serverproc import http_client, serving

MODEL = """
import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

import envmarker  # only the model's environment has it


class TritonPythonModel:
    def execute(self, requests):
        report = json.dumps({"prefix": sys.prefix, "marker": envmarker.MARKER})
        out = np.array([report.encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("REPORT", out)]) for _ in requests]
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] }} ]
parameters {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{env}" }} }}
"""


def make_environment(root: Path) -> Path:
    """A virtual environment with a marker package; numpy is reached through a
    .pth file, as the stub needs it (a conda-pack archive would carry its own)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    (site,) = root.glob("lib/python3*/site-packages")
    (site / "envmarker.py").write_text('MARKER = "from the model environment"\n')
    (site / "numpy_from_server.pth").write_text(str(Path(np.__file__).parent.parent) + "\n")
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("execution_env")
    environment = make_environment(tmp_path_factory.mktemp("built") / "env")
    packed = root / "packed"
    (packed / "1").mkdir(parents=True)
    with tarfile.open(packed / "env.tar.gz", "w:gz") as tar:
        tar.add(environment, arcname=".")
    (packed / "config.pbtxt").write_text(
        CONFIG.format(name="packed", env="$$TRITON_MODEL_DIRECTORY/env.tar.gz")
    )
    unpacked = root / "unpacked"
    (unpacked / "1").mkdir(parents=True)
    (unpacked / "config.pbtxt").write_text(CONFIG.format(name="unpacked", env=environment))
    broken = root / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "env.tar.gz").write_bytes(b"not an archive")
    (broken / "config.pbtxt").write_text(
        CONFIG.format(name="broken", env="$$TRITON_MODEL_DIRECTORY/env.tar.gz")
    )
    for model in (packed, unpacked, broken):
        (model / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    return root


@pytest.fixture(scope="module")
def client(repository):
    with serving(repository, args=["--exit-on-error=false"]) as proc, http_client(proc) as client:
        yield client


def report(client, model: str) -> dict:
    inputs = [httpclient.InferInput("IN", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([1], dtype=np.int32))
    return json.loads(client.infer(model, inputs).as_numpy("REPORT")[0])


@pytest.mark.parametrize("model", ["packed", "unpacked"])
def test_model_runs_in_its_environment(client, model):
    answer = report(client, model)
    assert answer["marker"] == "from the model environment"
    assert os.path.realpath(answer["prefix"]) != os.path.realpath(sys.prefix)
    if model == "packed":
        # unpacked once into the cache, not into the repository
        assert "trionserve-envs" in answer["prefix"]


def test_a_broken_archive_names_the_cause(client):
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    assert rows["broken"]["state"] == "UNAVAILABLE"
    assert "EXECUTION_ENV_PATH" in rows["broken"]["reason"]
    assert "cannot unpack it" in rows["broken"]["reason"]
