"""SageMaker's multi-model endpoint (served with the SageMaker port): a real server,
its SageMaker port, real models copied under a multi-model root, each answer as
Triton's src/sagemaker_server.cc gives it, and the directories a request may name
confined to the root."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.e2e.test_sagemaker import A, B, SageMaker, _json_body, _start
from tests.serverproc import EXAMPLES
from trionserve.protocol.http.sagemaker import BINARY_MIME_TYPE

AUTH = {"X-Auth": "secret"}  # --http-restricted-api=inference:X-Auth=secret


def _model(root: Path, hash_: str, *models: str) -> Path:
    """``<root>/<hash>/model``: one model's directory (one name), or a repository
    of several."""
    url = root / hash_ / "model"
    if len(models) == 1:
        shutil.copytree(EXAMPLES / models[0], url)
    else:
        for model in models:
            shutil.copytree(EXAMPLES / model, url / model)
    return url


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mme")
    root = base / "models"
    outside = base / "outside"
    _model(outside, "evil", "simple")
    paths = {
        "root": root,
        "outside": outside / "evil" / "model",
        "simple": _model(root, "111", "simple"),
        "identity": _model(root, "222", "identity_fp32"),
        "ensemble": _model(root, "ens", "simple", "simple_ensemble"),
    }
    # A link out of the root, and a model whose file is a link out of it.
    (root / "333").symlink_to(outside / "evil")
    paths["link_out"] = root / "333" / "model"
    linked = _model(root, "444", "simple")
    (linked / "1" / "model.onnx").unlink()
    (linked / "1" / "model.onnx").symlink_to(outside / "evil" / "model" / "1" / "model.onnx")
    paths["file_link_out"] = linked
    # Links inside the root are fine.
    (root / "555").symlink_to(root / "111")
    paths["link_in"] = root / "555" / "model"
    # A link to a model just under the root: its repository would be the root.
    shutil.copytree(EXAMPLES / "simple", root / "flat")
    (root / "888").mkdir()
    (root / "888" / "model").symlink_to(root / "flat")
    paths["link_to_root_child"] = root / "888" / "model"
    broken = root / "666" / "model"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text('backend: "no_such_backend"\n')
    paths["broken"] = broken
    oom = root / "777" / "model"
    (oom / "1").mkdir(parents=True)
    (oom / "config.pbtxt").write_text(
        'backend: "python"\nparameters { key: "EXECUTION_MODE" value { string_value: '
        '"in_process" } }\n'
    )
    (oom / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n"
        "        raise MemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
    )
    paths["oom"] = oom
    (base / "empty").mkdir()
    paths["empty"] = base / "empty"
    return paths


@pytest.fixture(scope="module")
def mme(layout) -> Iterator[SageMaker]:
    """As Triton's docker/sagemaker/serve starts it for MME: an empty repository,
    EXPLICIT mode, namespacing; the inference API restricted."""
    server = _start(
        [layout["empty"]],
        {},
        "--model-control-mode=explicit",
        "--model-namespacing=true",
        f"--sagemaker-multi-model-root={layout['root']}",
        "--http-restricted-api=inference:X-Auth=secret",
    )
    try:
        yield server
        assert server.proc.stop() == 0, server.proc.output()
    finally:
        server.proc.close()


def _load(server: SageMaker, name: str, url: Path | str, **headers: str):
    body = json.dumps({"model_name": name, "url": str(url)}).encode()
    return server.request("POST", "/models", body, {"Content-Type": "application/json", **headers})


def _invoke(server: SageMaker, name: str, headers: dict | None = None):
    body, _ = _json_body()
    return server.request("POST", f"/models/{name}/invoke", body, {**AUTH, **(headers or {})})


def _index(server: SageMaker) -> dict[str, str]:
    status, _, answer = server.request(
        "POST", "/v2/repository/index", b"", port=server.proc.http_port
    )
    assert status == 200
    return {row["name"]: row.get("state", "") for row in json.loads(answer)}


def test_load_list_get_invoke_unload(mme, layout):
    url = layout["simple"]
    assert _load(mme, "mme_a", url)[::2] == (200, b"")
    # Loaded under the request's name (the config says "simple").
    assert _index(mme)["mme_a"] == "READY"
    status, _, answer = _load(mme, "mme_a", url)
    assert status == 409 and "already" in json.loads(answer)["error"]
    listed = {"modelName": "mme_a", "modelUrl": str(url.parent)}
    assert json.loads(mme.request("GET", "/models")[2]) == {"models": [listed]}
    assert json.loads(mme.request("GET", "/models/mme_a")[2]) == listed
    assert mme.request("GET", "/models/nothing")[::2] == (404, b"")

    status, _, answer = _invoke(mme, "mme_a")
    assert status == 200, answer
    outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
    assert outputs["OUTPUT0"] == (A + B).ravel().tolist()
    assert json.loads(answer)["model_name"] == "mme_a"
    # The inference restriction, after the loaded check (sagemaker_server.cc:210-232, :436).
    body, json_size = _json_body(binary_inputs=True, binary_outputs=True)
    assert mme.request("POST", "/models/mme_a/invoke", body)[0] == 403
    assert mme.request("POST", "/models/nothing/invoke", body)[::2] == (404, b"")
    # Binary tensors sized by SageMaker's content type, both ways.
    headers = {**AUTH, "Content-Type": f"{BINARY_MIME_TYPE}{json_size}"}
    status, answer_headers, answer = mme.request("POST", "/models/mme_a/invoke", body, headers)
    assert status == 200, answer
    size = int(answer_headers["content-type"][len(BINARY_MIME_TYPE) :])
    result = httpclient.InferenceServerClient.parse_response_body(answer, header_length=size)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    # An infer error is a 400 here, whatever the HTTP port answers.
    status, _, answer = mme.request("POST", "/models/mme_a/invoke", b'{"inputs": 5}', AUTH)
    assert status == 400 and "error" in json.loads(answer)

    assert mme.request("DELETE", "/models/mme_a")[::2] == (200, b"")
    assert _index(mme).get("mme_a") != "READY"
    assert mme.request("DELETE", "/models/mme_a")[::2] == (404, b"")
    assert _invoke(mme, "mme_a")[::2] == (404, b"")
    assert json.loads(mme.request("GET", "/models")[2]) == {"models": []}
    # Its repository was unregistered: the same url loads again.
    assert _load(mme, "mme_a", url)[0] == 200
    assert mme.request("DELETE", "/models/mme_a")[0] == 200


def test_two_models_and_a_link_inside_the_root(mme, layout):
    assert _load(mme, "one", layout["link_in"])[0] == 200
    assert _load(mme, "two", layout["identity"])[0] == 200
    models = json.loads(mme.request("GET", "/models")[2])["models"]
    assert sorted(m["modelName"] for m in models) == ["one", "two"]
    data = np.arange(8, dtype=np.float32).reshape(1, 8)
    inputs = [httpclient.InferInput("INPUT0", [1, 8], "FP32")]
    inputs[0].set_data_from_numpy(data, binary_data=False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
    body, _ = httpclient.InferenceServerClient.generate_request_body(inputs, outputs)
    status, _, answer = mme.request("POST", "/models/two/invoke", body, AUTH)
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["data"] == data.ravel().tolist()
    assert _invoke(mme, "one")[0] == 200
    for name in ("one", "two"):
        assert mme.request("DELETE", f"/models/{name}")[0] == 200


def test_an_ensemble_inside_a_repository(mme, layout):
    """A url without config.pbtxt is a repository: its ensemble is the model, its
    steps load with it and unload with it (sagemaker_server.cc:971-1035, :723-727)."""
    target = {"X-Amzn-SageMaker-Target-Model": "ens"}
    assert _load(mme, "ens", layout["ensemble"], **target)[0] == 200
    index = _index(mme)
    assert (index["ens"], index["simple"]) == ("READY", "READY")
    status, _, answer = _invoke(mme, "ens", target)
    assert status == 200, answer
    outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
    assert outputs["OUTPUT0"] == (2 * A).ravel().tolist()
    assert json.loads(mme.request("GET", "/models/ens")[2])["modelUrl"] == str(layout["ensemble"])
    assert mme.request("DELETE", "/models/ens", b"", target)[0] == 200
    index = _index(mme)
    assert index.get("ens") != "READY" and index.get("simple") != "READY"


@pytest.mark.parametrize(
    "url, message",
    [
        ("{root}/111/../222/model", "must not contain '..'"),
        ("{outside}", "expected a path of the form {root}/<hash>/model[/<subdir>]"),
        ("{root}/111", "expected a path of the form"),
        ("{root}/111/model/1/x/y", "expected a path of the form"),
        ("{link_out}", "outside the multi-model root"),
        ("{file_link_out}", "is a symbolic link to"),
        ("{link_to_root_child}", "would be the multi-model root"),
        ("{root}/999/model", "repository not found"),
        ("/proc/self/model", "cannot start with /dev/, /proc/, or /sys/"),
    ],
)
def test_a_url_outside_the_root_is_refused(mme, layout, url, message):
    url = url.format(**{k: str(v) for k, v in layout.items()})
    message = message.format(root=layout["root"])
    status, _, answer = _load(mme, "bad", url)
    assert status == 400 and message in json.loads(answer)["error"], answer
    assert "bad" not in _index(mme) and "evil" not in _index(mme)
    assert json.loads(mme.request("GET", "/models")[2]) == {"models": []}


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "JSON buffer: Missing a name for object member. at 1"),
        (b"", "JSON buffer: The document is empty. at 0"),
        (b"[1]", "must be a JSON object"),
        (b'{"model_name": "m"}', '"url"'),
        (b'{"url": "/x", "model_name": 5}', '"model_name"'),
        (b'{"url": "/x", "model_name": ".."}', "path traversal"),
    ],
)
def test_a_malformed_load_is_400(mme, body, message):
    status, _, answer = mme.request("POST", "/models", body)
    assert status == 400 and message in json.loads(answer)["error"]


def test_a_failed_load_is_undone_and_memory_is_507(mme, layout):
    for _ in range(2):  # unregistered after the failure: again 400, not 409
        status, _, answer = _load(mme, "broken", layout["broken"])
        assert status == 400 and "no_such_backend" in json.loads(answer)["error"], answer
    status, _, answer = _load(mme, "oom", layout["oom"])
    assert status == 507 and "out of memory" in json.loads(answer)["error"], answer
    assert json.loads(mme.request("GET", "/models")[2]) == {"models": []}


def test_off_with_an_empty_root(tmp_path):
    server = _start(
        [EXAMPLES],
        {"SAGEMAKER_MULTI_MODEL": "true"},  # not consulted, as by Triton's binary
        "--model-control-mode=explicit",
        "--load-model=simple",
        "--sagemaker-multi-model-root=",
    )
    try:
        url = tmp_path / "1" / "model"
        shutil.copytree(EXAMPLES / "simple", url)
        for method, path, body in (
            ("POST", "/models", json.dumps({"model_name": "m", "url": str(url)}).encode()),
            ("GET", "/models", b""),
            ("GET", "/models/m", b""),
            ("DELETE", "/models/m", b""),
            ("POST", "/models/m/invoke", b"{}"),
        ):
            status, _, answer = server.request(method, path, body)
            assert status == 404, (method, path)
            assert "--sagemaker-multi-model-root is empty" in json.loads(answer)["error"]
        assert "m" not in _index(server)
        # A load's body is read first, as Triton's ParseSageMakerRequest does: a
        # malformed one is its 400, in RapidJSON's words (L0_sagemaker's chunked test).
        status, _, answer = server.request("POST", "/models", b"A" * 100)
        assert status == 400
        expected = "failed to parse the request JSON buffer: Invalid value. at 0"
        assert json.loads(answer)["error"] == expected
        assert server.proc.stop() == 0
    finally:
        server.proc.close()


def test_a_registration_needs_explicit_mode(tmp_path):
    root = tmp_path / "models"
    url = _model(root, "1", "simple")
    server = _start([EXAMPLES], {}, f"--sagemaker-multi-model-root={root}")
    try:
        status, _, answer = _load(server, "m", url)
        assert status == 400
        assert "not allowed if model control mode is not EXPLICIT" in json.loads(answer)["error"]
        assert server.proc.stop() == 0
    finally:
        server.proc.close()


def test_the_root_flag(monkeypatch):
    from trionserve.cli.options import options_from_args

    args = [f"--model-repository={EXAMPLES}", "--allow-sagemaker=true"]
    monkeypatch.delenv("SAGEMAKER_MULTI_MODEL", raising=False)
    options = options_from_args(args).sagemaker
    assert options is not None
    assert (options.multi_model, options.multi_model_root) == (True, "/opt/ml/models")
    options = options_from_args([*args, "--sagemaker-multi-model-root=rel"]).sagemaker
    assert options is not None
    assert (options.multi_model, options.multi_model_root) == (True, os.path.abspath("rel"))
    monkeypatch.setenv("SAGEMAKER_MULTI_MODEL", "false")  # the binary does not read it
    assert options_from_args(args).sagemaker.multi_model  # type: ignore[union-attr]
    options = options_from_args([*args, "--sagemaker-multi-model-root="]).sagemaker
    assert options is not None and not options.multi_model


def test_the_model_repository_restriction_comes_first(tmp_path):
    """--http-restricted-api=model-repository guards load, list, get and unload
    before anything else (sagemaker_server.cc:194-253), invoke is not in it."""
    root = tmp_path / "models"
    url = _model(root, "1", "simple")
    server = _start(
        [EXAMPLES],
        {},
        "--model-control-mode=explicit",
        f"--sagemaker-multi-model-root={root}",
        "--http-restricted-api=model-repository:X-SM=s",
    )
    try:
        key = {"X-SM": "s"}
        load = json.dumps({"model_name": "m", "url": str(url)}).encode()
        for method, path, body in (
            ("POST", "/models", load),
            ("GET", "/models", b""),
            ("GET", "/models/m", b""),
            ("DELETE", "/models/m", b""),
        ):
            status, _, answer = server.request(method, path, body)
            assert status == 403 and "This API is restricted" in json.loads(answer)["error"]
        assert server.request("POST", "/models", load, key)[0] == 200
        assert json.loads(server.request("GET", "/models/m", b"", key)[2])["modelName"] == "m"
        assert _invoke(server, "m")[0] == 200
        assert server.request("DELETE", "/models/m", b"", key)[0] == 200
        assert server.proc.stop() == 0
    finally:
        server.proc.close()
