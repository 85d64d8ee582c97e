"""The lines Triton's onnxruntime backend and core log while a model is set up,
served and torn down, in their words and at their levels (Triton's qa/L0_logging
counts them): onnxruntime_backend src/onnxruntime.cc, core src/server.cc's
backend table and model_config_utils.cc's verbose auto-completed config."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from tests.serverproc import EXAMPLES
from trionserve.actors.registry_entries import prepare_model
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.manager import BackendManager
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.observability.logging import SETTINGS, configure_logging, update_settings
from trionserve.repository.config import read_model_config

pytest.importorskip("onnxruntime")

# I1129 10:30:00.123456 1234 backend.py:56] "message"
RECORD = re.compile(r"^([IWE])\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ ([\w.]+):\d+\] \"(.*)\"$")


@pytest.fixture
def logging_restored():
    saved = SETTINGS.as_dict()
    configure_logging()
    yield
    update_settings(saved, network=False)


def messages(text: str) -> list[tuple[str, str]]:
    """(level letter, message) of each record; a table's lines follow its record."""
    return [m.group(1, 3) for m in map(RECORD.match, text.splitlines()) if m]


def test_onnxruntime_backend_announces_model_and_instance_steps(tmp_path, capsys, logging_restored):
    model_dir = shutil.copytree(EXAMPLES / "simple", tmp_path / "simple")
    update_settings({"log_verbose_level": 1}, network=False)
    manager = BackendManager()
    prepared = prepare_model(model_dir, True, None, backends=manager)
    context = ModelContext("simple", 1, prepared.config, model_dir, model_dir / "1")
    loaded = prepared.backend.load(context)
    instance = loaded.create_instance(InstanceSpec("simple_0_0", "simple_0", "KIND_CPU", 0))
    ones = np.ones((1, 16), dtype=np.int32)
    request = InferenceRequest(
        "simple",
        id="1",
        inputs={name: Tensor(name, "INT32", ones) for name in ("INPUT0", "INPUT1")},
    )
    request.batch_size = 1
    (response,) = instance.execute([request])
    outputs = {tensor.name: tensor.data for tensor in response.outputs}
    assert np.array_equal(outputs["OUTPUT0"], ones * 2)
    instance.close()
    loaded.unload()
    found = messages(capsys.readouterr().out)
    # Backend lines in Triton's order (onnxruntime.cc :1017, :3028, :3093, :3178,
    # :3145, :3069), each once; the verbose config comes first (core, at poll).
    backend_lines = [m for m in found if "TRITONBACKEND" in m[1] or m[1].startswith("skipping")]
    assert backend_lines == [
        ("I", "TRITONBACKEND_Initialize: onnxruntime"),
        (
            "I",
            "skipping model configuration auto-complete for 'simple': "
            "inputs and outputs already specified",
        ),
        ("I", "TRITONBACKEND_ModelInitialize: simple (version 1)"),
        ("I", "TRITONBACKEND_ModelInstanceInitialize: simple_0_0 (CPU device 0)"),
        ("I", "TRITONBACKEND_ModelInstanceFinalize: delete instance state"),
        ("I", "TRITONBACKEND_ModelFinalize: delete model state"),
    ]
    assert ("I", "model simple, instance simple_0_0, executing 1 requests") in found
    completed = [m for _, m in found if m.startswith("Server side auto-completed config: ")]
    assert len(completed) == 1 and 'name: \\"simple\\"' in completed[0]


def test_verbose_lines_stay_out_of_the_default_level(tmp_path, capsys, logging_restored):
    model_dir = shutil.copytree(EXAMPLES / "simple", tmp_path / "simple")
    prepare_model(model_dir, True, None, backends=BackendManager())
    found = messages(capsys.readouterr().out)
    assert [m for _, m in found if "auto-completed" in m] == []
    assert [m for _, m in found if m.startswith("skipping model configuration")] != []


def test_backend_table_lists_the_backends_models_use():
    """core server.cc:642-667: one row per backend loaded, its path and config."""
    manager = BackendManager()
    assert manager.backend_rows() == []
    config, _ = read_model_config(EXAMPLES / "simple", None)
    manager.backend_for(config)
    manager.backend_for(config)
    (row,) = manager.backend_rows()
    assert row["Backend"] == "onnxruntime"
    assert row["Path"].endswith("onnxruntime/backend.py")
    assert json.loads(row["Config"])["cmdline"]["default-max-batch-size"] == "4"
