"""Each server's BackendManager: two servers in one process keep their own
``--backend-config``, ``--backend-directory``, backends and custom metrics (Triton's
TritonBackendManager is per server, core src/backend_manager.cc)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_backend import instance_backend
from trionserve import api
from trionserve._generated.model_config_pb2 import ModelConfig
from trionserve.backends.manager import BackendManager
from trionserve.core.errors import InvalidArgument

# auto_complete_config runs in a stub started with this server's Python settings;
# the model reports the stub's shared-memory arena size (on the stub's command line,
# the third argument after the stub's process name: package root, socket, arena size,
# growth size, lane, name) as max_batch_size.
ARENA_MODEL = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        with open("/proc/self/cmdline", "rb") as f:
            args = f.read().split(b"\\0")
        arena_bytes = int(args[args.index(b"triton_python_backend_stub") + 3])
        config.set_max_batch_size(arena_bytes // 4096)
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]})
        return config

    def execute(self, requests):
        return []
"""


def write_arena_model(repository: Path) -> None:
    (repository / "m" / "1").mkdir(parents=True)
    (repository / "m" / "config.pbtxt").write_text('backend: "python"\n')
    (repository / "m" / "1" / "model.py").write_text(ARENA_MODEL)


def options(repository: Path, arena_bytes: int) -> api.Options:
    return api.Options(
        model_repository=repository,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        backend_configuration={"python": {"shm-default-byte-size": str(arena_bytes)}},
    )


async def test_two_servers_in_one_process_keep_their_own_backend_config(tmp_path):
    write_arena_model(tmp_path)
    # Both servers exist before either loads a model: a process-wide setting
    # would give the first one the second one's arena size.
    async with (
        api.open_server(options(tmp_path, 8 * 4096)) as first,
        api.open_server(options(tmp_path, 16 * 4096)) as second,
    ):
        assert (await first.load("m")).config()["max_batch_size"] == 8
        assert (await second.load("m")).config()["max_batch_size"] == 16


# Counts its requests in a custom metric family, labelled with the model's name.
COUNTING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(
            name="custom_requests", description="requests seen",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.requests = self.family.Metric(labels={"model": args["model_name"]})

    def execute(self, requests):
        self.requests.increment(len(requests))
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]
            )
            for r in requests
        ]
"""

COUNTING_CONFIG = """
backend: "python"
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
parameters {{ key: "EXECUTION_MODE" value {{ string_value: "{mode}" }} }}
"""


def custom_requests(server: api.AsyncServer) -> dict[str, float]:
    """custom_requests by model, from the server's own metrics."""
    return {
        sample.labels["model"]: sample.value
        for family in text_string_to_metric_families(server.metrics())
        if family.name == "custom_requests"
        for sample in family.samples
    }


@pytest.mark.parametrize("mode", ["stub", "in_process"])
async def test_two_servers_in_one_process_show_only_their_own_custom_metrics(tmp_path, mode):
    for name in ("first", "second"):
        (tmp_path / name / name / "1").mkdir(parents=True)
        (tmp_path / name / name / "config.pbtxt").write_text(COUNTING_CONFIG.format(mode=mode))
        (tmp_path / name / name / "1" / "model.py").write_text(COUNTING_MODEL)
    async with (
        api.open_server(model_repository=tmp_path / "first") as first,
        api.open_server(model_repository=tmp_path / "second") as second,
    ):
        for server, name, count in ((first, "first", 2), (second, "second", 3)):
            for _ in range(count):
                async for _response in server.model(name).infer(
                    inputs={"IN": np.ones(1, dtype=np.float32)}
                ):
                    pass
        # The same family in both servers, each with its own model's metric only.
        assert custom_requests(first) == {"first": 2.0}
        assert custom_requests(second) == {"second": 3.0}


def test_backends_given_to_a_manager_are_its_own():
    config = ModelConfig(name="m", backend="test_own")
    backends = instance_backend("test_own", lambda context, spec: None)
    assert BackendManager(backends=backends).backend_for(config).name == "test_own"
    with pytest.raises(InvalidArgument, match="for backend 'test_own'"):
        BackendManager().backend_for(config)


