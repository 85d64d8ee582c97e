"""The ONNX Runtime backend's sessions: how an instance's InferenceSession is set up
from the model config (thread pools that sleep rather than spin by default)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trionserve.actors import registry_entries
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.onnxruntime.backend import OnnxRuntimeBackend
from trionserve.core.errors import InvalidArgument

SIMPLE = Path(__file__).resolve().parents[2] / "examples" / "model_repository" / "simple"
SPINNING = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")


def _instance(parameters: dict[str, str]):
    config = registry_entries.prepare_model(SIMPLE, autocomplete=True, override_json=None).config
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    context = ModelContext("simple", 1, config, SIMPLE, SIMPLE / "1")
    model = OnnxRuntimeBackend().load(context)
    return model.create_instance(InstanceSpec("simple_0_0", "simple_0", "KIND_CPU", 0))


def _entries(instance) -> list[str]:
    options = instance._session.get_session_options()
    return [options.get_session_config_entry(key) for key in SPINNING]


def test_pool_threads_sleep_between_runs_by_default():
    assert _entries(_instance({})) == ["0", "0"]


def test_a_model_config_can_ask_for_spinning_back():
    instance = _instance({"session.intra_op.allow_spinning": "1"})
    assert _entries(instance) == ["1", "0"]


def test_a_spinning_value_other_than_0_or_1_fails_the_load_naming_it():
    with pytest.raises(InvalidArgument) as caught:
        _instance({"session.inter_op.allow_spinning": "yes"})
    message = str(caught.value)
    assert "'simple'" in message
    assert "'session.inter_op.allow_spinning'" in message
    assert '"yes"' in message
