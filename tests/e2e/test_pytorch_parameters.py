"""The pytorch backend's model-config parameters, as Triton's libtorch backend reads
and applies them (pytorch_backend src/libtorch.cc ParseParameters and Execute):
TorchScript models made here, loaded by the backend, their effect on torch read
back (the JIT's and cuDNN's process-wide flags, the executor's optimized graph,
the thread pools in a process of their own, one module shared by instances, the
CUDA cache emptied on a GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

from tests.repository import write_model
from trionserve.backends.base import InstanceSpec, ModelContext
from trionserve.backends.pytorch import backend as pytorch
from trionserve.backends.pytorch import parameters as torch_parameters
from trionserve.core.errors import InvalidArgument
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.repository.config import read_model_config

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed", allow_module_level=True)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


class Scale(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x * 2.0 + 1.0)


def write_scale(root: Path, name: str, parameters: dict[str, str], kind: str = "KIND_CPU") -> Path:
    """Model ``name`` (Scale scripted) with these config parameters; its folder."""
    extra = "".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        for key, value in parameters.items()
    )
    text = (
        f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        f"instance_group [ {{ kind: {kind} }} ]\n{extra}"
    )
    model_dir = write_model(root, name, text, versions=[1])
    torch.jit.script(Scale()).save(str(model_dir / "1" / "model.pt"))
    return model_dir


def load(model_dir: Path):
    config, _ = read_model_config(model_dir)
    context = ModelContext(model_dir.name, 1, config, model_dir, model_dir / "1")
    return pytorch.PyTorchBackend().load(context)


def run(instance, rows: int = 2) -> np.ndarray:
    requests = []
    for row in range(rows):
        data = np.full((1, 4), float(row), dtype=np.float32)
        request = InferenceRequest("m", inputs={"INPUT__0": Tensor("INPUT__0", "FP32", data)})
        request.batch_size = 1
        requests.append(request)
    responses = instance.execute(requests)
    return np.concatenate([r.outputs[0].data for r in responses])


@pytest.fixture
def torch_flags():
    """The process-wide flags a model sets (as Triton, never restored by it), put
    back after the test: the JIT's profiling executor and mode, its fuser, cuDNN."""
    executor = torch._C._jit_set_profiling_executor(True)
    mode = torch._C._jit_set_profiling_mode(True)
    fuser = torch._C._jit_texpr_fuser_enabled()
    cudnn = torch.backends.cudnn.enabled
    yield
    torch._C._jit_set_profiling_executor(executor)
    torch._C._jit_set_profiling_mode(mode)
    torch._C._jit_set_texpr_fuser_enabled(fuser)
    torch.backends.cudnn.enabled = cudnn


def flags() -> dict[str, bool]:
    executor = torch._C._jit_set_profiling_executor(True)  # read: set returns the old
    torch._C._jit_set_profiling_executor(executor)
    mode = torch._C._jit_set_profiling_mode(True)
    torch._C._jit_set_profiling_mode(mode)
    return {
        "executor": executor,
        "profiling": mode,
        "fuser": torch._C._jit_texpr_fuser_enabled(),
        "cudnn": torch.backends.cudnn.enabled,
    }


# -- values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("ENABLE_JIT_PROFILING", "maybe", "failed to convert 'maybe' to boolean"),
        # backend_common's ParseBoolValue takes true/on/1 and false/off/0 only.
        ("INFERENCE_MODE", "yes", "failed to convert 'yes' to boolean"),
        ("DISABLE_CUDNN", " true", "failed to convert ' true' to boolean"),
        ("ENABLE_WEIGHT_SHARING", "", "failed to convert '' to boolean"),
        ("INTRA_OP_THREAD_COUNT", "many", "failed to convert 'many' to integral number"),
        ("INTER_OP_THREAD_COUNT", "99999999999", "failed to convert '99999999999' to integral"),
    ],
)
def test_a_value_triton_cannot_parse_fails_the_load(tmp_path, key, value, message):
    model_dir = write_scale(tmp_path, "pt_bad", {key: value})
    with pytest.raises(InvalidArgument) as failure:
        load(model_dir)
    assert str(failure.value).startswith(message)
    assert f"parameter '{key}' of model 'pt_bad'" in str(failure.value)


