"""PyTorch 2 models (platform ``torch_aoti``, ``model.pt2``): an ExportedProgram and
an AOTInductor package made here, served by a real server and checked with
tritonclient against calling the model in torch; broken archives fail to load
with reasons naming the file."""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.repository import write_model
from tests.serverproc import ServerProcess
from trionserve.backends.pytorch import torch_aoti
from trionserve.core.errors import InvalidArgument

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

if HAS_TORCH:
    import torch

    class Nested(torch.nn.Module):
        """Positional and keyword inputs; a dict holding a tuple out."""

        def forward(self, x, y, *, scale):
            return {"sum": x + y * scale, "pair": (x * y, x - y)}

    class Single(torch.nn.Module):
        """One Tensor in, one out: the output is RESULT."""

        def forward(self, x):
            return torch.relu(x) * 2 + 1

    class Accumulator(torch.nn.Module):
        """Triton's torch_aoti sequence QA model: a running sum, reset on START,
        plus the correlation ID, gated by READY; the sum is the implicit state."""

        def forward(self, value, state, start, ready, corrid):
            new_state = value + state * (1 - start)
            return (new_state + corrid.to(new_state.dtype)) * ready, new_state


def tensor(name: str, data_type: str, dims: str) -> str:
    return f'{{ name: "{name}" data_type: {data_type} dims: [ {dims} ] }}'


def config(name: str, inputs: list[str], outputs: list[str], batch: int) -> str:
    return (
        f'name: "{name}"\nbackend: "pytorch"\nplatform: "torch_aoti"\n'
        f"max_batch_size: {batch}\n"
        f"input [ {', '.join(inputs)} ]\noutput [ {', '.join(outputs)} ]\n"
    )


# Inputs by call place, by ordinal and by keyword; outputs out of order and mixed.
NESTED_INPUTS = [
    tensor("KWARGS[scale]", "TYPE_FP32", "4"),
    tensor("ARGS[0]", "TYPE_FP32", "4"),
    tensor("INPUT__1", "TYPE_FP32", "4"),
]
NESTED_OUTPUTS = [
    tensor("RESULT[pair][1]", "TYPE_FP32", "4"),
    tensor("OUTPUT__0", "TYPE_FP32", "4"),
    tensor("RESULT[pair][0]", "TYPE_FP32", "4"),
]


def exported_nested():
    batch = torch.export.Dim("batch", min=1, max=8)
    static = torch.export.Dim.STATIC
    # Three distinct tensors: export treats one tensor passed twice as one input.
    x, y, scale = (torch.zeros(2, 4) for _ in range(3))
    return torch.export.export(
        Nested().eval(),
        (x, y),
        {"scale": scale},
        dynamic_shapes={name: (batch, static) for name in ("x", "y", "scale")},
    )