def test_backend_directories_belong_to_their_manager(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    (here / "mine").mkdir(parents=True)
    (here / "mine" / "model.py").write_text("")
    there.mkdir()
    config = ModelConfig(name="m", backend="mine")
    assert BackendManager(directories=[here]).backend_for(config).name == "python"
    with pytest.raises(InvalidArgument, match="Python-based backend at .*there/mine/model.py"):
        BackendManager(directories=[there]).backend_for(config)


def test_a_bad_python_setting_is_refused_naming_the_flag():
    with pytest.raises(InvalidArgument, match="--backend-config=python,stub-max-restarts"):
        BackendManager({"python": {"stub-max-restarts": "-1"}})
    assert BackendManager().settings_for("python") == {}


def _batching_onnx(shape: tuple[str | int, ...] = ("batch", 4)) -> bytes:
    """An ONNX identity whose tensors have ``shape`` (a variable leading dimension
    unless told otherwise)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["IN"], ["OUT"])],
        "identity",
        [helper.make_tensor_value_info("IN", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, list(shape))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.mark.parametrize(
    ("given", "max_batch_size", "dynamic"),
    [
        ([], 4, True),  # Triton's default, and a dynamic batcher for it
        (["default-max-batch-size=6"], 6, True),
        (["default-max-batch-size=7", "onnxruntime,default-max-batch-size=1"], 1, False),
        (["onnxruntime,default-max-batch-size=0"], 0, False),
    ],
)
def test_default_max_batch_size_is_what_onnx_auto_complete_gives(
    tmp_path, given, max_batch_size, dynamic
):
    # qa/L0_backend_config: onnxruntime.cc AutoCompleteMaxBatch takes the
    # backend config's default-max-batch-size (global, overridden by the
    # backend's own: core backend_model.cc ResolveBackendConfigs) and turns on
    # the dynamic batcher above 1.
    from tests.repository import write_model
    from trionserve.actors.registry_entries import prepare_model
    from trionserve.backends.backend_config import parse_backend_config

    model_dir = write_model(tmp_path, "no_config", None, {"1/model.onnx": _batching_onnx()})
    manager = BackendManager(parse_backend_config(given))
    config = prepare_model(model_dir, True, None, backends=manager).config
    assert config.max_batch_size == max_batch_size
    assert config.HasField("dynamic_batching") is dynamic
    declared = 'max_batch_size: 8\nsequence_batching { }\ninput [ { name: "IN" } ]'
    model_dir = write_model(tmp_path, "sequenced", declared, {"1/model.onnx": _batching_onnx()})
    config = prepare_model(model_dir, True, None, backends=manager).config
    assert not config.HasField("dynamic_batching")  # a scheduler named stays alone


def test_onnx_auto_complete_refuses_max_batch_size_for_a_model_that_cannot_batch(tmp_path):
    # qa/L0_model_config autofill_noplatform/onnx/bad_max_batch_size: onnxruntime.cc
    # AutoCompleteMaxBatch, its words.
    from tests.repository import write_model
    from trionserve.actors.registry_entries import prepare_model

    declared = 'max_batch_size: 1\ninput [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]'
    model_dir = write_model(tmp_path, "fixed", declared, {"1/model.onnx": _batching_onnx((16,))})
    with pytest.raises(InvalidArgument) as info:
        prepare_model(model_dir, True, None, backends=BackendManager())
    assert (
        "autofill failed for model 'fixed': model does not support batching while non-zero "
        "max_batch_size is specified"
    ) in info.value.message


def test_a_default_max_batch_size_that_is_not_a_number_is_refused():
    with pytest.raises(InvalidArgument, match="default-max-batch-size=many: expected an integer"):
        BackendManager({"": {"default-max-batch-size": "many"}})


def test_a_config_without_autofill_is_checked_before_its_versions(tmp_path):
    # Triton validates the config when it polls the model and looks for versions
    # only when it loads it (qa/L0_model_config's noautofill_platform models have
    # no version directory and expect the config's error).
    from tests.repository import write_model
    from trionserve.actors.registry_entries import prepare_model

    bad = 'platform: "onnxruntime_onnx"\nmax_batch_size: -1\ninput [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    model_dir = write_model(tmp_path, "bad", bad)
    with pytest.raises(
        InvalidArgument, match="'max_batch_size' must be non-negative value for bad"
    ):
        prepare_model(model_dir, False, None)
    # With autofill too (ValidateModelConfig runs at poll either way) ...
    with pytest.raises(
        InvalidArgument, match="'max_batch_size' must be non-negative value for bad"
    ):
        prepare_model(model_dir, True, None)
    # ... but not the inputs' and outputs' checks (ValidateModelIOConfig, only
    # without autofill: the model file may complete them): no versions it is.
    zero_dims = write_model(tmp_path, "zero", bad.replace("-1", "0").replace("[ 1 ]", "[ 0 ]"))
    with pytest.raises(InvalidArgument, match="must be integer >= 1"):
        prepare_model(zero_dims, False, None)
    with pytest.raises(InvalidArgument, match="has no versions to load"):
        prepare_model(zero_dims, True, None)
    good = bad.replace("-1", "0") + '\noutput [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    with pytest.raises(InvalidArgument, match="has no versions to load"):
        prepare_model(write_model(tmp_path, "good", good), False, None)


def test_a_runtime_names_the_library_the_backend_is_served_with():
    # Triton looks the runtime up as the backend's library (core backend_model.cc
    # GetBackendLibraryProperties; qa/L0_model_config special_cases).
    manager = BackendManager()
    served = ModelConfig(name="m", backend="identity", runtime="libtriton_identity.so")
    assert manager.backend_for(served).name == "identity"
    missing = ModelConfig(name="m", backend="identity", runtime="__invalid_runtime__")
    with pytest.raises(
        InvalidArgument, match="unable to find backend library '__invalid_runtime__' for model 'm'"
    ):
        manager.backend_for(missing)
    escaping = ModelConfig(
        name="m", backend="identity", runtime="../dummy_runtime/libtriton_identity.so"
    )
    with pytest.raises(
        InvalidArgument,
        match=r"backend library name '\.\./dummy_runtime/libtriton_identity\.so' escapes "
        "backend directory",
    ):
        manager.backend_for(escaping)


def test_onnx_auto_complete_leaves_a_config_naming_inputs_and_outputs(tmp_path):
    # onnxruntime_backend src/onnxruntime.cc AutoCompleteConfig skips a config
    # with inputs and outputs: no batch size, no dynamic batcher (qa/L0_model_config
    # autofill_noplatform_success/onnx/cpu_instance); with only inputs, it completes.
    from tests.repository import write_model
    from trionserve.actors.registry_entries import prepare_model

    tensors = 'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    outputs = 'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    files = {"1/model.onnx": _batching_onnx()}
    both = write_model(tmp_path, "both", "max_batch_size: 8\n" + tensors + outputs, files)
    config = prepare_model(both, True, None, backends=BackendManager()).config
    assert config.max_batch_size == 8 and not config.HasField("dynamic_batching")
    inputs_only = write_model(tmp_path, "inputs_only", "max_batch_size: 8\n" + tensors, files)
    config = prepare_model(inputs_only, True, None, backends=BackendManager()).config
    assert config.HasField("dynamic_batching") and [o.name for o in config.output] == ["OUT"]