def test_values_parse_as_tritons_parse_bool_and_int_values(tmp_path):
    config, _ = read_model_config(
        write_scale(
            tmp_path,
            "pt_values",
            {
                "DISABLE_CUDNN": "TRUE",
                "ENABLE_CACHE_CLEANING": "On",
                "INFERENCE_MODE": "0",
                "ENABLE_JIT_EXECUTOR": "off",
                "INTRA_OP_THREAD_COUNT": " 4 threads",  # std::stoi reads the leading 4
                "INTER_OP_THREAD_COUNT": "-2",
            },
        )
    )
    read = torch_parameters.TorchParameters.from_config(config, "pt_values")
    assert read == torch_parameters.TorchParameters(
        cudnn=False,
        cache_cleaning=True,
        inference_mode=False,
        jit_executor=False,
        intra_op_threads=4,
        inter_op_threads=-2,
    )
    assert read.jit_profiling is None and read.tensor_fuser is None  # not given: torch's own


def test_the_load_logs_tritons_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_parameters, "log", structlog.get_logger(torch_parameters.__name__))
    model_dir = write_scale(
        tmp_path, "pt_logged", {"ENABLE_JIT_PROFILING": "false", "ENABLE_WEIGHT_SHARING": "1"}
    )
    with capture_logs() as logs:
        load(model_dir)
    where = " for model instance 'pt_logged'"
    assert [e["event"] for e in logs] == [
        "Optimized execution is enabled" + where,
        "Cache Cleaning is disabled" + where,
        "Inference Mode is enabled" + where,
        "cuDNN is enabled" + where,
        "Weight sharing is enabled" + where,
        "Jit profiling is disabled" + where,
    ]


# -- the JIT's flags and cuDNN, set before each forward --------------------------------


def test_jit_flags_are_set_before_forward_and_stay_set(tmp_path, torch_flags):
    legacy = load(
        write_scale(
            tmp_path,
            "pt_legacy",
            {
                "ENABLE_JIT_EXECUTOR": "false",
                "ENABLE_JIT_PROFILING": "false",
                "ENABLE_TENSOR_FUSER": "false",
                "DISABLE_CUDNN": "true",
            },
        )
    )
    instance = legacy.create_instance(InstanceSpec("pt_legacy_0", "pt_legacy", "KIND_CPU", 0))
    assert flags()["executor"] and flags()["profiling"]  # loading sets nothing
    for _ in range(3):
        np.testing.assert_allclose(run(instance)[:, 0], [1.0, 3.0])
    assert flags() == {"executor": False, "profiling": False, "fuser": False, "cudnn": False}
    # The legacy executor ran the module: its graph is specialised to the
    # arguments' types up front, and never profiled.
    graph = str(torch.jit.last_executed_optimized_graph())
    assert "Float(*, *, requires_grad=0" in graph and "prim::profile" not in graph
    instance.close()

    # A model that names none of them leaves the JIT's flags as the last model set
    # them and turns cuDNN back on (Triton sets cuDNN on every execute).
    plain = load(write_scale(tmp_path, "pt_plain", {}))
    instance = plain.create_instance(InstanceSpec("pt_plain_0", "pt_plain", "KIND_CPU", 0))
    run(instance)
    assert flags() == {"executor": False, "profiling": False, "fuser": False, "cudnn": True}
    instance.close()

    profiled = load(
        write_scale(
            tmp_path, "pt_profiled", {"ENABLE_JIT_EXECUTOR": "on", "ENABLE_JIT_PROFILING": "1"}
        )
    )
    instance = profiled.create_instance(InstanceSpec("pt_profiled_0", "pt_profiled", "KIND_CPU", 0))
    run(instance)
    assert flags()["executor"] and flags()["profiling"]
    # The profiling executor's first run records the tensors' types as it goes.
    graph = str(torch.jit.last_executed_optimized_graph())
    assert "prim::profile" in graph and "Float(*, *" not in graph
    instance.close()