# As Triton's gen_qa_implicit_models.py configures its torch_aoti sequence model:
# the controls and the state are the program's inputs 1..4 and output 1.
SEQUENCE_CONFIG = """
name: "pt2_sequence"
platform: "torch_aoti"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "INPUT__2" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "INPUT__3" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
    { name: "INPUT__4" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT32 } ] }
  ]
  state [
    { input_name: "INPUT__1" output_name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 1 ] }
  ]
}
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def exported_accumulator():
    batch = torch.export.Dim("batch", min=1, max=8)
    value, state, start, ready = (torch.zeros(2, 1) for _ in range(4))
    corrid = torch.zeros(2, 1, dtype=torch.int32)
    return torch.export.export(
        Accumulator().eval(),
        (value, state, start, ready, corrid),
        dynamic_shapes=[{0: batch}] * 5,
    )


def write(repository, name: str, config_text: str, content: bytes | None = None, program=None):
    version = write_model(repository, name, config_text, versions=[1]) / "1"
    if program is not None:
        torch.export.save(program, str(version / "model.pt2"))
    else:
        (version / "model.pt2").write_bytes(content or b"")
    return version / "model.pt2"


@pytest.fixture(scope="module")
def pt2_server(tmp_path_factory):
    if not HAS_TORCH:
        pytest.skip("torch is not installed")
    repository = tmp_path_factory.mktemp("pt2_repository")
    write(
        repository,
        "pt2_nested",
        config("pt2_nested", NESTED_INPUTS, NESTED_OUTPUTS, 8),
        program=exported_nested(),
    )
    single = torch.export.export(Single().eval(), (torch.zeros(3, 5),))
    write(
        repository,
        "pt2_single",
        config(
            "pt2_single",
            [tensor("INPUT__0", "TYPE_FP32", "3, 5")],
            [tensor("RESULT", "TYPE_FP32", "3, 5")],
            0,
        ),
        program=single,
    )
    write(
        repository,
        "pt2_corrupt",
        config(
            "pt2_corrupt", [tensor("x", "TYPE_FP32", "3")], [tensor("RESULT", "TYPE_FP32", "3")], 0
        ),
        content=b"definitely not a zip archive",
    )
    torchscript = write(
        repository,
        "pt2_torchscript",
        config(
            "pt2_torchscript",
            [tensor("x", "TYPE_FP32", "3, 5")],
            [tensor("RESULT", "TYPE_FP32", "3, 5")],
            0,
        ),
    )
    torch.jit.script(Single()).save(str(torchscript))
    write(
        repository,
        "pt2_bad_name",
        config(
            "pt2_bad_name",
            [tensor("ARGS[5]", "TYPE_FP32", "3, 5")],
            [tensor("RESULT", "TYPE_FP32", "3, 5")],
            0,
        ),
        program=single,
    )
    accumulator = exported_accumulator()
    write(repository, "pt2_sequence", SEQUENCE_CONFIG, program=accumulator)
    # Triton's qa/L0_torch_aoti negative model: a correlation ID no tensor can carry.
    bad_corrid = SEQUENCE_CONFIG.replace("pt2_sequence", "pt2_bad_corrid").replace(
        "data_type: TYPE_INT32", "data_type: TYPE_STRING"
    )
    write(repository, "pt2_bad_corrid", bad_corrid, program=accumulator)
    proc = ServerProcess(repository, args=["--exit-on-error=false"])
    try:
        proc.wait_ready()
        client = httpclient.InferenceServerClient(proc.http_url)
        yield client
        client.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()


def infer(client, model: str, arrays: dict[str, np.ndarray]):
    inputs = []
    for name, array in arrays.items():
        item = httpclient.InferInput(name, list(array.shape), "FP32")
        item.set_data_from_numpy(array)
        inputs.append(item)
    return client.infer(model, inputs)


def nested_expected(x, y, scale):
    with torch.inference_mode():
        result = Nested()(torch.from_numpy(x), torch.from_numpy(y), scale=torch.from_numpy(scale))
    return {
        "OUTPUT__0": result["sum"].numpy(),
        "RESULT[pair][0]": result["pair"][0].numpy(),
        "RESULT[pair][1]": result["pair"][1].numpy(),
    }


@needs_torch
@pytest.mark.parametrize("batch", [1, 8])
def test_exported_program_matches_torch(pt2_server, batch):
    rng = np.random.default_rng(batch)
    x, y, scale = (rng.standard_normal((batch, 4)).astype(np.float32) for _ in range(3))
    result = infer(pt2_server, "pt2_nested", {"ARGS[0]": x, "INPUT__1": y, "KWARGS[scale]": scale})
    for name, want in nested_expected(x, y, scale).items():
        np.testing.assert_array_equal(result.as_numpy(name), want)


@needs_torch
def test_single_tensor_result_is_named_result(pt2_server):
    x = np.linspace(-3, 3, 15, dtype=np.float32).reshape(3, 5)
    result = infer(pt2_server, "pt2_single", {"INPUT__0": x})
    with torch.inference_mode():
        want = Single()(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(result.as_numpy("RESULT"), want)
    assert pt2_server.get_model_metadata("pt2_single")["platform"] == "torch_aoti"


@needs_torch
def test_implicit_state_sequence_runs_as_tritons_qa_model(pt2_server):
    """The sequence batcher feeds the controls and carries the state (OUTPUT__1
    back into INPUT__1): each output is the running sum plus the correlation ID."""
    values = [1.0, 2.0, 5.0]
    got = []
    for step, value in enumerate(values):
        item = httpclient.InferInput("INPUT__0", [1, 1], "FP32")
        item.set_data_from_numpy(np.array([[value]], np.float32))
        result = pt2_server.infer(
            "pt2_sequence",
            [item],
            sequence_id=42,
            sequence_start=step == 0,
            sequence_end=step == len(values) - 1,
        )
        got.append(float(result.as_numpy("OUTPUT__0")[0, 0]))
    assert got == [1.0 + 42, 3.0 + 42, 8.0 + 42]


@needs_torch
def test_broken_archives_fail_to_load_naming_the_file(pt2_server):
    rows = {row["name"]: row for row in pt2_server.get_model_repository_index()}
    corrupt = rows["pt2_corrupt"]
    assert corrupt["state"] == "UNAVAILABLE"
    assert "'pt2_corrupt' from 1/model.pt2: not a PyTorch 2 archive" in corrupt["reason"]
    torchscript = rows["pt2_torchscript"]
    assert torchscript["state"] == "UNAVAILABLE"
    assert "1/model.pt2" in torchscript["reason"]
    assert "neither an AOTInductor package nor an ExportedProgram" in torchscript["reason"]
    bad_name = rows["pt2_bad_name"]
    assert bad_name["state"] == "UNAVAILABLE"
    assert "input 'ARGS[5]' is none of the model's inputs ['ARGS[0]']" in bad_name["reason"]
    bad_corrid = rows["pt2_bad_corrid"]
    assert bad_corrid["state"] == "UNAVAILABLE"
    assert "sequence_batching tensor 'INPUT__4' is TYPE_STRING" in bad_corrid["reason"]
    assert pt2_server.is_model_ready("pt2_nested")


@needs_torch
@pytest.mark.skipif(shutil.which("c++") is None, reason="AOTInductor needs a C++ compiler")
def test_aotinductor_package_matches_torch(tmp_path):
    """Compiles a package (about 20 s of C++ on one CPU core) and serves it."""
    package = tmp_path / "package.pt2"
    torch._inductor.aoti_compile_and_package(exported_nested(), package_path=str(package))
    repository = tmp_path / "repository"
    version = repository / "pt2_aoti" / "1"
    version.mkdir(parents=True)
    shutil.copy(package, version / "model.pt2")
    (repository / "pt2_aoti" / "config.pbtxt").write_text(
        config("pt2_aoti", NESTED_INPUTS, NESTED_OUTPUTS, 8)
    )
    proc = ServerProcess(repository)
    try:
        proc.wait_ready()
        client = httpclient.InferenceServerClient(proc.http_url)
        for batch in (1, 5):
            rng = np.random.default_rng(batch)
            x, y, scale = (rng.standard_normal((batch, 4)).astype(np.float32) for _ in range(3))
            result = infer(
                client, "pt2_aoti", {"ARGS[0]": x, "INPUT__1": y, "KWARGS[scale]": scale}
            )
            for name, want in nested_expected(x, y, scale).items():
                np.testing.assert_allclose(result.as_numpy(name), want, rtol=1e-6)
        client.close()
        assert proc.stop() == 0, proc.output()
        assert "kind=AOTInductor package" in proc.output()
    finally:
        proc.close()


# -- naming, unit-tested ----------------------------------------------------------------


def test_leaf_names_follow_tritons_readme():
    paths = [[0, 0], [0, 1], [0, 2, "keyA"], [1, "kwarg1"]]
    assert torch_aoti.input_names(paths) == [
        "ARGS[0]",
        "ARGS[1]",
        "ARGS[2][keyA]",
        "KWARGS[kwarg1]",
    ]
    assert torch_aoti.output_names([[]]) == ["RESULT"]
    assert torch_aoti.output_names([["AAA"], ["BBB", 1]]) == ["RESULT[AAA]", "RESULT[BBB][1]"]


def test_bind_leaves_by_name_or_ordinal():
    leaves = ["ARGS[0]", "ARGS[1]", "KWARGS[k]"]
    bound = torch_aoti.bind_leaves("m", "input", ["KWARGS[k]", "INPUT__0", "ARGS[1]"], leaves, True)
    assert bound == {"KWARGS[k]": 2, "INPUT__0": 0, "ARGS[1]": 1}
    with pytest.raises(InvalidArgument, match="model provides 3"):
        torch_aoti.bind_leaves("m", "input", ["ARGS[0]"], leaves, True)
    with pytest.raises(InvalidArgument, match="both name ARGS\\[0\\]"):
        torch_aoti.bind_leaves("m", "input", ["ARGS[0]", "INPUT__0", "ARGS[1]"], leaves, True)
    with pytest.raises(InvalidArgument, match="0..2"):
        torch_aoti.bind_leaves("m", "output", ["OUTPUT__3"], leaves, False)
    assert torch_aoti.bind_leaves("m", "output", ["OUTPUT__2"], leaves, False) == {"OUTPUT__2": 2}
