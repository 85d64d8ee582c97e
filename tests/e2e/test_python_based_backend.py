"""Python-based backends (Triton's layout): ``<backend directory>/<name>/model.py``
serves every model whose config says ``backend: "<name>"``; a real server."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.repository import write_model
from tests.serverproc import http_client, serving

BACKEND = """
import json

import c_python_backend_utils as c_utils
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [-1]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]})
        return config

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.scale = float(config["parameters"]["scale"]["string_value"])

    def execute(self, requests):
        parameters = {
            "model_dir": pb_utils.get_model_dir(),
            "free_memory": c_utils.shared_memory.free_memory(),
            "same_tensor": c_utils.Tensor is pb_utils.Tensor,
        }
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * self.scale)],
                parameters=parameters)
            for r in requests
        ]
"""


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("python_based")
    (root / "backends" / "scaler").mkdir(parents=True)
    (root / "backends" / "scaler" / "model.py").write_text(textwrap.dedent(BACKEND))
    repository = root / "models"
    for name, scale in (("double", 2), ("triple", 3)):
        config = (
            f'backend: "scaler"\nmax_batch_size: 0\n'
            f'parameters {{ key: "scale" value: {{ string_value: "{scale}" }} }}\n'
        )
        write_model(repository, name, config, versions=[1])
    write_model(repository, "unknown", 'backend: "nowhere"\n', versions=[1])
    args = [f"--backend-directory={root / 'backends'}", "--exit-on-error=false"]
    with serving(repository, args=args) as proc, http_client(proc) as client:
        client.repository = repository
        yield client


@pytest.mark.parametrize(("model", "scale"), [("double", 2.0), ("triple", 3.0)])
def test_models_share_one_backend_model_py(client, model, scale):
    x = httpclient.InferInput("X", [3], "FP32")
    x.set_data_from_numpy(np.array([1.0, 2.0, 3.0], dtype=np.float32))
    result = client.infer(model, [x]).as_numpy("Y")
    np.testing.assert_array_equal(result, np.array([1.0, 2.0, 3.0]) * scale)
    # The backend's auto_complete_config filled in the tensors.
    config = client.get_model_config(model)
    assert [i["name"] for i in config["input"]] == ["X"]
    assert config["backend"] == "scaler"


def test_an_unknown_backend_names_where_it_looked(client):
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    reason = rows["unknown"]["reason"]
    assert rows["unknown"]["state"] == "UNAVAILABLE"
    assert "backend 'nowhere'" in reason and "nowhere/model.py" in reason


def test_the_model_dir_is_the_model_s_version_directory(client):
    """pb_stub.cc ModelContext::Init: get_model_dir() is the directory of
    <repository>/<model>/<version>/model.py, for a Python-based backend too (the
    QA add_sub backend reads its model.json there); c_python_backend_utils is
    importable, as in Triton's stub."""
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    parameters = client.infer("double", [x]).get_response()["parameters"]
    assert parameters["model_dir"] == str(client.repository / "double" / "1")
    assert parameters["free_memory"] > 0 and parameters["same_tensor"] is True
