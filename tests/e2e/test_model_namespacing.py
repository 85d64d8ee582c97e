"""--model-namespacing=true against a real server, through tritonclient.

Two repositories hold models of the same names. Each composing model adds its own
offset to INPUT0, so a response says which repository's model computed it: an
ensemble must call the composing model of its own repository, a name that both
repositories have is ambiguous for a client, and when one repository's composing
model goes away (or comes back) its ensemble calls the other one (or its own
again). Triton's qa/L0_model_namespacing is the specification of what is tested
here. Tests wait on what a client can observe, with bounded loops; POLL servers
poll every 0.1 s.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from tests.helpers import expect_error, wait_for, wire_name
from tests.serverproc import ServerProcess, scrape_metrics

AMBIGUOUS = "model namespace must be provided to resolve ambiguity"

OFFSET_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

ENSEMBLE_CONFIG = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ {
  model_name: "%s" model_version: -1
  input_map { key: "INPUT0" value: "INPUT0" }
  output_map { key: "OUTPUT0" value: "OUTPUT0" }
} ] }
"""


def offset_model(repository: Path, name: str, offset: float) -> Path:
    """An ONNX model computing OUTPUT0 = INPUT0 + offset."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "offset"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [4])],
        [helper.make_tensor("offset", TensorProto.FLOAT, [1], [offset])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    directory = repository / name
    (directory / "1").mkdir(parents=True)
    (directory / "1" / "model.onnx").write_bytes(model.SerializeToString())
    (directory / "config.pbtxt").write_text(OFFSET_CONFIG)
    return directory


def ensemble(repository: Path, name: str, step: str) -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(ENSEMBLE_CONFIG % step)


@pytest.fixture
def repos(tmp_path: Path) -> tuple[Path, Path]:
    """repo_a: composing (+1), ens_a, twin (ensemble of add_a), add_a (+10);
    repo_b: composing (+2), ens_b, twin (ensemble of add_b), add_b (+20)."""
    a, b = tmp_path / "repo_a", tmp_path / "repo_b"
    for repository, tag, offset in ((a, "a", 1.0), (b, "b", 2.0)):
        offset_model(repository, "composing", offset)
        ensemble(repository, f"ens_{tag}", "composing")
        offset_model(repository, f"add_{tag}", offset * 10)
        ensemble(repository, "twin", f"add_{tag}")
    return a, b


def start(a: Path, b: Path, *args: str) -> ServerProcess:
    server = ServerProcess(a, b, args=["--model-namespacing=true", *args])
    try:
        server.wait_ready()
    except BaseException:
        server.close()
        raise
    return server


def stop(server: ServerProcess) -> None:
    try:
        assert server.stop() == 0, server.output()
    finally:
        server.close()


def infer(client, model: str, module=httpclient) -> float:
    """What ``model`` adds to INPUT0 = zeros."""
    tensor = module.InferInput("INPUT0", [4], "FP32")
    tensor.set_data_from_numpy(np.zeros(4, dtype=np.float32))
    return float(client.infer(model, [tensor]).as_numpy("OUTPUT0")[0])


def adds(client, model: str) -> float | None:
    """What ``model`` adds now, or None while it answers with an error."""
    try:
        return infer(client, model)
    except Exception:
        return None


def test_same_names_in_two_repositories_are_two_models(repos):
    a, b = repos
    server = start(a, b)
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        # Each ensemble calls its own repository's composing model.
        assert infer(client, "ens_a") == 1.0
        assert infer(client, "ens_b") == 2.0
        assert infer(client, "add_a") == 10.0 and infer(client, "add_b") == 20.0
        # A name both repositories have is ambiguous, in Triton's words.
        message = "There are 2 identifiers of model 'composing' in global map, " + AMBIGUOUS
        expect_error(lambda: infer(client, "composing"), message, 400)
        expect_error(lambda: infer(client, "twin"), AMBIGUOUS, 400)
        expect_error(lambda: client.get_model_metadata("twin"), AMBIGUOUS, 400)
        expect_error(lambda: client.get_inference_statistics("twin"), AMBIGUOUS, 400)
        assert not client.is_model_ready("composing")
        assert client.is_model_ready("ens_a") and client.is_model_ready("add_b")
        # Over gRPC the same: INVALID_ARGUMENT.
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        assert infer(grpc, "ens_b", grpcclient) == 2.0
        expect_error(lambda: infer(grpc, "composing", grpcclient), AMBIGUOUS, "INVALID_ARGUMENT")
        # An unknown name is INVALID_ARGUMENT too (FindModelIdentifier).
        expect_error(
            lambda: infer(client, "nothing"), "Request for unknown model: 'nothing' is not found"
        )
        # The index lists each repository's model on its own rows, by repository
        # and then name, without the namespace.
        index = client.get_model_repository_index()
        assert [(row["name"], row.get("state")) for row in index] == [
            ("add_a", "READY"),
            ("composing", "READY"),
            ("ens_a", "READY"),
            ("twin", "READY"),
            ("add_b", "READY"),
            ("composing", "READY"),
            ("ens_b", "READY"),
            ("twin", "READY"),
        ]
        # Statistics of every model list both; the metrics tell them apart by
        # their namespace label (core metric_model_reporter.cc GetMetricLabels).
        stats = client.get_inference_statistics()["model_stats"]
        assert [s["name"] for s in stats].count("composing") == 2
        family = scrape_metrics(server)["nv_inference_request_success"]
        counts = {
            (s.labels["model"], s.labels.get("namespace")): s.value
            for s in family.samples
            if wire_name(family, s) == "nv_inference_request_success"
        }
        # ens_a once; ens_b over HTTP and over gRPC.
        assert counts[("composing", str(a))] == 1 and counts[("composing", str(b))] == 2
        assert counts[("twin", str(a))] == 0
    finally:
        stop(server)


def test_poll_resolves_a_removed_composing_model_elsewhere_and_back(repos, tmp_path):
    a, b = repos
    c = tmp_path / "repo_c"
    ensemble(c, "far", "composing")  # not in repo_c: ambiguous while a and b have it
    server = ServerProcess(
        a,
        b,
        c,
        args=[
            "--model-namespacing=true",
            "--model-control-mode=poll",
            "--repository-poll-secs=0.1",
            "--exit-on-error=false",
        ],
    )
    try:
        server.wait_ready(path="/v2/health/live")
        client = httpclient.InferenceServerClient(server.http_url)
        assert infer(client, "ens_a") == 1.0
        assert "not available or ambiguous: composing" in reason(client, "far")
        shutil.move(a / "composing", tmp_path / "composing")
        # repo_a's ensemble now calls repo_b's composing model, the only one left,
        # which a client can call by name again; the ensemble that could not load
        # while the name was ambiguous loads.
        wait_for(lambda: adds(client, "ens_a") == 2.0, "ens_a to call repo_b's composing")
        assert infer(client, "composing") == 2.0 and infer(client, "ens_b") == 2.0
        wait_for(lambda: adds(client, "far") == 2.0, "far to load, calling repo_b's composing")
        shutil.move(tmp_path / "composing", a / "composing")
        wait_for(lambda: adds(client, "ens_a") == 1.0, "ens_a to call its own composing again")
        assert infer(client, "ens_b") == 2.0
        expect_error(lambda: infer(client, "composing"), AMBIGUOUS, 400)
        # far's step is ambiguous again: it keeps its binding (where Triton unloads
        # it), and the index says why it was not rebound.
        wait_for(lambda: "ambiguous" in reason(client, "far"), "far's failed rebinding")
        assert infer(client, "far") == 2.0
    finally:
        stop(server)


def reason(client, name: str) -> str:
    return " ".join(
        row.get("reason", "") for row in client.get_model_repository_index() if row["name"] == name
    )


def test_explicit_load_resolves_then_rebinds_and_unloads_by_name(repos, tmp_path):
    a, b = repos
    c = tmp_path / "repo_c"
    ensemble(c, "far", "composing")  # not in repo_c: ambiguous once a and b have it
    shutil.move(a / "composing", tmp_path / "composing")
    server = ServerProcess(
        a, b, c, args=["--model-namespacing=true", "--model-control-mode=explicit"]
    )
    try:
        server.wait_ready()
        client = httpclient.InferenceServerClient(server.http_url)
        client.load_model("ens_a")  # its composing model is found in repo_b only
        assert infer(client, "ens_a") == 2.0 and infer(client, "composing") == 2.0
        shutil.move(tmp_path / "composing", a / "composing")
        client.load_model("ens_a")  # loads repo_a's composing model, and rebinds
        assert infer(client, "ens_a") == 1.0
        expect_error(lambda: infer(client, "composing"), AMBIGUOUS, 400)
        expect_error(
            lambda: client.load_model("far"),
            f"ensemble {c}::far contains models that are not available or ambiguous: composing",
            400,
        )
        # A load by name loads every repository's model of that name.
        client.load_model("twin")
        twins = [r for r in client.get_model_repository_index() if r["name"] == "twin"]
        assert [r.get("state") for r in twins] == ["READY", "READY"]
        assert infer(client, "add_a") == 10.0 and infer(client, "add_b") == 20.0
        # An unload by name unloads every model known by it (Triton's global map);
        # then the name is unknown again.
        client.unload_model("twin")
        wait_for(
            lambda: all(
                r.get("state") == "UNAVAILABLE"
                for r in client.get_model_repository_index()
                if r["name"] == "twin"
            ),
            "both twins to unload",
        )
        expect_error(lambda: infer(client, "twin"), "Request for unknown model: 'twin'")
    finally:
        stop(server)
