"""The model loading API of Python models (``pb_utils.load_model``,
``unload_model``, ``is_model_ready``) on a real server, in ``initialize`` and in
``execute``, with the EXPLICIT-mode rule Triton has."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.repository import python_model
from tests.serverproc import http_client, serving

TARGET = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)])
            for r in requests
        ]
"""

TARGET_CONFIG = {
    "name": "target",
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [1]}],
    "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]}],
}

LOADER = f"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

TARGET = {TARGET!r}
CONFIG = {json.dumps(TARGET_CONFIG)!r}


class TritonPythonModel:
    def initialize(self, args):
        self.startup = "loaded"
        try:
            if not pb_utils.is_model_ready("target"):
                pb_utils.load_model(
                    "target", config=CONFIG, files={{"file:1/model.py": TARGET.encode()}}
                )
        except pb_utils.TritonModelException as exc:
            self.startup = str(exc)

    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0]
            action = action.decode()
            answer = ""
            try:
                if action == "unload":
                    pb_utils.unload_model("target")
                elif action == "load":
                    pb_utils.load_model("target", config=CONFIG,
                                        files={{"file:1/model.py": TARGET.encode()}})
                elif action == "self":
                    pb_utils.unload_model("loader")
                elif action == "bad_version":
                    pb_utils.is_model_ready("target", "one")
            except pb_utils.TritonModelException as exc:
                answer = str(exc)
            report = {{
                "startup": self.startup,
                "error": answer,
                "ready": pb_utils.is_model_ready("target"),
                "ready_v1": pb_utils.is_model_ready("target", "1"),
                "ready_v2": pb_utils.is_model_ready("target", 2),
            }}
            out = np.array([json.dumps(report).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("REPORT", out)]))
        return responses
"""

LOADER_CONFIG = """
name: "loader"
backend: "python"
max_batch_size: 0
input [ { name: "ACTION" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def report(client, action: str) -> dict:
    inputs = [httpclient.InferInput("ACTION", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([action.encode()], dtype=np.object_))
    return json.loads(client.infer("loader", inputs).as_numpy("REPORT")[0])


def double(client, value: int) -> int:
    inputs = [httpclient.InferInput("IN", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([value], dtype=np.int32))
    return int(client.infer("target", inputs).as_numpy("OUT")[0])


@pytest.fixture(scope="module")
def explicit(tmp_path_factory):
    repository = tmp_path_factory.mktemp("loader_explicit")
    python_model(repository, "loader", LOADER_CONFIG, LOADER)
    args = ["--model-control-mode=explicit", "--load-model=loader"]
    with serving(repository, args=args) as proc, http_client(proc) as client:
        yield client


def test_a_model_loads_another_in_initialize(explicit):
    assert explicit.is_model_ready("target")
    assert double(explicit, 21) == 42
    first = report(explicit, "none")
    assert first == {
        "startup": "loaded",
        "error": "",
        "ready": True,
        "ready_v1": True,
        "ready_v2": False,
    }


def test_unload_and_load_from_execute(explicit):
    assert report(explicit, "unload")["ready"] is False
    assert not explicit.is_model_ready("target")
    with pytest.raises(InferenceServerException):
        double(explicit, 1)
    assert report(explicit, "load")["ready"] is True
    assert double(explicit, 5) == 10


def test_a_model_cannot_unload_itself_and_versions_are_checked(explicit):
    assert "cannot load or unload itself" in report(explicit, "self")["error"]
    assert explicit.is_model_ready("loader")
    assert "model_version must be a version number" in report(explicit, "bad_version")["error"]


def test_loading_needs_explicit_mode(tmp_path):
    python_model(tmp_path, "loader", LOADER_CONFIG, LOADER)
    args = ["--model-control-mode=none"]
    with serving(tmp_path, args=args) as proc, http_client(proc) as client:
        startup = report(client, "none")
        assert "explicit" in startup["startup"].lower()
        assert startup["ready"] is False
        assert not client.is_model_ready("target")