# -- weight sharing ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["KIND_CPU", pytest.param("KIND_GPU", marks=needs_cuda)])
def test_weight_sharing_gives_the_instances_on_a_device_one_module(tmp_path, kind, monkeypatch):
    monkeypatch.setattr(pytorch, "log", structlog.get_logger(pytorch.__name__))
    shared = load(write_scale(tmp_path, "pt_shared", {"ENABLE_WEIGHT_SHARING": "true"}, kind))
    with capture_logs() as logs:
        first = shared.create_instance(InstanceSpec("pt_shared_0", "pt_shared", kind, 0))
        second = shared.create_instance(InstanceSpec("pt_shared_1", "pt_shared", kind, 0))
    assert first._module is second._module
    assert [e["event"] for e in logs if "Reusing" in e["event"]] == [
        "Reusing TorchScript model for instance 'pt_shared'"
    ]
    np.testing.assert_allclose(run(second)[:, 0], [1.0, 3.0])
    first.close()
    np.testing.assert_allclose(run(second)[:, 0], [1.0, 3.0])  # the other's close kept it
    second.close()
    shared.unload()

    own = load(write_scale(tmp_path, "pt_own", {}, kind))
    a = own.create_instance(InstanceSpec("pt_own_0", "pt_own", kind, 0))
    b = own.create_instance(InstanceSpec("pt_own_1", "pt_own", kind, 0))
    assert a._module is not b._module
    a.close()
    b.close()


# -- thread pools: process-wide, once ----------------------------------------------------

THREADS_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    import torch
    from trionserve.backends.base import ModelContext
    from trionserve.backends.pytorch.backend import PyTorchBackend
    from trionserve.repository.config import read_model_config

    for name in sys.argv[1:]:
        model_dir = Path(name)
        config, _ = read_model_config(model_dir)
        PyTorchBackend().load(ModelContext(model_dir.name, 1, config, model_dir, model_dir / "1"))
    seen = {}
    # An instance's thread starts after its model loaded: it reads the pools there.
    thread = threading.Thread(target=lambda: seen.update(intra=torch.get_num_threads()))
    thread.start()
    thread.join()
    print("threads", seen["intra"], torch.get_num_interop_threads())
    """
)


def test_thread_counts_are_set_for_the_process_by_the_first_model(tmp_path):
    first = write_scale(
        tmp_path, "pt_threads", {"INTRA_OP_THREAD_COUNT": "3", "INTER_OP_THREAD_COUNT": "3"}
    )
    second = write_scale(
        tmp_path, "pt_more", {"INTRA_OP_THREAD_COUNT": "5", "INTER_OP_THREAD_COUNT": "0"}
    )
    done = subprocess.run(
        [sys.executable, "-c", THREADS_SCRIPT, str(first), str(second)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "threads 3 3" in done.stdout
    output = done.stdout + done.stderr
    assert "Intra op thread count is set to 3 for model instance 'pt_threads'" in output
    assert "Inter op thread count is set to 3 for model instance 'pt_threads'" in output
    # The second model's 5 comes too late (call_once); its 0 asks for nothing.
    assert "Intra op thread count is set to 3 for model instance 'pt_more'" in output
    assert "Inter op thread count is set to 3 for model instance 'pt_more'" not in output


# -- cache cleaning (a GPU's caching allocator) ----------------------------------------


@needs_cuda
@pytest.mark.parametrize("cleaning", [True, False])
def test_cache_cleaning_empties_the_cuda_cache_after_each_execute(tmp_path, cleaning):
    name = f"pt_clean_{cleaning}".lower()
    loaded = load(write_scale(tmp_path, name, {"ENABLE_CACHE_CLEANING": str(cleaning)}, "KIND_GPU"))
    instance = loaded.create_instance(InstanceSpec(f"{name}_0", name, "KIND_GPU", 0))
    run(instance)
    block = 256 * 2**20
    spare = torch.empty(block // 4, dtype=torch.float32, device="cuda:0")
    del spare  # freed into the caching allocator, which keeps it
    torch.cuda.synchronize(0)
    held = torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0)
    assert held >= block
    np.testing.assert_allclose(run(instance)[:, 0], [1.0, 3.0])
    left = torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0)
    assert (left < block) if cleaning else (left >= block)
    instance.close()
